"""MixedPrecisionMonitor, checked by reading its event files with TensorBoard's reader.

The model is built so that float16 overflows happen exactly where the data says:
``out = a(x1) + b(x2)`` with both kernels 1 and SGD at learning rate 0, batch size 1.
A normal row (x1=1, x2=0, y=0) gives unscaled gradients a/kernel=2, a/bias=2,
b/kernel=0, b/bias=2. A spike row (x1=0, x2=10000, y=9999) gives a scaled
b/kernel gradient of 20000 * scale, which overflows float16 for every scale >= 4,
while every other gradient stays finite. Step k of an epoch is row k.

Tests that fit are in the slow tier; the fast tier runs the monitor's glue over a
plain-Python step record (tests/fake_optimizer.py) and reads its files back the same way.
"""

from __future__ import annotations

import math
import os
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from fake_optimizer import FakeModel, FakeRecorder, built_stock, fake_fit, scripted, stock_step
from spiky import spiky_data, spiky_model
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2

import kmix
from kmix import report, tags
from kmix.callbacks import MixedPrecisionMonitor


def fit(model, data, epochs: int = 1, **kwargs):
    x, y = data
    return model.fit(x, y, batch_size=1, epochs=epochs, shuffle=False, verbose=0, **kwargs)


def read_back(log_dir) -> dict[str, list[tuple[int, object]]]:
    """Every tensor point under ``<log_dir>/train``, as TensorBoard reads it."""
    guidance = {kind: 0 for kind in event_accumulator.DEFAULT_SIZE_GUIDANCE}
    acc = event_accumulator.EventAccumulator(
        os.path.join(str(log_dir), tags.TRAIN_DIR), size_guidance=guidance
    )
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        out[tag] = [(e.step, tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
    return out


def scalars(data, tag) -> dict[int, float]:
    return {step: float(value) for step, value in data.get(tag, [])}


def texts(data, tag) -> list[tuple[int, str]]:
    return [(step, value.item().decode()) for step, value in data.get(tag, [])]


def events(data) -> list[tuple[int, tags.ScaleEvent]]:
    parsed = [(step, tags.parse_event(line)) for step, line in texts(data, tags.EVENTS)]
    return [(step, event) for step, event in parsed if event is not None]


def assert_every_overflow_at_its_exact_step(log_dir) -> None:
    """Skips at steps 3 and 7 of each 10-step epoch, update_freq=1000: what the log holds."""
    data = read_back(log_dir)
    got = events(data)
    assert [step for step, _ in got] == [3, 7, 13, 17]
    assert all(step == event.step for step, event in got)
    assert {event.variable for _, event in got} == {"b/kernel"}
    assert [(e.kind, e.old_scale, e.new_scale) for _, e in got] == [
        ("backoff", 1024.0, 512.0),
        ("backoff", 512.0, 256.0),
        ("backoff", 256.0, 128.0),
        ("backoff", 128.0, 64.0),
    ]
    assert all(e.loss_finite and e.nonfinite_variables == 1 for _, e in got)
    # The scale before and after each change, plus the reads at both epoch ends.
    assert scalars(data, tags.LOSS_SCALE) == {
        2: 1024.0, 3: 512.0, 6: 512.0, 7: 256.0, 10: 256.0,
        12: 256.0, 13: 128.0, 16: 128.0, 17: 64.0, 20: 64.0,
    }  # fmt: skip
    assert scalars(data, tags.SKIPPED_STEPS) == {3: 1, 7: 2, 10: 2, 13: 3, 17: 4, 20: 4}
    assert scalars(data, tags.SKIP_RATE) == pytest.approx({10: 0.2, 20: 0.2}, rel=1e-6)
    assert scalars(data, tags.LOSS_FINITE) == {10: 1.0, 20: 1.0}


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_every_overflow_at_its_exact_step_with_a_long_update_freq(tmp_path):
    model = spiky_model()
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=1000, verbose=0)
    fit(model, spiky_data(10, spikes=(3, 7)), epochs=2, callbacks=[monitor])

    assert_every_overflow_at_its_exact_step(tmp_path)


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_health_scalars_and_exponent_histograms(tmp_path):
    model = spiky_model()
    optimizer = model.optimizer
    before = (optimizer.health_every, optimizer.histogram_every)
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=2, histogram_freq=4, verbose=0)
    fit(model, spiky_data(8, spikes=(3,)), callbacks=[monitor])
    assert (optimizer.health_every, optimizer.histogram_every) == before  # restored

    data = read_back(tmp_path)
    # Steps 2 and 8 are normal; step 4 is normal too (scale 512 after the spike at 3).
    scale_at = {2: 1024.0, 4: 512.0, 6: 512.0, 8: 512.0}
    # Health every update_freq steps, and at the skipped step 3 (b's kernel overflowed).
    assert sorted(scalars(data, tags.GRAD_NORM)) == [2, 3, 4, 6, 8]
    assert scalars(data, tags.NONFINITE_ELEMENTS)[3] == 1.0
    assert (
        scalars(data, tags.LOSS_SCALE_LOG2)[2] == 10.0
        and scalars(data, tags.LOSS_SCALE_LOG2)[3] == 9.0
    )
    acc = event_accumulator.EventAccumulator(os.path.join(str(tmp_path), tags.TRAIN_DIR))
    acc.Reload()
    for tag in (tags.GRAD_NORM, tags.UNDERFLOW_BY_VARIABLE + "a/kernel"):
        assert acc.SummaryMetadata(tag).summary_description == tags.description(tag) != ""
    for step, scale in scale_at.items():
        assert scalars(data, tags.GRAD_NORM)[step] == pytest.approx(math.sqrt(12), rel=1e-6)
        assert scalars(data, tags.MAX_ABS_SCALED_GRAD)[step] == 2 * scale
        headroom = scalars(data, tags.OVERFLOW_HEADROOM_BITS)[step]
        assert headroom == pytest.approx(math.log2(65504 / (2 * scale)), abs=1e-5)
        assert scalars(data, tags.UNDERFLOW_FRACTION)[step] == 0.25
        # b's kernel sees x2 = 0: its gradient is an exact zero, not a float16 underflow.
        assert scalars(data, tags.ZERO_FRACTION)[step] == 0.25
        assert scalars(data, tags.SUBNORMAL_FRACTION)[step] == 0.0
        assert scalars(data, tags.NONFINITE_ELEMENTS)[step] == 0.0
    by_variable = {
        path: scalars(data, tags.UNDERFLOW_BY_VARIABLE + path)[8]
        for path in ("a/kernel", "a/bias", "b/kernel", "b/bias")
    }
    assert by_variable == {"a/kernel": 0.0, "a/bias": 0.0, "b/kernel": 1.0, "b/bias": 0.0}

    edges = tags.exponent_bucket_edges()
    for path, exponent in (("a/kernel", 10), ("b/kernel", None)):  # 2 * 512 = 2**10
        points = data[tags.GRAD_EXPONENT + path]
        assert [step for step, _ in points] == [4, 8]
        histogram = points[-1][1]
        assert histogram.shape == (len(edges), 3)
        assert [tuple(row) for row in histogram[:, :2]] == edges
        (nonzero,) = np.nonzero(histogram[:, 2])
        assert histogram[:, 2].sum() == 1
        left = histogram[nonzero[0], 0]
        # A zero gradient is drawn left of every exponent, below float16's 2**-24.
        assert left == (exponent if exponent is not None else tags.EXPONENT_MIN - 2)
    assert histogram[:, 0].min() < tags.FLOAT16_MIN_SUBNORMAL_EXPONENT
    assert histogram[:, 1].max() > tags.FLOAT16_MAX_EXPONENT + 1


