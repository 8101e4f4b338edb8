"""``kmix demo --backend torch``: choosing the backend, and the demo on torch.

Fast tier: ``--backend torch`` and ``KERAS_BACKEND=torch``, the one-line error when torch
is missing (simulated), what the command does on torch, the demo's pieces that differ
there (one step a call where Keras's trainer allows no more; the step-time line saying
so). Slow tier (``@pytest.mark.slow``): the demo on torch in a fresh process, as a user
runs it, importing no TensorFlow (as ``tests/demo/test_demo_jax.py`` does for JAX).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from test_cli import Ran, one_line_error
from test_demo_jax import (
    assert_the_demo_finished_with_its_report,
    demo_in_a_fresh_process,
    fake_demo,
    kmix_here,
)

from kmix.cli import commands as cli
from kmix.demo import steps as demo_steps
from kmix.demo import train as demo
from kmix.policy import demo_check

__all__ = ["fake_demo", "kmix_here"]  # fixtures, used by name

HERE = keras.backend.backend()


# ------------------------------------------------------------ choosing the backend
@pytest.mark.parametrize(
    ("requested", "environ"),
    [("torch", {}), (None, {"KERAS_BACKEND": "torch"}), ("torch", {"KERAS_BACKEND": "jax"})],
)
def test_torch_is_chosen_by_the_flag_or_keras_backend(monkeypatch, requested, environ):
    monkeypatch.setattr(cli, "loaded_backend", lambda: None)  # a fresh process
    monkeypatch.setattr(cli, "torch_installed", lambda: True)
    assert cli.choose_backend(requested, environ) == "torch"


@pytest.mark.parametrize(
    ("args", "environ", "says"),
    [
        (["--backend", "torch"], {}, "--backend torch needs torch"),
        ([], {"KERAS_BACKEND": "torch"}, "--backend torch (from KERAS_BACKEND) needs torch"),
    ],
    ids=["flag", "environment"],
)
def test_torch_not_installed_is_a_one_line_error(
    kmix_here, monkeypatch, tmp_path, args, environ, says
):
    monkeypatch.setattr(cli, "torch_installed", lambda: False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    logdir = tmp_path / "run"
    line = one_line_error(kmix_here("demo", "--logdir", str(logdir), *args))
    assert line == (
        f'kmix demo: {says}, which is not installed: pip install ".[torch]" from the root of '
        "kmix's checkout, or use --backend tensorflow"
    )
    assert not logdir.exists()  # refused before anything was written


def test_torch_installed_looks_up_torch(monkeypatch):
    import importlib.util

    found = {"torch": object()}
    monkeypatch.setattr(importlib.util, "find_spec", found.get)
    assert cli.torch_installed()
    del found["torch"]
    assert not cli.torch_installed()


def test_on_torch_the_command_sets_keras_backend_and_skips_the_onednn_check(
    kmix_here, monkeypatch, tmp_path, fake_demo
):
    monkeypatch.setattr(cli, "loaded_backend", lambda: None)  # as in a fresh process
    monkeypatch.setattr(cli, "torch_installed", lambda: True)
    logdir = str(tmp_path / "run")
    assert kmix_here("demo", "--logdir", logdir, "--backend", "torch") == Ran(0, "", "")
    assert fake_demo["main"] == [
        {
            "logdir": logdir,
            "epochs": 10,
            "policy": "mixed_float16",
            "overwrite": False,
            "KERAS_BACKEND": "torch",  # set before the demo imports Keras
        }
    ]
    assert fake_demo["onednn"] == []  # oneDNN's float16 check is TensorFlow's


def test_keras_imported_on_another_backend_refuses_torch(kmix_here, monkeypatch, tmp_path):
    if HERE == "torch":
        pytest.skip("this process's Keras is on torch")
    monkeypatch.setattr(cli, "torch_installed", lambda: True)
    line = one_line_error(kmix_here("demo", "--logdir", str(tmp_path / "r"), "--backend", "torch"))
    assert line.startswith(
        f"kmix demo: --backend torch: Keras is already imported in this process with the {HERE} "
        "backend"
    )


# ------------------------------------------------------- the demo's torch pieces
class Refusing:
    """A model whose trainer refuses ``steps_per_execution > 1``, as Keras's torch one does."""

    def __init__(self):
        self.compiled: list[int] = []

    def compile(self, *, steps_per_execution, **kwargs):
        self.compiled.append(steps_per_execution)

    def make_train_function(self):
        if self.compiled[-1] > 1:
            raise ValueError("`steps_per_execution` must be 1 with the PyTorch backend.")


def test_compile_model_takes_one_step_a_call_where_the_trainer_refuses_more():
    refusing = Refusing()
    demo_steps.compile_model(refusing, "adam", 47)
    assert refusing.compiled == [47, 1]
    one = Refusing()
    demo_steps.compile_model(one, "adam", 1)  # one step a call: nothing to ask
    assert one.compiled == [1]


@pytest.mark.torch
def test_compile_model_keeps_steps_per_execution_where_keras_runs_it():
    model = demo.build_model()
    demo_steps.compile_model(model, keras.optimizers.Adam(), 4)
    expected = 1 if HERE == "torch" else 4  # Keras's torch trainer runs one step a call
    assert model.steps_per_execution == expected
    x, y = np.zeros((8, 8, 8, 1), "float32"), np.zeros((8,), "int32")
    clock = demo_steps.StepClock()
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, callbacks=[clock])
    assert clock.steps_a_call == expected
    assert len(clock.per_step) == 8 // expected - 1  # the first execution left out


def test_step_clock_counts_the_steps_a_call():
    clock = demo_steps.StepClock()
    assert clock.steps_a_call == 0
    for begin, end in [(0, 46), (47, 93)]:
        clock.on_train_batch_begin(begin)
        clock.on_train_batch_end(end)
    assert clock.steps_a_call == 47 and len(clock.per_step) == 1


def test_the_step_line_says_how_the_float32_run_called_its_steps():
    assert demo_check.step_line("mixed_float16", 0.101, 0.0238, None) == (
        "step time: mixed_float16 101 ms (one step a call, with kmix's callbacks), "
        "float32 23.8 ms (one step a call, without callbacks): 4.24x"
    )
    assert "float32 23.8 ms (an epoch a call): 4.24x" in demo_check.step_line(
        "mixed_float16", 0.101, 0.0238
    )


# --------------------------------------------------------- slow: a fresh process
@pytest.fixture(scope="module")
def torch_demo(tmp_path_factory):
    """``kmix demo --backend torch --epochs 1`` in a fresh process, KERAS_BACKEND unset."""
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("torch_demo")
    # The CPU, as the step counts assume.
    return demo_in_a_fresh_process(folder, "torch", CUDA_VISIBLE_DEVICES="")


@pytest.mark.slow
def test_demo_on_torch_finishes_and_writes_the_report(torch_demo):
    done, logdir, _ = torch_demo
    assert_the_demo_finished_with_its_report(done, logdir, "torch")
    assert "(one step a call, without callbacks)" in done.stdout  # torch's trainer: one a call


@pytest.mark.slow
def test_demo_on_torch_imports_no_tensorflow(torch_demo):
    """Neither the demo nor kmix (hardware detection, kmix.use's float16 probe on torch's
    kernels, the epoch scalars, the seed) imports it."""
    done, _, facts = torch_demo
    assert done.returncode == 0, done.stderr[-2000:]
    assert facts["tensorflow"] is False, f"imported from: {facts['stacks'][:1]}"
