"""LoopDriver in a single-process custom loop: hooks, stop, errors, flushing.

The custom loops with kmix's optimizer are in the slow tier; the fast tier drives the
same callbacks over a plain-Python step record (tests/fake_optimizer.py).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from fake_optimizer import FakeModel, FakeRecorder
from tensorboard.backend.event_processing import event_accumulator

import kmix
from kmix import tags


def custom_loop(driver, model, opt, inputs):
    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    with driver:
        for x in inputs:
            train_step(tf.constant(x))
            if driver.step_end():
                break


def make():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = kmix.LossScaleOptimizer("sgd", initial_scale=8.0)
    model.compile(optimizer=opt)
    return model, opt


@pytest.mark.slow
def test_monitor_sees_every_event_of_a_custom_loop(tmp_path):
    model, opt = make()
    monitor = kmix.callbacks.MixedPrecisionMonitor(str(tmp_path), update_freq=100, verbose=0)
    inputs = [np.ones((2, 2), "float32")] * 5
    inputs[1] = np.full((2, 2), np.inf, "float32")
    driver = kmix.callbacks.LoopDriver(model, [monitor])
    custom_loop(driver, model, opt, inputs)
    assert driver.step == 5 and driver.is_chief
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / tags.TRAIN_DIR), size_guidance={"tensors": 0}
    )
    acc.Reload()
    assert [e.step for e in acc.Tensors(tags.EVENTS)] == [2]  # drained at train end


@pytest.mark.slow
def test_guard_stop_ends_the_loop_and_raise_mode_propagates():
    model, opt = make()
    nan = [np.full((2, 2), np.nan, "float32")] * 10
    guard = kmix.callbacks.LossScaleGuard(patience=2, verbose=0)
    driver = kmix.callbacks.LoopDriver(model, [guard])
    custom_loop(driver, model, opt, nan)
    assert (driver.step, guard.reason, model.stop_training) == (2, "nonfinite_loss", True)

    model, opt = make()
    guard = kmix.callbacks.LossScaleGuard(patience=3, mode="raise", verbose=0)
    driver = kmix.callbacks.LoopDriver(model, [guard])
    with pytest.raises(kmix.callbacks.LossScaleGuardError):
        custom_loop(driver, model, opt, nan)
    assert driver.step == 3


@pytest.mark.parametrize("bad", [["not a callback"], [object()]])
def test_loop_driver_rejects_what_is_not_a_callback(bad):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="`callbacks`"):
        kmix.callbacks.LoopDriver(model, bad)


def fake_loop(driver, optimizer, steps):
    with driver:
        for kind in steps:
            optimizer.step(kind)
            if driver.step_end():
                break


def test_fake_monitor_sees_every_event_of_a_custom_loop(tmp_path):
    optimizer = FakeRecorder(initial_scale=8.0, min_scale=1.0)
    model = FakeModel(optimizer)
    monitor = kmix.callbacks.MixedPrecisionMonitor(str(tmp_path), update_freq=100, verbose=0)
    driver = kmix.callbacks.LoopDriver(model, [monitor])
    fake_loop(driver, optimizer, [None, "skip", None, None, None])
    assert driver.step == 5 and driver.is_chief
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / tags.TRAIN_DIR), size_guidance={"tensors": 0}
    )
    acc.Reload()
    assert [e.step for e in acc.Tensors(tags.EVENTS)] == [2]  # drained at train end


def test_fake_guard_stop_ends_the_loop_and_raise_mode_propagates():
    optimizer = FakeRecorder(initial_scale=8.0, min_scale=1.0)
    model = FakeModel(optimizer)
    guard = kmix.callbacks.LossScaleGuard(patience=2, verbose=0)
    driver = kmix.callbacks.LoopDriver(model, [guard])
    fake_loop(driver, optimizer, ["nan"] * 10)
    assert (driver.step, guard.reason, model.stop_training) == (2, "nonfinite_loss", True)

    optimizer = FakeRecorder(initial_scale=8.0, min_scale=1.0)
    model = FakeModel(optimizer)
    guard = kmix.callbacks.LossScaleGuard(patience=3, mode="raise", verbose=0)
    driver = kmix.callbacks.LoopDriver(model, [guard])
    with pytest.raises(kmix.callbacks.LossScaleGuardError):
        fake_loop(driver, optimizer, ["nan"] * 10)
    assert driver.step == 3


def test_fake_loop_ended_by_an_error_records_why(tmp_path):
    """The loop raises at step 3: the monitor writes the event at 2 and the run's end."""
    optimizer = FakeRecorder(initial_scale=8.0, min_scale=1.0)
    model = FakeModel(optimizer)
    monitor = kmix.callbacks.MixedPrecisionMonitor(str(tmp_path), update_freq=100, verbose=0)
    driver = kmix.callbacks.LoopDriver(model, [monitor])
    with pytest.raises(RuntimeError, match="disk full"), driver:
        for kind in [None, "skip", None]:
            optimizer.step(kind)
            driver.step_end()
        raise RuntimeError("disk full")
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / tags.TRAIN_DIR), size_guidance={"tensors": 0}
    )
    acc.Reload()
    assert [e.step for e in acc.Tensors(tags.EVENTS)] == [2]
    (run_end,) = acc.Tensors(tags.RUN_END)
    parsed = tags.parse_run_end(tf.make_ndarray(run_end.tensor_proto).item().decode())
    assert (run_end.step, parsed.reason, parsed.message) == (
        3,
        tags.EXCEPTION,
        "training ended by RuntimeError: disk full",
    )
