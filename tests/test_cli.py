"""The ``kmix`` command, run as a user runs it: a subprocess, its exit status and output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
from test_report import assert_png, write_run

from kmix import cli, demo, report, tags

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def kmix(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``python -m kmix.cli ARGS`` and returns the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "kmix.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        check=False,
    )


def python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs a Python snippet in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
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
def test_help_does_not_import_tensorflow():
    result = python(
        """
        import contextlib, io, sys
        from kmix import cli
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                cli.main(["--help"])
            except SystemExit as exit:
                code = exit.code
        print(code, "tensorflow" in sys.modules, "keras" in sys.modules, "demo" in out.getvalue())
        """
    )
    assert result.stdout.split() == ["0", "False", "False", "True"], result.stderr


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
def test_subcommand_help(command):
    result = kmix(command, "--help")
    assert result.returncode == 0
    assert f"usage: kmix {command}" in result.stdout


def test_version():
    result = kmix("--version")
    assert (result.returncode, result.stdout.strip()) == (0, "kmix 0.1.0")


def test_no_command_prints_usage_and_exits_2():
    result = kmix()
    assert result.returncode == 2
    assert "usage: kmix" in result.stderr


# -------------------------------------------------------------------- report
def test_report_prints_the_summary_and_writes_plots(run_dir):
    result = kmix("report", run_dir)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"kmix report: {os.path.join(run_dir, tags.TRAIN_DIR)}" in out
    assert "steps seen      100" in out
    assert "skipped steps   4 of 100 (4.00%)" in out
    assert "first non-finite: dense_2/kernel (3 variables)" in out
    assert (
        "! 37% of gradient elements in dense_2/kernel sit below float16's smallest normal"
    ) in out
    for name in report.PLOT_FILES:
        path = os.path.join(run_dir, "report", name)
        assert f"plot: {path}" in out
        assert_png(path)


def test_report_does_not_import_tensorflow(run_dir):
    result = python(
        f"""
        import sys
        from kmix import cli
        code = cli.main(["report", {run_dir!r}, "--no-plots"])
        print("status", code, "tensorflow" in sys.modules, "keras" in sys.modules)
        """
    )
    assert result.stdout.splitlines()[-1] == "status 0 False False", result.stderr


def test_report_json_is_the_summary(run_dir, tmp_path):
    out = str(tmp_path / "pngs")
    result = kmix("report", run_dir, "--json", "--out", out)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    expected = report.summarize(report.read_log(run_dir)).to_dict()
    expected["plots"] = [os.path.join(out, name) for name in report.PLOT_FILES]
    assert printed == expected
    for path in expected["plots"]:
        assert_png(path)


def test_report_no_plots(run_dir):
    result = kmix("report", run_dir, "--no-plots")
    assert result.returncode == 0
    assert "plot:" not in result.stdout
    assert not os.path.exists(os.path.join(run_dir, "report"))


def test_report_without_matplotlib_still_prints_the_summary(run_dir):
    result = python(
        f"""
        import sys
        sys.modules["matplotlib"] = None  # makes `import matplotlib...` fail
        from kmix import cli
        sys.exit(cli.main(["report", {run_dir!r}]))
        """
    )
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
def test_report_bad_log_dir(tmp_path, make, says):
    path = tmp_path / "logs"
    make(path)
    line = one_line_error(kmix("report", str(path)))
    assert line.startswith("kmix report: ")
    assert says in line
    assert str(path) in line
    assert "expected" in line and "MixedPrecisionMonitor" in line


def test_report_out_is_a_file(run_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(kmix("report", run_dir, "--out", str(blocker)))
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
def test_bad_arguments_exit_2(args, says):
    result = kmix(*args)
    assert result.returncode == 2
    assert says in result.stderr.strip().splitlines()[-1]


def test_demo_logdir_is_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(kmix("demo", "--logdir", str(blocker)))
    assert (
        line
        == f"kmix demo: --logdir {blocker} is a file: expected a directory (created if missing)"
    )


# -------------------------------------------------------------------- doctor
def test_doctor(tmp_path):
    result = kmix("doctor")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("tensorflow", "keras", "tensorboard"):
        assert f"  {name} " in out
    assert "hardware\n  devices: " in out
    assert 'kmix.use("auto") would choose ' in out
    assert "Keras backend: tensorflow" in out


GOOD = {"tensorflow": "2.21.0", "keras": "3.15.1", "tensorboard": "2.21.0", "tf-keras": None}


def test_version_warnings_good_combination():
    assert cli.version_warnings(GOOD, {}, ["keras>=3.12.0", "numpy>=1.26"], "tensorflow") == []


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
        ({}, {"KERAS_BACKEND": "jax"}, "the Keras backend is 'jax'"),
        ({"tensorboard": None}, {}, "TensorBoard is not installed"),
    ],
)
def test_version_warnings_known_bad(changes, environ, says):
    found = cli.version_warnings(GOOD | changes, environ, ["keras>=3.12.0"])
    assert any(says in warning for warning in found), found


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


def test_clear_previous_run(tmp_path):
    for sub in (tags.TRAIN_DIR, "validation"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "events.out.tfevents.1.host").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("kept")
    assert demo.clear_previous_run(str(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["notes.txt"]


def test_demo_run_small(tmp_path):
    before = keras.config.dtype_policy().name
    logdir = str(tmp_path / "demo")
    # 320 images, 5 epochs: 50 steps; exponent histograms at steps 25 and 50.
    result = demo.run(logdir, epochs=5, train_limit=320, verbose=0)
    assert keras.config.dtype_policy().name == before
    assert result.policy.startswith("mixed_float16: ")
    assert 0.0 <= result.mixed_accuracy <= 1.0 and 0.0 <= result.float32_accuracy <= 1.0
    summary = result.summary.to_dict()
    assert summary["steps_seen"] == 50
    first = summary["events"][0]
    assert (first["step"], first["kind"], first["old_scale"]) == (1, "backoff", 2.0**24)
    assert summary["loss_scale"]["initial"] == 2.0**24
    assert summary["loss_scale"]["final"] < 2.0**24
    assert summary["skipped_steps"] >= 1
    assert set(summary["trends"]) == {"overflow_headroom_bits", "underflow_fraction", "grad_norm"}
    assert all(trend["points"] == 5 for trend in summary["trends"].values())
    assert {shares["step"] for shares in summary["gradient_exponents"].values()} == {50}
    assert any(f["rule"] == "overflow_episode" for f in summary["findings"])
    assert result.plots == [os.path.join(logdir, "report", name) for name in report.PLOT_FILES]
    assert result.guard_diagnosis is None


def test_demo_command_one_epoch(tmp_path):
    logdir = str(tmp_path / "demo")
    result = kmix("demo", "--epochs", "1", "--logdir", logdir, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "47/47" in out  # the progress bar: 1,497 images in batches of 32
    assert "test accuracy, mixed_float16 with kmix: " in out
    assert "test accuracy, same model in float32: " in out
    assert "  step       1  backoff           16777216 (2^24) -> 8388608 (2^23)" in out
    assert f"TensorBoard: tensorboard --logdir {logdir}" in out
    for name in report.PLOT_FILES:
        assert_png(os.path.join(logdir, "report", name))
    # The logs it wrote are what `kmix report` reads.
    assert kmix("report", logdir, "--no-plots").returncode == 0
