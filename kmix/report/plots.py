"""PNG plots of a run with matplotlib, imported only when plots are written."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kmix import tags
from kmix._words import plural
from kmix.report.advice import loss_scale_unused
from kmix.report.finding_rules import HEADROOM_WARN_BITS, UNDERFLOW_WARN_FRACTION
from kmix.report.read import KmixLog, scale_events_of
from kmix.report.summary import TREND_TAGS, Summary

PLOT_FILES = ("loss_scale.png", "health.png", "grad_exponents.png", "activations.png")
MAX_LAYERS_PLOTTED = 12
"""The activation plot draws the layers with the least headroom, at most this many."""

_MARKERS = (  # kind, marker, colour
    ("backoff", "v", "tab:red"),
    ("skip_absorbed", "x", "tab:orange"),
    ("overflow_at_floor", "X", "black"),
    ("forward_overflow", "D", "tab:purple"),
    ("growth", "^", "tab:green"),
)


def write_plots(log: KmixLog, summary: Summary, out_dir: str) -> list[str]:
    """Writes the PNG plots of a run with matplotlib (no global backend is changed).

    * ``loss_scale.png``: the loss scale over steps on a log2 axis, skipped steps
      marked, and the stretches whose scale events were lost shaded (none for a run
      that does not use its scale: :func:`kmix.report.advice.loss_scale_unused`);
    * ``health.png``: overflow headroom, underflow fraction (and its subnormal
      part, and per float16 variable) and gradient norm, those that were logged;
    * ``grad_exponents.png``: a heatmap of the latest gradient exponents per
      variable, float16 variables first with float16's limits drawn as lines over
      them, variables of other dtypes below, marked (only with histograms);
    * ``activations.png``: activation headroom per float16 layer over steps (the
      :data:`MAX_LAYERS_PLOTTED` tightest; identical lines drawn once, their
      layers named together), with float16's max at 0 bits and the warning line
      (only when activation statistics were recorded).

    Lines over steps span steps 0 to the last step seen, their legends sit beside
    the axes, their titles say how many readings they show, and a series of at
    most :data:`MARKER_POINTS` points is drawn with markers. When the log dir holds
    several runs, each figure says which one it draws (:func:`runs_title`).

    Args:
        log: what :func:`kmix.report.read_log` returned.
        summary: its :func:`kmix.report.summarize` summary.
        out_dir: the directory to write into; created if missing.

    Returns:
        The paths written.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: the directory cannot be written.
    """
    from matplotlib.figure import Figure

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, plot in zip(
        PLOT_FILES,
        (_plot_loss_scale, _plot_health, _plot_exponents, _plot_activations),
        strict=True,
    ):
        figure = Figure(figsize=(9, 6), layout="constrained")
        if plot(figure, log, summary):
            title = runs_title(summary)
            if title is not None:
                figure.suptitle(title, fontsize="small", color="#b71c1c")
            path = os.path.join(out_dir, name)
            figure.savefig(path, dpi=100)
            written.append(path)
    return written


def runs_title(summary: Summary) -> str | None:
    """Which run a figure draws, when the log dir holds several.

    Args:
        summary: the summary of the run drawn.

    Returns:
        E.g. ``"run 2 of 2 in this log dir (the latest; id ...): the others are not
        drawn"``; None when the directory holds one run.
    """
    run, runs = summary.run, summary.runs
    if run is None or len(runs) < 2:
        return None
    latest = "the latest; " if run.index == len(runs) else ""
    which = f"id {run.run_id}" if run.run_id is not None else "no run id"
    return (
        f"run {run.index} of {len(runs)} in this log dir ({latest}{which}): "
        "the others are not drawn"
    )


def _plot_loss_scale(figure: Any, log: KmixLog, summary: Summary) -> bool:
    if loss_scale_unused(summary) is not None:  # a flat line would suggest it did something
        return False
    events = summary.events
    points = [(0, summary.loss_scale.initial)]
    points += [(e.step, e.new_scale) for e in events]
    series = log.scalars.get(tags.LOSS_SCALE)
    if series is not None:
        points += zip(series.steps.tolist(), series.values.tolist(), strict=True)
    points = sorted((step, value) for step, value in points if value)
    if not points:
        return False
    ax = figure.add_subplot()
    steps, values = zip(*points, strict=True)
    ax.step(steps, values, where="post", label="loss scale")
    for kind, marker, color in _MARKERS:
        chosen = [e for e in events if e.kind == kind]
        if chosen:
            label = kind if kind == "growth" else f"skipped step ({kind})"
            ax.scatter(
                [e.step for e in chosen],
                [e.old_scale for e in chosen],
                marker=marker,
                color=color,
                label=label,
                zorder=3,
            )
    for k, (first, last) in enumerate(scale_events_of(log).unknown_scale()):
        ax.axvspan(
            first,
            last,
            color="0.88",
            alpha=0.9,
            zorder=2.5,  # over the line, which is a guess there; under the event markers
            label=None if k else "scale events lost: the scale here is not known",
        )
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale (log2)")
    ax.set_title(f"Loss scale: {summary.skipped_steps} skipped of {summary.steps_seen} steps")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return True


MARKER_POINTS = 30
"""A series of at most this many points is drawn with a marker at each point, so a
single reading (or a few) shows as points instead of an invisible one-point line."""


def _style(points: int) -> dict[str, Any]:
    """Line style for a series of ``points`` points: markers when they are few."""
    return {"marker": "o", "markersize": 4} if points <= MARKER_POINTS else {}


def _readings(count: int, steps: list[int]) -> str:
    """``"1 reading, at step 100"``, ``"12 readings"``."""
    if count == 1 and steps:
        return f"1 reading, at step {steps[0]}"
    return plural(count, "reading")


def _step_axis(ax: Any, summary: Summary, last: int) -> None:
    """Steps from 0 to the last step seen, so a few readings sit where they were taken."""
    right = max(summary.steps_seen, last, 1)
    ax.set_xlim(-0.02 * right, 1.02 * right)


def _outside_legend(ax: Any, **kwargs: Any) -> None:
    """A legend right of the axes (constrained layout makes room): it covers no line."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


