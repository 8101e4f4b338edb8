"""Times what training runs, in float32, float16 and bfloat16, on this machine's CPU (glue).

Each op (a matmul, a convolution) is timed forward and backward, as a training step runs
it: the forward pass alone hides where half precision is slow (oneDNN's float16
convolution on Xeons with AVX512_FP16: forward 2.7x float32's time, forward and backward
over 100x). The kernels timed are those the Keras backend runs: TensorFlow's, in a
``tf.function``; on Keras's JAX backend XLA's, each step a ``jax.jit``-compiled
function; on its torch backend torch's own, eager, the backward pass by autograd, with
torch's thread count as it is (on JAX and torch TensorFlow is never imported). What the
times mean is judged in
``kmix/policy/speed.py``. How they are taken (:func:`measure`): every cell (op, dtype) is
run once untimed (kernel set-up or compilation), once timed to size its rounds, then the
cells take turns in :data:`ROUNDS`
rounds of about :data:`ROUND_SECONDS` each; a round's time is its fastest call (on a
machine shared with other jobs, the one they disturbed least), a JAX call's time ending
when its result is ready (``block_until_ready``; torch's CPU ops return when done). A
call slower than :data:`SLOW_CALL_S`
is timed in two rounds only (where float16 is 300x slow). :func:`measure_in_subprocess`
does the same in a fresh process on the same backend, e.g. with
``TF_ENABLE_ONEDNN_OPTS=0``, which TensorFlow reads when it is imported.

Run as ``python -m kmix.policy.timing [--ops matmul,conv2d] [--dtypes float32,float16]
[--backend tensorflow|jax|torch]`` it prints the measurement as JSON (what
:func:`measure_in_subprocess` reads).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kmix.policy.machine import read_cpuinfo
from kmix.policy.speed import (
    BACKENDS,
    DTYPES,
    ONEDNN_FLOAT16_FLAGS,
    OPS,
    Missing,
    SpeedMeasurement,
    Timing,
)

ROUNDS = 5
"""Rounds per cell (a call slower than :data:`SLOW_CALL_S` gets 2)."""

ROUND_SECONDS = 0.03
"""About how long one cell's calls take in one round."""

SLOW_CALL_S = 0.1
"""A single call slower than this is timed in two rounds only."""

INPUT_SHAPES = {"matmul": ((128, 512), (512, 512)), "conv2d": ((8, 32, 32, 32), (3, 3, 32, 32))}
"""Each op's two inputs' shapes (conv2d: NHWC images, HWIO kernel; see ``SHAPES``)."""


def measuring_backend() -> str:
    """Whose kernels :func:`measure` times here: ``"jax"`` or ``"torch"`` on Keras's JAX or
    torch backend, else ``"tensorflow"`` (also when Keras does not import). Imports Keras."""
    from kmix.policy.machine import keras_backend

    return _timed_backend(keras_backend())


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
    backend: str | None = None,
) -> SpeedMeasurement:
    """Times each op in each dtype on this machine's CPU with the backend's kernels.

    Args:
        ops: names from :data:`OPS`.
        dtypes: names from :data:`DTYPES`; include ``"float32"`` for ratios.
        rounds: rounds per cell.
        round_seconds: about how long one cell's calls take in one round.
        backend: one of :data:`BACKENDS` (``"tensorflow"`` imports TensorFlow, ``"jax"``
            imports JAX only, ``"torch"`` torch only); None: :func:`measuring_backend`.

    Returns:
        The :class:`SpeedMeasurement`; a cell the backend cannot run is in ``missing``.
        On JAX and torch its oneDNN fields are None (``TF_ENABLE_ONEDNN_OPTS`` is
        TensorFlow's).

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
    """
    backend = measuring_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(
            f"Invalid backend for kmix's speed probe: {backend!r}. Use one of {BACKENDS}."
        )
    start = time.perf_counter()
    calls, missing, sizes = {}, [], {}
    with _cpu_op_calls(backend) as op_call:
        for op in ops:
            for dtype in dtypes:
                try:
                    call = op_call(op, dtype)
                    call()  # kernel set-up or compilation, untimed
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
    tensorflow = backend == "tensorflow"
    flags = read_cpuinfo()[1]
    return SpeedMeasurement(
        timings=tuple(Timing(op, dtype, tuple(s)) for (op, dtype), s in seconds.items()),
        missing=tuple(missing),
        onednn=onednn_enabled() if tensorflow else None,
        onednn_setting=os.environ.get("TF_ENABLE_ONEDNN_OPTS") if tensorflow else None,
        seconds=time.perf_counter() - start,
        backend=backend,
        onednn_float16_cpu=any(f in flags for f in ONEDNN_FLOAT16_FLAGS) if tensorflow else None,
    )


