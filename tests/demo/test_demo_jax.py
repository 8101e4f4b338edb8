"""``kmix demo --backend jax``: choosing the backend, and the demo on JAX.

Fast tier: ``--backend`` and its default, the one-line errors (JAX missing is simulated),
what the command does per backend, and the TensorFlow-free epoch scalars, in this process
(whose Keras is already imported, with its own backend). Slow tier
(``@pytest.mark.slow``): the demo on JAX in a fresh process, as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import pytest
from test_cli import Ran, keep_keras_backend, one_line_error
from test_report import assert_png

import kmix.demo as kmix_demo
import kmix.policy as kmix_policy
from kmix import report
from kmix.cli import commands as cli
from kmix.demo import scalars as _demo_scalars
from kmix.demo import train as demo

HERE = keras.backend.backend()
OTHER = "jax" if HERE == "tensorflow" else "tensorflow"


@pytest.fixture
def kmix_here(capsys, monkeypatch):
    """Runs ``kmix ARGS`` in this process (``cli.main``) and returns a :class:`Ran`."""
    keep_keras_backend(monkeypatch)

    def run(*args: str) -> Ran:
        capsys.readouterr()
        try:
            status = cli.main(list(args))
        except SystemExit as exit:  # argparse: bad arguments
            status = exit.code
        out, err = capsys.readouterr()
        return Ran(status, out, err)

    return run


@pytest.fixture
def fake_demo(monkeypatch):
    """Replaces the demo's training and the oneDNN check; returns what each was called with."""
    calls: dict[str, list] = {"main": [], "onednn": []}

    def fake_main(**arguments):
        calls["main"].append(arguments | {"KERAS_BACKEND": os.environ.get("KERAS_BACKEND")})
        return 0

    monkeypatch.setattr(kmix_demo, "main", fake_main)  # what the command calls
    monkeypatch.setattr(kmix_policy, "avoid_slow_float16_path", calls["onednn"].append)
    return calls


# ------------------------------------------------------------ choosing the backend
@pytest.mark.parametrize(
    ("requested", "environ", "chosen"),
    [
        (None, {}, "tensorflow"),
        (None, {"KERAS_BACKEND": ""}, "tensorflow"),  # empty is unset, as for Keras
        (None, {"KERAS_BACKEND": "jax"}, "jax"),
        (None, {"KERAS_BACKEND": "tensorflow"}, "tensorflow"),
        ("tensorflow", {"KERAS_BACKEND": "jax"}, "tensorflow"),  # the flag wins
        ("jax", {}, "jax"),
    ],
)
def test_backend_is_the_flag_else_keras_backend_else_tensorflow(
    monkeypatch, requested, environ, chosen
):
    monkeypatch.setattr(cli, "loaded_backend", lambda: None)  # a fresh process
    monkeypatch.setattr(cli, "jax_installed", lambda: True)
    assert cli.choose_backend(requested, environ) == chosen


def test_backend_flag_accepts_tensorflow_jax_and_torch_only(kmix_here):
    result = kmix_here("demo", "--backend", "openvino")
    assert result.returncode == 2
    assert "argument --backend: invalid choice: 'openvino' (choose from" in result.stderr
    help_text = cli.build_parser().commands["demo"].format_help()
    assert "{tensorflow,jax,torch}" in help_text
    assert "KERAS_BACKEND if set, else tensorflow" in " ".join(help_text.split())


