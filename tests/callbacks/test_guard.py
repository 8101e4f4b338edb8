"""LossScaleGuard: trips exactly after `patience` bad steps, never on a healthy run.

Two tiers. The slow tests fit the spiky model (as in test_monitor): ``out = a(x1) +
b(x2)``, kernels 1, SGD at learning rate 0, batch size 1. A spike row overflows only
b/kernel's float16 gradient (20000 * scale, for every scale >= 4); a NaN in x1 makes the
loss NaN. The fast tests run the same scenarios through the guard's glue with a
plain-Python step record (tests/fake_optimizer.py) and assert the same values; the rules
themselves are tested in test_trip.py, the wording here.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from fake_optimizer import FakeModel, FakeRecorder, built_stock, fake_fit, scripted, stock_step
from spiky import spiky_data, spiky_model

import kmix
from kmix.callbacks import LossScaleGuard, LossScaleGuardError
from kmix.callbacks._diagnosis import diagnosis
from kmix.callbacks._trip import NonfiniteLoss, OverflowAtFloor, SkipRate
from kmix.tags import GUARD_RAISED, ForwardOrigin, ScaleEvent


class CountSteps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def at_the_floor(**kwargs) -> kmix.LossScaleOptimizer:
    """SGD at learning rate 0 whose scale starts at its floor, 64: every spike is skipped."""
    return kmix.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=64, min_scale=64, **kwargs
    )


def fit(model, data, guard, epochs: int = 1):
    counter = CountSteps()
    x, y = data
    model.fit(
        x, y, batch_size=1, epochs=epochs, shuffle=False, verbose=0, callbacks=[guard, counter]
    )
    return counter.steps


@pytest.mark.slow
def test_a_healthy_run_never_trips_it():
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1))).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), "mse")
    guard = LossScaleGuard(patience=3, window=20, max_skip_rate=0.2)
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[guard])
    assert len(history.history["loss"]) == 3
    assert (guard.diagnosis, guard.reason, guard.step) == (None, None, None)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_nonfinite_loss_stops_after_exactly_patience_steps(capsys):
    model = spiky_model()
    guard = LossScaleGuard(patience=5)
    steps = fit(model, spiky_data(30, nan_rows=range(6, 31)), guard)
    assert steps == 10  # NaN loss from step 6; the 5th in a row is step 10
    assert (guard.reason, guard.step) == ("nonfinite_loss", 10)
    assert model.optimizer.attempted_steps == 10
    assert "step 10" in guard.diagnosis and "since step 6" in guard.diagnosis
    assert "`a/kernel`" in guard.diagnosis  # every gradient is NaN; the first is named
    assert "lowering the loss scale cannot help" in guard.diagnosis
    assert guard.diagnosis in capsys.readouterr().out
    # kmix's optimizer never goes below its floor, unlike the stock one (below).
    assert model.optimizer.loss_scale >= 1.0


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_overflow_at_the_floor_stops_and_names_the_variable():
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=16, min_scale=4)
    model = spiky_model(optimizer)
    guard = LossScaleGuard(patience=4, verbose=0)
    # Every step overflows: 16 -> 8 -> 4 (steps 1, 2), then skipped at the floor.
    steps = fit(model, spiky_data(20, spikes=range(1, 21)), guard)
    assert steps == 4 and (guard.reason, guard.step) == ("overflow_at_floor", 4)
    assert "`b/kernel`" in guard.diagnosis and "floor 4" in guard.diagnosis


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_skip_rate_over_the_window_raises_in_raise_mode():
    optimizer = at_the_floor()
    model = spiky_model(optimizer)
    guard = LossScaleGuard(patience=5, window=10, max_skip_rate=0.4, mode="raise")
    with pytest.raises(LossScaleGuardError) as caught:
        fit(model, spiky_data(40, spikes=range(2, 41, 2)), guard)  # every other step
    assert (caught.value.reason, caught.value.step) == ("skip_rate", 10)
    assert str(caught.value) == guard.diagnosis
    assert "5 of the last 10 steps (50%)" in guard.diagnosis


def counted_reads(optimizer) -> list[int]:
    """The step of each read of the optimizer's state (the guard's host syncs) from now on:
    at the record's owner (``optimizer.recorder``, kmix.optimizer.recorder), which every public
    read of the record goes through, the event reads' counter read included."""
    owner = getattr(optimizer, "recorder", optimizer)
    reads = []
    original = owner.read_state

    def read_state(counters_only=False):
        state = original(counters_only=counters_only)
        reads.append(state.attempted_steps)
        return state

    owner.read_state = read_state
    return reads