def measure_in_subprocess(
    environ_changes: Mapping[str, str],
    ops: Sequence[str] = OPS,
    dtypes: Sequence[str] = ("float32", "float16"),
    *,
    backend: str | None = None,
    timeout_s: float = 60.0,
) -> SpeedMeasurement:
    """Runs :func:`measure` in a fresh Python process with some environment variables set.

    Args:
        environ_changes: variables to set, e.g. ``{"TF_ENABLE_ONEDNN_OPTS": "0"}``
            (read by TensorFlow when it is imported).
        ops: as for :func:`measure`.
        dtypes: as for :func:`measure`.
        backend: whose kernels the process times, one of :data:`BACKENDS`; it is passed
            as ``--backend`` and as ``KERAS_BACKEND``. None: this process's Keras backend
            (:func:`backend_without_importing`), or, when that is not known, the one the
            fresh process's Keras finds.
        timeout_s: how long the process may take, its library's start-up included.

    Returns:
        The measurement; its ``seconds`` is the process's whole wall time.

    Raises:
        RuntimeError: the process failed, timed out or printed no measurement; the
            message says which, with the last line of its stderr.
    """
    backend = backend_without_importing(sys.modules, os.environ) if backend is None else backend
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **environ_changes}
    command = [sys.executable, "-c", CHILD]
    command += ["--ops", ",".join(ops), "--dtypes", ",".join(dtypes)]
    if backend is not None:  # the same kernels as here, and Keras there on the same backend
        env["KERAS_BACKEND"] = backend
        command += ["--backend", backend]
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


def backend_without_importing(modules: Mapping[str, Any], environ: Mapping[str, str]) -> str | None:
    """Whose kernels a fresh measuring process should time, known without importing Keras.

    Rule: the imported Keras's backend when Keras is imported, else ``KERAS_BACKEND``
    when set and not empty, else None (Keras's config file decides there); a backend
    that is neither ``"jax"`` nor ``"torch"`` times TensorFlow's kernels
    (:func:`measuring_backend`).

    Args:
        modules: the imported modules, ``sys.modules``.
        environ: the environment variables.

    Returns:
        One of :data:`BACKENDS`, or None when not known.
    """
    keras = modules.get("keras")
    name = keras.backend.backend() if keras is not None else environ.get("KERAS_BACKEND")
    return _timed_backend(name) if name else None


def _timed_backend(keras_backend: str | None) -> str:
    """Whose kernels time for a Keras backend: its own library's where the probe has them
    (``"jax"``, ``"torch"``), else TensorFlow's (also for None: Keras did not import)."""
    return keras_backend if keras_backend in ("jax", "torch") else "tensorflow"


_float16_probe: list[SpeedMeasurement] = []


def float16_probe() -> SpeedMeasurement:
    """float32 and float16 training (every op, forward and backward) timed once per process
    (5 short rounds, a fraction of a second where float16 is not pathological).

    Returns:
        The measurement, of the Keras backend's kernels (:func:`measuring_backend`); the
        same value on later calls (Keras keeps its backend, and TensorFlow its oneDNN
        state, until the process ends).
    """
    if not _float16_probe:
        _float16_probe.append(measure(OPS, ("float32", "float16"), rounds=5, round_seconds=0.01))
    return _float16_probe[0]


CHILD = "import sys; from kmix.policy.timing import _main; sys.exit(_main(sys.argv[1:]))"
"""What the measuring process runs (not ``-m kmix.policy.timing``: ``kmix.policy`` imports
this module first, and runpy would warn that it runs it twice)."""

OpCall = Callable[[str, str], Callable[[], Any]]
"""``(op, dtype) -> call``: a function running the op once in the dtype on the CPU."""


@contextlib.contextmanager
def _cpu_op_calls(backend: str) -> Iterator[OpCall]:
    """Makes the backend's op calls, on the CPU while the block runs (TensorFlow's scope)."""
    if backend == "jax":
        import jax

        yield functools.partial(_jax_op_call, jax)
        return
    if backend == "torch":
        import torch

        yield functools.partial(_torch_op_call, torch)
        return
    import logging

    import tensorflow as tf

    # Each op is traced once per dtype on purpose; TensorFlow would call that "excessive
    # retracing" on stderr (kmix doctor's output). Its logger is quiet for the block only.
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with tf.device("/CPU:0"):
            yield functools.partial(_tf_op_call, tf)
    finally:
        logger.setLevel(level)


def _inputs(op: str) -> tuple[np.ndarray, ...]:
    """``op``'s fixed random float32 inputs (:data:`INPUT_SHAPES`, seed 0)."""
    if op not in INPUT_SHAPES:
        raise ValueError(f"Invalid op for kmix's speed probe: {op!r}. Use one of {OPS}.")
    generator = np.random.default_rng(0)
    return tuple(generator.standard_normal(shape, np.float32) for shape in INPUT_SHAPES[op])


