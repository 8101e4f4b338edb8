"""The host's choice of step on JAX (kmix/optimizer/jax_train_function.py), with fakes: pure logic.

The train function runs the measuring step where gradient health is due at one of an
execution's steps, the quiet step elsewhere, and counts the steps each execution took.
"""

from __future__ import annotations

import itertools
import warnings
from types import SimpleNamespace

import keras
import numpy as np
import pytest

import kmix.callbacks
from kmix.optimizer import jax_train_function as _jax_train_function
from kmix.optimizer.jax_train_function import TrainFunction, due_within
from kmix.record import step_record as record

ATTEMPTED = record.Counters._fields.index("attempted_steps")
INT32_MAX = 2**31 - 1


def due_one_by_one(attempted: int, steps: int, every: int, int_max: int) -> bool:
    """The reference: each step as the record counts it (saturating), then ``every | step``."""
    for _ in range(steps):
        attempted = min(attempted + 1, int_max)
        if every > 0 and attempted % every == 0:
            return True
    return False


@pytest.mark.jax
@pytest.mark.parametrize("every", [0, 1, 2, 3, 7, 100])
@pytest.mark.parametrize("steps", [1, 2, 3, 10])
def test_due_within_agrees_with_counting_step_by_step(every, steps):
    for attempted in range(0, 60):
        want = due_one_by_one(attempted, steps, every, INT32_MAX)
        assert due_within(attempted, steps, every, INT32_MAX) == want, (attempted, steps, every)


@pytest.mark.jax
def test_due_within_at_the_saturated_counter():
    # The counter stops at int_max: every later step is int_max again.
    for every, attempted, steps in itertools.product(
        [1, 2, 7, 8], range(INT32_MAX - 9, INT32_MAX + 1), [1, 4]
    ):
        want = due_one_by_one(attempted, steps, every, INT32_MAX)
        assert due_within(attempted, steps, every, INT32_MAX) == want, (every, attempted, steps)
    assert not due_within(5, 0, 1, INT32_MAX)  # no step, nothing due


class FakeStep:
    """Keras's train function of one variant: takes up to ``steps`` batches from the
    iterator, attempts each (the counters are a new array after every execution)."""

    def __init__(self, name: str, calls: list, steps: int) -> None:
        self.name, self.calls, self.steps = name, calls, steps

    def __call__(self, state: tuple, iterator) -> tuple:
        taken = list(itertools.islice(iterator, self.steps))
        counters = np.array(state[2][1])
        counters[ATTEMPTED] += len(taken)
        self.calls.append((self.name, taken))
        return {"loss": 0.0}, (state[0], state[1], [state[2][0], counters], state[3])


class FakeModel:
    """What the train function reads of the model: ``steps_per_execution``."""

    steps_per_execution = 1


def fake_setup(health_every: int, steps: int, attempted: int = 0):
    counters_variable = SimpleNamespace(dtype="int32")
    recorder = SimpleNamespace(
        counters=counters_variable,
        settings=SimpleNamespace(variables={"health_every": SimpleNamespace(value=health_every)}),
    )
    optimizer = SimpleNamespace(recorder=recorder, variables=[object(), counters_variable])
    model = FakeModel()
    model.steps_per_execution = steps
    calls: list = []
    function = TrainFunction(
        optimizer, model, FakeStep("quiet", calls, steps), FakeStep("measuring", calls, steps)
    )
    counters = np.zeros(len(record.Counters._fields), "int32")
    counters[ATTEMPTED] = attempted
    function.model_kept_alive = model  # the train function holds its model weakly
    return function, ([], [], [0.0, counters], []), calls


def executions(function, state, iterator, count: int) -> tuple:
    """``count`` calls of the train function on one iterator; the state after them."""
    for _ in range(count):
        _, state = function(state, iterator)
    return state


@pytest.mark.jax
def test_the_measuring_step_runs_exactly_where_health_is_due():
    function, state, calls = fake_setup(health_every=3, steps=1)
    executions(function, state, iter(range(1, 11)), 10)
    assert [name for name, _ in calls] == [
        "quiet",
        "quiet",
        "measuring",
        "quiet",
        "quiet",
        "measuring",
        "quiet",
        "quiet",
        "measuring",
        "quiet",
    ]
    assert function.measured_executions == 3


@pytest.mark.jax
def test_executions_of_several_steps_and_a_short_last_one_are_counted():
    # Steps 1-3, 4-6, 7-8 (the data ends): health every 4 is due at 4 and 8.
    function, state, calls = fake_setup(health_every=4, steps=3)
    state = executions(function, state, iter(range(8)), 3)
    assert [(name, len(taken)) for name, taken in calls] == [
        ("quiet", 3),
        ("measuring", 3),
        ("measuring", 2),
    ]
    # The next fit starts from the record's 8: steps 9-11 are quiet, 12-14 measure.
    executions(function, state, iter(range(6)), 2)
    assert [name for name, _ in calls[3:]] == ["quiet", "measuring"]


@pytest.mark.jax
def test_a_state_it_did_not_return_is_read_again():
    # A loaded checkpoint (or a new fit) brings counters the function did not make.
    function, state, calls = fake_setup(health_every=5, steps=1, attempted=3)
    _, state = function(state, iter([0]))  # step 4: quiet
    loaded = np.array(state[2][1])
    loaded[ATTEMPTED] = 9  # the next step is 10: due
    _, state = function((state[0], state[1], [0.0, loaded], state[3]), iter([0]))
    assert [name for name, _ in calls] == ["quiet", "measuring"]


