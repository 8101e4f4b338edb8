"""The notebooks run top to bottom in a fresh kernel and show what they claim.

Each notebook is executed with nbclient in a temporary working directory (so its
TensorBoard logs land there), and the line its last cell prints is checked.
"""

from __future__ import annotations

import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 180


def _stdout(cell) -> str:
    return "".join(
        output.get("text", "")
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream" and output.get("name") == "stdout"
    )


def _run(name: str, workdir: pathlib.Path):
    """Executes a notebook in ``workdir``; fails with the failing cell's error."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{name} failed:\n{error}", pytrace=False)
    return notebook


def _result(notebook, prefix: str) -> dict[str, str]:
    """The ``key=value`` pairs of the ``PREFIX ...`` line the last cell prints."""
    text = _stdout(notebook.cells[-1])
    match = re.search(rf"^{prefix} (.*)$", text, re.MULTILINE)
    assert match, f"the last cell did not print a {prefix} line; its output:\n{text}"
    return dict(pair.split("=", 1) for pair in match[1].split())


@pytest.mark.parametrize("name", ["01_quickstart.ipynb", "02_diagnose_overflow.ipynb"])
def test_stored_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    assert notebook.cells[0].cell_type == "markdown"
    assert notebook.cells[0].source.startswith("# ")
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow
def test_quickstart(tmp_path):
    notebook = _run("01_quickstart.ipynb", tmp_path)
    result = _result(notebook, "QUICKSTART")
    assert int(result["steps"]) == 4 * 47  # 4 epochs of 1,497 images in batches of 32
    assert int(result["skipped_steps"]) < int(result["steps"]) // 10
    assert float(result["test_accuracy"]) > 0.8
    assert float(result["loss_scale"]) >= 1.0
    assert (tmp_path / "runs" / "quickstart" / "train").is_dir()
    assert (tmp_path / "runs" / "quickstart" / "report" / "loss_scale.png").is_file()


@pytest.mark.slow
def test_diagnose_overflow(tmp_path):
    notebook = _run("02_diagnose_overflow.ipynb", tmp_path)
    result = _result(notebook, "DIAGNOSIS")
    assert result["offending_variable"] == "energy_proj/kernel"
    assert int(result["skipped_before"]) >= 1
    assert int(result["skipped_after"]) == 0
    assert float(result["scale_before"]) < float(result["scale_after"]) == 2.0**15
    for run in ("before", "after"):
        assert (tmp_path / "runs" / "overflow" / run / "train").is_dir()
    forward = _result(notebook, "FORWARD")
    assert forward == {
        "origin": "sum_of_squares",
        "inputs_finite": "True",
        "kind": "forward_overflow",
        "scale_kept": "True",
        "skipped_after": "0",
    }
