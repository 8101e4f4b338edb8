"""The notebooks run top to bottom in a fresh kernel and show what they claim.

Each notebook is executed with nbclient in a temporary working directory (so its
TensorBoard logs land there). What it computed is read from the kernel afterwards, by
a cell the test appends to its in-memory copy (:func:`_run`): the notebook files print
nothing for the tests.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

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


def _run(name: str, workdir: pathlib.Path, values: str) -> tuple[Any, dict[str, Any]]:
    """Executes a notebook in ``workdir`` and reads what it computed from its kernel.

    Args:
        name: the notebook's file name in ``notebooks/``.
        workdir: the kernel's working directory.
        values: a Python expression over the notebook's variables giving a dict of
            JSON-ready values, evaluated by a cell appended after the notebook's last
            (to the copy in memory only).

    Returns:
        The executed notebook, without the appended cell, and the dict.
    """
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    cells = len(notebook.cells)
    notebook.cells.append(
        nbformat.v4.new_code_cell(f"import json as _json\nprint(_json.dumps({values}))")
    )
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
    probe = notebook.cells.pop()
    assert len(notebook.cells) == cells
    return notebook, json.loads(_stdout(probe))


@pytest.mark.parametrize(
    "name",
    [
        "01_quickstart.ipynb",
        "02_diagnose_overflow.ipynb",
        "03_autopilot.ipynb",
        "04_float8.ipynb",
    ],
)
def test_stored_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    assert notebook.cells[0].cell_type == "markdown"
    assert notebook.cells[0].source.startswith("# ")
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def _heading_level(cell) -> int | None:
    """The level of the heading a markdown cell starts with (``## x`` is 2), or None."""
    match = re.match(r"(#+) ", cell.source) if cell.cell_type == "markdown" else None
    return len(match[1]) if match else None


@pytest.mark.parametrize(
    "name",
    [
        "01_quickstart.ipynb",
        "02_diagnose_overflow.ipynb",
        "03_autopilot.ipynb",
        "04_float8.ipynb",
    ],
)
def test_every_heading_has_content_and_nothing_prints_for_the_tests(name):
    cells = nbformat.read(NOTEBOOKS / name, as_version=4).cells
    for index, cell in enumerate(cells):
        if cell.cell_type == "code":
            # A "NAME key=value ..." line is for a test to parse, not for the reader.
            assert not re.search(r'print\(\s*f?"[A-Z_]{3,} \w+=', cell.source), cell.source
        level = _heading_level(cell)
        if level is None or "\n" in cell.source.strip():
            continue  # not a heading, or a heading with its text
        following = cells[index + 1] if index + 1 < len(cells) else None
        next_level = None if following is None else _heading_level(following)
        assert following is not None and (next_level is None or next_level > level), (
            f"the section {cell.source!r} is empty"
        )


@pytest.mark.slow
def test_quickstart(tmp_path):
    _, result = _run(
        "01_quickstart.ipynb",
        tmp_path,
        "{'skipped_steps': int(summary.skipped_steps), 'steps': int(summary.steps_seen), "
        "'loss_scale': float(summary.loss_scale.final), 'test_accuracy': float(test_accuracy)}",
    )
    assert result["steps"] == 4 * 47  # 4 epochs of 1,497 images in batches of 32
    assert result["skipped_steps"] < result["steps"] // 10
    assert result["test_accuracy"] > 0.8
    assert result["loss_scale"] >= 1.0
    assert (tmp_path / "runs" / "quickstart" / "train").is_dir()
    assert (tmp_path / "runs" / "quickstart" / "report" / "loss_scale.png").is_file()


@pytest.mark.slow
def test_diagnose_overflow(tmp_path):
    notebook, result = _run(
        "02_diagnose_overflow.ipynb",
        tmp_path,
        "{'offending_variable': f'{culprit_layer}/kernel', "
        "'skipped_before': int(before['skipped']), 'skipped_after': int(after['skipped']), "
        "'scale_before': float(before['loss_scale']), 'scale_after': float(after['loss_scale']), "
        "'forward': {'origin': first.origin.layer, "
        "'inputs_finite': bool(first.origin.inputs_finite), 'kind': first.kind, "
        "'scale_kept': bool(first.old_scale == first.new_scale), "
        "'skipped_after': int(forward_after['skipped'])}}",
    )
    assert result["offending_variable"] == "energy_proj/kernel"
    assert result["skipped_before"] >= 1
    assert result["skipped_after"] == 0
    assert result["scale_before"] < result["scale_after"] == 2.0**15
    for run in ("before", "after"):
        assert (tmp_path / "runs" / "overflow" / run / "train").is_dir()
    assert result["forward"] == {
        "origin": "sum_of_squares",
        "inputs_finite": True,
        "kind": "forward_overflow",
        "scale_kept": True,
        "skipped_after": 0,
    }
    # The comparison is printed under its heading, before Part 2.
    heading = next(
        i for i, cell in enumerate(notebook.cells) if cell.source.startswith("## Before vs after")
    )
    lines = _stdout(notebook.cells[heading + 1]).splitlines()
    assert [line.split()[0] for line in lines] == ["skipped", "loss_scale", "loss", "accuracy"]
    assert all(" before " in line and " after " in line for line in lines), lines


@pytest.mark.slow
def test_autopilot(tmp_path):
    import importlib.util

    import numpy as np

    _, result = _run(
        "03_autopilot.ipynb",
        tmp_path,
        "{'stock': {k: float(v) for k, v in stock.items()}, "
        "'stop': {'step': stop_guard.step, 'reason': stop_guard.reason, "
        "'diagnosis': stop_guard.diagnosis}, "
        "'healing': {k: float(v) for k, v in healing.items()}, "
        "'moves': [[m.step, m.layer, m.from_policy, m.to_policy] for m in autopilot.moves], "
        "'reactive': {'skipped': int(reactive_optimizer.skipped_steps), "
        "'moves': [[m.step, m.layer] for m in reactive.moves], "
        "'loss': float(reactive_history.history['loss'][-1])}, "
        "'float32': [float(v) for v in float32_losses.values()], "
        "'plan': dict(plan.policies), 'healed': {k: float(v) for k, v in healed.items()}, "
        "'healed_policies': {l.name: l.dtype_policy.name for l in healed_model.layers}, "
        "'loaded_policies': loaded_policies, "
        "'model': [[type(l).__name__, l.name] for l in build_model().layers], "
        "'data': [float(x.astype('float64').sum()), float(np.log(y.astype('float64')).sum())]}",
    )
    # The notebook's model and data are bench/growing_model.py's.
    path = NOTEBOOKS.parent / "bench" / "growing_model.py"
    spec = importlib.util.spec_from_file_location("growing_model", path)
    growing_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(growing_model)
    x, y = growing_model.make_data(2048 + 512)
    expected = [float(x.astype("float64").sum()), float(np.log(y.astype("float64")).sum())]
    np.testing.assert_allclose(result["data"], expected, rtol=1e-6, atol=1e-6)
    assert result["model"] == [
        [type(lay).__name__, lay.name] for lay in growing_model.build_model().layers
    ]

    # Stock Keras: the loss becomes inf, the scale falls to 0.
    assert not np.isfinite(result["stock"]["loss"])
    assert result["stock"]["loss_scale"] == 0.0 and result["stock"]["skipped"] > 100
    # kmix without the autopilot: the guard stops, naming the layer.
    assert result["stop"]["step"] < 512 and result["stop"]["reason"] == "nonfinite_loss"
    assert "`energy`" in result["stop"]["diagnosis"]
    # With the autopilot (proactive): energy moves before it overflows; nothing skipped.
    assert [m[1:] for m in result["moves"]] == [["energy", "mixed_float16", "float32"]]
    assert result["healing"]["skipped"] == 0 and np.isfinite(result["healing"]["loss"])
    # Reactive: one skipped step per moved layer.
    assert [m[1] for m in result["reactive"]["moves"]] == ["energy"]
    assert result["reactive"]["skipped"] == 1
    # Within float32's run-to-run spread: as close to float32 with the same seed as the
    # float32 seeds are to each other.
    spread = max(result["float32"]) - min(result["float32"])
    for loss in (result["healing"]["loss"], result["reactive"]["loss"], result["healed"]["loss"]):
        assert abs(loss - result["float32"][0]) <= spread
    # The plan starts the next run healed, and a .keras file keeps the policies.
    assert result["plan"] == {"energy": "float32"}
    assert result["healed"]["skipped"] == 0
    assert result["healed_policies"]["energy"] == "float32"
    assert result["loaded_policies"] == result["healed_policies"]
    assert result["loaded_policies"]["proj"] == "mixed_float16"


@pytest.mark.slow
def test_float8(tmp_path):
    import math

    _, result = _run(
        "04_float8.ipynb",
        tmp_path,
        "{'stock': stock, 'off': kmix_off, 'on': kmix_on, 'off_growths': off_growths, "
        "'stock_growths': stock_growths, 'on_growths': on_growths, "
        "'references': [float16_loss, float32_loss], "
        "'reports': {kind: {'saturated': r.float8.saturated_tensor_steps, "
        "'episodes': len(r.float8.episodes), "
        "'growths': [g.step for g in r.float8.growth_saturations], "
        "'rules': sorted({f.rule for f in r.findings if f.rule.startswith('float8')})} "
        "for kind, r in reports.items()}, "
        "'episodes': {'kmix off': len(off_optimizer.float8_episodes()), "
        "'kmix on': len(on_optimizer.float8_episodes())}}",
    )
    stock, off, on = result["stock"], result["off"], result["on"]
    # kmix with following off trains exactly as stock Keras, and counts what the
    # independent replay of stock Keras's variables counts.
    assert off == stock and result["off_growths"] == result["stock_growths"]
    # The 18 overflowing batches and one of the MLP's own are skipped in every run, and the
    # flush replay's output gradient is Keras's at every applied step (its max is Keras's
    # recorded amax).
    for row in (stock, on):
        assert row["skipped"] == 19 and row["amax_mismatches"] == 0
    # After the backoffs (2**18 to 1), stock Keras's output-gradient scale stays where the loss
    # scale was and the last layer's output gradient loses values (8 steps, 8 values here);
    # following the loss scale, nothing of it flushes to zero.
    assert stock["flushed_steps"] > 0 and stock["flushed_values"] >= stock["flushed_steps"]
    assert on["flushed_steps"] == on["flushed_values"] == 0
    assert len(result["off_growths"]) >= 5 and stock["after_growths"] >= len(result["off_growths"])
    # Following the loss scale: growths saturate far fewer output gradients (1 vs 8 after
    # growths, 19 vs 45 in all here); the other tensors' counts move with the run (667 vs 663
    # in all), so they are not compared.
    assert len(result["on_growths"]) >= len(result["off_growths"])
    assert on["after_growths"] < off["after_growths"] // 4
    assert on["outputs_grad"] < off["outputs_grad"] // 2
    losses = [stock["loss"], off["loss"], on["loss"], *result["references"]]
    assert all(math.isfinite(loss) and loss > 0 for loss in losses)
    # The report reads back what the optimizers counted, and names the growths only
    # where the float8 scales did not follow.
    reports = result["reports"]
    for kind, row in (("kmix off", off), ("kmix on", on)):
        assert reports[kind]["saturated"] == row["saturated"]
        assert reports[kind]["episodes"] == result["episodes"][kind]
    assert reports["kmix off"]["growths"] and set(reports["kmix off"]["growths"]) <= set(
        result["off_growths"]
    )
    assert "float8_growth" in reports["kmix off"]["rules"]
    assert (
        reports["kmix on"]["growths"] == [] and "float8_growth" not in reports["kmix on"]["rules"]
    )
