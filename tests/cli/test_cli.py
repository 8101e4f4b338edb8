"""The ``kmix`` command: its exit status and output, in two tiers.

Fast tier: ``cli.main([...])`` in this process (:func:`kmix_here`), for arguments, bad
log dirs, ``kmix report`` on a log dir written here and ``kmix doctor``. Slow tier
(``@pytest.mark.slow``): the command run as a user runs it, in a subprocess
(:func:`kmix`), for what only a fresh process shows (no TensorFlow at import, no
TensorFlow start-up lines, a closed pipe), the full ``kmix demo``, and the demo's fits.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_report import assert_png, write_run
from test_speed import XEON

import kmix.demo as kmix_demo
import kmix.policy as kmix_policy
from kmix import report, tags
from kmix.cli import commands as cli
from kmix.cli import doctor as _cli_doctor
from kmix.demo import train as demo
from kmix.policy import speed as _speed_probe
from kmix.policy.machine import GPU, Hardware, hardware

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
USER_ENV = {name: value for name, value in os.environ.items() if name != "TF_CPP_MIN_LOG_LEVEL"}
"""The environment of a user who has not set TF_CPP_MIN_LOG_LEVEL."""

# Lines TensorFlow 2.21 writes to stderr at start-up on a machine without a GPU.
STARTUP_LINES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1796046500.902047    4362 port.cc:153] oneDNN custom operations are on. "
    "You may see slightly different numerical results due to floating-point round-off errors "
    "from different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.\n"
    "I0000 00:00:1796046500.902298    4362 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.\n"
    "I0000 00:00:1796046521.717030    6569 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.\n"
    "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.\n"
    "E0000 00:00:1796046503.413596    4362 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
    "E0000 00:00:1796046505.266419    4362 util.cc:131] oneDNN supports DT_HALF only on "
    "platforms with AVX-512. Falling back to the default Eigen-based implementation if present.\n"
)


def kmix(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs ``python -m kmix.cli ARGS`` and returns the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "kmix.cli", *args],
        capture_output=True,
        text=True,
        env=ENV if env is None else env,
        timeout=timeout,
        check=False,
    )


class Ran(NamedTuple):
    """What a ``kmix`` command run in this process did, named as by ``CompletedProcess``."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def kmix_here(capsys, monkeypatch):
    """Runs ``kmix ARGS`` in this process (``cli.main``) and returns a :class:`Ran`.

    ``kmix demo`` sets ``KERAS_BACKEND`` in the process; it is restored after the test.
    """
    keep_keras_backend(monkeypatch)

    def run(*args: str) -> Ran:
        capsys.readouterr()  # what was printed before is not this command's
        try:
            status = cli.main(list(args))
        except SystemExit as exit:  # argparse: --help, --version, bad arguments
            status = exit.code
        out, err = capsys.readouterr()
        return Ran(status, out, err)

    return run