def first_trip_by_rule(
    skips: list[bool], patience: int, window: int, rate: float, every: int = 1
) -> tuple[str, int, int] | None:
    """The floor and skip-rate rules checked every ``every`` steps, in plain Python:
    the streak at the check, and every window that ended since the last check.

    Returns:
        ``(reason, check step, last step of the window over the rate or the check's)``.
    """
    for t in range(every, len(skips) + 1, every):
        streak = next((i for i, s in enumerate(reversed(skips[:t])) if not s), t)
        if streak >= patience:
            return "overflow_at_floor", t, t
        for end in range(max(t - every + 1, window), t + 1):
            if sum(skips[end - window : end]) / window > rate:
                return "skip_rate", t, end
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("seed", "patience", "steps_per_execution"),
    [
        pytest.param(0, 6, 1, marks=pytest.mark.torch),
        (1, 6, 1),
        (1, 4, 1),
        (3, 4, 1),
        (0, 6, 4),
        (3, 4, 4),
        pytest.param(5, 4, 8, marks=pytest.mark.jax),
        (7, 4, 8),
    ],
)
def test_sparse_reads_trip_at_the_same_step_as_a_check_after_every_step(
    seed, patience, steps_per_execution
):
    """Irregular skips at the floor: the guard reads a few times, and trips where the rules
    checked after every execution say."""
    rng = np.random.default_rng(seed)
    skips = list(rng.random(60) < np.linspace(0.1, 0.9, 60))  # more and more often
    reason, step, end = first_trip_by_rule(skips, patience, 12, 0.5, steps_per_execution)
    optimizer = at_the_floor()
    model = spiky_model(optimizer, steps_per_execution)
    reads = counted_reads(optimizer)
    guard = LossScaleGuard(patience=patience, window=12, max_skip_rate=0.5, verbose=0)
    rows = [i + 1 for i, s in enumerate(skips) if s]
    executions = fit(model, spiky_data(60, spikes=rows), guard)
    assert (guard.reason, guard.step) == (reason, step)
    assert (optimizer.attempted_steps, executions) == (step, step // steps_per_execution)
    if reason == "skip_rate":
        which = "the last 12 steps" if end == step else f"the 12 steps up to step {end}"
        assert f"{sum(skips[end - 12 : end])} of {which} (" in guard.diagnosis
    checked = set(reads) - {0}  # steps with a read (events and health read at a check too)
    if patience > steps_per_execution:  # else a streak could reach patience at every one
        assert len(checked) < executions  # a check after every execution reads at each


@pytest.mark.slow
def test_a_healthy_run_reads_once_per_patience_steps():
    optimizer = at_the_floor()
    model = spiky_model(optimizer)
    reads = counted_reads(optimizer)
    guard = LossScaleGuard(patience=10, window=50, verbose=0)
    assert fit(model, spiky_data(100, spikes=[3, 40]), guard) == 100
    assert guard.reason is None
    # At train begin and after the first step, then where a streak could first reach
    # 10: every 10 steps (the two skips make no streak at a read, and the window never
    # nears 25 skips of 50); the events of the skips at 3 and 40 when the next read
    # finds them; the health measured at step 100 (health_every=100), read in full.
    assert reads == [0, 1, 11, 11, 21, 31, 41, 41, 51, 61, 71, 81, 91, 100, 100]


@pytest.mark.slow
def test_windows_between_reads_far_apart_are_each_counted():
    """Skips at steps 1-4 of every 8, window 4, rate 0.4, read every 8 steps (by
    check_freq, and by steps_per_execution): the window ending at each read skipped
    none, but the one ending at step 4 skipped all four, so the first read trips."""
    for check_freq, steps_per_execution in [(8, 1), (1, 8)]:
        optimizer = at_the_floor()
        model = spiky_model(optimizer, steps_per_execution)
        guard = LossScaleGuard(
            patience=50, window=4, max_skip_rate=0.4, check_freq=check_freq, verbose=0
        )
        spikes = [s for s in range(1, 33) if (s - 1) % 8 < 4]
        fit(model, spiky_data(32, spikes=spikes), guard)
        assert (guard.reason, guard.step) == ("skip_rate", 8)
        assert "4 of the 4 steps up to step 4 (100%)" in guard.diagnosis


@pytest.mark.slow
@pytest.mark.parametrize(
    ("capacity", "counted"),
    [(4, "3 of the 5 steps up to step 8 (60%)"), (2, "6 of the last 10 steps (60%)")],
)
def test_a_check_after_the_ring_overflowed_counts_what_it_can_exactly(capacity, counted):
    """Skips at steps 1-6, read at step 10. A ring of 4 holds the skips at 3-6, each
    counted back from the total, so the window (3, 8] is counted exactly: three skips.
    A ring of 2 holds those at 5 and 6, so only the window (5, 10] is exact (one skip,
    under the rate); the windows before it are unknown, and the share skipped since the
    start, 6 of 10, trips."""
    model = spiky_model(at_the_floor(event_capacity=capacity))
    guard = LossScaleGuard(patience=50, window=5, max_skip_rate=0.5, check_freq=10, verbose=0)
    assert fit(model, spiky_data(20, spikes=range(1, 7)), guard) == 10
    assert (guard.reason, guard.step) == ("skip_rate", 10)
    assert counted in guard.diagnosis


@pytest.mark.slow
def test_a_ring_that_kept_a_growth_first_counts_exactly_only_from_its_first_skip():
    """Skips at 1, 2, 3 and 6, growths at 5 and 8, a ring of 3 read at step 10: it kept
    the growth at 5, the skip at 6 and the growth at 8. Whether a skip was lost between
    the start and step 6 is unknown, so the window (5, 10] is not counted as exact (it
    would read 4 of 5): the guard falls back to the reads' span, 4 of 10 steps."""
    optimizer = at_the_floor(max_scale=128, dynamic_growth_steps=2, event_capacity=3)
    model = spiky_model(optimizer)
    guard = LossScaleGuard(patience=50, window=5, max_skip_rate=0.5, check_freq=10, verbose=0)
    assert fit(model, spiky_data(12, spikes=[1, 2, 3, 6]), guard) == 12
    kinds = [(e.step, e.kind) for e in optimizer.scale_events()]
    assert kinds == [(5, "growth"), (6, "backoff"), (8, "growth")]
    assert (guard.reason, guard.diagnosis) == (None, None)


@pytest.mark.slow
def test_a_ring_smaller_than_patience_is_read_before_it_overflows():
    """A ring of 3, patience 10, no skip-rate rule: the guard reads at least every 3 steps,
    before the ring could drop an event."""
    optimizer = at_the_floor(event_capacity=3)
    model = spiky_model(optimizer)
    reads = counted_reads(optimizer)
    guard = LossScaleGuard(patience=10, max_skip_rate=1.0, verbose=0)
    assert fit(model, spiky_data(16, spikes=[2, 3, 4, 9, 10, 11]), guard) == 16
    assert guard.reason is None
    # Counter reads every 3 steps from step 1; each that finds new events reads the ring.
    assert reads == [0, 1, 4, 4, 7, 10, 10, 13, 13, 16]


# Not on torch: Keras refuses steps_per_execution > 1 there.
@pytest.mark.jax
@pytest.mark.slow
def test_the_ring_is_read_in_time_when_keras_calls_back_once_per_execution():
    """steps_per_execution=2, a ring of 3: a read asked for 3 steps on would come after
    4, when 4 skips could have pushed the first out. Reading every 2 steps keeps them all,
    so the window (4, 14], 6 skips of 10, is counted exactly."""
    optimizer = at_the_floor(event_capacity=3)
    model = spiky_model(optimizer, steps_per_execution=2)
    reads = counted_reads(optimizer)
    guard = LossScaleGuard(patience=50, window=10, max_skip_rate=0.5, verbose=0)
    assert fit(model, spiky_data(20, spikes=[8, 10, 11, 12, 13, 14]), guard) == 7
    assert (guard.reason, guard.step) == ("skip_rate", 14)
    assert "6 of the last 10 steps (60%)" in guard.diagnosis
    assert sorted(set(reads)) == [0, 2, 4, 6, 8, 10, 12, 14]


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_stock_keras_scale_falls_to_zero_and_the_guard_stops_it_within_patience():
    data = spiky_data(200, nan_rows=range(1, 201))

    def stock():
        return keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.01))

    # Stock Keras alone: the scale halves on every NaN step down to exactly 0.0
    # and training goes on with a NaN loss, silently.
    model = spiky_model(stock())
    history = model.fit(*data, batch_size=1, shuffle=False, verbose=0)
    assert float(model.optimizer.dynamic_scale.numpy()) == 0.0
    assert np.isnan(history.history["loss"][-1])

    model = spiky_model(stock())
    guard = LossScaleGuard(patience=5, verbose=0)
    assert fit(model, data, guard) == 5
    assert (guard.reason, guard.step) == ("nonfinite_loss", 5)
    assert "kmix.LossScaleOptimizer does" in guard.diagnosis  # where to see the variable


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_stock_keras_overflow_at_the_floor():
    optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=4)
    model = spiky_model(optimizer)
    guard = LossScaleGuard(patience=3, verbose=0)
    # x2 = 60000, y = 0: the loss (3.6e9) is finite in float32, but b/kernel's
    # scaled gradient (3.6e9 * scale) overflows float16 at every scale down to 2**-16.
    x = [np.zeros((20, 1), np.float32), np.full((20, 1), 60000.0, np.float32)]
    steps = fit(model, (x, np.zeros((20, 1), np.float32)), guard)
    # The stock scale goes 4 -> 2 -> 1 -> 0.5: after step 3 it is below the floor
    # 1.0 the guard assumes, with three skipped steps in a row.
    assert (guard.reason, guard.step, steps) == ("overflow_at_floor", 3, 3)
    assert "0.5, at or below its floor 1" in guard.diagnosis


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_without_loss_scaling_only_the_loss_check_applies():
    keras.config.set_dtype_policy("float32")
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x = np.full((20, 1), np.nan, np.float32)
    guard = LossScaleGuard(patience=3, verbose=0)
    with pytest.warns(UserWarning, match="only the non-finite loss check"):
        model.fit(x, np.zeros((20, 1)), batch_size=1, verbose=0, callbacks=[guard])
    assert (guard.reason, guard.step) == ("nonfinite_loss", 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"patience": 0}, "patience=0.*integer >= 1"),
        ({"patience": 2.0}, "patience=2.0"),
        ({"max_skip_rate": 0}, r"max_skip_rate=0.*\(0, 1\]"),
        ({"max_skip_rate": 1.5}, "max_skip_rate=1.5"),
        ({"max_skip_rate": float("nan")}, "max_skip_rate=nan"),
        ({"window": 0}, "window=0"),
        ({"mode": "halt"}, "mode='halt'.*'stop'.*'raise'"),
        ({"check_freq": -1}, "check_freq=-1"),
        ({"verbose": 3}, "verbose=3"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaleGuard(**kwargs)


def test_uncompiled_model_fails_at_train_begin():
    guard = LossScaleGuard()
    guard.set_model(keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)]))
    with pytest.raises(ValueError, match="not compiled"):
        guard.on_train_begin()


