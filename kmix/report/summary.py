"""A typed :class:`Summary` of a run, from a :class:`~kmix.report.read.KmixLog`.

Free of printing and matplotlib: the TensorBoard plugin reuses it. The typed values
(:class:`Summary`, :class:`Trend`, ...) live in :mod:`kmix.report.values` and are
importable from here too; JSON through :meth:`Summary.to_dict` (the contract of
``kmix report --json``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from typing import Any

import numpy as np

from kmix import tags
from kmix.report.finding_rules import HEADROOM_WARN_BITS, findings
from kmix.report.float8 import output_gradient_headroom, summarize_float8
from kmix.report.read import EventLog, KmixLog, Series, scale_events_of
from kmix.report.values import (
    ExponentShares,
    Finding,
    Forecast,
    LossScale,
    Note,
    Summary,
    Trend,
)
from kmix.report.whatif import whatif
from kmix.tags import ScaleEvent

__all__ = [
    "FORECAST_HORIZON",
    "FORECAST_MIN_POINTS",
    "FORECAST_MIN_R2",
    "TREND_TAGS",
    "UNDERFLOW_SPLIT_TAGS",
    "ExponentShares",
    "Finding",
    "Forecast",
    "LossScale",
    "Note",
    "Summary",
    "Trend",
    "begin_scale",
    "compute_dtype",
    "exponent_shares",
    "forecast_zero_crossing",
    "summarize",
    "variables_not_float16",
]

TREND_TAGS = {
    "overflow_headroom_bits": tags.OVERFLOW_HEADROOM_BITS,
    "underflow_fraction": tags.UNDERFLOW_FRACTION,
    "grad_norm": tags.GRAD_NORM,
}
"""Summary key -> scalar tag of the gradient-health trends."""

UNDERFLOW_SPLIT_TAGS = {
    "zero_fraction": tags.ZERO_FRACTION,
    "subnormal_fraction": tags.SUBNORMAL_FRACTION,
}
"""Summary key -> scalar tag of the two parts of the underflow fraction."""

FORECAST_MIN_POINTS = 6
FORECAST_MIN_R2 = 0.5
"""A forecast needs at least this many points, and a fit explaining this share of their variance."""
FORECAST_HORIZON = 1.0
"""A forecast reaches no further ahead of the last reading than this many times the span of
the readings it was fitted on. Early training often lowers headroom quickly for a while
and then levels off; a line through that stretch, carried far beyond it, would warn of an
overflow that never comes."""

_MODEL_POLICY = re.compile(r"model `[^`]*` policy `([^`]+)`")


def summarize(log: KmixLog) -> Summary:
    """Summarizes a run: steps, loss scale, skips, events, health trends, findings.

    Args:
        log: what :func:`kmix.report.read_log` (or :func:`kmix.report.build_log`) returned.

    Returns:
        The :class:`Summary`, its ``findings`` filled in.
    """
    read = scale_events_of(log)
    events, notes, lost = _events_and_notes(log, read)
    scale = log.scalars.get(tags.LOSS_SCALE)
    recent = log.scalars.get(tags.SKIP_RATE)
    steps_seen = _steps_seen(log, events)
    skipped = _skipped_steps(log.scalars.get(tags.SKIPPED_STEPS), events)
    policy = _latest_text(log, tags.POLICY)
    records = _records(log, tags.POLICY_RECORD, tags.parse_policy_record)
    record = records[-1][1] if records else None
    begin = begin_scale(log)
    other = variables_not_float16(record)
    if record is not None:
        dtype: str | None = record.compute_dtype
    else:
        dtype = None if policy is None else compute_dtype(policy)
    activation = {
        tag[len(tags.ACTIVATION_HEADROOM_BITS) :]: _trend(series)
        for tag, series in log.scalars.items()
        if tag.startswith(tags.ACTIVATION_HEADROOM_BITS)
    }
    activation = dict(
        sorted(activation.items(), key=lambda item: (item[1].last is None, item[1].last or 0.0))
    )
    summary = Summary(
        logdir=log.path,
        steps_seen=steps_seen,
        loss_scale=_loss_scale(scale, events, begin, [n for _, n in read.lost_between]),
        skipped_steps=skipped,
        skip_rate=skipped / steps_seen if steps_seen else 0.0,
        recent_skip_rate=None if recent is None else _finite(recent.values[-1]),
        events=tuple(events),
        event_counts=dict(Counter(event.kind for event in events)),
        trends={key: _trend(log.scalars.get(tag)) for key, tag in TREND_TAGS.items()},
        underflow_by_variable=_latest_by_variable(log, tags.UNDERFLOW_BY_VARIABLE, other),
        gradient_exponents={
            variable: exponent_shares(*points[-1])
            for variable, points in log.histograms.items()
            if variable not in other
        },
        policy=policy,
        compute_dtype=dtype,
        notes=tuple(notes),
        events_lost=lost,
        policy_record=record,
        run_end=_latest_record(log, tags.RUN_END, tags.parse_run_end),
        underflow_split={
            key: _trend(log.scalars.get(tag)) for key, tag in UNDERFLOW_SPLIT_TAGS.items()
        },
        subnormal_by_variable=_latest_by_variable(log, tags.SUBNORMAL_BY_VARIABLE, other),
        activation_headroom=activation,
        min_activation_headroom=_trend(log.scalars.get(tags.MIN_ACTIVATION_HEADROOM_BITS)),
        forecasts=_forecasts(log),
        precision_whatif={"gradients": whatif(log.histograms, output_gradient_headroom(log))},
        variables_not_float16=_measured(other, log),
        run=log.run,
        runs=log.runs,
        precision_moves=tuple(
            record.move
            for _, record in _records(
                log, tags.PRECISION_MOVE_RECORD, tags.parse_precision_move_record
            )
        ),
        float16_share=_trend(log.scalars.get(tags.FLOAT16_SHARE)),
        float8=summarize_float8(log, tuple(events)),
    )
    return dataclasses.replace(summary, findings=tuple(findings(summary)))


# ------------------------------------------------------------------- pieces
def _latest_text(log: KmixLog, tag: str) -> str | None:
    points = log.texts.get(tag)
    return points[-1][1] if points else None


def _latest_record(log: KmixLog, tag: str, parse: Any) -> Any:
    """The latest text of ``tag`` that parses as a record (the last run of a resumed log)."""
    records = _records(log, tag, parse)
    return records[-1][1] if records else None


def _records(log: KmixLog, tag: str, parse: Any) -> list[tuple[int, Any]]:
    """``(step, record)`` of every text of ``tag`` that parses as a record, in step order."""
    parsed = ((step, parse(text)) for step, text in log.texts.get(tag, []))
    return [(step, record) for step, record in parsed if record is not None]


def begin_scale(log: KmixLog) -> tuple[int, float] | None:
    """The loss scale written at the first train begin of a log, and that step.

    Args:
        log: the log.

    Returns:
        ``(step, scale)`` of the earliest policy record that holds a scale (the
        scale before the first step after it); None in logs without one.
    """
    records = _records(log, tags.POLICY_RECORD, tags.parse_policy_record)
    return next(((step, r.loss_scale) for step, r in records if r.loss_scale is not None), None)


def variables_not_float16(record: tags.PolicyRecord | None) -> dict[str, str]:
    """The variables a policy record says compute in another dtype than float16.

    Args:
        record: the run's policy record, or None.

    Returns:
        Variable path -> compute dtype of its layer, for every variable recorded
        with a dtype other than ``"float16"``; empty when the record holds no
        dtypes (logs written before ``variable_dtypes``: every variable is then
        treated as before, by the model's compute dtype).
    """
    dtypes = None if record is None else record.variable_dtypes
    return {path: dtype for path, dtype in (dtypes or {}).items() if dtype != "float16"}


def _measured(other: dict[str, str], log: KmixLog) -> dict[str, str]:
    """The variables of ``other`` that the log holds a float16 range statistic of."""
    measured = set(log.histograms)
    for prefix in (tags.UNDERFLOW_BY_VARIABLE, tags.SUBNORMAL_BY_VARIABLE):
        measured |= {tag[len(prefix) :] for tag in log.scalars if tag.startswith(prefix)}
    return {path: dtype for path, dtype in other.items() if path in measured}


def _events_and_notes(log: KmixLog, read: EventLog) -> tuple[list[ScaleEvent], list[Note], int]:
    """Events (each once, in step order), notes, and how many events were said lost.

    The events are :func:`kmix.report.read.scale_events_of`'s (``read``); the notes are
    its lines beside the events (lost-event notes) and the writer's ``kmix/notes``,
    in step order.
    """
    notes = [Note(step, text) for step, text in read.notes]
    notes += [Note(step, text) for step, text in log.texts.get(tags.NOTES, [])]
    notes.sort(key=lambda note: note.step)
    return list(read.events), notes, read.lost


def _steps_seen(log: KmixLog, events: list[ScaleEvent]) -> int:
    last = [int(series.steps[-1]) for series in log.scalars.values()]
    last += [points[-1][0] for points in log.histograms.values()]
    last += [event.step for event in events[-1:]]
    return max(last, default=0)


def _skipped_steps(series: Series | None, events: list[ScaleEvent]) -> int:
    """The counter's last value, plus skip events logged after it was last written."""
    counted, since = (0, 0) if series is None else (int(series.values[-1]), int(series.steps[-1]))
    return counted + sum(e.kind in tags.SKIP_KINDS and e.step > since for e in events)


def _loss_scale(
    series: Series | None,
    events: list[ScaleEvent],
    begin: tuple[int, float] | None,
    lost: list[tags.EventsLost],
) -> LossScale:
    """Initial, final, min and max scale from what the log holds, none made up.

    The known scales are ``(step, scale after that step)`` points: the scale written
    at train begin (``begin``), the ``kmix/loss_scale`` points, and each event's old
    scale (at the step before it) and new scale. The initial scale is the earliest of
    them, the final the latest (on a tie the scalar's point wins, as it is read after
    the events). When events were lost before the earliest known scale, the log lost
    its beginning: initial, min and max are then unknown (None).
    """
    points = [] if begin is None else [(begin[0], 0, float(begin[1]))]
    if series is not None:
        points += [(int(s), 2, float(v)) for s, v in zip(series.steps, series.values, strict=True)]
    for event in events:
        points += [(event.step - 1, 1, event.old_scale), (event.step, 1, event.new_scale)]
    if not points:
        return LossScale(None, None, None, None)
    first = min(points, key=lambda point: (point[0], point[1] != 0, -point[1]))
    final = max(points, key=lambda point: (point[0], point[1]))[2]
    if any(note.after_step < first[0] for note in lost):
        return LossScale(None, _finite(final), None, None)
    values = [value for _, _, value in points]
    return LossScale(_finite(first[2]), _finite(final), _finite(min(values)), _finite(max(values)))


def _trend(series: Series | None) -> Trend | None:
    """First, last, min, max over finite points, and the direction of the change."""
    if series is None:
        return None
    finite = np.isfinite(series.values)
    values = series.values[finite]
    counts = {
        "points": int(series.values.size),
        "nonfinite_points": int((~finite).sum()),
        "first_step": int(series.steps[0]),
        "last_step": int(series.steps[-1]),
    }
    if values.size == 0:
        return Trend(**counts, first=None, last=None, min=None, max=None, direction=None)
    return Trend(
        **counts,
        first=float(values[0]),
        last=float(values[-1]),
        min=float(values.min()),
        max=float(values.max()),
        direction=_direction(values),
    )


def _direction(values: np.ndarray) -> str:
    """``"rising"``, ``"falling"`` or ``"steady"``: second half's mean vs the first half's.

    A change below 5% of the largest absolute value counts as steady.
    """
    if values.size < 2:
        return "steady"
    half = values.size // 2
    change = values[values.size - half :].mean() - values[:half].mean()
    if abs(change) <= 0.05 * max(np.abs(values).max(), 1e-30):
        return "steady"
    return "rising" if change > 0 else "falling"


def _latest_by_variable(
    log: KmixLog, prefix: str, leave_out: dict[str, str]
) -> dict[str, float | None]:
    latest = {
        tag[len(prefix) :]: _finite(series.values[-1])
        for tag, series in log.scalars.items()
        if tag.startswith(prefix) and tag[len(prefix) :] not in leave_out
    }
    return dict(sorted(latest.items(), key=lambda item: -(item[1] or 0.0)))


def compute_dtype(policy_text: str) -> str | None:
    """The model's compute dtype from the prose of ``kmix/policy`` (logs of kmix 0.1.0).

    Newer logs hold a :class:`kmix.tags.PolicyRecord`, which the summary reads
    instead; this is the one place that reads the prose.

    Args:
        policy_text: the text, which names the model's policy as ``policy `NAME```.

    Returns:
        ``"float16"``, ``"bfloat16"``, ``"float32"``...; None if the text names none.
    """
    match = _MODEL_POLICY.search(policy_text)
    return None if match is None else match[1].removeprefix("mixed_")


def exponent_shares(step: int, counts: np.ndarray) -> ExponentShares:
    """Splits one exponent histogram into the ranges that matter for float16.

    Args:
        step: the step of the histogram.
        counts: one count per exponent bin of :mod:`kmix.tags`.

    Returns:
        The :class:`ExponentShares`: ``step``, ``elements``, and the share of
        elements that are ``zero``, non-zero but ``below_normal`` (below
        ``2**-14``, where float16 loses precision and then flushes to zero),
        ``in_range`` (normal float16 values), ``above_max`` (finite, ``2**16`` or
        more) and ``nonfinite`` (inf/NaN).
    """
    normal = tags.exponent_bin(tags.FLOAT16_MIN_NORMAL_EXPONENT)
    overflow = tags.exponent_bin(tags.FLOAT16_MAX_EXPONENT + 1)
    total = float(counts.sum())
    parts = (
        counts[0],
        counts[1:normal].sum(),
        counts[normal:overflow].sum(),
        counts[overflow:-1].sum(),
        counts[-1],
    )
    shares = (float(value) / total if total else 0.0 for value in parts)
    return ExponentShares(int(step), int(total), *shares)


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


# ------------------------------------------------------------------ forecast
def forecast_zero_crossing(
    steps: np.ndarray, values: np.ndarray, min_points: int = FORECAST_MIN_POINTS
) -> tuple[float, float, int] | None:
    """Where a steadily falling series would reach 0, by least squares on its latest half.

    The fit takes the latest half of the finite points, at least ``min_points``,
    and fits ``value = slope * step + intercept``. The series falls steadily when
    the slope is negative and the line explains at least :data:`FORECAST_MIN_R2`
    of the points' variance. The crossing is told only when it lies within
    :data:`FORECAST_HORIZON` times the fitted steps' span after the last of them.

    Args:
        steps: the steps, increasing.
        values: one value per step (non-finite ones are left out).
        min_points: the fewest points to fit, >= 2.

    Returns:
        ``(zero_step, slope, points)``: the step at which the line reaches 0
        (after the last step fitted), its slope and how many points were fitted;
        None when there are too few points, the series is not falling steadily, the
        line is at or below 0 already, or the crossing lies beyond the horizon.
    """
    steps = np.asarray(steps, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    steps, values = steps[finite], values[finite]
    if values.size < max(min_points, 2):
        return None
    count = max(min_points, math.ceil(values.size / 2))
    x, y = steps[-count:], values[-count:]
    dx, dy = x - x.mean(), y - y.mean()
    spread = float((dx * dx).sum())
    if spread == 0.0:
        return None
    slope = float((dx * dy).sum()) / spread
    intercept = float(y.mean()) - slope * float(x.mean())
    total = float((dy * dy).sum())
    residual = float(((y - (slope * x + intercept)) ** 2).sum())
    if slope >= 0 or total == 0.0 or 1.0 - residual / total < FORECAST_MIN_R2:
        return None
    zero = -intercept / slope
    if zero <= x[-1] or zero - x[-1] > FORECAST_HORIZON * (x[-1] - x[0]):
        return None
    return zero, slope, int(count)


def _forecasts(log: KmixLog) -> tuple[Forecast, ...]:
    """Forecasts for each layer's activation headroom.

    Only for series whose latest value is still at or above ``HEADROOM_WARN_BITS``
    (below it, the headroom findings warn already). Not for the gradients' headroom:
    under dynamic loss scaling it falls toward 0 and bounces back on every run (the scale
    grows until the largest gradient nears float16's max, then backs off).
    """
    series = [
        (f"activations of {tag[len(tags.ACTIVATION_HEADROOM_BITS) :]}", values)
        for tag, values in sorted(log.scalars.items())
        if tag.startswith(tags.ACTIVATION_HEADROOM_BITS)
    ]
    found = []
    for name, values in series:
        if values is None:
            continue
        finite = values.values[np.isfinite(values.values)]
        if finite.size == 0 or finite[-1] < HEADROOM_WARN_BITS:
            continue
        fit = forecast_zero_crossing(values.steps, values.values)
        if fit is not None:
            zero, slope, points = fit
            last = np.nonzero(np.isfinite(values.values))[0][-1]
            found.append(
                Forecast(
                    series=name,
                    zero_step=int(round(zero)),
                    bits_per_step=slope,
                    last_step=int(values.steps[last]),
                    last_bits=float(values.values[last]),
                    points=points,
                )
            )
    return tuple(found)