def keep_keras_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restores ``KERAS_BACKEND`` after the test, also to unset, whatever the test sets."""
    was = os.environ.get("KERAS_BACKEND")
    monkeypatch.setenv("KERAS_BACKEND", "recorded")  # undone last: back to `was` or unset
    if was is None:
        monkeypatch.delenv("KERAS_BACKEND")
    else:
        monkeypatch.setenv("KERAS_BACKEND", was)


def python(code: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs a Python snippet in a fresh interpreter (with ``env``, or the tests' own)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=ENV if env is None else env,
        timeout=timeout,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess | Ran) -> str:
    """The single stderr line of a bad-input exit, after checking the status."""
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def run_dir(tmp_path) -> str:
    logdir = str(tmp_path / "run")
    write_run(logdir)
    return logdir


# ---------------------------------------------------------------------- help
def test_help_lists_the_commands(kmix_here):
    result = kmix_here("--help")
    assert result.returncode == 0
    for command in ("demo", "report", "doctor"):
        assert command in result.stdout


@pytest.mark.slow
def test_help_does_not_import_tensorflow():
    result = python(
        """
        import contextlib, io, sys
        from kmix.cli import commands as cli
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                cli.main(["--help"])
            except SystemExit as exit:
                code = exit.code
        print(code, "tensorflow" in sys.modules, "keras" in sys.modules, "demo" in out.getvalue())
        """
    )
    assert result.stdout.split() == ["0", "False", "False", "True"], result.stderr


@pytest.mark.slow
def test_console_script_help():
    script = Path(sys.executable).with_name("kmix")
    if not script.exists():
        pytest.skip("the kmix console script is not installed next to this Python")
    result = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, env=ENV, check=False
    )
    assert result.returncode == 0
    for command in ("demo", "report", "doctor"):
        assert command in result.stdout


@pytest.mark.parametrize("command", ["demo", "report", "doctor"])
def test_subcommand_help(kmix_here, command):
    result = kmix_here(command, "--help")
    assert result.returncode == 0
    assert f"usage: kmix {command}" in result.stdout


def test_version(kmix_here):
    result = kmix_here("--version")
    assert (result.returncode, result.stdout.strip()) == (0, "kmix 0.1.0")


def test_no_command_prints_usage_and_exits_2(kmix_here):
    result = kmix_here()
    assert result.returncode == 2
    assert "usage: kmix" in result.stderr


# -------------------------------------------------------------------- report
def test_report_prints_the_summary_and_writes_plots(kmix_here, run_dir):
    result = kmix_here("report", run_dir)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"kmix report: {os.path.join(run_dir, tags.TRAIN_DIR)}" in out
    assert "steps seen      100" in out
    assert "skipped steps   4 of 100 (4.00%)" in out
    assert "first non-finite gradient dense_2/kernel (3 variables)" in out
    assert (
        "! 37% of gradient elements in dense_2/kernel sit below float16's smallest normal"
    ) in out
    for name in report.PLOT_FILES[:3]:  # the synthetic run has no activation statistics
        path = os.path.join(run_dir, "report", name)
        assert f"plot: {path}" in out
        assert_png(path)
    assert "activations.png" not in out


@pytest.mark.slow
def test_report_does_not_import_tensorflow(run_dir):
    result = python(
        f"""
        import sys
        from kmix.cli import commands as cli
        code = cli.main(["report", {run_dir!r}, "--no-plots"])
        print("status", code, "tensorflow" in sys.modules, "keras" in sys.modules)
        """
    )
    assert result.stdout.splitlines()[-1] == "status 0 False False", result.stderr


def test_report_json_is_the_summary(kmix_here, run_dir, tmp_path):
    out = str(tmp_path / "pngs")
    result = kmix_here("report", run_dir, "--json", "--out", out)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    expected = report.summarize(report.read_log(run_dir)).to_dict()
    expected["plots"] = [os.path.join(out, name) for name in report.PLOT_FILES[:3]]
    assert printed == expected
    for path in expected["plots"]:
        assert_png(path)


def test_report_no_plots(kmix_here, run_dir):
    result = kmix_here("report", run_dir, "--no-plots")
    assert result.returncode == 0
    assert "plot:" not in result.stdout
    assert not os.path.exists(os.path.join(run_dir, "report"))


def test_report_without_matplotlib_still_prints_the_summary(kmix_here, run_dir, monkeypatch):
    # None in sys.modules makes `import matplotlib...` fail, also where it was imported before.
    for name in ["matplotlib", *(name for name in sys.modules if name.startswith("matplotlib."))]:
        monkeypatch.setitem(sys.modules, name, None)
    result = kmix_here("report", run_dir)
    assert result.returncode == 0
    assert "steps seen      100" in result.stdout
    assert result.stderr.strip() == (
        "kmix report: matplotlib is not installed, so no plots were written "
        "(pip install matplotlib)"
    )


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text("not a dir"), "is not a directory"),
        (lambda p: p.mkdir(), "is empty"),
        (lambda p: (p / "other").mkdir(parents=True), "no kmix data in"),
    ],
    ids=["missing", "file", "empty", "no-kmix-data"],
)
def test_report_bad_log_dir(kmix_here, tmp_path, make, says):
    path = tmp_path / "logs"
    make(path)
    line = one_line_error(kmix_here("report", str(path)))
    assert line.startswith("kmix report: ")
    assert says in line
    assert str(path) in line
    assert "expected" in line and "MixedPrecisionMonitor" in line


@pytest.mark.slow
def test_report_into_a_closed_pipe_exits_0(run_dir):
    # `kmix report LOGDIR --json | head`: the reader closes the pipe before kmix writes.
    process = subprocess.Popen(
        [sys.executable, "-m", "kmix.cli", "report", run_dir, "--json", "--no-plots"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert (process.wait(timeout=120), stderr) == (0, "")


def test_report_out_is_a_file(kmix_here, run_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(kmix_here("report", run_dir, "--out", str(blocker)))
    assert line.startswith(f"kmix report: cannot write plots to {blocker}")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["report"], "the following arguments are required: LOGDIR"),
        (["demo", "--epochs", "0"], "argument --epochs: expected an integer >= 1, got 0"),
        (["demo", "--epochs", "two"], "argument --epochs: expected an integer >= 1, got 'two'"),
        (["demo", "--policy", "float8"], "argument --policy: invalid choice: 'float8'"),
        (["train"], "argument COMMAND: invalid choice: 'train'"),
    ],
)
def test_bad_arguments_exit_2(kmix_here, args, says):
    result = kmix_here(*args)
    assert (result.returncode, result.stdout) == (2, "")
    assert says in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (["demo", "--bogus"], "usage: kmix demo [-h]"),
        (["report", "runs/x", "--bogus"], "usage: kmix report [-h]"),
        (["report", "--bogus", "runs/x"], "usage: kmix report [-h]"),
        (["doctor", "--bogus"], "usage: kmix doctor [-h]"),
        (["--bogus"], "usage: kmix [-h]"),
    ],
    ids=["demo", "report", "report-option-first", "doctor", "no-command"],
)
def test_unknown_argument_prints_its_commands_usage(kmix_here, args, usage):
    result = kmix_here(*args)
    assert (result.returncode, result.stdout) == (2, "")
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(usage), result.stderr
    command = "kmix" if args[0] == "--bogus" else f"kmix {args[0]}"
    assert lines[-1] == f"{command}: error: unrecognized arguments: --bogus"


def test_build_parser_rejects_unknown_arguments_with_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.build_parser().parse_args(["report", "runs/x", "--bogus"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.startswith("usage: kmix report [-h]")


def test_report_empty_logdir(kmix_here):
    assert one_line_error(kmix_here("report", "")) == (
        "kmix report: LOGDIR '' is empty: expected the log_dir given to "
        "kmix.callbacks.MixedPrecisionMonitor, e.g. kmix report runs/demo"
    )


def test_report_of_a_directory_of_log_dirs_lists_their_runs(kmix_here, tmp_path):
    """`kmix report runs` on runs/a/train, runs/b/train: was 'no kmix data in runs'."""
    from test_runs import write_small_run, write_twice

    parent = tmp_path / "runs"
    write_small_run(str(parent / "a"), "20250101-090000-cccccc", scale=8.0, skips=(3,), steps=5)
    write_twice(str(parent / "b"))
    ran = kmix_here("report", str(parent))
    assert (ran.returncode, ran.stderr) == (0, "")
    lines = ran.stdout.splitlines()
    assert lines[0] == (
        f"kmix report: {parent} has no kmix log of its own; under it, 3 kmix runs in 2 log dirs:"
    )
    a, b = f"  {parent / 'a'}  ", f"  {parent / 'b'}  "
    assert lines[1].startswith(a + "id 20250101-090000-cccccc, began ")
    assert lines[2].startswith(b + "run 1 of 2: id 20250101-100000-aaaaaa, began ")
    assert lines[3].startswith(b + "run 2 of 2: id 20250101-110000-bbbbbb, began ")
    assert lines[1].endswith(", steps 0..5, completed at step 5")
    assert lines[3].endswith(", steps 0..6, completed at step 6")
    assert lines[4:] == [
        f"report one with: kmix report {parent / 'a'}  (the latest run of a log dir; "
        "--run N for another)"
    ]
    assert not (parent / "report").exists()  # a listing draws no plots

    data = json.loads(kmix_here("report", str(parent), "--json").stdout)
    assert data["parent"] == str(parent)
    assert [(d["logdir"], [r["run_id"] for r in d["runs"]]) for d in data["logdirs"]] == [
        (str(parent / "a"), ["20250101-090000-cccccc"]),
        (str(parent / "b"), ["20250101-100000-aaaaaa", "20250101-110000-bbbbbb"]),
    ]
    assert data["logdirs"][0]["runs"][0]["end"]["reason"] == "completed"


def test_report_of_a_directory_without_kmix_data_under_it_is_still_an_error(kmix_here, tmp_path):
    plain = tmp_path / "runs" / "plain" / "train"
    writer = tf.summary.create_file_writer(str(plain))
    with writer.as_default():
        tf.summary.scalar("loss", 1.0, step=1)
    writer.close()
    line = one_line_error(kmix_here("report", str(tmp_path / "runs")))
    assert line.startswith(f"kmix report: no kmix data in {tmp_path / 'runs'}: expected")


def test_report_run_picks_a_run_of_a_log_dir_written_twice(kmix_here, tmp_path):
    from test_runs import write_twice

    logdir = str(tmp_path / "twice")
    write_twice(logdir)
    train = os.path.join(logdir, tags.TRAIN_DIR)
    latest = kmix_here("report", logdir, "--no-plots")
    assert latest.returncode == 0
    assert latest.stdout.splitlines()[1] == (
        f"run             2 of 2 in this log dir (the latest); see run 1 with: "
        f"kmix report {train} --run 1"
    )
    assert "skipped steps   1 of 6 (16.67%)" in latest.stdout
    first = kmix_here("report", logdir, "--run", "1", "--no-plots")
    assert first.returncode == 0
    assert first.stdout.splitlines()[1] == (
        f"run             1 of 2 in this log dir; see run 2 with: kmix report {train} --run 2"
    )
    assert "backoff at step 2: loss scale 4 → 2" in first.stdout
    assert one_line_error(kmix_here("report", logdir, "--run", "7")).startswith(
        f"kmix report: no run '7' in {logdir}: it holds 2 kmix runs (1: id "
    )


def test_demo_logdir_is_a_file(kmix_here, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(kmix_here("demo", "--logdir", str(blocker)))
    assert (
        line
        == f"kmix demo: --logdir {blocker} is a file: expected a directory (created if missing)"
    )


def files_in(folder: Path) -> list[str]:
    """Every file under ``folder``, as sorted relative paths."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def keras_tensorboard_run(logdir: Path) -> list[str]:
    """A log dir as the Keras TensorBoard callback leaves it; returns its files."""
    for sub in (tags.TRAIN_DIR, "validation"):
        (logdir / sub).mkdir(parents=True, exist_ok=True)
        (logdir / sub / "events.out.tfevents.1.host.v2").write_bytes(b"keras events")
    return files_in(logdir)