@pytest.mark.slow
@pytest.mark.parametrize(
    "guard_first", [False, pytest.param(True, marks=[pytest.mark.jax, pytest.mark.torch])]
)
def test_a_run_the_guard_ends_keeps_every_event_and_says_why(tmp_path, guard_first):
    """NaN loss from step 5, patience 3: the guard raises at step 7 with 5, 6, 7 on disk."""
    from test_monitor import events, read_back, texts

    from kmix import report, tags

    model = spiky_model()
    monitor = kmix.callbacks.MixedPrecisionMonitor(
        tmp_path, update_freq=1 if guard_first else 100, verbose=0
    )
    guard = LossScaleGuard(patience=3, mode="raise", verbose=0)
    x, y = spiky_data(12, nan_rows=range(5, 13))
    callbacks = [guard, monitor] if guard_first else [monitor, guard]
    with pytest.raises(LossScaleGuardError):
        model.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=callbacks)

    data = read_back(tmp_path)
    got = events(data)
    assert [(step, e.kind, e.loss_finite) for step, e in got] == [
        (5, "forward_overflow", False),
        (6, "forward_overflow", False),
        (7, "forward_overflow", False),
    ]
    ((_, text),) = texts(data, tags.RUN_END)
    run_end = tags.parse_run_end(text)
    assert (run_end.step, run_end.reason) == (7, "guard_raised")
    assert "non-finite" in run_end.message or "NaN" in run_end.message
    summary = report.summarize(report.read_log(str(tmp_path)))
    assert summary.to_dict()["run_end"]["reason"] == "guard_raised"
    assert "no problems found" not in report.format_summary(summary)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("jit_compile", "steps_per_execution"),
    [
        pytest.param(False, 1, marks=pytest.mark.torch),
        pytest.param(True, 1, marks=pytest.mark.jax),
        (False, 2),
    ],
)
def test_a_forward_overflow_is_named_at_its_layer_and_the_scale_is_kept(
    jit_compile, steps_per_execution
):
    """Dense `big` outputs 2 * 40000 > 65504 in float16 from step 3: its inputs are finite."""
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(2, kernel_initializer="ones", name="big")(inputs)
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(hidden)
    model = keras.Model(inputs, outputs)
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=16.0)
    model.compile(opt, "mse", jit_compile=jit_compile, steps_per_execution=steps_per_execution)
    x = np.ones((6, 2), np.float32)
    x[2:] = 40000.0
    guard = LossScaleGuard(patience=3, verbose=0)
    model.fit(
        x, np.zeros((6, 1), np.float32), batch_size=1, shuffle=False, verbose=0, callbacks=[guard]
    )
    events = opt.scale_events()
    last = 5 if steps_per_execution == 1 else 6  # the guard checks after each execution
    assert [(e.step, e.kind) for e in events] == [
        (step, "forward_overflow") for step in range(3, last + 1)
    ]
    assert opt.loss_scale == 16.0  # no scale can fix the forward pass
    origin = events[0].origin
    assert (origin.layer.split("/")[-1], origin.layer_class, origin.inputs_finite) == (
        "big",
        "Dense",
        True,
    )
    assert origin.max_abs_input == 40000.0
    assert guard.reason == "nonfinite_loss" and "Forward overflow in `" in guard.diagnosis
    assert "max |input| 40000" in guard.diagnosis


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_nan_in_the_data_is_not_blamed_on_a_layer():
    model = spiky_model()
    guard = LossScaleGuard(patience=2, verbose=0)
    fit(model, spiky_data(4, nan_rows=(2, 3, 4)), guard)
    origin = model.optimizer.scale_events()[0].origin
    assert origin is not None and origin.inputs_finite is False
    assert "already non-finite" in guard.diagnosis