def test_keras_backend_naming_another_backend_is_a_one_line_error(kmix_here, monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_BACKEND", "openvino")
    logdir = tmp_path / "run"
    line = one_line_error(kmix_here("demo", "--logdir", str(logdir)))
    assert line == (
        "kmix demo: KERAS_BACKEND=openvino is not a backend the demo trains on: use "
        "--backend tensorflow, --backend jax or --backend torch"
    )
    assert not logdir.exists()


@pytest.mark.parametrize(
    ("args", "environ", "says"),
    [
        (["--backend", "jax"], {}, "--backend jax needs JAX"),
        ([], {"KERAS_BACKEND": "jax"}, "--backend jax (from KERAS_BACKEND) needs JAX"),
    ],
    ids=["flag", "environment"],
)
def test_jax_not_installed_is_a_one_line_error(
    kmix_here, monkeypatch, tmp_path, args, environ, says
):
    monkeypatch.setattr(cli, "jax_installed", lambda: False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    logdir = tmp_path / "run"
    line = one_line_error(kmix_here("demo", "--logdir", str(logdir), *args))
    assert line == (
        f'kmix demo: {says}, which is not installed: pip install ".[jax]" from the root of '
        "kmix's checkout, or use --backend tensorflow"
    )
    assert not logdir.exists()  # refused before anything was written


def test_jax_installed_looks_up_jax_and_jaxlib(monkeypatch):
    import importlib.util

    found = {"jax": object(), "jaxlib": object()}
    monkeypatch.setattr(importlib.util, "find_spec", found.get)
    assert cli.jax_installed()
    del found["jaxlib"]
    assert not cli.jax_installed()


def test_keras_imported_with_another_backend_is_a_one_line_error(kmix_here, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "jax_installed", lambda: True)
    assert cli.loaded_backend() == HERE  # this process imported Keras
    logdir = tmp_path / "run"
    line = one_line_error(kmix_here("demo", "--logdir", str(logdir), "--backend", OTHER))
    assert line == (
        f"kmix demo: --backend {OTHER}: Keras is already imported in this process with the "
        f"{HERE} backend, which it keeps until the process ends; run "
        f"`kmix demo --backend {OTHER}` in a new process"
    )
    assert not logdir.exists()


def test_on_jax_the_command_sets_keras_backend_and_skips_the_onednn_check(
    kmix_here, monkeypatch, tmp_path, fake_demo
):
    monkeypatch.setattr(cli, "loaded_backend", lambda: None)  # as in a fresh process
    monkeypatch.setattr(cli, "jax_installed", lambda: True)
    logdir = str(tmp_path / "run")
    assert kmix_here("demo", "--logdir", logdir, "--backend", "jax") == Ran(0, "", "")
    assert fake_demo["main"] == [
        {
            "logdir": logdir,
            "epochs": 10,
            "policy": "mixed_float16",
            "overwrite": False,
            "KERAS_BACKEND": "jax",  # set before the demo imports Keras
        }
    ]
    assert fake_demo["onednn"] == []  # oneDNN's float16 check is TensorFlow's


def test_on_tensorflow_the_command_checks_onednn_first(kmix_here, monkeypatch, tmp_path, fake_demo):
    monkeypatch.setattr(cli, "loaded_backend", lambda: None)
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    logdir = str(tmp_path / "run")
    assert kmix_here("demo", "--logdir", logdir, "--policy", "float16").returncode == 0
    assert fake_demo["onednn"] == ["float16"]
    assert fake_demo["main"][0]["KERAS_BACKEND"] == "tensorflow"  # the default, made explicit


# ------------------------------------------------------- the demo's JAX pieces
def read_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``folder``, read back through TensorBoard's own reader."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    reader = event_accumulator.EventAccumulator(folder, size_guidance={"tensors": 0})
    reader.Reload()
    return {
        tag: [
            (e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in reader.Tensors(tag)
        ]
        for tag in reader.Tags()["tensors"]
    }


def test_epoch_scalars_are_the_tags_keras_tensorboard_writes(tmp_path):
    callback = _demo_scalars.EpochScalars(str(tmp_path))
    callback.on_epoch_end(0, {"loss": 2.5, "accuracy": 0.25, "val_loss": 2.0, "val_accuracy": 0.5})
    callback.on_epoch_end(1, {"loss": 1.5, "accuracy": 0.5, "val_loss": 1.0, "val_accuracy": 0.75})
    callback.on_train_end()
    assert read_scalars(str(tmp_path / "train")) == {
        "epoch_loss": [(0, 2.5), (1, 1.5)],
        "epoch_accuracy": [(0, 0.25), (1, 0.5)],
    }
    assert read_scalars(str(tmp_path / "validation")) == {
        "epoch_loss": [(0, 2.0), (1, 1.0)],
        "epoch_accuracy": [(0, 0.5), (1, 0.75)],
    }


def test_tensorboard_callback_is_keras_own_on_tensorflow(tmp_path):
    callback = _demo_scalars.tensorboard_callback(str(tmp_path))
    expected = keras.callbacks.TensorBoard if HERE == "tensorflow" else _demo_scalars.EpochScalars
    assert type(callback) is expected


# --------------------------------------------------------- slow: a fresh process
WATCHED = textwrap.dedent(
    """
    import json, sys, traceback

    stacks = []


    class Watch:  # notes who imports TensorFlow, and imports nothing itself
        def find_spec(self, name, path=None, target=None):
            if name == "tensorflow":
                frames = traceback.extract_stack()[:-1]
                stacks.append([f"{f.filename}:{f.lineno}" for f in frames if "kmix" in f.filename])
            return None


    sys.meta_path.insert(0, Watch())
    from kmix.cli import commands as cli

    status = cli.main(sys.argv[2:])
    facts = {"tensorflow": "tensorflow" in sys.modules, "jax": "jax" in sys.modules}
    with open(sys.argv[1], "w") as file:
        json.dump(facts | {"status": status, "stacks": stacks}, file)
    sys.exit(status)
    """
)


def demo_in_a_fresh_process(folder, backend: str, **environ: str) -> tuple:
    """``kmix demo --backend BACKEND --epochs 1`` in a fresh process, KERAS_BACKEND unset.

    Returns:
        ``(done, logdir, facts)``: the finished process, its log folder, and what it
        imported (``tensorflow``, ``jax``, and the kmix frames that imported TensorFlow).
    """
    logdir, facts = str(folder / "demo"), str(folder / "facts.json")
    env = {
        k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL")
    }
    done = subprocess.run(
        [sys.executable, "-c", WATCHED, facts, "demo", "--backend", backend, "--epochs", "1"]
        + ["--logdir", logdir],
        capture_output=True,
        text=True,
        env=env | environ,
        timeout=600,
        check=False,
    )
    try:
        with open(facts, encoding="utf-8") as file:
            return done, logdir, json.load(file)
    except FileNotFoundError:  # it failed before the end: the tests show its stderr
        return done, logdir, {"tensorflow": None, "jax": None, "stacks": []}


def assert_the_demo_finished_with_its_report(done, logdir: str, backend: str) -> None:
    """The demo's lines on ``backend``, its report's figures and plots, and its marker."""
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.startswith(
        f"kmix demo: 1 epoch on the 8x8 digits, policy mixed_float16, Keras backend {backend}."
    )
    assert "oneDNN" not in out  # TensorFlow's kernels are not what the backend runs
    assert "test accuracy, mixed_float16 with kmix: " in out
    assert "test accuracy, same model in float32: " in out
    assert "  backoff at step 1: loss scale 16777216 → 8388608" in out
    summary = report.summarize(report.read_log(logdir))
    assert summary.steps_seen == 47
    assert set(summary.trends) >= {"overflow_headroom_bits", "underflow_fraction", "grad_norm"}
    for name in report.PLOT_FILES:
        assert_png(os.path.join(logdir, "report", name))
    assert [tag for tag, _ in sorted(read_scalars(os.path.join(logdir, "validation")).items())] == [
        "epoch_accuracy",
        "epoch_loss",
    ]
    assert demo.read_marker(logdir) == [n for n in demo.files_under(logdir) if n != demo.MARKER]


@pytest.fixture(scope="module")
def jax_demo(tmp_path_factory):
    """``kmix demo --backend jax --epochs 1`` in a fresh process, KERAS_BACKEND unset."""
    pytest.importorskip("jax")
    return demo_in_a_fresh_process(tmp_path_factory.mktemp("jax_demo"), "jax")


@pytest.mark.slow
def test_demo_on_jax_finishes_and_writes_the_report(jax_demo):
    done, logdir, facts = jax_demo
    assert_the_demo_finished_with_its_report(done, logdir, "jax")
    assert facts["jax"]


@pytest.mark.slow
def test_demo_on_jax_imports_no_tensorflow(jax_demo):
    """Neither the demo nor kmix (hardware detection, kmix.use's float16 probe) imports it.

    Keras's ``set_random_seed`` and ``TensorBoard`` callback import TensorFlow on every
    backend; the demo does without both on JAX (``kmix/demo/scalars.py``,
    ``kmix.backend.set_random_seed``).
    """
    done, _, facts = jax_demo
    assert done.returncode == 0, done.stderr[-2000:]
    assert not facts["tensorflow"], f"imported from: {facts['stacks'][:1]}"
