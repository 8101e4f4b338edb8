"""kmix.compare.memory: the memory process imports what the comparison's process imports.

A ``build_model`` in a module the user's script put on ``sys.path`` (its folder, not the
current directory) must be importable in the process that measures its peak memory.
"""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import pytest

from kmix.compare.memory import child_pythonpath, measure_peaks


def test_the_child_gets_the_parents_import_path_then_pythonpath():
    path = ["", "/home/me/models", "lib", "/usr/lib/python3.11", "/home/me/models"]
    got = child_pythonpath(path, os.pathsep.join(["/opt/extra", "/usr/lib/python3.11"]), "/work")
    # '' is the current directory; relative entries are made absolute; each entry once,
    # in the parent's order; PYTHONPATH's entries the parent no longer has are kept
    assert got == os.pathsep.join(
        ["/work", "/home/me/models", "/work/lib", "/usr/lib/python3.11", "/opt/extra"]
    )
    assert child_pythonpath(["/a"], None, "/work") == "/a"
    assert child_pythonpath(["/a"], "", "/work") == "/a"


@pytest.fixture
def models_folder(tmp_path, monkeypatch):
    """A module ``farmodels`` in a folder on this process's sys.path only (not the cwd)."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "farmodels.py").write_text(
        textwrap.dedent(
            """
            def tiny():
                import keras
                model = keras.Sequential(
                    [keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                     keras.layers.Dense(2, dtype="float32")])
                model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
                return model
            """
        )
    )
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(tmp_path)  # the folder is not the current directory
    monkeypatch.delenv("PYTHONPATH", raising=False)
    yield folder
    sys.modules.pop("farmodels", None)


@pytest.mark.slow  # one memory process: imports TensorFlow, trains five steps
def test_a_build_function_on_the_scripts_path_is_measured(models_folder):
    import farmodels

    rng = np.random.default_rng(0)
    data = rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")
    (peak,) = measure_peaks(farmodels.tiny, data, ("float32",), 16, None, 0).values()
    assert peak.bytes is not None and peak.bytes > 0, peak.note
    assert "not measured" not in peak.note
