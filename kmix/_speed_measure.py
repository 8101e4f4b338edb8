"""Times small float32, float16 and bfloat16 ops on this machine's CPU (thin TensorFlow glue).

What the times mean is judged in ``kmix/_speed_probe.py``. How they are taken
(:func:`measure`): every cell (op, dtype) is run once untimed (kernel set-up), once timed
to size its rounds, then the cells take turns in :data:`ROUNDS` rounds of about
:data:`ROUND_SECONDS` each; a round's time is its fastest call (on a machine shared with
other jobs, the one they disturbed least). A call slower than :data:`SLOW_CALL_S` is timed
in two rounds only (where float16 is 300x slow). :func:`measure_in_subprocess` does the
same in a fresh process, e.g. with ``TF_ENABLE_ONEDNN_OPTS=0``, which TensorFlow reads
when it is imported.

Run as ``python -m kmix._speed_measure [--ops matmul,conv2d] [--dtypes float32,float16]``
it prints the measurement as JSON (what :func:`measure_in_subprocess` reads).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kmix._speed_probe import DTYPES, OPS, Missing, SpeedMeasurement, Timing

ROUNDS = 5
"""Rounds per cell (a call slower than :data:`SLOW_CALL_S` gets 2)."""

ROUND_SECONDS = 0.03
"""About how long one cell's calls take in one round."""

SLOW_CALL_S = 0.1
"""A single call slower than this is timed in two rounds only."""