def assert_lost_events_reported(log_dir) -> None:
    """Skips at 1, 2, 4, 6, 9 of 10 steps with a ring of 2 and update_freq=1000: the last two
    events, one note counting the three lost, the skips still counted."""
    data = read_back(log_dir)
    assert [step for step, _ in events(data)] == [6, 9]
    notes = [line for _, line in texts(data, tags.EVENTS) if tags.parse_event(line) is None]
    assert len(notes) == 1
    assert "3 scale events lost" in notes[0]
    assert "event_capacity=2" in notes[0] and "update_freq" in notes[0]
    assert scalars(data, tags.SKIPPED_STEPS) == {10: 5}


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_lost_events_are_reported_not_silently_dropped(tmp_path):
    optimizer = kmix.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=1024, event_capacity=2
    )
    model = spiky_model(optimizer)
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=1000, verbose=0)
    fit(model, spiky_data(10, spikes=(1, 2, 4, 6, 9)), callbacks=[monitor])

    assert_lost_events_reported(tmp_path)


# Not on torch: Keras refuses steps_per_execution > 1 there.
@pytest.mark.jax
@pytest.mark.slow
def test_steps_per_execution(tmp_path):
    model = spiky_model(steps_per_execution=2)
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=4, verbose=0)
    fit(model, spiky_data(10, spikes=(3, 6)), callbacks=[monitor])

    data = read_back(tmp_path)
    assert [step for step, _ in events(data)] == [3, 6]
    assert scalars(data, tags.SKIPPED_STEPS) == {3: 1, 4: 1, 6: 2, 8: 2, 10: 2}
    assert scalars(data, tags.LOSS_SCALE) == {
        2: 1024.0, 3: 512.0, 4: 512.0, 5: 512.0, 6: 256.0, 8: 256.0, 10: 256.0
    }  # fmt: skip


