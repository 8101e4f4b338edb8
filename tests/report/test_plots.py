"""kmix.report.plots: what each PNG draws, read back from matplotlib's figure (issue 21,
items 11, 14, 17): a single reading shows, legends cover no line, identical lines are
said to be one, float16's limits are drawn over float16 variables only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_report import event_line, exponent_histogram, hand_log

from kmix import report, tags
from kmix.report import plots
from kmix.tags import PolicyRecord

pytest.importorskip("matplotlib")

RECORD = PolicyRecord(
    "mixed_float16", "m", "mixed_float16", "float16", "float32", "kmix", 1.0, 2.0**24, 100, 0
)


def drawn(plot, log):
    """The figure ``plot`` drew for ``log``, laid out and rendered (as savefig would)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 6), layout="constrained")
    assert plot(figure, log, report.summarize(log))
    FigureCanvasAgg(figure).draw()
    return figure


def one_reading_log():
    """192 steps, update_freq=100: one health reading, at step 100."""
    return hand_log(
        scalars={
            tags.LOSS_SCALE: ([100, 192], [32768.0, 32768.0]),
            tags.OVERFLOW_HEADROOM_BITS: ([100], [1.12]),
            tags.UNDERFLOW_FRACTION: ([100], [0.5625]),
            tags.SUBNORMAL_FRACTION: ([100], [0.0]),
            tags.GRAD_NORM: ([100], [2.98]),
            tags.UNDERFLOW_BY_VARIABLE + "dense/kernel": ([100], [0.5625]),
            tags.UNDERFLOW_BY_VARIABLE + "dense/bias": ([100], [0.5625]),
            tags.ACTIVATION_HEADROOM_BITS + "dense": ([100], [15.6]),
        }
    )


@pytest.mark.parametrize("plot", [plots._plot_health, plots._plot_activations])
def test_a_single_reading_is_drawn_as_a_point_and_said(plot):
    figure = drawn(plot, one_reading_log())
    axes = figure.axes
    data = [line for ax in axes for line in ax.get_lines() if len(line.get_xdata()) == 1]
    data = [line for line in data if line.get_xdata()[0] == 100]  # not the reference lines
    assert data and all(line.get_marker() == "o" for line in data)
    assert "1 reading, at step 100" in axes[0].get_title()
    left, right = axes[-1].get_xlim()
    assert left <= 0 and right >= 192  # the step sits within the run, not on a 95..105 axis


def test_many_readings_are_lines_and_are_counted():
    steps = list(range(10, 410, 10))
    log = hand_log(scalars={tags.OVERFLOW_HEADROOM_BITS: (steps, [5.0] * len(steps))})
    figure = drawn(plots._plot_health, log)
    (line,) = [line for line in figure.axes[0].get_lines() if len(line.get_xdata()) == 40]
    assert line.get_marker() in ("None", None, "")
    assert "40 readings" in figure.axes[0].get_title()


@pytest.mark.parametrize("plot", [plots._plot_health, plots._plot_activations])
def test_legends_cover_no_line(plot):
    steps = list(range(10, 410, 10))
    ramp = np.linspace(0.0, 0.5, len(steps))
    log = hand_log(
        scalars={
            tags.UNDERFLOW_FRACTION: (steps, ramp),
            tags.UNDERFLOW_BY_VARIABLE + "a/kernel": (steps, ramp / 2),
            tags.ACTIVATION_HEADROOM_BITS + "a": (steps, 20 - 10 * ramp),
            tags.ACTIVATION_HEADROOM_BITS + "b": (steps, 18 - 10 * ramp),
        }
    )
    figure = drawn(plot, log)
    legends = [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None]
    assert legends
    for legend in legends:
        box = legend.get_window_extent()
        for ax in figure.axes:
            assert not box.overlaps(ax.get_window_extent()), "the legend covers an axes"


def test_identical_activation_lines_are_drawn_once_and_named_together():
    steps = [10, 20, 30]
    log = hand_log(
        scalars={
            tags.ACTIVATION_HEADROOM_BITS + "conv2d_1": (steps, [18.0, 14.0, 13.5]),
            tags.ACTIVATION_HEADROOM_BITS + "max_pooling2d": (steps, [18.0, 14.0, 13.5]),
            tags.ACTIVATION_HEADROOM_BITS + "dense": (steps, [16.0, 15.0, 15.0]),
        }
    )
    figure = drawn(plots._plot_activations, log)
    labels = [line.get_label() for line in figure.axes[0].get_lines()]
    data = [label for label in labels if "float16 max" not in label and label != "warning"]
    assert len(data) == 2
    assert "conv2d_1, max_pooling2d (identical: one line)" in data
    assert plots.identical_series(
        {name: log.scalars[tags.ACTIVATION_HEADROOM_BITS + name] for name in ("dense", "conv2d_1")}
    ) == [["dense"], ["conv2d_1"]]