def _tf_op_call(tf: Any, op: str, dtype: str) -> Callable[[], Any]:
    """A function running ``op`` forward and backward once in ``dtype``, as training does.

    The step is a ``tf.function`` (a graph, as ``fit``'s), given its inputs as arguments
    so that nothing is folded into constants; the backward pass is the gradient with
    respect to both inputs, for an upstream gradient of ones.
    """
    a, b = (tf.cast(tf.constant(x), dtype) for x in _inputs(op))
    if op not in _TF_TRAIN:  # one function per op, traced once per dtype

        def forward(x: Any, y: Any) -> Any:
            if op == "matmul":
                return tf.linalg.matmul(x, y)
            return tf.nn.conv2d(x, y, strides=1, padding="SAME")

        def train(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch([x, y])
                out = forward(x, y)
            return tape.gradient(out, [x, y], output_gradients=tf.ones_like(out))

        _TF_TRAIN[op] = tf.function(train, autograph=False)
    train_step = _TF_TRAIN[op]
    return lambda: train_step(a, b)


_TF_TRAIN: dict[str, Any] = {}
"""The probe's ``tf.function`` per op (a new one per cell made TensorFlow warn of
retracing on stderr, in kmix doctor's output)."""


def _jax_op_call(jax: Any, op: str, dtype: str) -> Callable[[], Any]:
    """A function running ``op`` forward and backward once in ``dtype``, jit-compiled, on
    JAX's CPU device, as training does (the backward pass: the gradient with respect to
    both inputs, for an upstream gradient of ones).

    The inputs are committed to the CPU, so the compiled function runs there whatever
    JAX's default device; a call returns when its result is ready.
    """
    cpu = jax.local_devices(backend="cpu")[0]
    a, b = (jax.device_put(x, cpu).astype(dtype) for x in _inputs(op))

    def forward(x: Any, k: Any) -> Any:
        if op == "matmul":
            return x @ k
        return jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def train(x: Any, k: Any) -> Any:
        out, pullback = jax.vjp(forward, x, k)
        return pullback(jax.numpy.ones_like(out))

    compiled = jax.jit(train)
    return lambda: jax.block_until_ready(compiled(a, b))


def _torch_op_call(torch: Any, op: str, dtype: str) -> Callable[[], Any]:
    """A function running ``op`` forward and backward once in ``dtype`` with torch's own CPU
    kernels, eagerly, as Keras's torch backend runs a step by default (the backward pass:
    autograd's gradient with respect to both inputs, for an upstream gradient of ones).

    The convolution takes torch's layout, NCHW images and an OIHW kernel, of the sizes of
    :data:`INPUT_SHAPES` (Keras's torch backend hands torch that layout too). torch's
    thread count is left as it is. A call returns when its gradients are computed (torch's
    CPU ops are synchronous) and returns nothing: NumPy cannot read bfloat16 tensors.
    """
    a, b = (torch.from_numpy(x) for x in _inputs(op))
    if op == "conv2d":  # NHWC, HWIO -> NCHW, OIHW
        a, b = a.permute(0, 3, 1, 2), b.permute(3, 2, 0, 1)
    a, b = (t.to(getattr(torch, dtype)).contiguous().requires_grad_() for t in (a, b))

    def forward() -> Any:
        if op == "matmul":
            return torch.matmul(a, b)
        return torch.nn.functional.conv2d(a, b, padding="same")

    def train() -> None:
        out = forward()
        torch.autograd.grad(out, (a, b), grad_outputs=torch.ones_like(out))

    return train


def _time_calls(call: Callable[[], Any], count: int) -> float:
    """The fastest of ``count`` calls, in seconds: the one other jobs disturbed least.

    TensorFlow runs eager ops synchronously by default, a JAX call waits for its result
    (``block_until_ready``) and torch's CPU ops are synchronous, so a call's time is its
    op's; the last result (if any) is read anyway, so that nothing is left running.
    """
    fastest = float("inf")
    for _ in range(count):
        start = time.perf_counter()
        result = call()
        fastest = min(fastest, time.perf_counter() - start)
    for value in result if isinstance(result, list | tuple) else [result]:
        if value is not None:
            np.asarray(value)
    return fastest


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m kmix.policy.timing``: prints :func:`measure`'s result as JSON."""
    parser = argparse.ArgumentParser(prog="python -m kmix.policy.timing")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--backend", choices=BACKENDS, default=None)
    args = parser.parse_args(argv)
    measured = measure(args.ops.split(","), args.dtypes.split(","), backend=args.backend)
    print(json.dumps(measured.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