@pytest.mark.slow
def test_with_validation_and_keras_tensorboard_on_the_same_log_dir(tmp_path):
    model = spiky_model()
    callbacks = [
        keras.callbacks.TensorBoard(tmp_path, update_freq=1),
        MixedPrecisionMonitor(tmp_path, update_freq=5, verbose=0),
    ]
    fit(
        model,
        spiky_data(10, spikes=(4,)),
        epochs=2,
        validation_data=spiky_data(3),
        callbacks=callbacks,
    )
    data = read_back(tmp_path)
    assert [step for step, _ in events(data)] == [4, 14]
    assert scalars(data, tags.SKIPPED_STEPS) == {4: 1, 5: 1, 10: 1, 14: 2, 15: 2, 20: 2}
    assert "epoch_loss" in data  # Keras's own points sit beside kmix's
    assert os.path.isdir(os.path.join(tmp_path, "validation"))


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_train_begin_writes_policy_layout_and_prints_the_command(tmp_path, capsys):
    model = spiky_model()
    fit(model, spiky_data(2), callbacks=[MixedPrecisionMonitor(tmp_path)])
    assert f"tensorboard --logdir {tmp_path}" in capsys.readouterr().out

    data = read_back(tmp_path)
    ((_, policy),) = texts(data, tags.POLICY)
    assert "mixed_float16" in policy and "kmix.LossScaleOptimizer" in policy
    assert "| b | Dense | float16 | float32 |" in policy  # the per-layer dtype table
    ((_, raw),) = data["custom_scalars__config__"]
    layout = layout_pb2.Layout.FromString(raw.item())
    patterns = {
        pattern
        for category in layout.category
        for chart in category.chart
        for pattern in chart.multiline.tag
    }
    for tag in (tags.LOSS_SCALE_LOG2, tags.SKIPPED_STEPS, tags.SKIP_RATE, tags.GRAD_NORM):
        assert f"^{tag}$" in patterns
    assert f"^{tags.OVERFLOW_HEADROOM_BITS}$" in patterns
    assert f"^{tags.UNDERFLOW_FRACTION}$" in patterns


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_stock_keras_optimizer_logs_scale_and_inferred_skips_and_warns_once(tmp_path):
    optimizer = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=1024
    )
    model = spiky_model(optimizer)
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=5, verbose=0)
    with pytest.warns(UserWarning, match="kmix.LossScaleOptimizer") as record:
        fit(model, spiky_data(10, spikes=(2, 3, 8)), callbacks=[monitor])
        fit(model, spiky_data(5), callbacks=[monitor])
    (warning,) = [w for w in record if "kmix.LossScaleOptimizer" in str(w.message)]
    assert warning.filename == __file__  # points at the user's code, not Keras's

    data = read_back(tmp_path)
    assert scalars(data, tags.LOSS_SCALE)[5] == 256.0
    assert scalars(data, tags.LOSS_SCALE)[10] == 128.0
    assert scalars(data, tags.SKIPPED_STEPS)[5] == 2
    assert scalars(data, tags.SKIPPED_STEPS)[10] == 3
    assert tags.GRAD_NORM not in data and not events(data)
    assert "kmix.LossScaleOptimizer('adam')" in texts(data, tags.NOTES)[0][1]


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_without_loss_scaling_logs_the_policy_and_why_the_rest_is_missing(tmp_path):
    keras.config.set_dtype_policy("float32")
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = np.ones((4, 1), np.float32), np.zeros((4, 1), np.float32)
    model.fit(x, y, callbacks=[MixedPrecisionMonitor(tmp_path, update_freq=1, verbose=0)])

    data = read_back(tmp_path)
    assert tags.LOSS_SCALE not in data and tags.SKIPPED_STEPS not in data
    ((_, note),) = texts(data, tags.NOTES)
    assert "No loss-scale optimizer" in note and "float32" in note
    assert "loss scaling: none" in texts(data, tags.POLICY)[0][1]


class RaiseAt(keras.callbacks.Callback):
    """Another user callback that ends fit by raising at a chosen step."""

    def __init__(self, step, error):
        super().__init__()
        self.step, self.error = step, error

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.step:
            raise self.error


@pytest.mark.slow
@pytest.mark.parametrize(
    ("error", "reason"),
    [
        pytest.param(
            KeyboardInterrupt(), "interrupted", marks=[pytest.mark.jax, pytest.mark.torch]
        ),
        (RuntimeError("disk"), "exception"),
    ],
)
def test_a_fit_ended_by_another_callback_leaves_every_event_on_disk(tmp_path, error, reason):
    model = spiky_model()
    before = model.optimizer.health_every
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=5, verbose=0)
    with pytest.raises(type(error)):
        fit(model, spiky_data(20, spikes=(3, 12)), callbacks=[monitor, RaiseAt(13, error)])

    data = read_back(tmp_path)
    assert [step for step, _ in events(data)] == [3, 12]  # step 12 too, though unread then
    assert max(scalars(data, tags.LOSS_SCALE)) == 13
    ((step, text),) = texts(data, tags.RUN_END)
    run_end = tags.parse_run_end(text)
    assert (step, run_end.step, run_end.reason) == (13, 13, reason)
    assert model.optimizer.health_every == before  # the monitor's request is withdrawn


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_dir": None}, TypeError, "log_dir=None"),
        ({"log_dir": 3}, TypeError, "log_dir=3"),
        ({"log_dir": " "}, ValueError, "non-empty"),
        ({"update_freq": 0}, ValueError, "update_freq=0.*integer >= 1"),
        ({"update_freq": -5}, ValueError, "update_freq=-5"),
        ({"update_freq": 2.5}, ValueError, "update_freq=2.5"),
        ({"update_freq": True}, ValueError, "update_freq=True"),
        ({"histogram_freq": -1}, ValueError, "histogram_freq=-1.*integer >= 0"),
        ({"verbose": 2}, ValueError, "verbose=2"),
    ],
)
def test_bad_arguments_fail_at_construction(tmp_path, kwargs, error, match):
    kwargs = {"log_dir": tmp_path, **kwargs}
    with pytest.raises(error, match=match):
        MixedPrecisionMonitor(**kwargs)


