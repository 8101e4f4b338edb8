"""kmix.LossScaleOptimizer's eager step (kmix/optimizer/torch_step.py), and a nested model's
overflow on every backend.

Marked ``jax`` and ``torch`` too: the test runs in each pass (TensorFlow, JAX, torch), in
process, with the same expected values.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmix


class Block(keras.layers.Layer):
    """``up`` (a Dense whose float16 output overflows) then BatchNormalization."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(4, kernel_initializer="ones", name="up")
        self.norm = keras.layers.BatchNormalization(name="norm")

    def call(self, x, training=False):
        return self.norm(self.up(x), training=training)


class Net(keras.Model):
    def __init__(self):
        super().__init__(name="net")
        self.stem = keras.layers.Dense(4, kernel_initializer="ones", name="stem")
        self.block = Block(name="block")
        self.head = keras.layers.Dense(1, dtype="float32", name="head")

    def call(self, x, training=False):
        return self.head(self.block(self.stem(x), training=training))


def state(model: keras.Model, optimizer: kmix.LossScaleOptimizer) -> list[np.ndarray]:
    return [
        np.array(keras.ops.convert_to_numpy(v))
        for v in [*model.weights, *optimizer.inner_optimizer.variables]
    ]


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_an_overflow_in_a_nested_layer_is_named_skipped_and_leaves_every_state_as_it_was():
    """Inputs 0.5: ``stem`` outputs 4 x 0.5 = 2 (exact in float16); with ``up``'s kernel at
    30000 its outputs are 4 x 2 x 30000 = 240000, past float16's 65504: inf from finite
    inputs. The step is skipped: weights, Adam's state and BatchNormalization's moving
    statistics keep every bit; the scale is kept (a forward overflow)."""
    keras.config.set_dtype_policy("mixed_float16")
    model = Net()
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=1024.0)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.full((8, 4), 0.5, "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=8, verbose=0)  # one good step: Adam's state is not zeros
    model.block.up.kernel.assign(np.full((4, 4), 30000.0, "float32"))
    before = state(model, optimizer)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[kmix.callbacks.LossScaleGuard(verbose=0)])

    after = state(model, optimizer)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    (event,) = optimizer.scale_events()
    assert (event.step, event.kind, event.old_scale, event.new_scale) == (
        2,
        "forward_overflow",
        1024.0,
        1024.0,
    )
    assert event.loss_finite is False
    origin = event.origin
    assert (origin.layer, origin.layer_class, origin.inputs_finite) == (
        "net/block/up",
        "Dense",
        True,
    )
    assert origin.max_abs_input == 2.0
    snapshot = optimizer.read_state()
    assert (snapshot.attempted_steps, snapshot.skipped_steps, snapshot.loss_scale) == (2, 1, 1024.0)


@pytest.mark.torch
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="counts torch's host reads")
def test_a_quiet_eager_step_reads_one_value_on_the_host(monkeypatch):
    """On torch each read of a device value is a sync: a quiet step of kmix's optimizer
    (monitor's tap installed) reads its decisions at once, one read; stock Keras's reads two
    (its finite check and its growth check), counted the same way."""
    import torch

    keras.config.set_dtype_policy("mixed_float16")
    model = Net()
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.full((8, 4), 0.5, "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=8, verbose=0)  # built, one step done
    optimizer.watch(model)  # the tap, as the monitor installs it
    stock = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-3))

    reads = []
    for name in ("__bool__", "item", "tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def reads_of(opt):
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=8, verbose=0)  # builds stock's state outside the count
        reads.clear()
        model.train_step((keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)))
        return list(reads)

    assert len(reads_of(stock)) == 2
    assert len(reads_of(optimizer)) == 1
