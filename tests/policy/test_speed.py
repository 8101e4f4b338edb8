"""Tests for kmix.policy.speed (the ratio rules and their words, over hand-made timings)
and kmix.policy.timing (a real measurement, in this process and in a fresh one)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from kmix.policy import demo_check
from kmix.policy import speed as probe_rules
from kmix.policy import timing as probe
from kmix.policy.speed import (
    DTYPES,
    ONEDNN_FIX,
    OPS,
    Missing,
    Ratio,
    SpeedMeasurement,
    Timing,
    describe,
    doctor_lines,
    float16_cpu_finding,
    measurement_lines,
    onednn_fix_applies,
    relative_spread,
    speed_ratios,
    verdict,
)

MS = 1e-3


def cells(op: str, **seconds_ms: tuple[float, ...]) -> tuple[Timing, ...]:
    """One Timing per dtype keyword, its round times given in milliseconds."""
    return tuple(Timing(op, dtype, tuple(s * MS for s in ms)) for dtype, ms in seconds_ms.items())


# float16 400x float32 (oneDNN's float16 path on a Xeon with AVX512_FP16), bfloat16 faster.
XEON = SpeedMeasurement(
    timings=cells("matmul", float32=(1.0, 1.1, 0.9), float16=(400.0, 401.0), bfloat16=(0.5,) * 3)
    + cells("conv2d", float32=(2.0, 2.0, 2.0), float16=(700.0, 800.0), bfloat16=(2.1,) * 3),
    onednn=True,
    seconds=2.5,
)
# The same machine with TF_ENABLE_ONEDNN_OPTS=0, float32 and float16 only.
XEON_OFF = SpeedMeasurement(
    timings=cells("matmul", float32=(1.0, 1.0), float16=(1.5, 1.5))
    + cells("conv2d", float32=(2.0, 2.0), float16=(2.0, 2.0)),
    onednn=False,
    onednn_setting="0",
    seconds=4.0,
)


@pytest.mark.parametrize(
    ("ratio", "noise", "expected"),
    [
        (10.0, 0.0, "pathological"),
        (400.0, None, "pathological"),
        (9.99, 9.0, "same"),  # just below PATHOLOGICAL, inside a wide noise floor
        (1.2, 0.1, "slower"),
        (1.1, 0.1, "same"),  # exactly at the noise floor: not measurably slower
        (0.95, 0.1, "same"),
        (0.9, 0.1, "faster"),  # below 1 / 1.1
        (1.0, None, "same"),
        (1.01, None, "slower"),
        (0.5, 0.0, "faster"),
    ],
)
def test_verdict_rule(ratio, noise, expected):
    assert verdict(ratio, noise) == expected


def test_relative_spread_is_max_minus_min_over_the_median():
    assert relative_spread([1.0]) is None
    assert relative_spread([]) is None
    assert relative_spread([1.0, 2.0, 3.0]) == 1.0
    assert relative_spread([4.0, 4.0]) == 0.0
    # 4 or more rounds: the fastest and the slowest are left out of the spread
    assert relative_spread([1.0, 2.0, 2.0, 2.5, 9.0]) == pytest.approx(0.25)
    assert relative_spread([1.0, 2.0, 3.0, 4.0]) == pytest.approx(1.0 / 2.5)


def test_speed_ratios_in_op_and_dtype_order_against_float32():
    assert speed_ratios(XEON) == (
        Ratio("matmul", "float16", pytest.approx(400.5), pytest.approx(0.2), 2),
        Ratio("matmul", "bfloat16", pytest.approx(0.5), pytest.approx(0.2), 3),
        Ratio("conv2d", "float16", pytest.approx(375.0), 0.0, 2),
        Ratio("conv2d", "bfloat16", pytest.approx(1.05), 0.0, 3),
    )
    assert [r.verdict for r in speed_ratios(XEON)] == [
        "pathological",
        "faster",
        "pathological",
        "slower",
    ]


def test_speed_ratios_skip_cells_without_float32_or_without_the_dtype():
    only_half = SpeedMeasurement(
        timings=cells("matmul", float16=(1.0,)) + cells("conv2d", float32=(1.0,)),
        missing=(Missing("matmul", "float32", "boom"),),
    )
    assert speed_ratios(only_half) == ()


def test_describe_words_each_verdict():
    assert describe(Ratio("matmul", "float16", 400.5, 0.2, 2)) == (
        "float16 matmul: 400x float32's time, pathologically slow"
    )
    assert describe(Ratio("matmul", "float16", 1.5, 0.2, 5)) == (
        "float16 matmul: 1.50x float32's time (slower; float32's own noise 20%)"
    )
    assert describe(Ratio("conv2d", "bfloat16", 0.5, 0.04, 5)) == (
        "bfloat16 conv2d: 0.50x float32's time (faster; float32's own noise 4%)"
    )
    assert describe(Ratio("matmul", "float16", 1.09, 0.21, 5)) == (
        "float16 matmul: 1.09x float32's time, no measurable difference (float32's own noise 21%)"
    )
    assert describe(Ratio("matmul", "float16", 1.5, None, 1)) == (
        "float16 matmul: 1.50x float32's time (slower)"
    )


def test_measurement_lines_times_ratios_and_what_was_not_measured():
    measured = SpeedMeasurement(
        timings=cells("matmul", float32=(0.46, 0.5, 0.4), float16=(152.0, 160.0)),
        missing=(Missing("conv2d", "bfloat16", "NotFoundError: no kernel"),),
    )
    assert measurement_lines(measured) == [
        "matmul 128x512 @ 512x512, forward and backward: float32 0.460 ms, float16 156 ms a "
        "call (median of 2/3 rounds)",
        "float16 matmul: 339x float32's time, pathologically slow",
        "bfloat16 conv2d: not measured: NotFoundError: no kernel",
    ]


def test_onednn_fix_applies_only_to_a_pathological_float16_with_onednn_on():
    assert onednn_fix_applies(XEON)
    assert not onednn_fix_applies(XEON_OFF)
    assert not onednn_fix_applies(SpeedMeasurement(XEON.timings, onednn=False))
    assert not onednn_fix_applies(SpeedMeasurement(XEON.timings, onednn=None))
    bfloat16_only = SpeedMeasurement(
        cells("matmul", float32=(1.0,), float16=(1.0,), bfloat16=(50.0,)), onednn=True
    )
    assert not onednn_fix_applies(bfloat16_only)


def test_doctor_lines_show_the_fix_and_its_measured_effect():
    assert doctor_lines(XEON, XEON_OFF) == [
        "oneDNN CPU kernels: on (TF_ENABLE_ONEDNN_OPTS unset); measured in 2.5 s",
        "matmul 128x512 @ 512x512, forward and backward: float32 1.00 ms, float16 400 ms, "
        "bfloat16 0.500 ms a call (median of 2/3 rounds)",
        "conv2d 8x32x32x32 (NHWC), 3x3 kernel, 32 filters, forward and backward: float32 "
        "2.00 ms, float16 750 ms, bfloat16 2.10 ms a call (median of 2/3 rounds)",
        "float16 matmul: 400x float32's time, pathologically slow",
        "bfloat16 matmul: 0.50x float32's time (faster; float32's own noise 20%)",
        "float16 conv2d: 375x float32's time, pathologically slow",
        "bfloat16 conv2d: 1.05x float32's time (slower; float32's own noise 0%)",
        f"fix: oneDNN's float16 path is slow here: {ONEDNN_FIX}",
        "measured with TF_ENABLE_ONEDNN_OPTS=0 in a fresh process (4.0 s):",
        "  matmul 128x512 @ 512x512, forward and backward: float32 1.00 ms, float16 1.50 ms a "
        "call (median of 2 rounds)",
        "  conv2d 8x32x32x32 (NHWC), 3x3 kernel, 32 filters, forward and backward: float32 "
        "2.00 ms, float16 2.00 ms a call (median of 2 rounds)",
        "  float16 matmul: 1.50x float32's time (slower; float32's own noise 0%)",
        "  float16 conv2d: 1.00x float32's time, no measurable difference (float32's own noise 0%)",
        "effect: float16 matmul 400 ms -> 1.50 ms a call (400x -> 1.50x float32's time)",
        "effect: float16 conv2d 750 ms -> 2.00 ms a call (375x -> 1.00x float32's time)",
    ]


def test_doctor_lines_when_the_fix_could_not_be_measured_or_does_not_apply():
    failed = doctor_lines(XEON, None, "the measuring process took over 60 s")
    assert failed[-2:] == [
        f"fix: oneDNN's float16 path is slow here: {ONEDNN_FIX}",
        "its effect was not measured: the measuring process took over 60 s",
    ]
    oneDNN_off = SpeedMeasurement(XEON.timings, onednn=False, onednn_setting="0", seconds=2.5)
    lines = doctor_lines(oneDNN_off)
    assert lines[0] == "oneDNN CPU kernels: off (TF_ENABLE_ONEDNN_OPTS '0'); measured in 2.5 s"
    assert lines[-1] == (
        "no fix kmix knows for the pathologically slow dtype: use a policy that avoids it "
        "(kmix compare measures each policy on your model)"
    )
    assert not any(line.startswith("fix:") for line in lines)
    assert doctor_lines(XEON_OFF)[-1].startswith("  ") is False  # no fix, no recheck


def test_float16_cpu_finding_gives_the_measured_ratio_or_says_why_not():
    slow = SpeedMeasurement(cells("matmul", float32=(1.0, 1.02, 0.98), float16=(3.0, 3.1, 2.9)))
    assert float16_cpu_finding(slow) == (
        "no GPU or TPU was found, and on this CPU a float16 matmul (128x512 @ 512x512, forward "
        "and backward) "
        "measured 3.00x float32's time (median of 3 rounds; float32's own noise 4%)",
        True,
    )
    same = SpeedMeasurement(cells("matmul", float32=(1.0, 1.2, 0.9), float16=(1.1, 1.1, 1.1)))
    assert float16_cpu_finding(same) == (
        "no GPU or TPU was found, and on this CPU a float16 matmul (128x512 @ 512x512, forward "
        "and backward) "
        "measured 1.10x float32's time (median of 3 rounds; float32's own noise 30%)",
        False,
    )
    a_little = SpeedMeasurement(cells("matmul", float32=(1.0, 1.0, 1.0), float16=(1.19,) * 3))
    assert float16_cpu_finding(a_little) == (
        "no GPU or TPU was found, and on this CPU a float16 matmul (128x512 @ 512x512, forward "
        "and backward) "
        "measured 1.19x float32's time (median of 3 rounds; float32's own noise 0%)",
        False,  # slower beyond the noise, but by less than WORTH_A_WARNING
    )
    sentence, slower = float16_cpu_finding(XEON)
    assert slower
    assert sentence.endswith(
        "measured 400x float32's time (median of 2 rounds; float32's own noise 20%); "
        f"oneDNN's float16 path is slow here: {ONEDNN_FIX}"
    )
    missing = SpeedMeasurement(missing=(Missing("matmul", "float16", "TypeError: no"),))
    assert float16_cpu_finding(missing) == (
        "float16's speed on this CPU was not measured (float16 matmul: TypeError: no)",
        False,
    )
    assert float16_cpu_finding(SpeedMeasurement()) == (
        "float16's speed on this CPU was not measured (no timing)",
        False,
    )


def test_measurement_round_trips_through_json():
    assert SpeedMeasurement.from_dict(json.loads(json.dumps(XEON.to_dict()))) == XEON
    with_missing = SpeedMeasurement(missing=(Missing("conv2d", "bfloat16", "why"),))
    assert SpeedMeasurement.from_dict(json.loads(json.dumps(with_missing.to_dict()))) == (
        with_missing
    )


def test_measure_times_every_cell_here_and_the_ratios_follow_from_the_times():
    measured = probe.measure(rounds=2, round_seconds=0.002)
    timed = {(t.op, t.dtype) for t in measured.timings}
    missing = {(m.op, m.dtype) for m in measured.missing}
    assert timed | missing == {(op, dtype) for op in OPS for dtype in DTYPES}
    assert not timed & missing
    assert ("matmul", "float32") in timed
    for timing in measured.timings:
        assert len(timing.seconds) == 2
        assert all(0 < s < 10 for s in timing.seconds)
    for ratio in speed_ratios(measured):
        assert ratio.ratio == pytest.approx(
            measured.timing(ratio.op, ratio.dtype).median
            / measured.timing(ratio.op, "float32").median
        )
    assert measured.onednn in (True, False)  # conftest: off unless the caller set it
    assert measured.seconds > 0


def test_float16_probe_is_measured_once_per_process_and_times_every_op():
    first = probe.float16_probe()
    assert probe.float16_probe() is first
    cells = {(t.op, t.dtype) for t in first.timings} | {(m.op, m.dtype) for m in first.missing}
    assert cells == {(op, dtype) for op in OPS for dtype in ("float32", "float16")}


def test_a_probe_call_runs_the_op_forward_and_backward():
    """The gradients a call returns are those of ``sum(op(a, b))``, against NumPy."""
    import tensorflow as tf

    a, b = (x.astype(np.float64) for x in probe._inputs("matmul"))
    grad_a, grad_b = probe._tf_op_call(tf, "matmul", "float32")()
    ones = np.ones((a.shape[0], b.shape[1]))
    np.testing.assert_allclose(grad_a, ones @ b.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(grad_b, a.T @ ones, rtol=1e-5, atol=1e-4)
    image, kernel = probe._inputs("conv2d")
    grads = probe._tf_op_call(tf, "conv2d", "float32")()
    assert [tuple(g.shape) for g in grads] == [image.shape, kernel.shape]
    # d(sum of the outputs)/d(kernel[i, j, c, f]) is the sum of the input channel c over the
    # positions that tap (i, j) sees; the centre tap sees every position. A float32 sum of
    # n terms is off by at most n * 2**-24 * max |term| (rounding at each addition).
    n = image.shape[0] * image.shape[1] * image.shape[2]
    bound = n * 2.0**-24 * np.abs(image).max()
    np.testing.assert_allclose(grads[1][1, 1, :, 0], image.sum(axis=(0, 1, 2)), atol=bound)


def test_measure_in_subprocess_says_when_the_process_fails(monkeypatch):
    with pytest.raises(RuntimeError, match=r"^the measuring process took over 0 s$"):
        probe.measure_in_subprocess({}, timeout_s=0.01)
    monkeypatch.setattr(sys, "executable", "false")  # exits 1, prints nothing
    with pytest.raises(
        RuntimeError, match=r"^the measuring process exited with status 1: no output$"
    ):
        probe.measure_in_subprocess({})


@pytest.mark.slow
def test_measure_in_subprocess_with_onednn_off():
    measured = probe.measure_in_subprocess({"TF_ENABLE_ONEDNN_OPTS": "0"}, ops=("matmul",))
    assert (measured.onednn, measured.onednn_setting) == (False, "0")
    assert [(t.op, t.dtype) for t in measured.timings] == [
        ("matmul", "float32"),
        ("matmul", "float16"),
    ]
    assert measured.seconds > sum(t.median for t in measured.timings)


# ------------------------------------------------------- kmix demo and oneDNN's float16 path
@pytest.mark.parametrize(
    ("policy", "flags", "environ", "imported", "expected"),
    [
        ("mixed_float16", ("avx512_fp16", "avx512f"), {}, False, True),
        ("float16", ("amx_fp16",), {}, False, True),
        ("mixed_float16", ("avx512f", "avx512_bf16"), {}, False, False),  # Eigen's float16
        ("mixed_bfloat16", ("avx512_fp16",), {}, False, False),
        ("float32", ("avx512_fp16",), {}, False, False),
        ("auto", ("avx512_fp16",), {}, False, False),  # "auto" never picks float16 on a CPU
        ("mixed_float16", ("avx512_fp16",), {"TF_ENABLE_ONEDNN_OPTS": "1"}, False, False),
        ("mixed_float16", ("avx512_fp16",), {"TF_ENABLE_ONEDNN_OPTS": "0"}, False, False),
        ("mixed_float16", ("avx512_fp16",), {}, True, False),  # too late to change
    ],
)
def test_demo_checks_onednn_only_where_the_check_can_change_something(
    policy, flags, environ, imported, expected
):
    assert demo_check.should_check_onednn(policy, flags, environ, imported) is expected


def test_demo_onednn_note_says_what_was_measured_and_done():
    assert demo_check.onednn_note(XEON) == (
        "kmix demo: a float16 matmul measured 400x float32's time on this CPU with oneDNN on "
        "(in a fresh process, 2.5 s), so this run sets TF_ENABLE_ONEDNN_OPTS=0 and float16 "
        "runs on TensorFlow's own kernels (TF_ENABLE_ONEDNN_OPTS=1 keeps oneDNN; kmix doctor "
        "measures both)"
    )
    assert demo_check.onednn_note(XEON_OFF) is None
    assert demo_check.onednn_note(SpeedMeasurement(XEON.timings, onednn=False)) is None


@pytest.fixture
def xeon_before_tensorflow(monkeypatch):
    """This process as a fresh ``kmix demo`` on a Xeon with AVX512_FP16 would see it."""
    cpuinfo = ("Xeon", ("avx512_fp16",))
    monkeypatch.setattr(sys.modules["kmix.policy.machine"], "read_cpuinfo", lambda: cpuinfo)
    monkeypatch.delitem(sys.modules, "tensorflow")
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    return monkeypatch


def test_demo_turns_onednn_off_where_float16_measured_pathological(xeon_before_tensorflow):
    asked = []
    xeon_before_tensorflow.setattr(
        demo_check, "measure_in_subprocess", lambda env, ops: asked.append((env, ops)) or XEON
    )
    assert demo_check.avoid_slow_float16_path("mixed_bfloat16") is None
    assert "TF_ENABLE_ONEDNN_OPTS" not in os.environ
    assert demo_check.avoid_slow_float16_path("mixed_float16") == demo_check.onednn_note(XEON)
    assert asked == [({}, OPS)]  # every op, forward and backward, as training runs them
    assert os.environ["TF_ENABLE_ONEDNN_OPTS"] == "0"


def test_demo_keeps_onednn_where_float16_is_not_pathological(xeon_before_tensorflow):
    xeon_before_tensorflow.setattr(demo_check, "measure_in_subprocess", lambda env, ops: XEON_OFF)
    assert demo_check.avoid_slow_float16_path("mixed_float16") is None
    assert "TF_ENABLE_ONEDNN_OPTS" not in os.environ
    xeon_before_tensorflow.setattr(demo_check, "measure_in_subprocess", fail_to_measure)
    assert demo_check.avoid_slow_float16_path("mixed_float16") == (
        "kmix demo: oneDNN's float16 speed could not be checked (the measuring process took "
        "over 60 s); oneDNN stays on"
    )
    assert "TF_ENABLE_ONEDNN_OPTS" not in os.environ


def fail_to_measure(*args, **kwargs):
    raise RuntimeError("the measuring process took over 60 s")


def test_demo_checks_nothing_on_this_process():
    assert demo_check.avoid_slow_float16_path("mixed_float16") is None  # TensorFlow is imported


def test_doctor_speed_section_says_an_accelerator_is_not_timed():
    from kmix.cli.doctor import speed_section
    from kmix.policy.machine import GPU, Hardware

    cpu_only = speed_section(Hardware(), XEON_OFF)
    assert cpu_only == ["speed on this CPU (each dtype's time for the same op)"] + [
        f"  {line}" for line in doctor_lines(XEON_OFF)
    ]
    with_gpu = speed_section(
        Hardware(gpus=(GPU("/physical_device:GPU:0", "H200", (9, 0)),)), XEON_OFF
    )
    assert with_gpu == cpu_only + [
        "  the GPU or TPU is not timed here: kmix compare times each policy on your model"
    ]


# ------------------------------------------------------------- Keras's JAX backend (issue 24)
# XLA's kernels on a CPU where float16 matmul is pathologically slow (hand-made).
ON_JAX = SpeedMeasurement(
    timings=cells("matmul", float32=(1.0, 1.0, 1.0), float16=(20.0, 20.0), bfloat16=(0.5,) * 3),
    missing=(Missing("conv2d", "float16", "XlaRuntimeError: UNIMPLEMENTED"),),
    seconds=1.5,
    backend="jax",
)


def test_kernels_timed_names_the_backend_and_onednn_only_for_tensorflow():
    assert (
        probe_rules.kernels_timed(XEON_OFF) == "oneDNN CPU kernels: off (TF_ENABLE_ONEDNN_OPTS '0')"
    )
    assert probe_rules.kernels_timed(XEON) == "oneDNN CPU kernels: on (TF_ENABLE_ONEDNN_OPTS unset)"
    assert probe_rules.kernels_timed(ON_JAX) == (
        "XLA's CPU kernels (JAX, jit-compiled), as Keras's jax backend runs them"
    )


def test_on_jax_no_onednn_words_and_no_onednn_fix():
    # Even a measurement claiming oneDNN was on: oneDNN's fix is TensorFlow's.
    assert not onednn_fix_applies(dataclasses.replace(XEON, backend="jax"))
    assert not onednn_fix_applies(ON_JAX)
    assert doctor_lines(ON_JAX, recheck_error="not run") == [
        "XLA's CPU kernels (JAX, jit-compiled), as Keras's jax backend runs them; "
        "measured in 1.5 s",
        "matmul 128x512 @ 512x512, forward and backward: float32 1.00 ms, float16 20.0 ms, "
        "bfloat16 0.500 ms a call (median of 2/3 rounds)",
        "float16 matmul: 20.0x float32's time, pathologically slow",
        "bfloat16 matmul: 0.50x float32's time (faster; float32's own noise 0%)",
        "float16 conv2d: not measured: XlaRuntimeError: UNIMPLEMENTED",
        "no fix kmix knows for the pathologically slow dtype: use a policy that avoids it "
        "(kmix compare measures each policy on your model)",
    ]
    assert float16_cpu_finding(ON_JAX) == (
        "no GPU or TPU was found, and on this CPU a float16 matmul (128x512 @ 512x512, forward "
        "and backward) "
        "measured 20.0x float32's time (median of 2 rounds; float32's own noise 0%)",
        True,
    )
    assert demo_check.onednn_note(dataclasses.replace(XEON, backend="jax")) is None


def test_a_jax_measurement_round_trips_through_json():
    assert SpeedMeasurement.from_dict(json.loads(json.dumps(ON_JAX.to_dict()))) == ON_JAX
    assert ON_JAX.to_dict()["backend"] == "jax"


@pytest.mark.parametrize(
    ("keras_backend", "expected"),
    [(None, True), ("", True), ("tensorflow", True), ("jax", False), ("torch", False)],
)
def test_demo_checks_onednn_only_on_tensorflow(keras_backend, expected):
    environ = {} if keras_backend is None else {"KERAS_BACKEND": keras_backend}
    assert demo_check.should_check_onednn("mixed_float16", ("avx512_fp16",), environ, False) is (
        expected
    )


def keras_on(backend):
    """A stand-in for an imported ``keras`` module on ``backend``."""
    return types.SimpleNamespace(backend=types.SimpleNamespace(backend=lambda: backend))


@pytest.mark.parametrize(
    ("modules", "environ", "expected"),
    [
        ({"keras": keras_on("jax")}, {}, "jax"),
        ({"keras": keras_on("tensorflow")}, {"KERAS_BACKEND": "jax"}, "tensorflow"),  # fixed
        ({"keras": keras_on("torch")}, {}, "torch"),
        ({"keras": keras_on("openvino")}, {}, "tensorflow"),  # no kernels of its own here
        ({}, {"KERAS_BACKEND": "jax"}, "jax"),
        ({}, {"KERAS_BACKEND": "tensorflow"}, "tensorflow"),
        ({}, {"KERAS_BACKEND": "torch"}, "torch"),
        ({}, {"KERAS_BACKEND": "openvino"}, "tensorflow"),
        ({}, {"KERAS_BACKEND": ""}, None),  # empty is unset, as for Keras
        ({}, {}, None),  # Keras's config file decides, in the fresh process
    ],
)
def test_backend_without_importing(modules, environ, expected):
    assert probe.backend_without_importing(modules, environ) == expected


def test_measure_in_subprocess_runs_the_child_on_the_same_backend(monkeypatch):
    runs = []

    def run(command, env, **kwargs):
        runs.append((command, env))
        return subprocess.CompletedProcess(command, 0, json.dumps(ON_JAX.to_dict()), "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    assert probe.measure_in_subprocess({}, ("matmul",), backend="jax").timings == ON_JAX.timings
    command, env = runs[-1]
    assert command[1:] == [
        "-c", probe.CHILD, "--ops", "matmul", "--dtypes", "float32,float16", "--backend", "jax",
    ]  # fmt: skip
    assert env["KERAS_BACKEND"] == "jax"
    probe.measure_in_subprocess({"TF_ENABLE_ONEDNN_OPTS": "0"})  # this process's backend
    command, env = runs[-1]
    assert command[-2:] == ["--backend", "tensorflow"]  # conftest's Keras
    assert (env["KERAS_BACKEND"], env["TF_ENABLE_ONEDNN_OPTS"]) == ("tensorflow", "0")


def test_measure_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match=r"^Invalid backend for kmix's speed probe: 'openvino'\. "):
        probe.measure(backend="openvino")


def test_measure_on_jax_times_xla_s_float32_and_float16_matmul():
    pytest.importorskip("jax")
    measured = probe.measure(("matmul",), ("float32", "float16"), rounds=2, backend="jax")
    assert [(t.op, t.dtype, len(t.seconds)) for t in measured.timings] == [
        ("matmul", "float32", 2),
        ("matmul", "float16", 2),
    ]
    assert all(0 < s < 10 for t in measured.timings for s in t.seconds)
    assert (measured.backend, measured.onednn, measured.onednn_setting) == ("jax", None, None)
    assert "oneDNN" not in "\n".join(doctor_lines(measured))


@pytest.mark.slow  # compiles six functions: about 2 s on the 2-core test machine
def test_measure_on_jax_times_every_cell_or_says_why_not():
    pytest.importorskip("jax")
    measured = probe.measure(rounds=2, round_seconds=0.002, backend="jax")
    timed = {(t.op, t.dtype) for t in measured.timings}
    missing = {(m.op, m.dtype) for m in measured.missing}
    assert timed | missing == {(op, dtype) for op in OPS for dtype in DTYPES}
    assert not timed & missing
    assert ("matmul", "float32") in timed and ("conv2d", "float32") in timed
    assert (measured.backend, measured.onednn, measured.onednn_setting) == ("jax", None, None)


@pytest.mark.slow
def test_measure_in_subprocess_on_jax():
    pytest.importorskip("jax")
    measured = probe.measure_in_subprocess({"JAX_PLATFORMS": "cpu"}, ("matmul",), backend="jax")
    assert [(t.op, t.dtype) for t in measured.timings] == [
        ("matmul", "float32"),
        ("matmul", "float16"),
    ]
    assert (measured.backend, measured.onednn, measured.onednn_setting) == ("jax", None, None)


# ---------------------------------------- one answer: the table measured on the Xeon
# Measured on a Xeon with AVX512_FP16 and AMX, 2 cores, eager TF 2.21, best of 20 (the
# machine this suite runs on may be another kind: the rule is checked on these numbers).
# The forward ops alone say float16 is nearly as fast; training (forward and backward)
# says a float16 convolution takes 155x float32's time with oneDNN on, 13x with it off.
XEON_MATMUL_FORWARD = SpeedMeasurement(  # what kmix.use timed before: one forward matmul
    cells("matmul", float32=(0.46,) * 3, float16=(0.49,) * 3), onednn=True
)
XEON_TRAINING = SpeedMeasurement(
    cells("matmul", float32=(0.46,) * 3, float16=(0.49,) * 3)
    + cells("conv2d", float32=(4.4,) * 3, float16=(683.0,) * 3),
    onednn=True,
    seconds=3.0,
)
XEON_TRAINING_OFF = SpeedMeasurement(
    cells("matmul", float32=(0.46,) * 3, float16=(1.04,) * 3)
    + cells("conv2d", float32=(4.4,) * 3, float16=(58.0,) * 3),
    onednn=False,
    onednn_setting="0",
)


def test_the_slowest_op_decides_because_training_runs_every_op():
    ratio = probe_rules.deciding_ratio(XEON_TRAINING)
    assert (ratio.op, ratio.ratio) == ("conv2d", pytest.approx(683.0 / 4.4))
    assert probe_rules.deciding_ratio(SpeedMeasurement()) is None


def test_forward_ops_alone_miss_what_training_shows_on_the_xeon():
    """kmix.use's old probe (a forward matmul, 1.07x) found float16 fast; training is not."""
    assert float16_cpu_finding(XEON_MATMUL_FORWARD)[1] is False
    sentence, slow = float16_cpu_finding(XEON_TRAINING)
    assert slow
    assert sentence == (
        "no GPU or TPU was found, and on this CPU a float16 conv2d (8x32x32x32 (NHWC), 3x3 "
        "kernel, 32 filters, forward and backward) measured 155x float32's time (median of 3 "
        f"rounds; float32's own noise 0%); oneDNN's float16 path is slow here: {ONEDNN_FIX}"
    )


