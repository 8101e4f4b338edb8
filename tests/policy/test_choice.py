"""Tests for kmix.use, kmix.policy_scope and the "auto" decision on fake hardware."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import keras
import pytest

import kmix
from kmix.policy import choice as policy
from kmix.policy import timing as _speed_measure
from kmix.policy.choice import (
    AUTO_IS_NOT_MEASURED,
    POLICY_NAMES,
    PolicyChoice,
    choose_auto,
    float16_slow_reason,
    policy_scope,
    use,
)
from kmix.policy.machine import GPU, Hardware, hardware
from kmix.policy.speed import ONEDNN_FIX, Missing, SpeedMeasurement, Timing

CPU = Hardware(devices=("/physical_device:CPU:0",))
CPU_AVX512_BF16 = Hardware(cpu_flags=("avx512_bf16", "avx512f"))
CPU_AMX = Hardware(cpu_flags=("amx_bf16", "amx_tile", "avx512_bf16"))
TPU = Hardware(tpus=("/physical_device:TPU:0",), cpu_flags=("amx_bf16",))


def matmul(float32_ms, float16_ms, onednn=None):
    """A hand-made measurement of the float32 and float16 matmul, round times in ms."""
    return SpeedMeasurement(
        timings=(
            Timing("matmul", "float32", tuple(t / 1e3 for t in float32_ms)),
            Timing("matmul", "float16", tuple(t / 1e3 for t in float16_ms)),
        ),
        onednn=onednn,
    )


SLOWER = matmul((1.0, 1.02, 0.98), (3.0, 3.1, 2.9))  # 3x, float32's own noise 4%
SAME = matmul((1.0, 1.2, 0.9), (1.1, 1.1, 1.1))  # 1.1x inside float32's 30% spread
ONEDNN_XEON = matmul((1.0, 1.0), (400.0, 410.0), onednn=True)  # 405x with oneDNN on


def gpus(*capabilities):
    """Fake hardware with one GPU per compute capability (and a CPU with AMX)."""
    return Hardware(
        gpus=tuple(
            GPU(f"/physical_device:GPU:{i}", f"GPU{i}", cc) for i, cc in enumerate(capabilities)
        ),
        cpu_flags=("amx_bf16",),  # the GPU decides, not the CPU
    )


@pytest.fixture(autouse=True)
def _fresh_warnings():
    policy._reset_warnings()
    yield
    policy._reset_warnings()


@pytest.mark.parametrize(
    ("detected", "expected"),
    [
        (TPU, "mixed_bfloat16"),
        (gpus((9, 0)), "mixed_bfloat16"),
        (gpus((8, 0)), "mixed_bfloat16"),
        (gpus((7, 5)), "mixed_float16"),
        (gpus((7, 0)), "mixed_float16"),
        (gpus((6, 1)), "float32"),
        (gpus(None), "float32"),
        (gpus((8, 0), (7, 0)), "mixed_float16"),  # the weakest GPU decides
        (gpus((8, 0), (6, 0)), "float32"),
        (CPU_AMX, "mixed_bfloat16"),
        (CPU_AVX512_BF16, "mixed_bfloat16"),
        (CPU, "float32"),
    ],
)
def test_choose_auto(detected, expected):
    assert choose_auto(detected)[0] == expected


def test_choose_auto_reasons_name_the_deciding_fact():
    assert choose_auto(TPU)[1] == ("TPU /physical_device:TPU:0 computes bfloat16 natively")
    assert choose_auto(gpus((8, 6)))[1] == (
        "GPU GPU0 has compute capability 8.6 (8.0 or newer): bfloat16 tensor cores "
        "are as fast as float16 ones, and bfloat16 has float32's range, so it needs "
        "no loss scaling"
    )
    assert choose_auto(gpus((7, 0)))[1] == (
        "GPU GPU0 has compute capability 7.0: float16 tensor cores start at 7.0, "
        "bfloat16 ones at 8.0"
    )
    assert choose_auto(gpus((6, 1)))[1] == (
        "GPU GPU0 has compute capability 6.1: tensor cores start at 7.0, so mixed "
        "precision would not be faster than float32"
    )
    assert "reports no compute capability" in choose_auto(gpus(None))[1]
    assert choose_auto(CPU_AMX)[1] == (
        "no GPU or TPU; the CPU has AMX-BF16, which computes bfloat16 natively"
    )
    assert "AVX512-BF16, which" in choose_auto(CPU_AVX512_BF16)[1]
    assert choose_auto(CPU)[1] == (
        "no GPU or TPU, and the CPU has neither AMX-BF16 nor AVX512-BF16, so it computes "
        "no bfloat16 natively"
    )


@pytest.mark.parametrize(
    ("detected", "expected"), [(gpus((8, 0)), "mixed_bfloat16"), (CPU, "float32")]
)
def test_use_auto_sets_the_global_policy(detected, expected):
    choice = use("auto", detected=detected)
    reason = f"{choose_auto(detected)[1]} ({AUTO_IS_NOT_MEASURED})"
    assert choice == PolicyChoice(expected, reason, detected)
    assert AUTO_IS_NOT_MEASURED == (
        "chosen from the hardware, not measured: kmix compare times each policy on your model"
    )
    assert keras.config.dtype_policy().name == expected
    assert keras.layers.Dense(2).dtype_policy.name == expected


def test_use_detects_the_hardware_by_default():
    choice = kmix.use()
    detected = hardware()
    name, reason = choose_auto(detected)
    assert choice == PolicyChoice(name, f"{reason} ({AUTO_IS_NOT_MEASURED})", detected)
    assert keras.config.dtype_policy().name == choice.name


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "auto"])
def test_use_accepts_the_keras_names(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on a CPU warns; tested below
        choice = use(name, detected=gpus((8, 0)))
    assert (choice.name, choice.reason) == (name, f"{name!r} was requested explicitly")
    assert keras.config.dtype_policy().name == name


@pytest.mark.parametrize("bad", ["mixed_float32", "Float32", "", None, 16])
def test_use_rejects_unknown_names_and_lists_the_valid_ones(bad):
    with pytest.raises(ValueError) as raised:
        use(bad, detected=CPU)
    message = str(raised.value)
    assert repr(bad) in message
    assert all(repr(name) in message for name in POLICY_NAMES)
    assert keras.config.dtype_policy().name == "float32"


def test_float16_on_a_cpu_warns_once_with_the_measured_ratio_and_says_what_to_use():
    with pytest.warns(UserWarning) as record:
        choice = use("mixed_float16", detected=CPU_AVX512_BF16, measured=SLOWER)
    assert len(record) == 1
    assert record[0].filename == __file__  # points at the caller
    assert str(record[0].message) == (
        "kmix.use('mixed_float16'): float16 is not fast on this machine: no GPU or TPU was "
        "found, and on this CPU a float16 matmul (128x512 @ 512x512, forward and backward) "
        "measured 3.00x float32's time (median of 3 rounds; float32's own noise 4%). Use "
        "kmix.use('mixed_bfloat16') instead (no GPU or TPU; the CPU has AVX512-BF16, which "
        "computes bfloat16 natively); kmix doctor times matmul and convolution in each dtype "
        "here, kmix compare each policy on your model."
    )
    assert choice.reason == (
        "'mixed_float16' was requested explicitly; float16 is not fast here: no GPU or TPU "
        "was found, and on this CPU a float16 matmul (128x512 @ 512x512, forward and "
        "backward) measured 3.00x float32's time (median of 3 rounds; float32's own noise 4%)"
    )
    assert keras.config.dtype_policy().name == "mixed_float16"  # still set

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same situation again: no warning
        use("mixed_float16", detected=CPU_AVX512_BF16, measured=SLOWER)
    with pytest.warns(UserWarning, match=r"Use kmix.use\('float32'\) instead"):
        use("float16", detected=CPU, measured=SLOWER)  # another situation warns too


def test_float16_on_a_cpu_claims_no_speed_when_not_measurably_slower():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = use("mixed_float16", detected=CPU, measured=SAME)
        unmeasured = use(
            "mixed_float16",
            detected=CPU,
            measured=SpeedMeasurement(missing=(Missing("matmul", "float16", "TypeError: x"),)),
        )
    assert choice.reason == (
        "'mixed_float16' was requested explicitly; no GPU or TPU was found, and on this CPU "
        "a float16 matmul (128x512 @ 512x512, forward and backward) measured 1.10x float32's "
        "time (median of 3 rounds; float32's own noise 30%)"
    )
    assert unmeasured.reason == (
        "'mixed_float16' was requested explicitly; float16's speed on this CPU was not "
        "measured (float16 matmul: TypeError: x)"
    )
    assert float16_slow_reason(CPU, SAME) is None
    assert float16_slow_reason(CPU) is None  # nothing measured: nothing claimed


def test_float16_pathologically_slow_with_onednn_warns_with_the_fix():
    with pytest.warns(UserWarning) as record:
        use("mixed_float16", detected=CPU, measured=ONEDNN_XEON)
    message = str(record[0].message)
    assert "measured 405x float32's time (median of 2 rounds; float32's own noise 0%)" in message
    assert f"oneDNN's float16 path is slow here: {ONEDNN_FIX}. Use kmix.use('float32')" in (message)


def test_float16_on_this_cpu_is_measured_by_default_and_never_claims_a_fixed_ratio(monkeypatch):
    calls = []
    monkeypatch.setattr(_speed_measure, "_float16_probe", [])
    real_measure = _speed_measure.measure
    monkeypatch.setattr(
        _speed_measure, "measure", lambda *a, **k: calls.append(a) or real_measure(*a, **k)
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        choice = use("mixed_float16", detected=CPU)
        again = use("mixed_float16", detected=CPU)
    assert calls == [(("matmul", "conv2d"), ("float32", "float16"))]  # once per process
    assert choice.reason == again.reason
    assert "measured" in choice.reason and "about 2x" not in choice.reason
    for warning in record:
        assert "float32's time (median of 5 rounds" in str(warning.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        use("mixed_float16", detected=gpus((8, 0)))  # a fast GPU: nothing measured
        use("mixed_bfloat16", detected=CPU)
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("detected", "instead", "why"),
    [
        (TPU, "mixed_bfloat16", "TPUs compute in bfloat16"),
        (gpus((6, 1)), "float32", "GPU GPU0 has compute capability 6.1"),
        (gpus((8, 0), (6, 1)), "float32", "GPU GPU1 has compute capability 6.1"),
    ],
)
def test_float16_on_slow_accelerators_warns(detected, instead, why):
    with pytest.warns(UserWarning, match=f"{why}.*kmix.use\\('{instead}'\\)"):
        use("mixed_float16", detected=detected)


@pytest.mark.parametrize("detected", [gpus((7, 0)), gpus((9, 0)), gpus(None)])
def test_float16_on_fast_or_unknown_gpus_does_not_warn(detected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert use("mixed_float16", detected=detected).name == "mixed_float16"
        use("mixed_bfloat16", detected=CPU)  # bfloat16 never warns


def test_policy_scope_sets_and_restores_the_policy():
    keras.config.set_dtype_policy("mixed_bfloat16")
    with kmix.policy_scope("float32", detected=CPU) as choice:
        head = keras.layers.Dense(2)
        assert choice == PolicyChoice("float32", "'float32' was requested explicitly", CPU)
        with policy_scope("float64", detected=CPU):
            inner = keras.layers.Dense(2)
        assert keras.config.dtype_policy().name == "float32"
    body = keras.layers.Dense(2)
    assert (head.compute_dtype, inner.compute_dtype, body.compute_dtype) == (
        "float32",
        "float64",
        "bfloat16",
    )
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


def test_policy_scope_restores_the_policy_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with policy_scope("mixed_bfloat16", detected=CPU):
            raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == "float32"


def test_policy_scope_rejects_unknown_names_before_changing_anything():
    with pytest.raises(ValueError, match="Invalid policy: 'fp16'"):
        with policy_scope("fp16"):
            pass  # pragma: no cover - never entered
    assert keras.config.dtype_policy().name == "float32"


def test_policy_choice_is_printable_and_json_ready():
    choice = use("auto", detected=CPU)
    assert str(choice) == f"float32: {choice.reason}"
    assert json.loads(json.dumps(choice.to_dict())) == {
        "name": "float32",
        "reason": choice.reason,
        "hardware": CPU.to_dict(),
    }


def test_public_names():
    assert kmix.use is use
    assert kmix.policy_scope is policy_scope
    assert kmix.PolicyChoice is PolicyChoice


# ------------------------------------------------------------- Keras's JAX backend (issue 24)
def test_float16_pathologically_slow_on_jax_warns_without_onednn_advice():
    on_jax = dataclasses.replace(ONEDNN_XEON, onednn=None, backend="jax")
    with pytest.warns(UserWarning) as record:
        choice = use("mixed_float16", detected=CPU, measured=on_jax)
    message = str(record[0].message)
    assert "measured 405x float32's time (median of 2 rounds; float32's own noise 0%). " in message
    assert "oneDNN" not in message and "ONEDNN" not in message
    assert "oneDNN" not in choice.reason


@pytest.mark.slow
def test_use_mixed_float16_on_jax_measures_xla_and_imports_no_tensorflow():
    pytest.importorskip("jax")
    code = """
        import json, sys, warnings
        import kmix
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            choice = kmix.use("mixed_float16")
        print(json.dumps({"name": choice.name, "reason": choice.reason,
                          "devices": choice.hardware.devices,
                          "warnings": [str(w.message) for w in record],
                          "tensorflow": "tensorflow" in sys.modules}))
    """
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert (facts["name"], facts["devices"], facts["tensorflow"]) == (
        "mixed_float16",
        ["cpu:0"],
        False,
    )
    assert re.search(
        r"a float16 (matmul|conv2d) \(.*, forward and backward\) measured ", facts["reason"]
    )
    for message in facts["warnings"]:
        assert "measured " in message and "oneDNN" not in message
    assert "oneDNN" not in facts["reason"]
