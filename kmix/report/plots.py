"""PNG plots of a run with matplotlib, imported only when plots are written."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kmix import tags
from kmix.report.findings import HEADROOM_WARN_BITS, UNDERFLOW_WARN_FRACTION
from kmix.report.read import KmixLog
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
      marked;
    * ``health.png``: overflow headroom, underflow fraction (and its subnormal
      part) and gradient norm, those that were logged;
    * ``grad_exponents.png``: a heatmap of the latest gradient exponents per
      variable with float16's limits drawn as lines (only with histograms);
    * ``activations.png``: activation headroom per float16 layer over steps (the
      :data:`MAX_LAYERS_PLOTTED` tightest), with float16's max at 0 bits and the
      warning line (only when activation statistics were recorded).

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
            path = os.path.join(out_dir, name)
            figure.savefig(path, dpi=100)
            written.append(path)
    return written


def _plot_loss_scale(figure: Any, log: KmixLog, summary: Summary) -> bool:
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
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale (log2)")
    ax.set_title(f"Loss scale: {summary.skipped_steps} skipped of {summary.steps_seen} steps")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return True


def _plot_health(figure: Any, log: KmixLog, summary: Summary) -> bool:
    present = [key for key, tag in TREND_TAGS.items() if tag in log.scalars]
    if not present:
        return False
    axes = figure.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, present, strict=True):
        series = log.scalars[TREND_TAGS[key]]
        if key == "underflow_fraction":
            ax.plot(series.steps, 100 * series.values, label="all gradients", linewidth=2)
            subnormal = log.scalars.get(tags.SUBNORMAL_FRACTION)
            if subnormal is not None:
                ax.plot(
                    subnormal.steps, 100 * subnormal.values, label="subnormal part", linewidth=2
                )
            for tag, other in sorted(log.scalars.items()):
                if tag.startswith(tags.UNDERFLOW_BY_VARIABLE):
                    name = tag[len(tags.UNDERFLOW_BY_VARIABLE) :]
                    ax.plot(other.steps, 100 * other.values, label=name, linewidth=0.8)
            ax.axhline(100 * UNDERFLOW_WARN_FRACTION, color="tab:red", linestyle="--")
            ax.set_ylabel("underflow (%)")
            ax.legend(fontsize="x-small", ncol=2)
        elif key == "overflow_headroom_bits":
            ax.plot(series.steps, series.values)
            ax.axhline(0, color="black", linestyle="-", linewidth=0.8)
            ax.axhline(HEADROOM_WARN_BITS, color="tab:red", linestyle="--")
            ax.set_ylabel("headroom (bits)")
        else:
            ax.plot(series.steps, series.values)
            ax.set_yscale("log")
            ax.set_ylabel("gradient norm")
        ax.grid(True, alpha=0.3)
    axes[0].set_title("Gradient health (dashed: warning thresholds)")
    axes[-1].set_xlabel("step")
    return True


def _plot_exponents(figure: Any, log: KmixLog, summary: Summary) -> bool:
    if not log.histograms:
        return False
    from matplotlib.colors import LogNorm

    variables = sorted(log.histograms)
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
    for x, label, color in (
        (tags.FLOAT16_MIN_SUBNORMAL_EXPONENT, "min subnormal 2^-24", "tab:red"),
        (tags.FLOAT16_MIN_NORMAL_EXPONENT, "min normal 2^-14", "tab:orange"),
        (tags.FLOAT16_MAX_EXPONENT + 1, "max 65504", "tab:red"),
    ):
        ax.axvline(x, color=color, linestyle="--", linewidth=1.2, label=f"float16 {label}")
    ax.set_yticks(range(len(variables)), variables, fontsize="small")
    ax.set_xlabel("log2 |scaled gradient| (leftmost column: zero; rightmost: inf/NaN)")
    steps = sorted({log.histograms[v][-1][0] for v in variables})
    ax.set_title(f"Gradient exponents per variable at step {', '.join(map(str, steps))}")
    ax.legend(fontsize="small", loc="upper left")
    return True


def _plot_activations(figure: Any, log: KmixLog, summary: Summary) -> bool:
    series = {
        tag[len(tags.ACTIVATION_HEADROOM_BITS) :]: values
        for tag, values in log.scalars.items()
        if tag.startswith(tags.ACTIVATION_HEADROOM_BITS)
    }
    if not series:
        return False
    tightest = sorted(series, key=lambda layer: np.nanmin(series[layer].values))
    ax = figure.add_subplot()
    for layer in tightest[:MAX_LAYERS_PLOTTED]:
        ax.plot(series[layer].steps, series[layer].values, label=layer, linewidth=1.2)
    ax.axhline(0, color="black", linewidth=1.0, label="float16 max (65504)")
    ax.axhline(HEADROOM_WARN_BITS, color="tab:red", linestyle="--", label="warning")
    ax.set_xlabel("step")
    ax.set_ylabel("headroom to 65504 (bits)")
    shown = min(len(tightest), MAX_LAYERS_PLOTTED)
    ax.set_title(f"Activation headroom: the {shown} tightest of {len(tightest)} float16 layers")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    return True