def test_every_tool_gives_the_same_answer_on_the_xeon_table():
    """kmix.use, kmix doctor and kmix demo read the same probe with the same rule."""
    from kmix.policy import choice
    from kmix.policy.machine import Hardware

    cpu_only = Hardware(devices=("/physical_device:CPU:0",), gpus=(), tpus=())
    use_says = choice.float16_slow_reason(cpu_only, XEON_TRAINING)
    assert use_says == float16_cpu_finding(XEON_TRAINING)[0]  # kmix.use's warning, doctor's line
    assert onednn_fix_applies(XEON_TRAINING)
    assert f"fix: oneDNN's float16 path is slow here: {ONEDNN_FIX}" in doctor_lines(XEON_TRAINING)
    assert demo_check.onednn_note(XEON_TRAINING).startswith(
        "kmix demo: a float16 conv2d measured 155x float32's time on this CPU with oneDNN on"
    )
    # With oneDNN off the convolution is still 13x: slow, and no oneDNN fix applies then.
    assert choice.float16_slow_reason(cpu_only, XEON_TRAINING_OFF).startswith(
        "no GPU or TPU was found, and on this CPU a float16 conv2d"
    )
    assert not onednn_fix_applies(XEON_TRAINING_OFF)
    assert demo_check.onednn_note(XEON_TRAINING_OFF) is None