def test_log_dir_under_a_file_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        MixedPrecisionMonitor(blocker / "run")
    with pytest.raises(ValueError, match="is a file"):
        MixedPrecisionMonitor(blocker)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_log_dir_fails_at_construction(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="not writable"):
        MixedPrecisionMonitor(locked / "run")


def test_a_train_dir_that_cannot_be_created_fails_at_train_begin_naming_log_dir(tmp_path):
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    monitor = MixedPrecisionMonitor(tmp_path, verbose=0)
    (tmp_path / tags.TRAIN_DIR).write_text("a file where the train dir goes")
    monitor.set_model(model)
    with pytest.raises(ValueError, match=r"cannot create its log directory.*log_dir=") as info:
        monitor.on_train_begin()
    assert str(tmp_path) in str(info.value) and isinstance(info.value.__cause__, OSError)


def test_uncompiled_model_fails_at_train_begin(tmp_path):
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    monitor = MixedPrecisionMonitor(tmp_path, verbose=0)
    monitor.set_model(model)
    with pytest.raises(ValueError, match="not compiled.*model.compile"):
        monitor.on_train_begin()
    assert not os.path.exists(os.path.join(tmp_path, tags.TRAIN_DIR))


class Block(keras.layers.Layer):
    """A nested block: its Dense is tapped as `<model>/block/up`, the block itself too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(2, kernel_initializer="ones", name="up")

    def call(self, x):
        return self.up(x)


class Net(keras.Model):
    def __init__(self):
        super().__init__(name="net")
        self.block = Block(name="block")
        self.head = keras.layers.Dense(1, kernel_initializer="zeros", dtype="float32")

    def call(self, x):
        return self.head(self.block(x))


def functional_net():
    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(2, kernel_initializer="ones", name="up")(inputs)
    outputs = keras.layers.Dense(1, kernel_initializer="zeros", dtype="float32")(hidden)
    return keras.Model(inputs, outputs, name="net")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "layers", "jit_compile"),
    [
        pytest.param(functional_net, ["up"], False, marks=pytest.mark.torch),
        pytest.param(Net, ["net/block/up", "net/block"], False, marks=pytest.mark.torch),
        # compiled by XLA (on JAX, jit_compile=False runs the step eagerly: slow)
        pytest.param(Net, ["net/block/up", "net/block"], True, marks=pytest.mark.jax),
    ],
)
def test_activation_headroom_per_layer_is_exact(tmp_path, make, layers, jit_compile):
    """Outputs peak at 512 + 512 = 1024: headroom log2(65504 / 1024) at every read."""
    keras.config.set_dtype_policy("mixed_float16")
    model = make()
    model.compile(
        kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1.0),
        "mse",
        jit_compile=jit_compile,
    )
    x = np.full((4, 2), 512.0, np.float32)
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=2, verbose=0)
    model.fit(x, np.zeros((4, 1), np.float32), batch_size=1, verbose=0, callbacks=[monitor])

    data = read_back(tmp_path)
    expected = math.log2(65504.0 / 1024.0)  # 5.99930
    found = sorted(
        t[len(tags.ACTIVATION_HEADROOM_BITS) :]
        for t in data
        if t.startswith(tags.ACTIVATION_HEADROOM_BITS)
    )
    assert [path.split("/", 1)[-1] if make is functional_net else path for path in found] == sorted(
        layers
    )
    for path in found:
        assert scalars(data, tags.ACTIVATION_MAX_ABS + path) == {2: 1024.0, 4: 1024.0}
        headroom = scalars(data, tags.ACTIVATION_HEADROOM_BITS + path)
        assert headroom == pytest.approx({2: expected, 4: expected}, abs=1e-6)
        assert scalars(data, tags.ACTIVATION_NONFINITE_FRACTION + path) == {2: 0.0, 4: 0.0}
    assert scalars(data, tags.MIN_ACTIVATION_HEADROOM_BITS) == pytest.approx(
        {2: expected, 4: expected}, abs=1e-6
    )
    assert events(data) == []  # a healthy run has no forward events


class Growing(keras.layers.Layer):
    """Outputs ``x * g`` with ``g`` doubling at every call: 1 bit of headroom lost per step."""

    def build(self, input_shape):
        self.g = self.add_weight(shape=(), initializer="ones", trainable=False)

    def call(self, x):
        out = x * keras.ops.cast(self.g, x.dtype)
        self.g.assign(self.g * 2.0)
        return out


# Not on torch: there Keras 3.15 drops a float variable's assignment made in a float16
# layer's call (the assignment writes into the autocast copy), so `Growing` never grows.
@pytest.mark.jax
@pytest.mark.slow
def test_a_steadily_falling_headroom_is_forecast_before_the_overflow(tmp_path, capsys):
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((2,)), Growing(name="grow"), keras.layers.Dense(1, dtype="float32")]
    )
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1.0), "mse")
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=1, verbose=1)
    guard = kmix.callbacks.LossScaleGuard(verbose=0)
    # The line through the latest 6 readings reaches 0 at step 17.0; it is told once that is
    # no further ahead than those readings span: at step 12 (12 + 5 >= 17).
    x = np.ones((12, 2), np.float32)
    with pytest.warns(UserWarning, match="activations of .*grow.* about step 17") as warned:
        model.fit(
            x, np.zeros((12, 1), np.float32), batch_size=1, verbose=0, callbacks=[monitor, guard]
        )
    (forecast,) = [w for w in warned if "falling steadily" in str(w.message)]
    assert forecast.filename == __file__ and "LossScaleGuard" in str(forecast.message)

    data = read_back(tmp_path)
    headroom = scalars(data, tags.ACTIVATION_HEADROOM_BITS + "sequential/grow")
    # Step k outputs 2**(k - 1): headroom log2(65504) - (k - 1), zero at step 16.9993.
    assert headroom == pytest.approx({k: math.log2(65504.0) - (k - 1) for k in range(1, 13)})
    notes = [(step, text) for step, text in texts(data, tags.NOTES) if "falling steadily" in text]
    assert [step for step, _ in notes] == [12] and "at about step 17" in notes[0][1]
    assert "kmix: headroom of the activations of sequential/grow" in capsys.readouterr().out


@pytest.mark.slow
def test_a_monitor_built_inside_the_fit_call_still_records_how_the_run_ended(tmp_path):
    """`model.fit(..., callbacks=[kmix.callbacks.MixedPrecisionMonitor(...)])` in a fresh
    process: `fit` is looked up before `kmix.callbacks` is first imported."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import keras, numpy as np, kmix
        keras.config.set_dtype_policy("mixed_float16")
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, dtype="float32")])
        model.compile(kmix.LossScaleOptimizer("sgd"), "mse")

        class Boom(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 2:
                    raise RuntimeError("disk full")

        try:
            model.fit(np.ones((8, 2), "float32"), np.zeros((8, 1), "float32"), batch_size=1,
                      verbose=0, callbacks=[kmix.callbacks.MixedPrecisionMonitor(
                          {str(tmp_path)!r}, update_freq=100, verbose=0), Boom()])
        except RuntimeError:
            pass
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    ((step, text),) = texts(read_back(tmp_path), tags.RUN_END)
    run_end = tags.parse_run_end(text)
    assert (step, run_end.reason, run_end.message) == (
        3,
        "exception",
        "training ended by RuntimeError: disk full",
    )


# ------------------------------------------------------------------ fast tier
# The monitor's glue over a plain-Python step record: the same values, read back.


def test_fake_every_overflow_at_its_exact_step_with_a_long_update_freq(tmp_path):
    model = FakeModel(FakeRecorder(initial_scale=1024, min_scale=1))
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=1000, verbose=0)
    fake_fit(model, [monitor], scripted(10, skip=(3, 7)), epochs=2)

    assert_every_overflow_at_its_exact_step(tmp_path)