# ------------------------------------------------------------------ fast tier
# The scenarios above, through the guard's glue with a plain-Python step record.


def floor_recorder(**kwargs) -> FakeRecorder:
    """A record whose scale starts at its floor, 64: every skip is at the floor."""
    return FakeRecorder(initial_scale=64, min_scale=64, **kwargs)


def test_the_error_is_a_runtime_error_with_the_reason_and_step():
    error = LossScaleGuardError("why", "skip_rate", 10)
    assert isinstance(error, RuntimeError)  # code catching RuntimeError keeps catching it
    assert (str(error), error.reason, error.step, error.kmix_reason) == (
        "why",
        "skip_rate",
        10,
        GUARD_RAISED,
    )


def test_fake_nonfinite_loss_stops_after_exactly_patience_steps(capsys):
    model = FakeModel(FakeRecorder(initial_scale=1024, min_scale=1))
    guard = LossScaleGuard(patience=5)
    assert fake_fit(model, [guard], scripted(30, nan=range(6, 31))) == 10
    assert (guard.reason, guard.step, model.stop_training) == ("nonfinite_loss", 10, True)
    assert model.optimizer.attempted_steps == 10
    assert "step 10" in guard.diagnosis and "since step 6" in guard.diagnosis
    assert "`a/kernel`" in guard.diagnosis
    assert "lowering the loss scale cannot help" in guard.diagnosis
    assert guard.diagnosis in capsys.readouterr().out
    assert model.optimizer.watched == [model]  # the source told the optimizer the model


