"""kmix.compare.rounds: each step's own loss, and the repeat's data in another order.

Keras's ``logs["loss"]`` in a batch callback is the mean over the epoch so far: one
non-finite step makes it non-finite to the end of the ``fit``. The comparison records
each step's own loss instead, exactly as the step computed it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kmix.compare.rounds import Entry, build_entry, make_dataset, train, warm_up

X = (0.5, 1.0, 1.5, 2.0, 1e5, 0.25)
"""One value per batch: a model that returns x gives the loss x**2 (y = 0). Trained as
a warm-up step, then turns of 2 and 3 steps: 1e5 is the middle step of the last turn."""


def identity_model():
    import keras

    model = keras.Sequential(
        [
            keras.Input((1,)),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="wide"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # the weights stay
    return model


def batches(values=X):
    """A batch of two examples per value, x = the value, y = 0."""
    x = np.repeat(np.array(values, "float32"), 2)[:, None]
    return x, np.zeros_like(x)


@pytest.mark.slow  # two tiny models trained six steps each
@pytest.mark.parametrize(
    ("policy", "big"),
    [("mixed_float16", math.inf), ("float32", 1e10)],  # 1e5 overflows float16 (65504)
)
def test_each_step_records_its_own_loss_across_turns(policy, big):
    from kmix.compare.step_loss import watch_step_loss

    model = build_entry(identity_model, policy, 0, None, "identity_model").model
    entry = Entry(policy, policy, model, [], step_loss=watch_step_loss(model))
    dataset, _ = make_dataset(batches(), 2)
    warm_up(entry, dataset, 1, 2, None)
    train([entry], dataset, [2, 3], lambda _: None)
    # exact: the loss the step computed, not recovered from Keras's running mean
    assert entry.losses == [0.25, 1.0, 2.25, 4.0, big, 0.0625]
    assert int(model.optimizer.skipped_steps) >= (1 if policy == "mixed_float16" else 0)


def running_mean_model():
    """A model whose own train_step keeps its own tracker: only its running mean is known."""
    import keras
    import tensorflow as tf

    class Mine(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
            self.tracker = keras.metrics.Mean(name="loss")

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            self.tracker.update_state(loss)
            return {"loss": self.tracker.result()}

    model = Mine()
    model(np.zeros((1, 1), "float32"))  # built: Keras's attribute tracking is locked
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


@pytest.mark.slow  # one tiny model trained five steps
def test_a_train_step_with_its_own_tracker_falls_back_to_the_running_mean():
    from kmix.compare.step_loss import watch_step_loss

    model = build_entry(running_mean_model, "float32", 0, None, "mine").model
    entry = Entry("float32", "float32", model, [], step_loss=watch_step_loss(model))
    dataset, _ = make_dataset(batches((1.0, 1.5, 2.0, 0.25)), 2)  # then 1.0 again
    warm_up(entry, dataset, 1, 1, None)
    train([entry], dataset, [4], lambda _: None)
    expected = [1.0, 2.25, 4.0, 0.0625, 1.0]
    # each step recovered from consecutive means m_k = ((k - 1) m_(k-1) + l_k) / k: within
    # k float32 ulps of the mean (m_k <= 2.25, k <= 4 steps a fit)
    assert entry.losses == pytest.approx(expected, rel=0, abs=4 * 2**-22)


# ------------------------------------------------------------ the repeat's data order
def test_order_seed_permutes_the_examples_of_arrays():
    x = np.arange(24, dtype="float32").reshape(12, 2)
    y = np.arange(12, dtype="int32")
    plain, examples = make_dataset((x, y), 4)
    assert examples == 4
    assert [int(v) for _, b in plain.take(3) for v in b] == list(range(12))
    shuffled, examples = make_dataset((x, y), 4, order_seed=5)
    assert examples == 4
    order = np.random.default_rng(5).permutation(12)
    got = [(xb.numpy(), yb.numpy()) for xb, yb in shuffled.take(6)]
    assert [int(v) for _, b in got[:3] for v in b] == order.tolist()
    assert [int(v) for _, b in got[3:] for v in b] == order.tolist()  # repeated as is
    np.testing.assert_array_equal(np.concatenate([b for b, _ in got[:3]]), x[order])


def test_order_seed_shuffles_the_batches_of_a_dataset_the_same_way_each_time():
    import tensorflow as tf

    ids = np.arange(6, dtype="int32")
    batched = tf.data.Dataset.from_tensor_slices((ids[:, None].astype("float32"), ids)).batch(1)

    def order(dataset, count):
        return [int(y[0]) for _, y in dataset.take(count)]

    plain, _ = make_dataset(batched, 32)
    assert order(plain, 12) == list(range(6)) * 2
    shuffled, examples = make_dataset(batched, 32, order_seed=1)
    assert examples == 1  # a dataset's own batches
    first = order(shuffled, 12)
    assert sorted(first[:6]) == list(range(6)) and first[:6] != list(range(6))
    assert first[6:] == first[:6]  # the same order every pass
    assert order(shuffled, 12) == first  # and every iterator: a turn's skip() continues it
    assert order(shuffled.skip(3), 3) == first[3:6]
    assert order(make_dataset(batched, 32, order_seed=1)[0], 12) == first