def test_fake_lost_events_are_reported_with_the_sources_capacity(tmp_path):
    model = FakeModel(FakeRecorder(initial_scale=1024, min_scale=1, event_capacity=2))
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=1000, verbose=0)
    fake_fit(model, [monitor], scripted(10, skip=(1, 2, 4, 6, 9)))

    assert_lost_events_reported(tmp_path)


def test_fake_steps_per_execution(tmp_path):
    model = FakeModel(FakeRecorder(initial_scale=1024, min_scale=1), steps_per_execution=2)
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=4, verbose=0)
    fake_fit(model, [monitor], scripted(10, skip=(3, 6)))

    data = read_back(tmp_path)
    assert [step for step, _ in events(data)] == [3, 6]
    assert scalars(data, tags.SKIPPED_STEPS) == {3: 1, 4: 1, 6: 2, 8: 2, 10: 2}
    assert scalars(data, tags.LOSS_SCALE) == {
        2: 1024.0, 3: 512.0, 4: 512.0, 5: 512.0, 6: 256.0, 8: 256.0, 10: 256.0
    }  # fmt: skip


def test_fake_policy_record_and_text_of_kmix_loss_scaling(tmp_path):
    model = FakeModel(FakeRecorder(initial_scale=1024, min_scale=2, max_scale=2.0**20))
    fake_fit(model, [MixedPrecisionMonitor(tmp_path, update_freq=7, verbose=0)], scripted(2))

    data = read_back(tmp_path)
    ((_, text),) = texts(data, tags.POLICY_RECORD)
    record = tags.parse_policy_record(text)
    assert (record.loss_scaling, record.min_scale, record.max_scale) == ("kmix", 2.0, 2.0**20)
    assert (record.compute_dtype, record.update_freq, record.model_name) == ("float16", 7, "fake")
    ((_, policy),) = texts(data, tags.POLICY)
    assert "loss scaling: `kmix.LossScaleOptimizer` (scale 1024, range [2, 1048576])." in policy
    assert tags.NOTES not in data  # float16 with kmix: everything is measured
    patterns = {
        pattern
        for category in layout_pb2.Layout.FromString(
            data["custom_scalars__config__"][0][1].item()
        ).category
        for chart in category.chart
        for pattern in chart.multiline.tag
    }
    for tag in (tags.LOSS_SCALE_LOG2, tags.SKIPPED_STEPS, tags.SKIP_RATE, tags.GRAD_NORM):
        assert f"^{tag}$" in patterns