def test_fake_overflow_at_the_floor_stops_and_names_the_variable():
    model = FakeModel(FakeRecorder(initial_scale=16, min_scale=4))
    guard = LossScaleGuard(patience=4, verbose=0)
    assert fake_fit(model, [guard], scripted(20, skip=range(1, 21))) == 4
    assert (guard.reason, guard.step) == ("overflow_at_floor", 4)
    assert "`b/kernel`" in guard.diagnosis and "floor 4" in guard.diagnosis


def test_fake_skip_rate_over_the_window_raises_in_raise_mode():
    model = FakeModel(floor_recorder())
    guard = LossScaleGuard(patience=5, window=10, max_skip_rate=0.4, mode="raise")
    with pytest.raises(LossScaleGuardError) as caught:
        fake_fit(model, [guard], scripted(40, skip=range(2, 41, 2)))
    assert (caught.value.reason, caught.value.step) == ("skip_rate", 10)
    assert str(caught.value) == guard.diagnosis
    assert "5 of the last 10 steps (50%)" in guard.diagnosis


@pytest.mark.parametrize("steps_per_execution", [1, 4, 8])
@pytest.mark.parametrize("patience", [4, 6])
@pytest.mark.parametrize("seed", range(12))
def test_fake_sparse_reads_trip_at_the_same_step_as_a_check_after_every_step(
    seed, patience, steps_per_execution
):
    """As the fit test above, on more seeds: irregular skips at the floor."""
    rng = np.random.default_rng(seed)
    skips = list(rng.random(60) < np.linspace(0.1, 0.9, 60))
    expected = first_trip_by_rule(skips, patience, 12, 0.5, steps_per_execution)
    optimizer = floor_recorder()
    model = FakeModel(optimizer, steps_per_execution)
    guard = LossScaleGuard(patience=patience, window=12, max_skip_rate=0.5, verbose=0)
    steps = ["skip" if s else None for s in skips]
    executions = fake_fit(model, [guard], steps)
    if expected is None:
        assert guard.reason is None
        return
    reason, step, end = expected
    assert (guard.reason, guard.step) == (reason, step)
    assert (optimizer.attempted_steps, executions) == (step, step // steps_per_execution)
    if reason == "skip_rate":
        which = "the last 12 steps" if end == step else f"the 12 steps up to step {end}"
        assert f"{sum(skips[end - 12 : end])} of {which} (" in guard.diagnosis
    checked = set(optimizer.reads) - {0}
    if patience > steps_per_execution:
        assert len(checked) < executions


def test_fake_healthy_run_reads_once_per_patience_steps():
    optimizer = floor_recorder()
    guard = LossScaleGuard(patience=10, window=50, verbose=0)
    assert fake_fit(FakeModel(optimizer), [guard], scripted(100, skip=[3, 40])) == 100
    assert guard.reason is None
    assert optimizer.reads == [0, 1, 11, 11, 21, 31, 41, 41, 51, 61, 71, 81, 91, 100, 100]


@pytest.mark.parametrize(("check_freq", "steps_per_execution"), [(8, 1), (1, 8)])
def test_fake_windows_between_reads_far_apart_are_each_counted(check_freq, steps_per_execution):
    model = FakeModel(floor_recorder(), steps_per_execution)
    guard = LossScaleGuard(
        patience=50, window=4, max_skip_rate=0.4, check_freq=check_freq, verbose=0
    )
    spikes = [s for s in range(1, 33) if (s - 1) % 8 < 4]
    fake_fit(model, [guard], scripted(32, skip=spikes))
    assert (guard.reason, guard.step) == ("skip_rate", 8)
    assert "4 of the 4 steps up to step 4 (100%)" in guard.diagnosis


@pytest.mark.parametrize(
    ("capacity", "counted"),
    [(4, "3 of the 5 steps up to step 8 (60%)"), (2, "6 of the last 10 steps (60%)")],
)
def test_fake_check_after_the_ring_overflowed_counts_what_it_can_exactly(capacity, counted):
    model = FakeModel(floor_recorder(event_capacity=capacity))
    guard = LossScaleGuard(patience=50, window=5, max_skip_rate=0.5, check_freq=10, verbose=0)
    assert fake_fit(model, [guard], scripted(20, skip=range(1, 7))) == 10
    assert (guard.reason, guard.step) == ("skip_rate", 10)
    assert counted in guard.diagnosis


def test_fake_ring_that_kept_a_growth_first_counts_exactly_only_from_its_first_skip():
    optimizer = floor_recorder(max_scale=128, event_capacity=3)
    guard = LossScaleGuard(patience=50, window=5, max_skip_rate=0.5, check_freq=10, verbose=0)
    steps = scripted(12, skip=[1, 2, 3, 6], growth=[5, 8])
    assert fake_fit(FakeModel(optimizer), [guard], steps) == 12
    kinds = [(e.step, e.kind) for e in optimizer.events[-3:]]
    assert kinds == [(5, "growth"), (6, "backoff"), (8, "growth")]
    assert (guard.reason, guard.diagnosis) == (None, None)


def test_fake_ring_smaller_than_patience_is_read_before_it_overflows():
    optimizer = floor_recorder(event_capacity=3)
    guard = LossScaleGuard(patience=10, max_skip_rate=1.0, verbose=0)
    steps = scripted(16, skip=[2, 3, 4, 9, 10, 11])
    assert fake_fit(FakeModel(optimizer), [guard], steps) == 16
    assert guard.reason is None
    assert optimizer.reads == [0, 1, 4, 4, 7, 10, 10, 13, 13, 16]


def test_fake_ring_is_read_in_time_when_keras_calls_back_once_per_execution():
    optimizer = floor_recorder(event_capacity=3)
    guard = LossScaleGuard(patience=50, window=10, max_skip_rate=0.5, verbose=0)
    steps = scripted(20, skip=[8, 10, 11, 12, 13, 14])
    assert fake_fit(FakeModel(optimizer, steps_per_execution=2), [guard], steps) == 7
    assert (guard.reason, guard.step) == ("skip_rate", 14)
    assert "6 of the last 10 steps (60%)" in guard.diagnosis
    assert sorted(set(optimizer.reads)) == [0, 2, 4, 6, 8, 10, 12, 14]


def test_fake_stock_keras_overflow_at_the_floor_is_inferred_from_its_iterations():
    optimizer = built_stock(4.0)
    model = FakeModel(optimizer)
    guard = LossScaleGuard(patience=3, verbose=0)
    # Every step skipped: 4 -> 2 -> 1 -> 0.5, below the floor 1.0 the guard assumes.
    assert fake_fit(model, [guard], ["skip"] * 20, step=stock_step(optimizer)) == 3
    assert (guard.reason, guard.step) == ("overflow_at_floor", 3)
    assert "0.5, at or below its floor 1" in guard.diagnosis


def test_fake_stock_keras_nonfinite_loss_when_every_step_is_skipped():
    optimizer = built_stock(2.0**15)
    guard = LossScaleGuard(patience=5, verbose=0)
    fake_fit(FakeModel(optimizer), [guard], ["nan"] * 200, step=stock_step(optimizer))
    assert (guard.reason, guard.step) == ("nonfinite_loss", 5)
    assert "kmix.LossScaleOptimizer does" in guard.diagnosis  # where to see the variable


def test_fake_stock_keras_applied_steps_break_the_streaks():
    optimizer = built_stock(2.0**15)
    guard = LossScaleGuard(patience=3, verbose=0)
    steps = ["nan", "nan", None] * 10  # the third step of each three is applied
    fake_fit(FakeModel(optimizer), [guard], steps, step=stock_step(optimizer))
    assert guard.reason is None


def test_fake_without_loss_scaling_only_the_loss_check_applies():
    model = FakeModel(keras.optimizers.SGD(0.01), policy="float32")
    guard = LossScaleGuard(patience=3, verbose=0)
    with pytest.warns(UserWarning, match="optimizer SGD does not scale the loss"):
        fake_fit(model, [guard], ["nan"] * 20, step=lambda kind: None)
    assert (guard.reason, guard.step) == ("nonfinite_loss", 3)


def event(step, kind="forward_overflow", variable=None, origin=None):
    return ScaleEvent(
        step, step, kind, 8.0, 8.0, variable, int(variable is not None), False, origin
    )


@pytest.mark.parametrize(
    ("events", "records", "says"),
    [
        (
            [event(7, variable="a/kernel"), event(6)],
            "kmix",
            "First non-finite gradient: `a/kernel`",
        ),
        ([event(7)], "kmix", "none (the gradients stayed finite)"),
        (
            [],
            "keras",
            "(the stock Keras optimizer does not record it; kmix.LossScaleOptimizer does)",
        ),
        ([], "none", "unknown (this run has no loss-scale optimizer, so nothing records which"),
        (
            [event(7, origin=ForwardOrigin("net/big", "Dense", True, 40000.0))],
            "kmix",
            "Forward overflow in `net/big` (Dense): inputs finite, max |input| 40000;",
        ),
        (
            [event(7, origin=ForwardOrigin("net/big", "Dense", True, None))],
            "kmix",
            "Forward overflow in `net/big` (Dense): inputs finite; keep",
        ),
        (
            [event(7, origin=ForwardOrigin("net/a", "Dense", False, None))],
            "kmix",
            "in `net/a` (Dense), whose inputs were already non-finite",
        ),
    ],
)
def test_the_nonfinite_loss_diagnosis_names_where_it_started(events, records, says):
    text = diagnosis(
        NonfiniteLoss(10, 5), patience=5, max_skip_rate=0.5, events=events, loss_scaling=records
    )
    assert text.startswith("kmix.LossScaleGuard stopped training at step 10: the loss has been")
    assert "for 5 consecutive steps (since step 6; patience=5)" in text
    assert says in text
    # A run without loss scaling is not told about a loss scale it does not have.
    assert ("loss scal" in text.split("First non-finite")[0]) == (records != "none")


def test_the_floor_and_skip_rate_diagnoses_say_the_numbers():
    floor = diagnosis(
        OverflowAtFloor(4, 4, 0.5, 1.0),
        patience=4,
        max_skip_rate=0.5,
        events=[event(4, "overflow_at_floor", "b/kernel")],
        loss_scaling="kmix",
    )
    assert "the loss scale is 0.5, at or below its floor 1, and the gradients" in floor
    assert "for 4 consecutive steps (since step 1; patience=4)" in floor
    assert "First non-finite gradient: `b/kernel`." in floor
    last = diagnosis(SkipRate(10, 10, 10, 5), patience=4, max_skip_rate=0.4)
    assert "5 of the last 10 steps (50%) were skipped" in last
    assert "more than max_skip_rate=0.4," in last
    earlier = diagnosis(SkipRate(8, 4, 4, 4), patience=4, max_skip_rate=0.4)
    assert "4 of the 4 steps up to step 4 (100%)" in earlier