def _plot_health(figure: Any, log: KmixLog, summary: Summary) -> bool:
    present = [key for key, tag in TREND_TAGS.items() if tag in log.scalars]
    if not present:
        return False
    axes = figure.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    steps: set[int] = set()
    for ax, key in zip(axes, present, strict=True):
        series = log.scalars[TREND_TAGS[key]]
        steps.update(series.steps.tolist())
        style = _style(series.steps.size)
        if key == "underflow_fraction":
            lines = {"all gradients": series}
            subnormal = log.scalars.get(tags.SUBNORMAL_FRACTION)
            if subnormal is not None:
                lines["subnormal part"] = subnormal
            lines |= {
                tag[len(tags.UNDERFLOW_BY_VARIABLE) :]: values
                for tag, values in sorted(log.scalars.items())
                if tag.startswith(tags.UNDERFLOW_BY_VARIABLE)
                and tag[len(tags.UNDERFLOW_BY_VARIABLE) :] not in summary.variables_not_float16
            }  # float16's range does not apply to the others' layers
            for names in identical_series(lines):
                values = lines[names[0]]
                ax.plot(
                    values.steps,
                    100 * values.values,
                    label=_group_label(names, wrap=True),
                    linewidth=2 if names[0] in ("all gradients", "subnormal part") else 0.8,
                    **_style(values.steps.size),
                )
            # The findings warn of a variable above it; where the subnormal part is known,
            # of its tiny non-zero values only (zeros, inactive units, do not count).
            known = "subnormal part" in lines
            ax.axhline(
                100 * UNDERFLOW_WARN_FRACTION,
                color="tab:red",
                linestyle="--",
                label="warning: a variable's tiny values" if known else "warning: a variable",
            )
            ax.set_ylabel("underflow (%)")
            _outside_legend(ax, fontsize="x-small")
        elif key == "overflow_headroom_bits":
            ax.plot(series.steps, series.values, **style)
            # Under dynamic loss scaling this bounces near 0 on every run: the scale grows
            # until the largest gradient nears float16's max, then backs off. No warning line.
            ax.axhline(0, color="black", linestyle="-", linewidth=0.8)
            ax.text(
                0.99,
                0.95,
                "near 0 on every run: the loss scale grows until it nears float16's max",
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize="x-small",
                color="dimgray",
            )
            ax.set_ylabel("headroom (bits)")
        else:
            ax.plot(series.steps, series.values, **style)
            ax.set_yscale("log")
            ax.set_ylabel("gradient norm")
        ax.grid(True, alpha=0.3)
    ordered = sorted(steps)
    _step_axis(axes[-1], summary, ordered[-1] if ordered else 0)
    axes[0].set_title(
        f"Gradient health, {_readings(len(ordered), ordered)} (dashed: a warning threshold)"
    )
    axes[-1].set_xlabel("step")
    return True