def onednn_enabled() -> bool | None:
    """Whether the imported TensorFlow runs oneDNN's CPU kernels; None when unknown."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except Exception:  # another TensorFlow build: the answer is unknown, not guessed
        return None


def measure(
    ops: Sequence[str] = OPS,
    dtypes: Sequence[str] = DTYPES,
    *,
    rounds: int = ROUNDS,
    round_seconds: float = ROUND_SECONDS,
) -> SpeedMeasurement:
    """Times each op in each dtype on this machine's CPU (imports TensorFlow).

    Args:
        ops: names from :data:`OPS`.
        dtypes: names from :data:`DTYPES`; include ``"float32"`` for ratios.
        rounds: rounds per cell.
        round_seconds: about how long one cell's calls take in one round.

    Returns:
        The :class:`SpeedMeasurement`; a cell TensorFlow cannot run is in ``missing``.
    """
    import tensorflow as tf

    start = time.perf_counter()
    calls, missing, sizes = {}, [], {}
    with tf.device("/CPU:0"):
        for op in ops:
            for dtype in dtypes:
                try:
                    call = _op_call(tf, op, dtype)
                    call()  # kernel set-up, untimed
                    sizes[op, dtype] = _time_calls(call, 1)
                    calls[op, dtype] = call
                except Exception as error:  # e.g. a dtype this build has no kernel for
                    missing.append(Missing(op, dtype, f"{type(error).__name__}: {error}"))
        seconds: dict[tuple[str, str], list[float]] = {cell: [] for cell in calls}
        for round_index in range(rounds):
            for cell, call in calls.items():
                if sizes[cell] > SLOW_CALL_S and round_index >= 2:
                    continue
                count = max(1, min(100, round(round_seconds / max(sizes[cell], 1e-6))))
                seconds[cell].append(_time_calls(call, count))
    return SpeedMeasurement(
        timings=tuple(Timing(op, dtype, tuple(s)) for (op, dtype), s in seconds.items()),
        missing=tuple(missing),
        onednn=onednn_enabled(),
        onednn_setting=os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        seconds=time.perf_counter() - start,
    )


def measure_in_subprocess(
    environ_changes: Mapping[str, str],
    ops: Sequence[str] = OPS,
    dtypes: Sequence[str] = ("float32", "float16"),
    *,
    timeout_s: float = 60.0,
) -> SpeedMeasurement:
    """Runs :func:`measure` in a fresh Python process with some environment variables set.

    Args:
        environ_changes: variables to set, e.g. ``{"TF_ENABLE_ONEDNN_OPTS": "0"}``
            (read by TensorFlow when it is imported).
        ops: as for :func:`measure`.
        dtypes: as for :func:`measure`.
        timeout_s: how long the process may take, TensorFlow's start-up included.

    Returns:
        The measurement; its ``seconds`` is the process's whole wall time.

    Raises:
        RuntimeError: the process failed, timed out or printed no measurement; the
            message says which, with the last line of its stderr.
    """
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **environ_changes}
    command = [sys.executable, "-m", "kmix._speed_measure"]
    command += ["--ops", ",".join(ops), "--dtypes", ",".join(dtypes)]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the measuring process took over {timeout_s:.0f} s") from None
    try:
        measured = SpeedMeasurement.from_dict(json.loads(done.stdout))
    except (ValueError, KeyError, TypeError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(
            f"the measuring process exited with status {done.returncode}: {last}"
        ) from None
    return dataclasses.replace(measured, seconds=time.perf_counter() - start)


_float16_matmul: list[SpeedMeasurement] = []


def float16_matmul_probe() -> SpeedMeasurement:
    """The float32 and float16 matmul timed once per process (5 short rounds, ~0.1 s).

    Returns:
        The measurement; the same value on later calls (oneDNN's state and the kernels
        cannot change once TensorFlow is imported).
    """
    if not _float16_matmul:
        _float16_matmul.append(
            measure(("matmul",), ("float32", "float16"), rounds=5, round_seconds=0.01)
        )
    return _float16_matmul[0]


def avoid_slow_float16_path(policy: str) -> str | None:
    """Before ``kmix demo`` imports TensorFlow: turns oneDNN off where its float16 is slow.

    Where :func:`kmix._speed_probe.demo_should_check_onednn` says so (a float16 policy, a
    CPU with AVX512_FP16 or AMX-FP16, ``TF_ENABLE_ONEDNN_OPTS`` unset, TensorFlow not yet
    imported), times float32 and float16 matmul in a fresh process; when float16 is
    pathologically slow there, sets ``TF_ENABLE_ONEDNN_OPTS=0`` in this process.

    Args:
        policy: the demo's ``--policy``.

    Returns:
        The line to print: what was measured and done, or why the check failed; None when
        nothing was checked or oneDNN stays on.
    """
    from kmix._speed_probe import demo_onednn_note, demo_should_check_onednn
    from kmix.hardware import read_cpuinfo

    flags = read_cpuinfo()[1]
    if not demo_should_check_onednn(policy, flags, os.environ, "tensorflow" in sys.modules):
        return None
    try:
        measured = measure_in_subprocess({}, ("matmul",))
    except RuntimeError as error:
        return f"kmix demo: oneDNN's float16 speed could not be checked ({error}); oneDNN stays on"
    note = demo_onednn_note(measured)
    if note:
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
    return note


def _op_call(tf: Any, op: str, dtype: str) -> Any:
    """A function running ``op`` once in ``dtype`` on fixed random inputs."""
    generator = tf.random.Generator.from_seed(0)
    if op == "matmul":
        a, b = generator.normal((128, 512)), generator.normal((512, 512))
        a, b = tf.cast(a, dtype), tf.cast(b, dtype)
        return lambda: tf.linalg.matmul(a, b)
    if op == "conv2d":
        x, kernel = generator.normal((8, 32, 32, 32)), generator.normal((3, 3, 32, 32))
        x, kernel = tf.cast(x, dtype), tf.cast(kernel, dtype)
        return lambda: tf.nn.conv2d(x, kernel, strides=1, padding="SAME")
    raise ValueError(f"Invalid op for kmix's speed probe: {op!r}. Use one of {OPS}.")


def _time_calls(call: Any, count: int) -> float:
    """The fastest of ``count`` calls, in seconds: the one other jobs disturbed least.

    TensorFlow runs eager ops synchronously by default, so a call's time is its op's; the
    last result is read anyway, so that nothing is left running.
    """
    fastest = float("inf")
    for _ in range(count):
        start = time.perf_counter()
        result = call()
        fastest = min(fastest, time.perf_counter() - start)
    result.numpy()
    return fastest


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m kmix._speed_measure``: prints :func:`measure`'s result as JSON."""
    parser = argparse.ArgumentParser(prog="python -m kmix._speed_measure")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    args = parser.parse_args(argv)
    measured = measure(args.ops.split(","), args.dtypes.split(","))
    print(json.dumps(measured.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
