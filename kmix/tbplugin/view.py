"""Shapes one run's kmix data into the JSON the tab draws, downsampled for the browser.

Everything numeric comes from :mod:`kmix.report` (summary, findings, events,
precision what-if) so the tab and ``kmix report`` say the same; this module only
cuts long series down to a few points per pixel and lays histograms out as rows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kmix import report, tags
from kmix._json import json_ready
from kmix.report import begin_scale, float16_in_use, runs_message, scale_caveat, scale_events_of
from kmix.tbplugin.float8 import float8_payload
from kmix.tbplugin.reader import TEXT_SAMPLES_DEFAULT, RunPoints

DEFAULT_POINTS = 1000
MIN_POINTS = 10
MAX_POINTS = 5000
"""Bounds of the ``points`` query parameter: points per series sent to the browser."""

MAX_HEADROOM_STEPS = 200
"""Columns of the headroom-per-variable heatmap (histogram steps, evenly picked)."""

SERIES_TAGS = {
    "loss_scale": tags.LOSS_SCALE,
    "skipped_steps": tags.SKIPPED_STEPS,
    "skip_rate": tags.SKIP_RATE,
    "grad_norm": tags.GRAD_NORM,
    "overflow_headroom_bits": tags.OVERFLOW_HEADROOM_BITS,
    "underflow_fraction": tags.UNDERFLOW_FRACTION,
    "min_activation_headroom_bits": tags.MIN_ACTIVATION_HEADROOM_BITS,
}
"""Key in the payload -> scalar tag of the series drawn over steps."""

ACTIVATION_HEADROOM = tags.ACTIVATION_HEADROOM_BITS
"""Per-layer forward headroom scalars (+ layer path), drawn as layers x steps."""

ALL_ZERO_BITS = math.log2(tags.FLOAT16_MAX / 2.0**tags.FLOAT16_MIN_SUBNORMAL_EXPONENT)
"""The activation headroom recorded for an output with nothing above float16's smallest
subnormal (all zero, as a float16 output): ``max_abs`` is floored there
(:class:`kmix.record.activations.ActivationStats`), so the headroom is capped at this."""

ALL_ZERO = "zero"
"""A headroom cell of an output (or gradient) that is all zero: no headroom to speak of."""


def to_log(points: RunPoints) -> report.KmixLog:
    """Builds the report's :class:`~kmix.report.KmixLog` from provider points.

    A TensorBoard run is a directory; when a script wrote several kmix runs into it,
    the log is of the latest, as ``kmix report`` reports (its ``runs`` lists them all).

    Args:
        points: what :func:`kmix.tbplugin.reader.read_run` returned.

    Returns:
        The log, exactly as ``kmix report`` would build it from the same points.
    """
    logs = report.build_logs(points.run, points.scalars, points.tensors)
    return logs[-1] if logs else report.build_log(points.run, {}, {})


def summary_dict(log: report.KmixLog) -> dict[str, Any]:
    """The report's summary of a log as the dict ``kmix report --json`` prints.

    Args:
        log: the run's log.

    Returns:
        The summary dict.
    """
    return report.summarize(log).to_dict()


def event_lines(summary: report.Summary) -> list[str]:
    """Each event of a summary as the one line that words it, in the summary's order.

    The line is :func:`kmix.tags.format_event`'s, the markdown its ``kmix/events``
    text holds (TensorBoard's Text dashboard shows the same), so the page words no
    event itself.

    Args:
        summary: the report's summary.

    Returns:
        One markdown line per event of ``summary.events``.
    """
    return [tags.format_event(event) for event in summary.events]


def downsample(steps: np.ndarray, values: np.ndarray, limit: int) -> np.ndarray:
    """Picks at most about ``limit`` indices that keep a series' shape, spikes included.

    The series is cut into ``limit // 3`` runs of consecutive points; each keeps its
    smallest and largest finite value and its first non-finite one, so a single
    overflow among 100,000 points still shows. The first and last points are kept.

    Args:
        steps: the steps, increasing.
        values: one value per step.
        limit: the most points wanted, >= 3.

    Returns:
        Sorted indices into ``steps``.
    """
    n = len(steps)
    if n <= limit:
        return np.arange(n)
    buckets = max(limit // 3, 1)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    finite = np.isfinite(values)
    keep = {0, n - 1}
    for start, stop in zip(edges[:-1], edges[1:], strict=True):
        if stop <= start:
            continue
        chunk, ok = values[start:stop], finite[start:stop]
        if ok.any():
            masked_low = np.where(ok, chunk, np.inf)
            masked_high = np.where(ok, chunk, -np.inf)
            keep.add(start + int(np.argmin(masked_low)))
            keep.add(start + int(np.argmax(masked_high)))
        if not ok.all():
            keep.add(start + int(np.argmin(ok)))
    return np.array(sorted(keep), dtype=np.int64)


def step_changes(values: np.ndarray) -> np.ndarray:
    """Indices where a step-shaped series changes value, with its first and last point.

    Args:
        values: the series' values.

    Returns:
        Sorted indices; drawing a step line through them alone gives the same picture.
    """
    if values.size == 0:
        return np.arange(0)
    changed = np.flatnonzero(values[1:] != values[:-1]) + 1
    return np.unique(np.concatenate([[0], changed, [values.size - 1]]))


def _series(series: report.Series | None, limit: int, steplike: bool) -> dict[str, Any] | None:
    if series is None:
        return None
    index = np.arange(series.steps.size)
    if steplike:
        index = step_changes(series.values)
    picked = downsample(series.steps[index], series.values[index], limit)
    index = index[picked]
    return {
        "steps": series.steps[index].tolist(),
        "values": json_ready(series.values[index].tolist()),
        "points": int(series.steps.size),
    }


def headroom_bits(counts: np.ndarray) -> float | None:
    """Whole bits between the largest value of a histogram and float16's maximum.

    ``FLOAT16_MAX_EXPONENT - e`` for the highest non-empty power of two ``e``: the
    largest value could double that many times before passing 65504 (within one
    bit, as bins are powers of two). Negative past the maximum; ``-inf`` if there
    are inf/NaN values.

    Args:
        counts: one count per exponent bin.

    Returns:
        The headroom, or None for a histogram of zeros only.
    """
    if counts[-1] > 0:
        return -math.inf
    nonzero = np.flatnonzero(counts[1:-1] > 0)
    if nonzero.size == 0:
        return None
    top = 1 + int(nonzero[-1])
    exponent = top - 2 + tags.EXPONENT_MIN
    return float(tags.FLOAT16_MAX_EXPONENT - exponent)


def heatmap(rows: dict[str, list[tuple[int, np.ndarray]]], step: int) -> dict[str, Any]:
    """Shares of elements per exponent bin for every variable at one histogram step.

    Args:
        rows: variable -> ``[(step, counts)]``.
        step: the histogram step.

    Returns:
        ``{"step", "variables", "shares": [[share per bin]], "elements": [count]}``
        for the variables with a histogram at that step, sorted by name.
    """
    names, shares, elements = [], [], []
    for name, points in sorted(rows.items()):
        counts = dict(points).get(step)
        if counts is None:
            continue
        total = float(counts.sum())
        names.append(name)
        elements.append(int(total))
        shares.append([round(c / total, 6) if total else 0.0 for c in counts.tolist()])
    return {"step": step, "variables": names, "shares": shares, "elements": elements}


def histogram_steps(rows: dict[str, list[tuple[int, np.ndarray]]]) -> list[int]:
    """Every step at which some variable of a group has a histogram, in order."""
    return sorted({step for points in rows.values() for step, _ in points})


def headroom_grid(
    rows: dict[str, list[tuple[int, np.ndarray]]], leave_out: dict[str, str]
) -> dict[str, Any] | None:
    """Whole bits of headroom to float16's max per variable and histogram step.

    Float16's max describes float16 layers only: the variables of ``leave_out``
    (their layers compute in another dtype) are not in the grid but named beside it.

    Args:
        rows: variable -> ``[(step, counts)]``.
        leave_out: variable -> compute dtype of its layer, for variables not in float16.

    Returns:
        ``{"steps", "names", "bits", "left_out"}`` (``bits``: one row per name, one
        value per step, ``"nonfinite"`` for inf/NaN, :data:`ALL_ZERO` for a histogram of
        zeros only, None without a histogram);
        ``left_out``: the variables of ``rows`` in ``leave_out``, with their dtype.
        None when ``rows`` is empty.
    """
    if not rows:
        return None
    steps = histogram_steps(rows)
    if len(steps) > MAX_HEADROOM_STEPS:
        picked = np.unique(np.linspace(0, len(steps) - 1, MAX_HEADROOM_STEPS).round().astype(int))
        steps = [steps[i] for i in picked]
    names = sorted(name for name in rows if name not in leave_out)
    grid = []
    for name in names:
        by_step = dict(rows[name])
        grid.append([_bits(by_step.get(step)) for step in steps])
    left_out = {name: leave_out[name] for name in sorted(rows) if name in leave_out}
    return {"steps": steps, "names": names, "bits": grid, "left_out": left_out}


def _bits(counts: np.ndarray | None) -> float | str | None:
    if counts is None:
        return None
    bits = headroom_bits(counts)
    if bits is None:
        return ALL_ZERO
    return "nonfinite" if bits == -math.inf else bits


def _activation_bits(value: float | None, nonfinite: float | None) -> float | str | None:
    """A recorded activation headroom as a grid cell.

    ``"nonfinite"`` when the output held inf/NaN at that step (its headroom is of the
    finite values only: an output all NaN reads as the cap), else :data:`ALL_ZERO` at the
    cap, else the headroom; None when not measured.
    """
    if value is None or not math.isfinite(value):
        return None
    if nonfinite is not None and nonfinite != 0.0:
        return "nonfinite"
    return ALL_ZERO if value >= ALL_ZERO_BITS - 1e-4 else value  # float32 as written


def _by_step(series: report.Series | None) -> dict[int, float]:
    if series is None:
        return {}
    return dict(zip(series.steps.tolist(), series.values.tolist(), strict=True))


def _activation_grid(log: report.KmixLog, limit: int) -> dict[str, Any] | None:
    layers = sorted(t for t in log.scalars if t.startswith(ACTIVATION_HEADROOM))
    if not layers:
        return None
    steps = sorted({int(s) for t in layers for s in log.scalars[t].steps})
    if len(steps) > limit:
        picked = np.unique(np.linspace(0, len(steps) - 1, limit).round().astype(int))
        steps = [steps[i] for i in picked]
    names = [t[len(ACTIVATION_HEADROOM) :] for t in layers]
    grid = []
    for name in names:
        bits, nonfinite = (
            _by_step(log.scalars.get(prefix + name))
            for prefix in (ACTIVATION_HEADROOM, tags.ACTIVATION_NONFINITE_FRACTION)
        )
        grid.append([_activation_bits(bits.get(step), nonfinite.get(step)) for step in steps])
    return {"steps": steps, "names": names, "bits": json_ready(grid)}


def _begin(log: report.KmixLog) -> dict[str, Any] | None:
    begin = begin_scale(log)
    return None if begin is None else {"step": begin[0], "value": begin[1]}


def default_run(runs: list[str], records: dict[str, tags.PolicyRecord]) -> str | None:
    """The run the tab ticks when it opens: the first that computes in float16.

    A ``kmix compare`` log dir sorts ``float32/train`` first, where every float16 view
    is empty; the float16 run is the one worth opening on.

    Args:
        runs: the runs with kmix data, in the order listed.
        records: run -> its latest policy record, for the runs that have one.

    Returns:
        The first run whose record says it computes in float16, else the first run;
        None when there is none.
    """
    for run in runs:
        if float16_in_use(records.get(run)):
            return run
    return runs[0] if runs else None


def float16_note(summary: report.Summary) -> str | None:
    """What the float16 views say of a run that computes nothing in float16.

    Args:
        summary: the run's summary.

    Returns:
        The sentence, or None when the run computes in float16 or its policy record
        is missing (then float16's views advise as usual).
    """
    record = summary.policy_record
    if float16_in_use(record) is not False:
        return None
    dtype = record.compute_dtype
    return (
        f"float16's statistics do not apply to a {dtype} run: it computes in {dtype} "
        "(its policy record says so), so float16's range, headroom and exponent bands say "
        "nothing about it"
    )


def loss_scale_note(summary: report.Summary) -> str | None:
    """Why no loss-scale line is drawn (:func:`kmix.report.loss_scale_unused`), or None."""
    unused = report.loss_scale_unused(summary)
    return None if unused is None else f"The loss scale is not used: {unused}"


def events_check(summary: dict[str, Any]) -> dict[str, Any]:
    """Whether every skipped step has its event line, and what to do if not.

    TensorBoard keeps :data:`TEXT_SAMPLES_DEFAULT` points per text tag unless it is
    started with ``--samples_per_plugin=text=0``; the skipped-step counter tells
    how many skip events there were.

    Args:
        summary: the report's summary dict.

    Returns:
        ``{"complete": bool, "shown": int, "skipped_steps": int, "message": str|None}``.
    """
    shown = sum(e["kind"] in tags.SKIP_KINDS for e in summary["events"])
    skipped = int(summary["skipped_steps"] or 0)
    lost = int(summary.get("events_lost") or 0)
    complete = shown + lost >= skipped
    message = None
    if lost:
        message = (
            f"{lost} scale events were lost before they were written: the optimizer's "
            "event ring filled up between two reads. Lower `update_freq` or raise "
            "`event_capacity` of kmix.LossScaleOptimizer."
        )
    if not complete:
        message = (
            f"TensorBoard kept {len(summary['events'])} event lines, {shown} of them for "
            f"the {skipped} skipped steps: it samples text summaries to "
            f"{TEXT_SAMPLES_DEFAULT} per tag. Restart it with "
            "--samples_per_plugin=text=0 to see every event, or run `kmix report LOGDIR`."
        )
    return {"complete": complete, "shown": shown, "skipped_steps": skipped, "message": message}


def run_payload(points: RunPoints, limit: int = DEFAULT_POINTS) -> dict[str, Any]:
    """Everything the tab draws for one run, at most about ``limit`` points per series.

    Args:
        points: the run's raw points.
        limit: points per series, in ``[MIN_POINTS, MAX_POINTS]``.

    Returns:
        A JSON-ready dict: ``run``, ``empty``, and for a run with kmix data
        ``summary`` (the report's), ``event_lines`` (one per event of the summary:
        :func:`event_lines`), ``precision_lines`` (one per move of
        ``summary["precision_moves"]``, :func:`kmix.tags.format_precision_move`) and
        ``precision_code`` (the plan's ``apply_plan`` code, None without moves),
        ``events_check``, ``series``, ``exponents`` (histogram
        ``steps`` and the gradient ``heatmap`` at the latest, or None; the page
        draws the variables of ``summary["variables_not_float16"]`` apart, without
        float16's limits), ``headroom_by_variable`` (:func:`headroom_grid`),
        ``scale_caveat`` (what the loss-scale line cannot say, as ``kmix report``
        words it), ``processes`` (what it says of the processes and devices, or None),
        ``loss_scale_begin`` (``{"step", "value"}`` of the scale written at
        train begin, or None), ``events_lost_between`` (``[first, last]`` steps of
        each stretch whose scale is unknown: events were lost,
        :meth:`kmix.report.read.EventLog.unknown_scale`), ``activation_headroom``
        (layers x steps like :func:`headroom_grid`, :data:`ALL_ZERO` for an all-zero
        output), ``float16``, ``float16_note`` (:func:`float16_note`) and
        ``loss_scale_note`` (:func:`loss_scale_note`); ``runs_note``: what the report
        says when the directory holds several kmix runs (the summary is of the latest,
        ``summary["runs"]`` lists them), else None; ``float8``: the Float8 section
        (:func:`kmix.tbplugin.float8.float8_payload`), None without float8 layers.
    """
    if points.empty:
        return {
            "run": points.run,
            "empty": True,
            "message": (
                f"Run {points.run} has no kmix data: no kmix/ tags. Train with "
                "kmix.callbacks.MixedPrecisionMonitor(log_dir) to record them."
            ),
        }
    log = to_log(points)
    typed = report.summarize(log)
    summary = typed.to_dict()
    exponents = None
    if log.histograms:
        steps = histogram_steps(log.histograms)
        exponents = {"steps": steps, "heatmap": heatmap(log.histograms, steps[-1])}
    payload = {
        "run": points.run,
        "empty": False,
        "summary": summary,
        "event_lines": event_lines(typed),
        "precision_lines": [tags.format_precision_move(m) for m in typed.precision_moves],
        "precision_code": typed.precision_plan.code() if typed.precision_moves else None,
        "events_check": events_check(summary),
        "series": {
            key: _series(
                log.scalars.get(tag), limit, steplike=key in ("loss_scale", "skipped_steps")
            )
            for key, tag in SERIES_TAGS.items()
        },
        "exponents": exponents,
        "headroom_by_variable": headroom_grid(log.histograms, typed.variables_not_float16),
        "scale_caveat": scale_caveat(typed),
        "processes": report.processes_words(typed),
        "runs_note": runs_message(typed.run, typed.runs),
        "loss_scale_begin": _begin(log),
        "events_lost_between": [list(pair) for pair in scale_events_of(log).unknown_scale()],
        "activation_headroom": _activation_grid(log, MAX_HEADROOM_STEPS),
        "float16_note": float16_note(typed),
        "loss_scale_note": loss_scale_note(typed),
        "float8": float8_payload(log, typed, MAX_HEADROOM_STEPS),
        "float16": {
            "min_subnormal_exponent": tags.FLOAT16_MIN_SUBNORMAL_EXPONENT,
            "min_normal_exponent": tags.FLOAT16_MIN_NORMAL_EXPONENT,
            "max_exponent": tags.FLOAT16_MAX_EXPONENT,
            "max": 65504.0,
            "exponent_min": tags.EXPONENT_MIN,
            "exponent_max": tags.EXPONENT_MAX,
            "bins": tags.NUM_EXPONENT_BINS,
        },
    }
    return json_ready(payload)