@pytest.mark.jax
def test_never_due_never_measures():
    function, state, calls = fake_setup(health_every=0, steps=2)
    executions(function, state, iter(range(9)), 5)
    assert {name for name, _ in calls} == {"quiet"} and function.measured_executions == 0


# ------------------------------------------------------------------ slow: compiled steps
def jax_fit(test):
    """Slow, and run in the JAX pass only: the test compiles Keras's JAX step in process."""
    skip = pytest.mark.skipif(keras.backend.backend() != "jax", reason="Keras's JAX train step")
    return pytest.mark.slow(pytest.mark.jax(skip(test)))


def mixed_session() -> None:
    """A fresh, seeded Keras session in mixed_float16 (set after clear_session resets it)."""
    keras.utils.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)


def compiled_memory(step, model) -> int:
    """Temporary bytes XLA's compiled ``step`` of ``model`` needs (memory_analysis)."""
    import jax

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    data = (np.ones((64, 512), "float32"), np.ones((64, 1), "float32"))
    return jax.jit(step).lower(state, data).compile().memory_analysis().temp_size_in_bytes


@jax_fit
def test_the_steps_kmix_compiles_need_no_more_memory_than_stock_keras(tmp_path):
    # Statistics by shape must not make XLA keep copies of the gradients (stacking their
    # columns did: 3.5x stock's temporary memory); the quiet step holds no activations.
    def model_with(optimizer):
        mixed_session()
        layers = [keras.layers.Dense(512) for _ in range(4)]
        model = keras.Sequential([keras.Input((512,)), *layers, keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    stock = model_with(keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam()))
    stock_bytes = compiled_memory(stock.train_step, stock)
    model = model_with(kmix.LossScaleOptimizer(keras.optimizers.Adam()))
    x, y = np.ones((64, 512), "float32"), np.ones((64, 1), "float32")
    model.fit(x, y, batch_size=64, verbose=0)  # wraps the model's step
    optimizer_bytes = compiled_memory(model.train_step, model)
    monitor = kmix.callbacks.MixedPrecisionMonitor(str(tmp_path), verbose=0)
    monitor.set_model(model)
    monitor.on_train_begin()  # taps the model
    quiet = _jax_train_function._variant(model.optimizer, model.train_step, False)
    quiet_bytes = compiled_memory(quiet, model)
    monitor.on_train_end()
    gradient_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert optimizer_bytes <= stock_bytes + gradient_bytes // 4, (optimizer_bytes, stock_bytes)
    assert quiet_bytes <= stock_bytes + gradient_bytes // 4, (quiet_bytes, stock_bytes)


@jax_fit
def test_a_model_compiled_again_with_stock_keras_trains_with_it(tmp_path):
    # kmix's wrappers stay on the model (and its tap, while the optimizer lives): they
    # must step aside for another optimizer, not read its variables as kmix's.
    mixed_session()
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1, dtype="float32")]
    )
    optimizer = kmix.LossScaleOptimizer("adam")
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor = kmix.callbacks.MixedPrecisionMonitor(str(tmp_path), verbose=0)
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
        assert optimizer.hooks.tapping and optimizer.read_state().attempted_steps == 4
        # Scale 1: no step of this small model overflows, so stock applies all four.
        stock = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(), 1.0)
        model.compile(optimizer=stock, loss="mse")
        history = model.fit(x, y, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert int(np.asarray(stock.iterations.value)) == 4
    assert optimizer.read_state().attempted_steps == 4  # kmix's record left alone


class OffsetBatches(keras.Model):
    """A model whose own train step reads ``(x, y, x_offset)`` batches (the offset where
    Keras puts sample weights) and gives the model ``x + x_offset``: the pass run again
    must be the one its step ran, not one on ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(4, kernel_initializer="ones", name="hidden")
        self.top = keras.layers.Dense(1, dtype="float32", name="top")

    def call(self, x):
        return self.top(self.hidden(x))

    def train_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_values, metrics = state
        x, y, offset = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, aux), grads = grad_fn(
            trainable,
            non_trainable,
            metrics,
            x + offset,
            y,
            None,
            training=True,
            optimizer_variables=optimizer_values,
        )
        _, _, non_trainable, metrics = aux
        trainable, optimizer_values = self.optimizer.stateless_apply(
            optimizer_values, grads, trainable
        )
        return {"loss": loss}, (trainable, non_trainable, optimizer_values, metrics)


@jax_fit
def test_a_train_step_of_the_users_own_gets_the_origin_of_its_own_pass(tmp_path):
    # Step 3's offset (90000) overflows hidden's input cast; its x alone (ones) would not.
    mixed_session()
    model = OffsetBatches()
    optimizer = kmix.LossScaleOptimizer("sgd", initial_scale=64.0)
    model.compile(optimizer=optimizer, loss="mse")
    offsets = np.zeros((6, 1, 4), "float32")
    offsets[2] = 90000.0
    batches = [(np.ones((1, 4), "float32"), np.ones((1, 1), "float32"), o) for o in offsets]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor = kmix.callbacks.MixedPrecisionMonitor(str(tmp_path), update_freq=5, verbose=0)
        model.fit((b for b in batches), steps_per_epoch=6, verbose=0, callbacks=[monitor])
    events = [(e.step, e.kind, e.origin) for e in optimizer.scale_events()]
    assert [(step, kind) for step, kind, _ in events] == [(3, "forward_overflow")]
    origin = events[0][2]
    assert (origin.layer, origin.inputs_finite, origin.max_abs_input) == (
        "offset_batches/hidden",
        True,
        90001.0,
    )
