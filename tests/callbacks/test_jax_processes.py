"""kmix under ``keras.distribution`` with two JAX processes on 127.0.0.1, two CPU devices each.

Each scenario starts both processes of tests/scripts/jax_processes.py (process 1's data
misbehaves), waits at most PROCESS_TIMEOUT seconds, always kills what is left (each
process in its own group), and shows the processes' output when something fails, so a
hang fails the test instead of hanging CI. The script sets the backend itself; the tests
run once, in the JAX pass (``KERAS_BACKEND=jax python -m pytest -m jax``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import keras
import numpy as np
import pytest

from kmix import tags

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
SCRIPT = os.path.join(TESTS, "scripts", "jax_processes.py")
PROCESS_TIMEOUT = 240
BAD_STEP, PATIENCE, STEPS = 3, 3, 8  # as in the script
PROCESS_1_SHARD = {"process": 1, "replica": 2}
"""Where the bad row is: process 1's first device, the third shard of the global batch."""

pytestmark = [
    pytest.mark.slow,  # two processes per test
    pytest.mark.jax,
    pytest.mark.skipif(keras.backend.backend() != "jax", reason="runs in the JAX pass"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Hung(AssertionError):
    """Some process did not end within its timeout (it was killed)."""


@dataclasses.dataclass
class Ended:
    returncode: int | None
    stdout: str
    stderr: str


def run_processes(args: list[str], n: int = 2, timeout: float = PROCESS_TIMEOUT) -> list[Ended]:
    """Runs ``SCRIPT INDEX *args`` for each index, each in its own process group.

    Output goes to files (a pipe nobody reads would block a chatty process). Whatever is
    still running at the deadline is killed with its group (a process stuck in a
    collective ignores SIGTERM); nothing is left running when this returns or raises.

    Raises:
        Hung: some process was still running at the deadline.
    """
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(TESTS), *filter(None, [env.get("PYTHONPATH")])]
    )
    with tempfile.TemporaryDirectory() as logs:
        files = [
            (open(os.path.join(logs, f"{i}.out"), "w+"), open(os.path.join(logs, f"{i}.err"), "w+"))
            for i in range(n)
        ]
        processes = []
        try:
            for i, (out, err) in enumerate(files):
                processes.append(
                    subprocess.Popen(
                        [sys.executable, SCRIPT, str(i), *args],
                        stdout=out,
                        stderr=err,
                        env=env,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(p.poll() is None for p in processes):
                time.sleep(0.2)
            hung = [i for i, p in enumerate(processes) if p.poll() is None]
        finally:
            for p in processes:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        ended = []
        for p, (out, err) in zip(processes, files, strict=True):
            out.seek(0), err.seek(0)
            ended.append(Ended(p.returncode, out.read(), err.read()))
            out.close(), err.close()
    if hung:
        raise Hung(f"processes {hung} ran past {timeout}s and were killed\n{shown(ended)}")
    return ended


def shown(ended: list[Ended]) -> str:
    lines = []
    for i, e in enumerate(ended):
        err = "\n".join(x for x in e.stderr.splitlines() if not x.startswith("[Gloo]"))
        lines.append(f"--- process {i} (exit {e.returncode})\n{e.stdout[-2000:]}\n{err[-4000:]}")
    return "\n".join(lines)


def run_scenario(scenario: str, directory: str) -> list[dict]:
    ended = run_processes([str(free_port()), scenario, directory])
    assert all(e.returncode == 0 for e in ended), shown(ended)
    return [json.loads(e.stdout.strip().splitlines()[-1]) for e in ended]


def event_files(log_dir: str) -> list[str]:
    return [
        os.path.join(root, name)
        for root, _, names in os.walk(log_dir)
        for name in names
        if "tfevents" in name
    ]


def same_in_both(first: dict, other: dict) -> None:
    """Everything but who wrote is the same in both processes."""
    assert (first["index"], other["index"]) == (0, 1)
    assert first["processes"] == other["processes"] == 2
    assert first["devices"] == other["devices"] == 4
    for key in ("scales", "state", "events", "kernel", "guard", "moves", "wide_policy"):
        assert first[key] == other[key], key


def only_process_zero_wrote(results: list[dict], log_dir: str, run_end: str = "completed") -> None:
    """One event file, process 0's; kmix report reads it as the run both processes had."""
    (path,) = event_files(log_dir)
    assert os.path.dirname(path) == os.path.join(log_dir, tags.TRAIN_DIR)
    assert f".{results[0]['pid']}." in os.path.basename(path)
    state, read = results[0]["state"], results[0]["report"]
    assert read["processes"] == [
        "processes       2 processes, 4 devices in all (keras.distribution); this log is "
        "process 0's, counters and events are global"
    ]
    assert read["event_steps"] == [e["step"] for e in results[0]["events"]]
    assert (read["steps_seen"], read["skipped_steps"]) == (
        state["attempted_steps"],
        state["skipped_steps"],
    )
    assert read["run_end"] == run_end


def test_a_process_that_never_ends_is_killed_at_its_timeout():
    start = time.monotonic()
    with pytest.raises(Hung, match=r"processes \[0, 1\] ran past 20s"):
        run_processes([str(free_port()), "hang", "unused"], timeout=20)
    assert time.monotonic() - start < 40


def test_gradient_overflow_in_one_process_skips_the_same_step_in_both(tmp_path):
    results = run_scenario("gradient", str(tmp_path))
    same_in_both(*results)
    first = results[0]
    assert first["scales"] == [1024.0] * (BAD_STEP - 1) + [512.0] * (STEPS - BAD_STEP + 1)
    assert first["events"] == [
        {
            "step": BAD_STEP,
            "kind": "backoff",
            "old_scale": 1024.0,
            "new_scale": 512.0,
            "variable": "wide/kernel",
            "loss_finite": True,
            "origin": None,
            "source": PROCESS_1_SHARD,
        }
    ]
    state = first["state"]
    assert (state["attempted_steps"], state["skipped_steps"]) == (STEPS, 1)
    assert state["last_overflow_step"] == BAD_STEP
    for first_or_other in results:
        refused = first_or_other["refused"]
        assert refused["compare"][0] == "CompareError"
        assert refused["demo"][0] == "ValueError"
        for tool in ("compare", "demo"):
            assert refused[tool][1] == (
                f"kmix {tool} is a single-process tool, but keras.distribution runs 2 "
                "processes here (4 devices): run it in one process, without "
                "keras.distribution.initialize(). To train across processes, use "
                "kmix.LossScaleOptimizer and kmix's callbacks in your own model.fit (README: "
                "'Across processes')."
            )
    # the kernel moved by the 7 applied steps only
    np.testing.assert_allclose(first["kernel"], expected_kernel(STEPS - 1), rtol=1e-5)
    only_process_zero_wrote(results, str(tmp_path / "logs"))
    # kmix report reads the source back from what process 0 wrote
    assert first["report"]["event_lines"] == [
        "backoff at step 3: loss scale 1024 → 512; first non-finite gradient wide/kernel "
        "(2 variables); first non-finite in process 1, replica 2"
    ]


def expected_kernel(applied: int) -> np.ndarray:
    """``wide``'s kernel after ``applied`` SGD(1e-3) steps of mse on the clean batches.

    x = 0.25 everywhere, y = 0; wide: 4 -> 8 with kernel k (all equal), top: 8 -> 1 with
    kernel t (all equal), no activation, biases 0 (both grow). Computed in float64 with the
    biases; the float16 forward pass differs from it by about 1e-6 (relative) here.
    """
    k, t, b1, b2, lr = 0.5, 0.5, 0.0, 0.0, 1e-3
    for _ in range(applied):
        h = 4 * 0.25 * k + b1  # each of the 8 hidden units
        out = 8 * h * t + b2
        d_out = 2 * out  # mse against 0, mean over one output
        d_t, d_b2 = d_out * h, d_out
        d_h = d_out * t
        d_k, d_b1 = d_h * 0.25, d_h
        k, t, b1, b2 = k - lr * d_k, t - lr * d_t, b1 - lr * d_b1, b2 - lr * d_b2
    return np.full((4, 8), k)


def test_forward_overflow_in_one_process_names_the_same_origin_in_both(tmp_path):
    results = run_scenario("forward", str(tmp_path))
    same_in_both(*results)
    first = results[0]
    assert first["scales"] == [1024.0] * STEPS  # no scale can fix the forward pass
    assert first["events"] == [
        {
            "step": BAD_STEP,
            "kind": "forward_overflow",
            "old_scale": 1024.0,
            "new_scale": 1024.0,
            "variable": "wide/kernel",
            "loss_finite": False,
            "origin": {
                "layer": "wide",
                "layer_class": "Dense",
                "inputs_finite": True,
                "max_abs_input": 90000.0,
            },
            "source": PROCESS_1_SHARD,
        }
    ]
    np.testing.assert_allclose(first["kernel"], expected_kernel(STEPS - 1), rtol=1e-5)
    only_process_zero_wrote(results, str(tmp_path / "logs"))


def test_guard_stops_both_processes_at_the_same_step(tmp_path):
    results = run_scenario("guard", str(tmp_path))
    same_in_both(*results)
    stop_step = BAD_STEP + PATIENCE - 1  # non-finite loss on steps 3, 4, 5
    first = results[0]
    assert first["guard"] == ["nonfinite_loss", stop_step]
    assert first["state"]["attempted_steps"] == stop_step
    assert first["state"]["skipped_steps"] == PATIENCE
    assert [e["step"] for e in first["events"]] == [3, 4, 5]
    assert [e["loss_finite"] for e in first["events"]] == [False] * PATIENCE
    assert [e["source"] for e in first["events"]] == [PROCESS_1_SHARD] * PATIENCE
    assert first["scales"] == [1024.0] * stop_step
    only_process_zero_wrote(results, str(tmp_path / "logs"), "stopped_by_guard")
    # verbose=1: the diagnosis is printed once for the run, by process 0
    assert "kmix.LossScaleGuard stopped training at step 5" in first["printed"]
    assert results[1]["printed"] == ""


def test_a_log_dir_process_0_cannot_create_fails_both_processes_at_train_begin(tmp_path):
    results = run_scenario("logdir", str(tmp_path))  # a hang would fail here (Hung)
    first, other = (r["error"] for r in results)
    assert first[0] == other[0] == "ValueError"
    assert "cannot create its log directory" in first[1]
    assert other[1] == (
        "kmix.callbacks.MixedPrecisionMonitor: process 0 could not create its log directory "
        f"under log_dir={str(tmp_path / 'logs')!r} (its error says why), so "
        "this process stops too rather than wait for it in the first step."
    )


def test_autopilot_moves_the_same_layer_at_the_same_step_in_both(tmp_path):
    results = run_scenario("autopilot", str(tmp_path))
    same_in_both(*results)
    first = results[0]
    assert first["moves"] == [[BAD_STEP, "wide", "mixed_float16", "float32"]]
    assert first["wide_policy"] == "float32"
    assert [e["step"] for e in first["events"]] == [BAD_STEP]
    assert first["state"]["attempted_steps"] == STEPS
    assert first["scales"] == [1024.0] * STEPS
    only_process_zero_wrote(results, str(tmp_path / "logs"))


def test_float8_health_is_read_by_process_0_and_the_same_in_both(tmp_path):
    """Process 0's monitor reads each float8 kernel's underflow (a compiled call on the
    replicated kernels) while process 1 does not: neither waits for the other. Both then
    read the same health; the kernels (0.5 everywhere, scales near 0.5 / 448) flush nothing."""
    results = run_scenario("float8", str(tmp_path))
    same_in_both(*results)
    first, other = results
    assert first["wide_policy"] == "float8_from_mixed_float16"
    assert first["float8"] == other["float8"]
    kernels = {layer: share for layer, tensor, share in first["float8"] if tensor == "kernel"}
    assert kernels == {"wide": 0.0, "top": 0.0}
    written = {
        (layer, step, share)
        for layer, tensor, step, share in first["report"]["float8"]
        if tensor == "kernel"
    }
    assert written == {("wide", STEPS, 0.0), ("top", STEPS, 0.0)}
    only_process_zero_wrote(results, str(tmp_path / "logs"))