def test_the_demo_compares_its_own_step_times():
    assert demo_check.step_line("mixed_float16", 0.0041, 0.00302) == (
        "step time: mixed_float16 4.10 ms (one step a call, with kmix's callbacks), "
        "float32 3.02 ms (an epoch a call): 1.36x"
    )
    assert demo_check.step_line("mixed_float16", 0.3457, 0.0135) == (
        "step time: mixed_float16 346 ms (one step a call, with kmix's callbacks), "
        "float32 13.5 ms (an epoch a call): 25.6x; mixed_float16 is pathologically slow on this "
        "machine: kmix doctor times each op in each dtype and says what helps"
    )


def test_onednn_is_not_blamed_where_it_does_not_run_float16():
    """On a CPU without AVX512_FP16 or AMX-FP16 (this AMD EPYC), TensorFlow runs float16 on
    Eigen's kernels with oneDNN on or off: a slow float16 convolution there is no oneDNN
    path to turn off (measured here: 12.3 ms on, 12.0 ms off; 13x float32's time)."""
    amd = dataclasses.replace(XEON_TRAINING, onednn_float16_cpu=False)
    assert not onednn_fix_applies(amd)
    sentence, slow = float16_cpu_finding(amd)
    assert slow and "oneDNN" not in sentence
    assert doctor_lines(amd)[-1] == (
        "no fix kmix knows for the pathologically slow dtype: use a policy that avoids it "
        "(kmix compare measures each policy on your model)"
    )
    assert demo_check.onednn_note(amd) is None
    assert SpeedMeasurement.from_dict(json.loads(json.dumps(amd.to_dict()))) == amd