def test_fake_stock_keras_optimizer_logs_scale_and_inferred_skips_and_warns_once(tmp_path):
    optimizer = built_stock(1024.0)
    model = FakeModel(optimizer)
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=5, verbose=0)
    step = stock_step(optimizer)
    with pytest.warns(UserWarning, match="kmix.LossScaleOptimizer") as record:
        fake_fit(model, [monitor], scripted(10, skip=(2, 3, 8)), step=step)
        fake_fit(model, [monitor], scripted(5), step=step)
    (warning,) = [w for w in record if "kmix.LossScaleOptimizer" in str(w.message)]
    assert warning.filename.endswith("fake_optimizer.py")  # the hooks' caller, not kmix's

    data = read_back(tmp_path)
    assert scalars(data, tags.LOSS_SCALE)[5] == 256.0
    assert scalars(data, tags.LOSS_SCALE)[10] == 128.0
    assert scalars(data, tags.SKIPPED_STEPS)[5] == 2
    assert scalars(data, tags.SKIPPED_STEPS)[10] == 3
    assert tags.GRAD_NORM not in data and not events(data)
    assert "kmix.LossScaleOptimizer('adam')" in texts(data, tags.NOTES)[0][1]
    record = tags.parse_policy_record(texts(data, tags.POLICY_RECORD)[0][1])
    assert (record.loss_scaling, record.min_scale, record.max_scale) == ("keras", None, None)
    assert (
        "loss scaling: the stock `keras.mixed_precision.LossScaleOptimizer`."
        in (texts(data, tags.POLICY)[0][1])
    )


def test_fake_without_loss_scaling_logs_the_policy_and_why_the_rest_is_missing(tmp_path):
    model = FakeModel(keras.optimizers.SGD(0.01), policy="float32")
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=1, verbose=0)
    with pytest.warns(UserWarning, match="No loss-scale optimizer"):
        fake_fit(model, [monitor], scripted(4), step=lambda kind: None)

    data = read_back(tmp_path)
    assert tags.LOSS_SCALE not in data and tags.SKIPPED_STEPS not in data
    ((_, note),) = texts(data, tags.NOTES)
    assert "No loss-scale optimizer" in note and "float32" in note
    assert "loss scaling: none (`SGD`)." in texts(data, tags.POLICY)[0][1]
    record = tags.parse_policy_record(texts(data, tags.POLICY_RECORD)[0][1])
    assert (record.loss_scaling, record.min_scale, record.max_scale) == ("none", None, None)


@pytest.mark.parametrize(
    ("error", "reason"), [(KeyboardInterrupt(), "interrupted"), (RuntimeError("disk"), "exception")]
)
def test_fake_run_ended_by_another_callback_leaves_every_event_on_disk(tmp_path, error, reason):
    model = FakeModel(FakeRecorder(initial_scale=1024, min_scale=1))
    before = model.optimizer.health_every
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=5, verbose=0)
    with pytest.raises(type(error)):
        fake_fit(model, [monitor, RaiseAt(13, error)], scripted(20, skip=(3, 12)))

    data = read_back(tmp_path)
    assert [step for step, _ in events(data)] == [3, 12]  # step 12 too, though unread then
    assert max(scalars(data, tags.LOSS_SCALE)) == 13
    ((step, text),) = texts(data, tags.RUN_END)
    run_end = tags.parse_run_end(text)
    assert (step, run_end.step, run_end.reason) == (13, 13, reason)
    assert model.optimizer.health_every == before  # the monitor's request is withdrawn


def test_fake_monitor_asks_for_health_every_update_freq_while_it_runs(tmp_path):
    optimizer = FakeRecorder()
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=6, verbose=0)
    seen = []
    fake_fit(
        FakeModel(optimizer),
        [monitor],
        scripted(3),
        step=lambda kind: (seen.append(optimizer.health_every), optimizer.step(kind)),
    )
    assert seen == [2, 2, 2]  # gcd(100, 6)
    assert optimizer.health_every == 100


