"""Peak memory per policy for ``kmix compare``: a process that runs only that policy.

In the comparison's own process every policy's model lives side by side, so no peak
there belongs to one policy. For each policy, :func:`measure_peaks` starts
``python -m kmix._compare_memory SPEC``, which imports TensorFlow, builds the model
under that policy with the user's ``build_model`` (imported by name), trains a few
steps on the comparison's first batches (saved to a temporary ``.npz``) and prints one
JSON line: the device's peak memory where TensorFlow reports it (a GPU), otherwise
the process's peak resident memory (``ru_maxrss``), with what the process held before
the model was built; or that the model did not fit (out of memory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MEMORY_STEPS", "WORKER_TIMEOUT_S", "importable_name", "main", "measure_peaks"]

MEMORY_STEPS = 5
"""Steps the memory process trains: the peak of a step is reached by the second."""
WORKER_TIMEOUT_S = 300
"""How long one memory process may take."""

Peak = tuple[int | None, str, bool]
"""(peak bytes or None, what was measured or why not, out of memory)."""


def importable_name(function: Any) -> str | None:
    """``"module:qualname"`` of a function another process can import, else None."""
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", "")
    if not module or module == "__main__" or not qualname or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def measure_peaks(
    build_model: Callable[[], Any],
    data: Any,
    policies: Sequence[str],
    batch_size: int,
    loss: Any,
    seed: int,
    measure: bool = True,
    skip: dict[str, str] | None = None,
) -> dict[str, Peak]:
    """Each policy's peak memory, from a process that runs only that policy.

    Args:
        build_model: the user's function (must be importable by name).
        data: the comparison's data (its first batches are used).
        policies: the policies.
        batch_size: examples per step for ``(x, y)`` data.
        loss: the loss for an uncompiled model (a name, or None).
        seed: the random seed.
        measure: False to measure nothing (every row says so).
        skip: policy -> why not to measure it.

    Returns:
        policy -> :data:`Peak`.
    """
    skip = skip or {}
    name = importable_name(build_model)
    why_not = None
    if not measure:
        why_not = "not measured (measure_memory=False)"
    elif name is None:
        why_not = (
            "not measured: build_model is not importable by name (a lambda, a nested "
            "function or one defined in __main__), so no separate process could run only "
            "one policy; define it in a module"
        )
    elif loss is not None and not isinstance(loss, str):
        why_not = "not measured: the loss is not a name another process can rebuild"
    if why_not is not None:
        return {policy: (None, why_not, False) for policy in policies}
    with tempfile.TemporaryDirectory() as folder:
        batches = os.path.join(folder, "batches.npz")
        saved = _save_batches(data, batch_size, batches)
        if saved is not None:
            return {policy: (None, f"not measured: {saved}", False) for policy in policies}
        return {
            policy: (None, f"not measured: {skip[policy]}", False)
            if policy in skip
            else _run_worker(name, policy, batches, loss, seed)
            for policy in policies
        }


def _save_batches(data: Any, batch_size: int, path: str) -> str | None:
    """Saves the first batches as arrays ``x`` and ``y``; returns why not, or None."""
    import numpy as np
    import tensorflow as tf

    from kmix._compare_run import make_dataset

    dataset, _ = make_dataset(data, batch_size)
    xs, ys = [], []
    for x, y in dataset.take(MEMORY_STEPS):
        if not (isinstance(x, tf.Tensor) and isinstance(y, tf.Tensor)):
            return "the data's x or y is not one array (a dict or tuple of inputs)"
        xs.append(x.numpy())
        ys.append(y.numpy())
    if len({x.shape for x in xs}) != 1:
        return "the data's first batches differ in size"
    np.savez(path, x=np.stack(xs), y=np.stack(ys))
    return None


def _run_worker(name: str, policy: str, batches: str, loss: Any, seed: int) -> Peak:
    spec = json.dumps(
        {"build": name, "policy": policy, "batches": batches, "loss": loss, "seed": seed}
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kmix._compare_memory", spec],
            capture_output=True,
            text=True,
            timeout=WORKER_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, f"not measured: its process took over {WORKER_TIMEOUT_S} s", False
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return None, f"not measured: its process failed ({tail})", False
    return peak_from_result(result)


def peak_from_result(result: dict[str, Any]) -> Peak:
    """The :data:`Peak` of a memory process's JSON line, with what was measured."""
    steps = f"{MEMORY_STEPS} steps"
    if result.get("out_of_memory"):
        return None, "out of device memory in a process that ran only this policy", True
    if result.get("device_peak") is not None:
        return (
            int(result["device_peak"]),
            f"peak {result['device']} memory of a process that ran only this policy "
            f"({steps}), as TensorFlow reports it",
            False,
        )
    start = result["start_rss"] / 2**20
    return (
        int(result["peak_rss"]),
        f"CPU: peak resident memory of a process that ran only this policy ({steps}); "
        f"{start:.0f} MiB of it was held before the model was built (Python, TensorFlow)",
        False,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The memory process: builds, trains a few steps, prints one JSON line.

    Args:
        argv: ``[SPEC]``, the JSON spec; None reads ``sys.argv[1:]``.

    Returns:
        0.
    """
    import importlib
    import resource

    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    import numpy as np
    import tensorflow as tf

    from kmix._compare_run import build_entry

    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    module, _, qualname = spec["build"].partition(":")
    function: Any = importlib.import_module(module)
    for part in qualname.split("."):
        function = getattr(function, part)
    gpus = tf.config.list_logical_devices("GPU")
    device = gpus[0].name.removeprefix("/device:") if gpus else None
    result: dict[str, Any] = {"start_rss": start, "device": device}
    try:
        model = build_entry(function, spec["policy"], spec["seed"], spec["loss"], qualname).model
        with np.load(spec["batches"]) as arrays:
            x, y = arrays["x"], arrays["y"]
        if device:
            tf.config.experimental.reset_memory_stats(device)
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)), epochs=1, verbose=0)
        if device:
            result["device_peak"] = tf.config.experimental.get_memory_info(device)["peak"]
    except tf.errors.ResourceExhaustedError:
        result["out_of_memory"] = True
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