def _plot_exponents(figure: Any, log: KmixLog, summary: Summary) -> bool:
    """Float16 variables first, with float16's limits; other dtypes below, without them."""
    if not log.histograms:
        return False
    from matplotlib.colors import LogNorm

    other = summary.variables_not_float16
    float16 = sorted(v for v in log.histograms if v not in other)
    variables = float16 + sorted(v for v in log.histograms if v in other)
    rows = np.stack([log.histograms[v][-1][1] for v in variables])
    fractions = rows / np.maximum(rows.sum(axis=1, keepdims=True), 1)
    edges = tags.exponent_bucket_edges()
    ax = figure.add_subplot()
    image = ax.imshow(
        np.ma.masked_equal(fractions, 0),
        aspect="auto",
        interpolation="nearest",
        extent=(edges[0][0], edges[-1][1], len(variables) - 0.5, -0.5),
        norm=LogNorm(vmin=max(fractions[fractions > 0].min(initial=1.0), 1e-6), vmax=1.0),
        cmap="viridis",
    )
    figure.colorbar(image, ax=ax, label="share of elements")
    if float16:
        for x, label, color in (
            (tags.FLOAT16_MIN_SUBNORMAL_EXPONENT, "min subnormal 2^-24", "tab:red"),
            (tags.FLOAT16_MIN_NORMAL_EXPONENT, "min normal 2^-14", "tab:orange"),
            (tags.FLOAT16_MAX_EXPONENT + 1, "max 65504", "tab:red"),
        ):
            ax.vlines(
                x,
                -0.5,
                len(float16) - 0.5,
                color=color,
                linestyle="--",
                linewidth=1.2,
                label=f"float16 {label}",
            )
        ax.legend(
            fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3
        )  # below the axes: it covers no cell
    if len(float16) < len(variables):
        ax.axhline(len(float16) - 0.5, color="black", linewidth=1.0)
        dtypes = " and ".join(sorted({other[v] for v in variables[len(float16) :]}))
        ax.text(
            0.99,
            (len(variables) - len(float16)) / len(variables),
            f"below: {dtypes} layers, float16's limits do not apply",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize="small",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"},
        )
    labels = [v if v not in other else f"{v} ({other[v]})" for v in variables]
    ax.set_yticks(range(len(variables)), labels, fontsize="small")
    ax.set_xlabel("log2 |scaled gradient| (leftmost column: zero; rightmost: inf/NaN)")
    steps = sorted({log.histograms[v][-1][0] for v in variables})
    ax.set_title(f"Gradient exponents per variable at step {', '.join(map(str, steps))}")
    return True


def identical_series(series: dict[str, Any]) -> list[list[str]]:
    """Groups the names whose series are identical (same steps, same values).

    Args:
        series: name -> :class:`~kmix.report.read.Series`.

    Returns:
        The groups, each in the order of ``series``, ordered by their first name.
    """
    groups: dict[tuple[bytes, bytes], list[str]] = {}
    for name, values in series.items():
        key = (values.steps.tobytes(), values.values.tobytes())
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _group_label(names: list[str], wrap: bool = False) -> str:
    """One name, or the names of identical lines drawn as one (a line each if ``wrap``)."""
    if len(names) == 1:
        return names[0]
    parts = names[:3] + ([f"and {len(names) - 3} more"] if len(names) > 3 else [])
    parts.append("(identical: one line)")
    return (",\n" if wrap else ", ").join(parts[:-1]) + ("\n" if wrap else " ") + parts[-1]


def _plot_activations(figure: Any, log: KmixLog, summary: Summary) -> bool:
    series = {
        tag[len(tags.ACTIVATION_HEADROOM_BITS) :]: values
        for tag, values in log.scalars.items()
        if tag.startswith(tags.ACTIVATION_HEADROOM_BITS)
    }
    if not series:
        return False
    tightest = sorted(series, key=lambda layer: np.nanmin(series[layer].values))
    shown = tightest[:MAX_LAYERS_PLOTTED]
    ax = figure.add_subplot()
    steps: set[int] = set()
    for names in identical_series({layer: series[layer] for layer in shown}):
        values = series[names[0]]
        steps.update(values.steps.tolist())
        ax.plot(
            values.steps,
            values.values,
            label=_group_label(names),
            linewidth=1.2,
            **_style(values.steps.size),
        )
    ax.axhline(0, color="black", linewidth=1.0, label="float16 max (65504)")
    ax.axhline(HEADROOM_WARN_BITS, color="tab:red", linestyle="--", label="warning")
    ordered = sorted(steps)
    _step_axis(ax, summary, ordered[-1] if ordered else 0)
    ax.set_xlabel("step")
    ax.set_ylabel("headroom to 65504 (bits)")
    which = (
        f"of {plural(len(shown), 'float16 layer')}"
        if len(shown) == len(tightest)
        else f"the {len(shown)} tightest of {len(tightest)} float16 layers"
    )
    ax.set_title(f"Activation headroom {which}, {_readings(len(ordered), ordered)}")
    ax.grid(True, alpha=0.3)
    ax.legend(  # below the axes: it covers no line
        fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3
    )
    return True