# ------------------------------------------------- several runs in one log dir
def run_ids(data) -> list[str | None]:
    """The run id of every policy record, event record and run end, in that order."""
    found = [tags.parse_policy_record(text).run_id for _, text in texts(data, tags.POLICY_RECORD)]
    for tag in (tags.EVENT_RECORD, tags.RUN_END):
        found += [tags.parse_run_id(text) for _, text in texts(data, tag)]
    return found


def other_run_warnings(record) -> list[warnings.WarningMessage]:
    return [w for w in record if "already holds" in str(w.message)]


def test_fake_a_second_run_into_one_log_dir_gets_its_own_id_and_a_warning(tmp_path):
    """A script run twice: the second run is told apart, and the user is told once."""
    first = FakeModel(FakeRecorder(initial_scale=4, min_scale=1))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fake_fit(first, [MixedPrecisionMonitor(tmp_path, verbose=0)], scripted(6, skip=(2,)))
    assert other_run_warnings(record) == []
    (first_id,) = set(run_ids(read_back(tmp_path)))

    second = FakeModel(FakeRecorder(initial_scale=1024, min_scale=1))
    monitor = MixedPrecisionMonitor(tmp_path, verbose=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fake_fit(second, [monitor], scripted(6, skip=(4,)))
    (warning,) = other_run_warnings(record)
    message = str(warning.message)
    assert message.startswith(
        f"MixedPrecisionMonitor: log_dir {str(tmp_path)!r} already holds 1 kmix run (the latest "
        "began "
    )
    assert "this fit starts a new one there: its optimizer starts at step 0" in message
    assert f"`kmix report {tmp_path}`" in message and "runs/<name>-<date>" in message
    assert warning.filename.endswith("fake_optimizer.py")  # the hooks' caller, not kmix's

    ids = run_ids(read_back(tmp_path))
    assert monitor.run_id != first_id and re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", monitor.run_id)
    assert sorted(ids) == sorted([first_id] * 3 + [monitor.run_id] * 3)  # record, event, end
    summary = report.summarize(report.read_log(str(tmp_path)))
    assert summary.run.run_id == monitor.run_id
    assert [(e.step, e.old_scale) for e in summary.events] == [(4, 1024.0)]
    assert (summary.steps_seen, summary.skipped_steps, summary.loss_scale.initial) == (6, 1, 1024)


@pytest.mark.parametrize("same_monitor", [True, False], ids=["same-monitor", "new-monitor"])
def test_fake_a_fit_continuing_the_optimizers_steps_resumes_the_run(tmp_path, same_monitor):
    """A second fit on the same model, or BackupAndRestore's restart: one run, no warning."""
    model = FakeModel(FakeRecorder(initial_scale=1024, min_scale=1))
    monitor = MixedPrecisionMonitor(tmp_path, verbose=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fake_fit(model, [monitor], scripted(6, skip=(2,)))
        if not same_monitor:
            monitor = MixedPrecisionMonitor(tmp_path, verbose=0)
        fake_fit(model, [monitor], scripted(6, skip=(3,)))
    assert other_run_warnings(record) == []

    ids = run_ids(read_back(tmp_path))
    assert len(ids) == 6 and set(ids) == {monitor.run_id}
    (log,) = report.read_runs(str(tmp_path))
    assert (log.run.first_step, log.run.last_step, log.run.train_begins) == (0, 12, 2)
    summary = report.summarize(log)
    assert [e.step for e in summary.events] == [2, 9]
    assert (summary.steps_seen, summary.skipped_steps) == (12, 2)


def test_fake_a_fresh_optimizer_after_a_run_with_the_same_monitor_is_a_new_run(tmp_path):
    monitor = MixedPrecisionMonitor(tmp_path, verbose=0)
    fake_fit(FakeModel(FakeRecorder()), [monitor], scripted(3))
    first_id = monitor.run_id
    with pytest.warns(UserWarning, match="already holds 1 kmix run"):
        fake_fit(FakeModel(FakeRecorder()), [monitor], scripted(3))
    assert monitor.run_id != first_id
    assert [log.run.run_id for log in report.read_runs(str(tmp_path))] == [first_id, monitor.run_id]


def test_fake_resuming_a_run_written_before_run_ids_keeps_it_one_run(tmp_path):
    """A log of an earlier version has no id: its resume writes none, so it stays one run."""
    from test_runs import write_small_run

    write_small_run(str(tmp_path), None, scale=1024.0, steps=4)
    optimizer = FakeRecorder(initial_scale=1024, min_scale=1)
    for _ in range(4):
        optimizer.step()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fake_fit(FakeModel(optimizer), [MixedPrecisionMonitor(tmp_path, verbose=0)], scripted(2))
    assert other_run_warnings(record) == []
    (log,) = report.read_runs(str(tmp_path))
    assert (log.run.run_id, log.run.train_begins, log.run.last_step) == (None, 2, 6)


def test_fake_a_new_run_after_a_run_written_before_run_ids_warns(tmp_path):
    from test_runs import write_small_run

    write_small_run(str(tmp_path), None, scale=1024.0, steps=4)
    monitor = MixedPrecisionMonitor(tmp_path, verbose=0)
    with pytest.warns(UserWarning, match="already holds 1 kmix run"):
        fake_fit(FakeModel(FakeRecorder()), [monitor], scripted(2))
    assert [log.run.run_id for log in report.read_runs(str(tmp_path))] == [None, monitor.run_id]


@pytest.mark.slow
def test_two_scripts_into_one_log_dir_through_model_fit(tmp_path):
    """Real fits: a second fit of a model resumes its run; a new model's fit is a new run."""
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=1000, verbose=0)
    model = spiky_model(kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(model, spiky_data(6, spikes=(2,)), callbacks=[monitor])
        fit(model, spiky_data(6, spikes=(3,)), callbacks=[monitor])  # steps 7..12: resumed
    assert other_run_warnings(record) == []
    first_id = monitor.run_id

    again = spiky_model(kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1024))
    second = MixedPrecisionMonitor(tmp_path, update_freq=1000, verbose=0)
    with pytest.warns(UserWarning, match="already holds 1 kmix run") as record:
        fit(again, spiky_data(6, spikes=(4,)), callbacks=[second])
    (warning,) = other_run_warnings(record)
    assert warning.filename == __file__  # points at the user's code

    logs = report.read_runs(str(tmp_path))
    assert [(log.run.run_id, log.run.train_begins) for log in logs] == [
        (first_id, 2),
        (second.run_id, 1),
    ]
    latest = report.summarize(logs[-1])
    assert [(e.step, e.old_scale, e.new_scale) for e in latest.events] == [(4, 1024.0, 512.0)]
    assert (latest.steps_seen, latest.skipped_steps) == (6, 1)
    assert (latest.loss_scale.initial, latest.loss_scale.final) == (1024.0, 512.0)
    assert latest.run_end.run_id == second.run_id
    earlier = report.summarize(logs[0])
    assert [(e.step, e.old_scale) for e in earlier.events] == [(2, 8.0), (9, 4.0)]
    assert (earlier.steps_seen, earlier.skipped_steps) == (12, 2)
    assert any(f.rule == "runs" for f in latest.findings)


@pytest.mark.slow
def test_a_run_resumed_by_backup_and_restore_is_one_run(tmp_path):
    """The script crashes in epoch 2 and is run again: a new monitor, the restored optimizer."""

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) >= 9:
                raise RuntimeError("crash")

    def script(crash: bool) -> MixedPrecisionMonitor:
        optimizer = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1024)
        monitor = MixedPrecisionMonitor(tmp_path, update_freq=2, verbose=0)
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        callbacks = [backup, monitor] + ([Crash()] if crash else [])
        fit(spiky_model(optimizer), spiky_data(6, spikes=(2,)), epochs=3, callbacks=callbacks)
        return monitor

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="crash"):
            script(crash=True)
        monitor = script(crash=False)
    assert other_run_warnings(record) == []
    (log,) = report.read_runs(str(tmp_path))
    assert (log.run.run_id, log.run.train_begins, log.run.last_step) == (monitor.run_id, 2, 18)
    summary = report.summarize(log)
    assert [e.step for e in summary.events] == [2, 8, 14]
    assert (summary.steps_seen, summary.skipped_steps, summary.run_end.reason) == (
        18,
        3,
        "completed",
    )


