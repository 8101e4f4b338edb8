"""Peak memory per policy for ``kmix compare``: a process that runs only that policy.

In the comparison's own process every policy's model lives side by side, so no peak
there belongs to one policy. For each policy, :func:`measure_peaks` starts
``python -m kmix.compare.memory SPEC``, which imports TensorFlow, builds the model
under that policy with the user's ``build_model`` (imported by name), trains a few
steps on the comparison's first batches (saved to a temporary ``.npz``) and prints one
JSON line: the device's peak memory where TensorFlow reports it (a GPU), otherwise
the process's peak resident memory (``ru_maxrss``), with what the process held before
the model was built; or that the model did not fit (out of memory). The process
imports what this one imports: its ``PYTHONPATH`` is this process's ``sys.path``
(:func:`child_pythonpath`), so a ``build_model`` in a module the user's script put on
the path imports there too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = [
    "MEMORY_STEPS",
    "WORKER_TIMEOUT_S",
    "Peak",
    "child_pythonpath",
    "importable_name",
    "main",
    "measure_peaks",
    "peak_from_result",
]

MEMORY_STEPS = 5
"""Steps the memory process trains: the peak of a step is reached by the second."""
WORKER_TIMEOUT_S = 300
"""How long one memory process may take."""


class Peak(NamedTuple):
    """One policy's peak memory, or why it was not measured.

    Attributes:
        bytes: the peak, None when not measured.
        baseline: what the process held before the model was built, where known.
        note: what was measured, or why not.
        out_of_memory: the model did not fit in the device's memory.
    """

    bytes: int | None
    baseline: int | None
    note: str
    out_of_memory: bool = False


def importable_name(function: Any) -> str | None:
    """``"module:qualname"`` of a function another process can import, else None."""
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", "")
    if not module or module == "__main__" or not qualname or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def child_pythonpath(path: Sequence[str], pythonpath: str | None, cwd: str) -> str:
    """The ``PYTHONPATH`` that makes a child process import what this one imports.

    Python puts ``PYTHONPATH`` before its own entries and drops repeats, keeping the
    first, so with this path the child searches the parent's folders in the parent's
    order. ``""`` (the current directory) and relative entries are made absolute
    against ``cwd``; entries of ``pythonpath`` the parent no longer has are kept, last.

    Args:
        path: the parent's ``sys.path`` (entries that are not strings are left out).
        pythonpath: the ``PYTHONPATH`` the child would otherwise get, or None.
        cwd: the current directory.

    Returns:
        The entries, each once, joined by ``os.pathsep``.
    """
    entries = [p for p in path if isinstance(p, str)]
    entries += [p for p in (pythonpath or "").split(os.pathsep) if p]
    absolute = (os.path.normpath(os.path.join(cwd, entry)) for entry in entries)
    return os.pathsep.join(dict.fromkeys(absolute))


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
        return {policy: Peak(None, None, why_not) for policy in policies}
    with tempfile.TemporaryDirectory() as folder:
        batches = os.path.join(folder, "batches.npz")
        saved = _save_batches(data, batch_size, batches)
        if saved is not None:
            return {policy: Peak(None, None, f"not measured: {saved}") for policy in policies}
        return {
            policy: Peak(None, None, f"not measured: {skip[policy]}")
            if policy in skip
            else _run_worker(name, policy, batches, loss, seed)
            for policy in policies
        }


def _one_array(value: Any) -> bool:
    """True for one tensor of a batch (a ``tf.data`` tensor or a NumPy array, whatever
    Keras's backend), not a dict, tuple or list of inputs."""
    return hasattr(value, "shape") and not isinstance(value, dict | tuple | list)


def _save_batches(data: Any, batch_size: int, path: str) -> str | None:
    """Saves the first batches as arrays ``x`` and ``y``; returns why not, or None."""
    import numpy as np

    from kmix.compare.rounds import make_dataset

    dataset, _ = make_dataset(data, batch_size)
    xs, ys = [], []
    for x, y in dataset.take(MEMORY_STEPS):
        if not (_one_array(x) and _one_array(y)):
            return "the data's x or y is not one array (a dict or tuple of inputs)"
        xs.append(np.asarray(x))
        ys.append(np.asarray(y))
    if len({x.shape for x in xs}) != 1:
        return "the data's first batches differ in size"
    np.savez(path, x=np.stack(xs), y=np.stack(ys))
    return None


def _run_worker(name: str, policy: str, batches: str, loss: Any, seed: int) -> Peak:
    spec = json.dumps(
        {"build": name, "policy": policy, "batches": batches, "loss": loss, "seed": seed}
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    env["PYTHONPATH"] = child_pythonpath(sys.path, env.get("PYTHONPATH"), os.getcwd())
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kmix.compare.memory", spec],
            capture_output=True,
            text=True,
            timeout=WORKER_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return Peak(None, None, f"not measured: its process took over {WORKER_TIMEOUT_S} s")
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return Peak(None, None, f"not measured: its process failed ({tail})")
    return peak_from_result(result)


def peak_from_result(result: dict[str, Any]) -> Peak:
    """The :class:`Peak` of a memory process's JSON line, with what was measured.

    Args:
        result: the line's object: ``start_rss`` and ``peak_rss`` (bytes, with
            ``rss_from``: how the peak was read), or ``device`` and ``device_peak``, or
            ``out_of_memory``.

    Returns:
        The peak and its note.
    """
    steps = f"{MEMORY_STEPS} steps"
    if result.get("out_of_memory"):
        note = "out of device memory in a process that ran only this policy"
        return Peak(None, None, note, True)
    if result.get("device_peak") is not None:
        return Peak(
            int(result["device_peak"]),
            None,
            f"peak {result['device']} memory of a process that built and trained only this "
            f"policy ({steps}), as TensorFlow reports it",
        )
    since = (
        "since just before the model was built"
        if result.get("rss_from") == "reset"
        else "since the process started (the high-water mark could not be reset)"
    )
    return Peak(
        int(result["peak_rss"]),
        int(result["start_rss"]),
        f"CPU: peak resident memory (VmHWM) {since}, of a process that built and trained "
        f"only this policy ({steps}); + is its rise over what Python and TensorFlow held "
        "before the model was built",
    )


def _rss() -> tuple[int, int, str]:
    """(resident now, peak resident, how the peak was read), bytes, after a reset."""
    import resource

    reset = "reset"
    try:  # Linux 4.0+: writing 5 resets the peak resident set size (VmHWM)
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:
        reset = "start"
    try:
        return (*_status_rss(), reset)
    except (OSError, ValueError, KeyError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak, "start"


def _status_rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) from /proc/self/status, in bytes."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as file:
        for line in file:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return int(fields["VmRSS"][0]) * 1024, int(fields["VmHWM"][0]) * 1024


def main(argv: Sequence[str] | None = None) -> int:
    """The memory process: builds, trains a few steps, prints one JSON line.

    Args:
        argv: ``[SPEC]``, the JSON spec; None reads ``sys.argv[1:]``.

    Returns:
        0.
    """
    import importlib

    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    import numpy as np

    from kmix import backend
    from kmix.compare.rounds import build_entry

    module, _, qualname = spec["build"].partition(":")
    function: Any = importlib.import_module(module)
    for part in qualname.split("."):
        function = getattr(function, part)
    device = backend.first_gpu()
    with np.load(spec["batches"]) as arrays:
        x, y = arrays["x"], arrays["y"]
    start, _, rss_from = _rss()
    result: dict[str, Any] = {"start_rss": start, "rss_from": rss_from, "device": device}
    try:
        model = build_entry(function, spec["policy"], spec["seed"], spec["loss"], qualname).model
        if device:
            backend.reset_peak_memory(device)
        model.fit(backend.dataset_from_arrays(x, y), epochs=1, verbose=0)
        if device:
            result["device_peak"] = backend.peak_memory(device)
    except Exception as error:
        if not backend.is_out_of_memory(error):
            raise
        result["out_of_memory"] = True
    try:
        result["peak_rss"] = _status_rss()[1]
    except (OSError, ValueError, KeyError):
        import resource

        result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
