"""What ``kmix demo`` measures of the policy's speed before and after it trains.

Before TensorFlow starts, on a CPU whose oneDNN float16 path can be pathologically slow,
:func:`avoid_slow_float16_path` times float16 training in a fresh process and turns oneDNN
off when it is; after training, :func:`step_line` compares the demo's own step times. Both
judge with the speed probe's rules (:mod:`kmix.policy.speed`), so the demo says what
``kmix doctor`` and ``kmix.use`` say.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from kmix.policy import machine
from kmix.policy.speed import (
    ONEDNN_FLOAT16_FLAGS,
    OPS,
    PATHOLOGICAL,
    SpeedMeasurement,
    format_ratio,
    format_seconds,
    onednn_fix_applies,
    speed_ratios,
)
from kmix.policy.timing import measure_in_subprocess

__all__ = ["avoid_slow_float16_path", "onednn_note", "should_check_onednn", "step_line"]


def should_check_onednn(
    policy: str, cpu_flags: Sequence[str], environ: Mapping[str, str], tensorflow_imported: bool
) -> bool:
    """Whether ``kmix demo`` times float16 with oneDNN on before TensorFlow is imported.

    The check costs a fresh process (a few seconds), so it runs only where it can change
    something: the demo trains on TensorFlow (``KERAS_BACKEND`` unset, empty or
    ``"tensorflow"``: oneDNN is TensorFlow's), computes in float16, the CPU has a flag of
    :data:`ONEDNN_FLOAT16_FLAGS`, the user left ``TF_ENABLE_ONEDNN_OPTS`` unset, and
    TensorFlow is not imported yet (it reads the variable once, when imported).

    Args:
        policy: the ``--policy`` given to ``kmix demo``.
        cpu_flags: the CPU's flags, e.g. ``kmix.policy.machine.read_cpuinfo()[1]``.
        environ: the environment variables (``kmix demo`` sets ``KERAS_BACKEND`` first).
        tensorflow_imported: whether TensorFlow is imported in this process.

    Returns:
        True when the check should run.
    """
    return (
        (environ.get("KERAS_BACKEND") or "tensorflow") == "tensorflow"
        and policy in ("mixed_float16", "float16")
        and any(flag in cpu_flags for flag in ONEDNN_FLOAT16_FLAGS)
        and "TF_ENABLE_ONEDNN_OPTS" not in environ
        and not tensorflow_imported
    )


def onednn_note(measured: SpeedMeasurement) -> str | None:
    """What ``kmix demo`` says when it turns oneDNN off for its run, or None when it keeps it.

    Args:
        measured: float32 and float16 timed in a fresh process with oneDNN as the user
            left it (:func:`should_check_onednn`).

    Returns:
        The line to print when :func:`onednn_fix_applies`, else None.
    """
    if not onednn_fix_applies(measured):
        return None
    slow = next(r for r in speed_ratios(measured) if r.verdict == "pathological")
    return (
        f"kmix demo: a float16 {slow.op} measured {format_ratio(slow.ratio)} float32's time on "
        f"this CPU with oneDNN on (in a fresh process, {measured.seconds:.1f} s), so this run sets "
        "TF_ENABLE_ONEDNN_OPTS=0 and float16 runs on TensorFlow's own kernels "
        "(TF_ENABLE_ONEDNN_OPTS=1 keeps oneDNN; kmix doctor measures both)"
    )


def step_line(
    policy: str,
    policy_step_s: float,
    float32_step_s: float,
    float32_calls: str | None = "an epoch a call",
) -> str:
    """What ``kmix demo`` says of its own step times: the policy's run against float32's.

    The two runs differ in more than the dtype (the policy's run takes one step a call,
    with kmix's callbacks; float32's a whole epoch a call where Keras's trainer allows it,
    with none), so only a ratio of :data:`PATHOLOGICAL` or more is called slow: no
    overhead of that kind explains it.

    Args:
        policy: the policy of the logged run, e.g. ``"mixed_float16"``.
        policy_step_s: its median time of a training step, in seconds.
        float32_step_s: the float32 run's.
        float32_calls: how the float32 run called its steps, e.g. ``"an epoch a call"``;
            None: one step a call (on torch, whose trainer runs no more), said as
            ``"without callbacks"``.

    Returns:
        One line, e.g. ``"step time: mixed_float16 4.10 ms, float32 3.02 ms (1.36x)"``.
    """
    ratio = policy_step_s / float32_step_s
    mixed, float32 = format_seconds(policy_step_s), format_seconds(float32_step_s)
    line = (
        f"step time: {policy} {mixed} (one step a call, with kmix's callbacks), "
        f"float32 {float32} ({float32_calls or 'one step a call, without callbacks'}): "
        f"{format_ratio(ratio)}"
    )
    if ratio >= PATHOLOGICAL:
        line += (
            f"; {policy} is pathologically slow on this machine: kmix doctor times each "
            "op in each dtype and says what helps"
        )
    return line


def avoid_slow_float16_path(policy: str) -> str | None:
    """Before ``kmix demo`` imports TensorFlow: turns oneDNN off where its float16 is slow.

    Where :func:`should_check_onednn` says so (a float16 policy, a
    CPU with AVX512_FP16 or AMX-FP16, ``TF_ENABLE_ONEDNN_OPTS`` unset, TensorFlow not yet
    imported), times float32 and float16 training (every op, forward and backward) in a fresh
    process; when float16 is
    pathologically slow there, sets ``TF_ENABLE_ONEDNN_OPTS=0`` in this process.

    Args:
        policy: the demo's ``--policy``.

    Returns:
        The line to print: what was measured and done, or why the check failed; None when
        nothing was checked or oneDNN stays on.
    """
    flags = machine.read_cpuinfo()[1]
    if not should_check_onednn(policy, flags, os.environ, "tensorflow" in sys.modules):
        return None
    try:
        measured = measure_in_subprocess({}, OPS)
    except RuntimeError as error:
        return f"kmix demo: oneDNN's float16 speed could not be checked ({error}); oneDNN stays on"
    note = onednn_note(measured)
    if note:
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
    return note