def raises_at_trace(y_true, y_pred):
    """A metric that fails while the first step is traced, after the optimizer built."""
    raise RuntimeError("a broken metric")


@pytest.mark.slow
@pytest.mark.parametrize("float8", [False, True])
def test_a_fit_whose_first_step_never_ran_ends_its_run_and_the_optimizer_says_why(tmp_path, float8):
    """On TensorFlow, kmix's optimizer first used in ``fit`` creates its variables while the
    step is traced; a metric raising later in that trace leaves them without values. The run
    still ends on disk (no step ran), and the next fit with that optimizer is refused in
    words, not with TensorFlow's "uninitialized" graph error."""
    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    if float8:
        model.quantize("float8")
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer, "mse", metrics=[raises_at_trace])
    x, y = np.ones((32, 8), np.float32), np.zeros((32, 1), np.float32)
    monitor = MixedPrecisionMonitor(tmp_path, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="a broken metric"):
            fit(model, (x, y), callbacks=[monitor])
    assert not [w for w in caught if "could not write the end of the run" in str(w.message)]
    assert optimizer.built and optimizer.read_state().attempted_steps == 0
    assert optimizer.float8_saturations() == [] and optimizer.float8_health() == []

    ((step, text),) = texts(read_back(tmp_path), tags.RUN_END)
    run_end = tags.parse_run_end(text)
    assert (step, run_end.step, run_end.reason) == (0, 0, "exception")

    model.compile(optimizer, "mse", metrics=["mae"])  # (no metrics would keep the old ones)
    with pytest.raises(RuntimeError, match="'loss_scale_optimizer' cannot train.*new optimizer"):
        fit(model, (x, y))
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse", metrics=["mae"])
    fit(model, (x, y))  # a new optimizer trains
    assert model.optimizer.read_state().attempted_steps == 32