def test_the_probe_says_whether_the_cpu_runs_float16_on_onednn():
    from kmix.policy.machine import read_cpuinfo

    measured = probe.measure(("matmul",), ("float32",), rounds=1, round_seconds=0.001)
    flags = read_cpuinfo()[1]
    assert measured.onednn_float16_cpu == any(
        flag in flags for flag in probe_rules.ONEDNN_FLOAT16_FLAGS
    )


# ------------------------------------------------------------ Keras's torch backend (issue 33)
ON_TORCH = dataclasses.replace(ON_JAX, missing=(), backend="torch")


def test_kernels_timed_on_torch_are_torch_s_eager_kernels_and_no_onednn_fix():
    assert probe_rules.kernels_timed(ON_TORCH) == (
        "torch's CPU kernels (eager), as Keras's torch backend runs them"
    )
    assert not onednn_fix_applies(dataclasses.replace(XEON, backend="torch"))
    assert doctor_lines(ON_TORCH)[0] == (
        "torch's CPU kernels (eager), as Keras's torch backend runs them; measured in 1.5 s"
    )
    assert doctor_lines(ON_TORCH)[-1].startswith("no fix kmix knows for the pathologically slow")
    assert SpeedMeasurement.from_dict(json.loads(json.dumps(ON_TORCH.to_dict()))) == ON_TORCH