def test_float16_limits_are_drawn_over_float16_variables_only():
    record = dataclasses.replace(
        RECORD, variable_dtypes={"conv/kernel": "float16", "dense/bias": "float32"}
    )
    log = hand_log(
        histograms={
            "conv/kernel": [(25, exponent_histogram(e3=10))],
            "dense/bias": [(25, exponent_histogram(e17=10))],
        },
        texts={tags.POLICY_RECORD: [(0, tags.format_policy_record(record))]},
    )
    figure = drawn(plots._plot_exponents, log)
    ax = figure.axes[0]
    labels = [label.get_text() for label in ax.get_yticklabels()]
    assert labels == ["conv/kernel", "dense/bias (float32)"]
    limits = [c for c in ax.collections if str(c.get_label()).startswith("float16 ")]
    assert len(limits) == 3
    for collection in limits:
        for segment in collection.get_segments():
            rows = sorted(segment[:, 1])
            assert rows == [-0.5, 0.5]  # row 0 (conv/kernel) only
    assert any("float16's limits do not apply" in t.get_text() for t in ax.texts)


def test_the_stretch_whose_events_were_lost_is_shaded():
    lost = tags.format_events_lost(tags.EventsLost(10, 0, 16, 2))
    log = hand_log(
        scalars={tags.LOSS_SCALE: ([11, 12, 16], [1.0, 1.0, 1.0])},
        texts={tags.EVENTS: [(11, lost), event_line(11, "overflow_at_floor", 1.0, 1.0, "w")]},
    )
    figure = drawn(plots._plot_loss_scale, log)
    labels = [h.get_label() for h in figure.axes[0].get_legend().legend_handles]
    assert "scale events lost: the scale here is not known" in labels
    (span,) = [p for p in figure.axes[0].patches if p.get_label().startswith("scale events")]
    # The ring keeps the newest events: the lost ones came before the kept one at step 11.
    assert (span.get_x(), span.get_x() + span.get_width()) == (0, 10)
    assert report.read.scale_events_of(log).unknown_scale() == [(0, 10)]


def test_the_plots_of_a_log_dir_written_twice_say_which_run_they_draw(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    from test_runs import write_twice

    write_twice(str(tmp_path))
    log = report.read_log(str(tmp_path))
    summary = report.summarize(log)
    title = (
        "run 2 of 2 in this log dir (the latest; id 20250101-110000-bbbbbb): the others are "
        "not drawn"
    )
    assert plots.runs_title(summary) == title
    saved = {}
    save = Figure.savefig
    monkeypatch.setattr(
        Figure,
        "savefig",
        lambda figure, path, **kw: (
            saved.update({path: figure.get_suptitle()}),
            save(figure, path, **kw),
        ),
    )
    written = report.write_plots(log, summary, str(tmp_path / "report"))
    assert [p.rsplit("/", 1)[1] for p in written] == ["loss_scale.png", "grad_exponents.png"]
    assert saved == {path: title for path in written}
    figure = drawn(plots._plot_loss_scale, log)
    assert "1 skipped of 6 steps" in figure.axes[0].get_title()
    assert plots.runs_title(report.summarize(report.read_runs(str(tmp_path))[0])).startswith(
        "run 1 of 2 in this log dir (id 20250101-100000-aaaaaa)"
    )
    assert plots.runs_title(report.summarize(one_reading_log())) is None


def test_a_float32_run_whose_scale_never_moved_has_no_loss_scale_chart(tmp_path):
    """Issue 32: kmix compare's float32 reference is compiled with a loss-scale optimizer;
    its scale never moves and nothing is skipped, so a flat chart would only suggest the
    scale did something: no loss_scale.png, and the report's line says it is not used (as
    the tab does). A float32 run whose scale moved, or a float16 one, keeps its chart."""
    record = dataclasses.replace(
        RECORD, model_policy="float32", compute_dtype="float32", loss_scale=32768.0
    )
    texts = {tags.POLICY_RECORD: [(0, tags.format_policy_record(record))]}
    flat = {tags.LOSS_SCALE: ([10, 20], [32768.0, 32768.0]), tags.GRAD_NORM: ([10], [1.0])}
    log = hand_log(scalars=flat, texts=texts)
    summary = report.summarize(log)
    unused = (
        "this run computes in float32, which needs no loss scaling (the optimizer's scale "
        "stayed at 32768 (2^15) and no step was skipped)"
    )
    assert report.loss_scale_unused(summary) == unused
    written = report.write_plots(log, summary, str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in written] == ["health.png"]
    assert f"\nloss scale      not used: {unused}\n" in report.format_summary(summary)
    moved = hand_log(scalars={tags.LOSS_SCALE: ([10, 20], [32768.0, 16384.0])}, texts=texts)
    assert report.loss_scale_unused(report.summarize(moved)) is None
    mixed = {tags.POLICY_RECORD: [(0, tags.format_policy_record(RECORD))]}
    assert report.loss_scale_unused(report.summarize(hand_log(scalars=flat, texts=mixed))) is None