def test_demo_refuses_a_log_dir_it_did_not_write(kmix_here, tmp_path):
    logdir = tmp_path / "keras_run"
    files = keras_tensorboard_run(logdir)
    for extra in ([], ["--overwrite"]):
        line = one_line_error(kmix_here("demo", "--logdir", str(logdir), *extra))
        assert line == (
            f"kmix demo: --logdir {logdir} is not empty and is not a kmix demo run (it holds "
            "2 files, e.g. train/events.out.tfevents.1.host.v2): kmix demo writes only to a "
            "new or empty directory; choose another --logdir, e.g. runs/demo"
        )
        assert files_in(logdir) == files
        assert (logdir / files[0]).read_bytes() == b"keras events"


def test_demo_empty_logdir_deletes_nothing_in_the_working_directory(
    kmix_here, tmp_path, monkeypatch
):
    files = keras_tensorboard_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    line = one_line_error(kmix_here("demo", "--logdir", ""))
    assert line == (
        "kmix demo: --logdir '' is empty: give the directory to write the run to, "
        "e.g. --logdir runs/demo"
    )
    assert files_in(tmp_path) == files


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: str(tmp / "file" / "run"), "Not a directory"),
        (lambda tmp: "/proc/kmix-nowhere/run", "No such file or directory (/proc/kmix-nowhere)"),
    ],
    ids=["through-a-file", "not-creatable"],
)
def test_demo_log_dir_it_cannot_write(kmix_here, tmp_path, make, says):
    (tmp_path / "file").write_text("x")
    logdir = make(tmp_path)
    line = one_line_error(kmix_here("demo", "--logdir", logdir))
    assert line == (
        f"kmix demo: cannot write to --logdir {logdir}: {says}; choose a directory you can "
        "write to, e.g. --logdir runs/demo"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_demo_log_dir_under_a_read_only_directory(kmix_here, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        line = one_line_error(kmix_here("demo", "--logdir", str(locked / "run")))
    finally:
        locked.chmod(0o755)
    assert line.startswith(f"kmix demo: cannot write to --logdir {locked / 'run'}: Permission")


def test_demo_command_passes_its_arguments_and_status(kmix_here, tmp_path, monkeypatch):
    calls = []

    def fake_main(**arguments):
        calls.append(arguments)
        return 1  # as when LossScaleGuard stopped training

    monkeypatch.setattr(kmix_demo, "main", fake_main)  # what the command calls
    logdir = str(tmp_path / "run")
    result = kmix_here(
        "demo", "--logdir", logdir, "--epochs", "3", "--policy", "float32", "--overwrite"
    )
    assert result == Ran(1, "", "")
    assert calls == [{"logdir": logdir, "epochs": 3, "policy": "float32", "overwrite": True}]
    assert demo.files_under(logdir) == [demo.MARKER]  # the log dir was prepared first


def test_files_to_replace():
    keras_files = ["train/events.out.tfevents.1.host.v2"]
    ours = ["report/health.png", "train/events.out.tfevents.2.host.v2"]
    assert demo.files_to_replace("d", [], None, overwrite=False) == []
    assert demo.files_to_replace("d", [demo.MARKER], [], overwrite=False) == []
    assert demo.files_to_replace("d", [demo.MARKER, *ours], ours, overwrite=True) == ours
    with pytest.raises(demo.LogdirError, match="is not a kmix demo run"):
        demo.files_to_replace("d", keras_files, None, overwrite=True)
    with pytest.raises(demo.LogdirError) as error:
        demo.files_to_replace("d", [demo.MARKER, *ours], ours, overwrite=False)
    assert str(error.value) == (
        "--logdir d holds a previous kmix demo run: add --overwrite to replace it (only the "
        "files the demo wrote are removed), or choose another --logdir"
    )
    with pytest.raises(demo.LogdirError) as error:
        demo.files_to_replace("d", [demo.MARKER, *keras_files, *ours], ours, overwrite=True)
    assert str(error.value) == (
        "--logdir d holds a kmix demo run and 1 file the demo did not write (e.g. "
        "train/events.out.tfevents.1.host.v2), which it will not remove: move it away or "
        "choose another --logdir"
    )


def test_overwrite_removes_only_what_the_demo_wrote(tmp_path):
    logdir = tmp_path / "demo"
    assert demo.prepare_logdir(str(logdir)) == 0
    assert demo.files_under(str(logdir)) == [demo.MARKER]
    assert demo.prepare_logdir(str(logdir)) == 0  # nothing written yet: nothing to replace
    for name in ("train/events.out.tfevents.1.a.v2", "report/health.png", "report/x/y.png"):
        (logdir / name).parent.mkdir(parents=True, exist_ok=True)
        (logdir / name).write_bytes(b"demo")
    demo.record_run(str(logdir))
    assert demo.read_marker(str(logdir)) == [
        "report/health.png",
        "report/x/y.png",
        "train/events.out.tfevents.1.a.v2",
    ]
    with pytest.raises(demo.LogdirError, match="add --overwrite"):
        demo.prepare_logdir(str(logdir))
    assert demo.prepare_logdir(str(logdir), overwrite=True) == 3
    # The demo's folders went with its files; the marker says the run is empty.
    assert sorted(p.name for p in logdir.iterdir()) == [demo.MARKER]
    assert demo.read_marker(str(logdir)) == []
    assert cli.build_parser().parse_args(["demo", "--overwrite"]).overwrite is True
    assert cli.build_parser().parse_args(["demo"]).overwrite is False


# ------------------------------------------------- TensorFlow's start-up lines
def test_startup_noise_is_recognised_line_by_line():
    noise = STARTUP_LINES.splitlines()
    assert [cli.is_startup_noise(line) for line in noise] == [True] * len(noise)
    for line in (
        "Traceback (most recent call last):",
        "E0000 00:00:1796046503.413596    4362 op_kernel.cc:1857] OP_REQUIRES failed: OOM",
        "WARNING: the loss is NaN",
        "UserWarning: failed call to cuInit mentioned in my own message",
    ):
        assert not cli.is_startup_noise(line), line


def test_quiet_startup_drops_only_the_startup_lines_in_process(capfd):
    error = b"E0000 00:00:1.5    1 op_kernel.cc:1857] OP_REQUIRES failed\n"
    with cli.quiet_tensorflow_startup():
        os.write(2, STARTUP_LINES.encode())
        os.write(2, error)
    assert capfd.readouterr().err == error.decode()


@pytest.mark.slow
def test_quiet_startup_keeps_every_other_line():
    result = python(
        f"""
        import os, sys
        from kmix.cli import commands as cli
        with cli.quiet_tensorflow_startup():
            os.write(2, {STARTUP_LINES.encode()!r})
            print("my warning", file=sys.stderr)
            os.write(2, b"E0000 00:00:1.5    1 op_kernel.cc:1857] OP_REQUIRES failed\\n")
            print("stdout is untouched")
        print("after", file=sys.stderr)
        raise SystemExit(os.environ["TF_CPP_MIN_LOG_LEVEL"])
        """
    )
    assert result.stdout == "stdout is untouched\n"
    assert result.stderr == (
        "my warning\nE0000 00:00:1.5    1 op_kernel.cc:1857] OP_REQUIRES failed\nafter\n2\n"
    )


@pytest.mark.slow  # sets KERAS_BACKEND=torch in its own process, from either pass
def test_doctor_on_torch_times_torch_s_kernels_and_imports_no_tensorflow():
    pytest.importorskip("torch")
    result = python(
        """
        import sys
        from kmix.cli import commands as cli
        status = cli.main(["doctor"])
        print("tensorflow imported:", "tensorflow" in sys.modules)
        raise SystemExit(status)
        """,
        env={**ENV, "KERAS_BACKEND": "torch", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    kernels = "torch's CPU kernels (eager), as Keras's torch backend runs them"
    assert f"\n  {kernels}; measured in " in out
    assert "oneDNN" not in out
    assert re.search(r"\n  matmul 128x512 @ 512x512, forward and backward: float32 .+ a call", out)
    assert "\nKeras backend: torch (KERAS_BACKEND=torch)\n" in out
    version = cli.package_versions(("torch",))["torch"]
    assert f"\n  torch        {version}\n" in out  # the versions table
    assert f"\n  torch: torch {version}\n" in out  # the backend section
    assert "hardware\n  devices: cpu\n" in out
    assert out.endswith("tensorflow imported: False\n")


@pytest.mark.slow
def test_doctor_prints_no_tensorflow_startup_lines():
    result = kmix("doctor", env=USER_ENV)
    assert (result.returncode, result.stderr) == (0, "")
    assert "versions\n" in result.stdout


# -------------------------------------------------------------------- doctor
def test_doctor(kmix_here, monkeypatch):
    monkeypatch.setattr(kmix_policy, "measure", lambda: XEON)  # hand-made: 400x float16
    monkeypatch.setattr(kmix_policy, "measure_in_subprocess", fail_to_measure)
    result = kmix_here("doctor")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("tensorflow", "keras", "tensorboard"):
        assert f"  {name} " in out
    assert "hardware\n  devices: " in out
    assert 'kmix.use("auto") would choose ' in out
    assert "(chosen from the hardware, not measured: kmix compare times each policy" in out
    section = "\n".join(f"  {line}" for line in _speed_probe.doctor_lines(XEON, None, "boom"))
    assert f"\nspeed on this CPU (each dtype's time for the same op)\n{section}\n" in out
    detected = hardware()
    if not detected.gpus and not detected.tpus:  # judged by the measurement
        assert "\nfloat16 here: no GPU or TPU was found, and on this CPU a float16 matmul " in out
    assert "\nKeras backend: tensorflow (KERAS_BACKEND" in out
    versions = cli.package_versions(("jax", "jaxlib"))
    for name, version in versions.items():
        assert f"  {name:<11}  {version or 'not installed'}\n" in out
    assert f"\n  kmix on JAX: {_cli_doctor.ON_JAX}\n" in out
    assert f"\n  kmix on torch: {_cli_doctor.ON_TORCH}\n" in out


def test_doctor_backend_section():
    jax = {"jax": "0.10.2", "jaxlib": "0.10.2"}
    on_jax = _cli_doctor.backend_section("jax", {"KERAS_BACKEND": "jax"}, jax)
    assert on_jax[:3] == [
        "Keras backend: jax (KERAS_BACKEND=jax)",
        "  JAX: jax 0.10.2, jaxlib 0.10.2",
        f"  kmix on JAX: {_cli_doctor.ON_JAX}",
    ]
    assert _cli_doctor.backend_section("tensorflow", {}, jax)[:2] == [
        "Keras backend: tensorflow (KERAS_BACKEND is not set)",
        "  JAX: jax 0.10.2, jaxlib 0.10.2 (KERAS_BACKEND=jax trains on it; kmix demo "
        "--backend jax shows it)",
    ]
    assert _cli_doctor.backend_section("tensorflow", {}, {"jax": None})[1] == (
        '  JAX: not installed (pip install ".[jax]" from the root of kmix\'s checkout, '
        "for KERAS_BACKEND=jax)"
    )
    torch = {"torch": "2.13.0+cpu"}
    assert _cli_doctor.backend_section("torch", {"KERAS_BACKEND": "torch"}, jax | torch) == [
        "Keras backend: torch (KERAS_BACKEND=torch)",
        "  JAX: jax 0.10.2, jaxlib 0.10.2 (KERAS_BACKEND=jax trains on it; kmix demo "
        "--backend jax shows it)",
        f"  kmix on JAX: {_cli_doctor.ON_JAX}",
        "  torch: torch 2.13.0+cpu",
        f"  kmix on torch: {_cli_doctor.ON_TORCH}",
    ]
    assert _cli_doctor.backend_section("tensorflow", {}, torch)[3] == (
        "  torch: torch 2.13.0+cpu (KERAS_BACKEND=torch trains on it; kmix demo --backend "
        "torch shows it)"
    )
    assert _cli_doctor.backend_section("tensorflow", {}, {"torch": None})[3] == (
        '  torch: not installed (pip install ".[torch]" from the root of kmix\'s checkout, '
        "for KERAS_BACKEND=torch)"
    )
    assert "not LoopDriver (it drives tf.distribute: TensorFlow only)" in _cli_doctor.ON_TORCH
    assert "kmix compare (from arrays), without TensorFlow" in _cli_doctor.ON_TORCH
    # What kmix runs on JAX, and what not: LoopDriver is tf.distribute's.
    assert "not LoopDriver (it drives tf.distribute: TensorFlow only)" in _cli_doctor.ON_JAX
    assert "LossScaleGuard, PrecisionAutopilot and kmix report" in _cli_doctor.ON_JAX


def fail_to_measure(*args, **kwargs):
    raise RuntimeError("boom")


@pytest.mark.slow
def test_doctor_measures_every_dtype_here_and_the_ratios_follow_from_the_times(kmix_here):
    result = kmix_here("doctor")
    assert result.returncode == 0, result.stderr
    section = result.stdout.split("speed on this CPU (each dtype's time for the same op)\n")[1]
    lines = [line[2:] for line in section.splitlines() if line.startswith("  ")]
    assert re.fullmatch(r"oneDNN CPU kernels: (on|off) \(TF_ENABLE_ONEDNN_OPTS .*\); .*", lines[0])
    times = {}
    for op in ("matmul", "conv2d"):
        line = next(line for line in lines if line.startswith(f"{op} "))
        found = re.findall(r"(float32|float16|bfloat16) ([0-9.]+) (ms|s)", line)
        times[op] = {d: float(v) * (1e-3 if u == "ms" else 1) for d, v, u in found}
    ratios = re.findall(r"^  (b?float16) (matmul|conv2d): ([0-9.]+)x", section, re.M)
    assert len(ratios) == sum(len(dtypes) - 1 for dtypes in times.values() if "float32" in dtypes)
    for dtype, op, ratio in ratios:  # times and ratios printed to 3 digits
        assert float(ratio) == pytest.approx(times[op][dtype] / times[op]["float32"], rel=0.02)
    assert "about 2x" not in result.stdout


GOOD = {"tensorflow": "2.21.0", "keras": "3.15.1", "tensorboard": "2.21.0", "tf-keras": None}


def test_version_warnings_good_combination():
    assert cli.version_warnings(GOOD, {}, ["keras>=3.12.0", "numpy>=1.26"], "tensorflow") == []
    on_jax = GOOD | {"jax": "0.10.2", "jaxlib": "0.10.2"}
    assert cli.version_warnings(on_jax, {"KERAS_BACKEND": "jax"}, ["keras>=3.12.0"], "jax") == []
    on_torch = GOOD | {"torch": "2.13.0+cpu"}
    assert cli.version_warnings(on_torch, {}, ["keras>=3.12.0"], "torch") == []


@pytest.mark.parametrize(
    ("changes", "environ", "says"),
    [
        ({"tensorflow": None}, {}, "TensorFlow is not installed"),
        ({"tensorflow": "2.15.1"}, {}, "TensorFlow 2.15.1 is older than 2.16"),
        ({"keras": None}, {}, "Keras is not installed"),
        ({"keras": "2.15.0"}, {}, "Keras 2.15.0 is Keras 2"),
        ({"keras": "3.3.3"}, {}, "Keras 3.3.3 is older than 3.8"),
        ({"keras": "3.10.0"}, {}, "TensorFlow 2.21.0 expects keras>=3.12.0 but Keras 3.10.0"),
        ({"tf-keras": "2.21.0"}, {"TF_USE_LEGACY_KERAS": "1"}, "TF_USE_LEGACY_KERAS is set"),
        ({}, {"KERAS_BACKEND": "openvino"}, "the Keras backend is 'openvino': kmix.LossScale"),
        ({"torch": None}, {"KERAS_BACKEND": "torch"}, "the Keras backend is 'torch' but torch is"),
        ({"jax": None}, {"KERAS_BACKEND": "jax"}, "the Keras backend is 'jax' but JAX is not"),
        ({"tensorboard": None}, {}, "TensorBoard is not installed"),
        ({"tensorboard": "1.15.0"}, {}, "TensorBoard 1.15.0 is too old for TensorFlow 2.21.0"),
    ],
)
def test_version_warnings_known_bad(changes, environ, says):
    found = cli.version_warnings(GOOD | changes, environ, ["keras>=3.12.0"])
    assert any(says in warning for warning in found), found


def test_version_warnings_one_per_rule_in_table_order():
    versions = {"tensorflow": "2.15.1", "keras": "3.3.3", "tensorboard": None, "tf-keras": "2.15"}
    found = cli.version_warnings(
        versions, {"TF_USE_LEGACY_KERAS": "true", "KERAS_BACKEND": "openvino"}, ["keras>=3.12"]
    )
    assert found == [
        "TensorFlow 2.15.1 is older than 2.16 and uses Keras 2 (tf.keras); kmix needs "
        "TensorFlow >= 2.16 with Keras 3 (pip install -U 'tensorflow>=2.16')",
        "Keras 3.3.3 is older than 3.8, which kmix needs (pip install -U keras)",
        "TensorFlow 2.15.1 expects keras>=3.12 but Keras 3.3.3 is installed "
        "(pip install 'keras>=3.12')",
        "TF_USE_LEGACY_KERAS is set, so tf.keras is Keras 2 (tf-keras 2.15): models built "
        "with tf.keras do not work with kmix; use `import keras` (Keras 3) or unset "
        "TF_USE_LEGACY_KERAS",
        "the Keras backend is 'openvino': kmix.LossScaleOptimizer and the callbacks need "
        "'tensorflow', 'jax' or 'torch' (set KERAS_BACKEND to one of them)",
        "TensorBoard is not installed: MixedPrecisionMonitor and kmix report need it "
        "(pip install tensorboard)",
    ]


# ---------------------------------------------------------------------- demo
def test_shipped_digits():
    images, labels = demo.load_digits()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8
    assert labels.shape == (1797,) and labels.dtype == np.uint8
    assert images.max() == 16
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    (x_train, y_train), (x_test, y_test) = demo.split(images, labels)
    assert x_train.shape == (1497, 8, 8, 1) and x_test.shape == (300, 8, 8, 1)
    assert x_train.dtype == np.float32 and x_train.max() == 1.0
    assert set(y_test.tolist()) == set(range(10))


def test_demo_introduction_says_what_it_runs():
    assert demo._introduction("runs/x", 1, "mixed_float16") == (
        "kmix demo: 1 epoch on the 8x8 digits, policy mixed_float16. The loss scale starts at "
        "2^24, too high for float16 on purpose: the first float16 steps overflow and back off. "
        "Logs in runs/x"
    )
    assert demo._introduction("d", 10, "float32").startswith("kmix demo: 10 epochs on the")


def test_demo_introduction_without_float16_promises_no_overflow():
    assert demo._introduction("d", 1, "float32") == (
        "kmix demo: 1 epoch on the 8x8 digits, policy float32. It computes in float32, whose "
        "range reaches 3.4e38 (float16's ends at 65504), so it needs no loss scaling: the loss "
        "scale starts at 2^24 as in the float16 demo, whose first steps overflow on purpose, and "
        "float16's headroom and underflow are not measured (--policy mixed_float16 shows the "
        "overflow). Logs in d"
    )
    for policy, dtype in [("mixed_bfloat16", "bfloat16"), ("bfloat16", "bfloat16")]:
        line = demo._introduction("d", 1, policy)
        assert f"policy {policy}. It computes in {dtype}, whose range reaches 3.4e38" in line
    assert "range reaches 1.8e308" in demo._introduction("d", 1, "float64")
    assert "too high for float16 on purpose: the first float16 steps overflow" in (
        demo._introduction("d", 1, "float16")
    )
    assert demo._introduction("d", 1, "mixed_bfloat16", auto=True).startswith(
        "kmix demo: 1 epoch on the 8x8 digits, policy mixed_bfloat16 (chosen by --policy auto). "
        "It computes in bfloat16"
    )


@pytest.mark.parametrize(
    ("detected", "chosen", "float16"),
    [
        (Hardware(cpu_flags=("avx512_bf16",)), "mixed_bfloat16", False),
        (Hardware(), "float32", False),
        (Hardware(gpus=(GPU("GPU:0", "V100", (7, 0)),)), "mixed_float16", True),
    ],
    ids=["bfloat16-cpu", "plain-cpu", "v100"],
)
def test_demo_main_names_the_policy_auto_chose(capsys, monkeypatch, detected, chosen, float16):
    calls = []

    def fake_run(logdir, epochs, policy, **options):
        calls.append((logdir, epochs, policy, options))
        return demo.DemoResult(
            logdir=logdir,
            policy=f"{chosen}: the reason",
            mixed_accuracy=0.9,
            float32_accuracy=0.8,
            guard_diagnosis=None,
            summary=None,
            plots=[],
            seconds=1.0,
        )

    monkeypatch.setattr(demo, "run", fake_run)
    monkeypatch.setattr(report, "format_summary", lambda summary: "the report")
    assert demo.main("runs/x", 2, "auto", detected=detected) == 0
    assert calls == [("runs/x", 2, "auto", {"overwrite": False, "detected": detected})]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        f"kmix demo: 2 epochs on the 8x8 digits, policy {chosen} (chosen by --policy auto), "
        f"Keras backend {keras.backend.backend()}."
    )
    assert ("the first float16 steps overflow" in lines[0]) == float16
    assert ("needs no loss scaling" in lines[0]) == (not float16)
    assert f"policy: {chosen}: the reason" in lines
    assert f"test accuracy, {chosen} with kmix: 0.9000" in lines
    assert not any("auto with kmix" in line for line in lines)


@pytest.mark.slow
def test_demo_without_float16_warns_of_nothing(tmp_path):
    # The monitor's note that float16's statistics do not apply is in the demo's own
    # introduction and report; as a warning it reached the user as a raw
    # "UserWarning: ... sys.exit(main())" line.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = demo.run(
            str(tmp_path / "demo"), 1, "float32", train_limit=64, compare_float32=False, verbose=0
        )
    assert [str(w.message) for w in caught if "not float16" in str(w.message)] == []
    assert "The model computes in float32, not float16" in report.format_summary(result.summary)


@pytest.mark.slow
def test_unlogged_training_takes_the_same_steps():
    data = demo.split(*demo.load_digits(), train_limit=100)  # 4 steps, the last one short
    runs = [
        demo._train(
            "float32", data, epochs=2, seed=3, callbacks=[], scaled=False, verbose=0, logged=logged
        )
        for logged in (True, False)
    ]
    assert runs[0].policy == runs[1].policy
    assert runs[0].accuracy == runs[1].accuracy
    assert int(runs[1].model.optimizer.iterations.numpy()) == 8
    for logged, unlogged in zip(runs[0].model.weights, runs[1].model.weights, strict=True):
        np.testing.assert_allclose(logged.numpy(), unlogged.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_demo_run_small(tmp_path):
    before = keras.config.dtype_policy().name
    logdir = str(tmp_path / "demo")
    # 320 images, 5 epochs: 50 steps; exponent histograms at steps 25 and 50.
    result = demo.run(logdir, epochs=5, train_limit=320, verbose=0)
    assert keras.config.dtype_policy().name == before
    assert result.policy.startswith("mixed_float16: ")
    assert result.float32_accuracy is not None  # the float32 comparison ran
    summary = result.summary.to_dict()
    assert summary["steps_seen"] == 50
    first = summary["events"][0]
    assert (first["step"], first["kind"], first["old_scale"]) == (1, "backoff", 2.0**24)
    assert summary["loss_scale"]["initial"] == 2.0**24
    assert summary["loss_scale"]["final"] < 2.0**24
    assert summary["skipped_steps"] >= 1
    assert set(summary["trends"]) == {"overflow_headroom_bits", "underflow_fraction", "grad_norm"}
    # Health every 10 steps (5 reads), and at every skipped step that is not a read step.
    skips = {e["step"] for e in summary["events"] if e["kind"] in tags.SKIP_KINDS}
    expected_points = 5 + len(skips - {10, 20, 30, 40, 50})
    trends = summary["trends"]
    assert (
        trends["grad_norm"]["points"] == trends["underflow_fraction"]["points"] == expected_points
    )
    # No headroom at a skipped step whose non-zero gradients were all inf/NaN.
    assert 5 <= trends["overflow_headroom_bits"]["points"] <= expected_points
    assert {shares["step"] for shares in summary["gradient_exponents"].values()} == {50}
    assert any(f["rule"] == "overflow_episode" for f in summary["findings"])
    assert result.plots == [os.path.join(logdir, "report", name) for name in report.PLOT_FILES]
    assert result.guard_diagnosis is None


@pytest.mark.slow
def test_demo_command_at_its_defaults(tmp_path):
    """The README's `kmix demo`, run as a user runs it, once for every check of its output.

    It trains a healthy model: early training lowers the activations' headroom for ~100
    steps before it levels off at ~12 bits, which is no overflow to come, so it warns of
    nothing.
    """
    logdir = str(tmp_path / "demo")
    result = kmix("demo", "--logdir", logdir, timeout=300, env=USER_ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr == ""  # no warnings: no guard forecast, no TensorFlow start-up lines
    out = result.stdout
    assert out.startswith(
        "kmix demo: 10 epochs on the 8x8 digits, policy mixed_float16, Keras backend tensorflow."
    )
    assert "47/47" in out  # the progress bar: 1,497 images in batches of 32
    assert "test accuracy, mixed_float16 with kmix: " in out
    assert "test accuracy, same model in float32: " in out
    assert "  backoff at step 1: loss scale 16777216 → 8388608" in out
    assert f"TensorBoard: tensorboard --logdir {logdir}" in out
    assert "falling steadily" not in out
    assert re.search(r"  - no problems found; \d+ notes? for information follows?\n", out)
    assert not report.summarize(report.read_log(logdir)).forecasts
    for name in report.PLOT_FILES:
        assert_png(os.path.join(logdir, "report", name))
    # The logs it wrote are what `kmix report` reads.
    assert kmix("report", logdir, "--no-plots").returncode == 0
    # Its run is marked and lists every file it wrote; a second run must be asked for.
    assert demo.read_marker(logdir) == [
        name for name in demo.files_under(logdir) if name != demo.MARKER
    ]
    assert len(demo.read_marker(logdir)) == 7  # 4 plots, 2 train and 1 validation event files
    line = one_line_error(kmix("demo", "--logdir", logdir))
    assert line.startswith(f"kmix demo: --logdir {logdir} holds a previous kmix demo run")