@pytest.mark.torch
def test_measure_on_torch_times_torch_s_kernels_forward_and_backward(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # importing it would raise
    threads = torch.get_num_threads()
    measured = probe.measure(OPS, DTYPES, rounds=2, round_seconds=0.002, backend="torch")
    assert [(t.op, t.dtype, len(t.seconds)) for t in measured.timings] == [
        (op, dtype, 2) for op in OPS for dtype in DTYPES
    ]  # torch 2.13's CPU kernels run every cell, float16 convolution's backward included
    assert measured.missing == ()
    assert all(0 < s < 10 for t in measured.timings for s in t.seconds)
    assert (measured.backend, measured.onednn, measured.onednn_setting) == ("torch", None, None)
    assert measured.onednn_float16_cpu is None
    assert torch.get_num_threads() == threads  # left as it was


def test_torch_op_call_runs_the_op_and_its_gradients_in_the_dtype():
    """The probe's call computes what autograd gives for the op (an independent reference:
    NumPy's matmul and the gradients of sum(a @ b): ones @ b.T and a.T @ ones)."""
    torch = pytest.importorskip("torch")
    seen = []
    real_grad = torch.autograd.grad

    def grad(outputs, inputs, grad_outputs):
        seen.append((outputs, inputs, real_grad(outputs, inputs, grad_outputs=grad_outputs)))
        return seen[-1][2]

    a, b = probe._inputs("matmul")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.autograd, "grad", grad)
        assert probe._torch_op_call(torch, "matmul", "float32")() is None
        probe._torch_op_call(torch, "conv2d", "bfloat16")()
    out, inputs, grads = seen[0]
    np.testing.assert_allclose(out.detach().numpy(), a @ b, rtol=1e-4, atol=1e-3)
    ones = np.ones((a.shape[0], b.shape[1]), np.float32)
    np.testing.assert_allclose(grads[0].numpy(), ones @ b.T, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(grads[1].numpy(), a.T @ ones, rtol=1e-4, atol=1e-3)
    out, inputs, grads = seen[1]  # torch's layout, the sizes of INPUT_SHAPES
    assert [tuple(x.shape) for x in inputs] == [(8, 32, 32, 32), (32, 32, 3, 3)]
    assert tuple(out.shape) == (8, 32, 32, 32)
    assert {x.dtype for x in (*inputs, out, *grads)} == {torch.bfloat16}


@pytest.mark.slow
def test_measure_in_subprocess_on_torch_imports_no_tensorflow():
    pytest.importorskip("torch")
    code = (
        "import json, sys\n"
        "from kmix.policy import timing\n"
        "m = timing.measure_in_subprocess({}, ('matmul',))\n"
        "print(json.dumps({'tensorflow': 'tensorflow' in sys.modules, 'backend': m.backend,\n"
        "    'cells': [[t.op, t.dtype] for t in m.timings],\n"
        "    'measuring': timing.measuring_backend(),\n"
        "    'tensorflow_after_keras': 'tensorflow' in sys.modules}))"
    )
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "tensorflow": False,
        "backend": "torch",  # the child timed torch's kernels: KERAS_BACKEND said so
        "cells": [["matmul", "float32"], ["matmul", "float16"]],
        "measuring": "torch",  # and here, with Keras imported on torch
        "tensorflow_after_keras": False,
    }
