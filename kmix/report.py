"""Read kmix's TensorBoard logs back: a summary, findings in plain words, PNG plots.

This is what ``kmix report LOGDIR`` runs. It reads the event files with
TensorBoard's own reader and imports neither TensorFlow nor Keras (TensorBoard
falls back to its stub once :func:`avoid_tensorflow` has been called), so it is
quick to start and works on a machine that only has TensorBoard.

Example:
    >>> from kmix import report
    >>> log = report.read_log("runs/demo")                    # doctest: +SKIP
    >>> summary = report.summarize(log)                       # doctest: +SKIP
    >>> print(report.format_summary(summary))                 # doctest: +SKIP
    >>> report.write_plots(log, summary, "runs/demo/report")  # doctest: +SKIP

Findings come from the small rules in :data:`RULES`; each reads the summary and
returns findings. Their thresholds:

* a variable with more than :data:`UNDERFLOW_WARN_FRACTION` of its scaled gradient
  elements at zero or below float16's smallest normal (``2**-14``): with exponent
  histograms, a warning that the scale is too low for it when the non-zero tiny
  values alone pass the threshold, else a note that its gradients are mostly exact
  zeros (inactive units, which no scale changes); without histograms, a warning
  that says zeros are included;
* an overflow headroom below :data:`HEADROOM_WARN_BITS` bits at the last reading:
  the largest scaled gradient is close to float16's maximum;
* more than :data:`SKIP_RATE_WARN` of all steps skipped, or more than
  :data:`RECENT_SKIP_RATE_WARN` of the latest window: the scale keeps backing off;
* any non-finite loss: the forward pass made the NaN/Inf, no scale can fix it;
* any overflow at ``min_scale``: the gradients overflow even at the lowest scale;
* for information: the first overflow episode and the recovery from it, the
  variable most often first non-finite, and the monitor's notes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from kmix import tags

UNDERFLOW_WARN_FRACTION = 0.25
HEADROOM_WARN_BITS = 1.0
SKIP_RATE_WARN = 0.05
RECENT_SKIP_RATE_WARN = 0.5
HEADROOM_TIGHT_BITS = 4.0

SKIP_KINDS = tags.SKIP_KINDS
"""Event kinds that mark a skipped step."""

TREND_TAGS = {
    "overflow_headroom_bits": tags.OVERFLOW_HEADROOM_BITS,
    "underflow_fraction": tags.UNDERFLOW_FRACTION,
    "grad_norm": tags.GRAD_NORM,
}
"""Summary key -> scalar tag of the gradient-health trends."""

PLOT_FILES = ("loss_scale.png", "health.png", "grad_exponents.png")

_MODEL_POLICY = re.compile(r"model `[^`]*` policy `([^`]+)`")

EXPECTED = (
    "TensorBoard event files with kmix/ tags under {train} "
    "(written by kmix.callbacks.MixedPrecisionMonitor)"
)


class ReportError(ValueError):
    """A log dir that cannot be reported on; the message names the path and what was expected."""


@dataclasses.dataclass(frozen=True)
class Series:
    """One scalar tag: steps in increasing order (one value per step, the last written).

    Attributes:
        steps: int64 steps.
        values: float64 values, one per step.
    """

    steps: np.ndarray
    values: np.ndarray


@dataclasses.dataclass(frozen=True)
class KmixLog:
    """The kmix data read from one log dir.

    Attributes:
        path: the directory the event files were read from (usually ``LOGDIR/train``).
        scalars: scalar tag -> :class:`Series`.
        histograms: variable path -> ``[(step, counts)]`` in step order; ``counts``
            has one entry per exponent bin of :mod:`kmix.tags`.
        texts: text tag -> ``[(step, text)]`` in step order.
    """

    path: str
    scalars: dict[str, Series]
    histograms: dict[str, list[tuple[int, np.ndarray]]]
    texts: dict[str, list[tuple[int, str]]]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One observation about the run.

    Attributes:
        severity: ``"warning"`` (something to act on) or ``"info"``.
        rule: the name of the rule that made it.
        message: the observation and what it means, in plain words.
    """

    severity: str
    rule: str
    message: str


# ---------------------------------------------------------------------- reading
def avoid_tensorflow() -> None:
    """Makes TensorBoard read event files with its TF-free stub in this process.

    TensorBoard's reader imports TensorFlow when it is installed, which takes
    seconds. ``kmix report`` calls this first; it does nothing once TensorFlow is
    imported. Do not call it in a process that will write summaries with
    TensorFlow afterwards: TensorBoard's summary ops would then find the stub.
    """
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))


def read_log(logdir: str) -> KmixLog:
    """Reads the kmix data of a log dir, also one that is still being written.

    Args:
        logdir: the ``log_dir`` given to ``MixedPrecisionMonitor``; its ``train``
            subdirectory is read. A directory that holds the event files itself
            (e.g. ``LOGDIR/train``) is accepted too.

    Returns:
        A :class:`KmixLog`.

    Raises:
        ReportError: the path is missing, not a directory, unreadable, empty, or
            holds no kmix data.
    """
    train = os.path.join(logdir, tags.TRAIN_DIR)
    expected = EXPECTED.format(train=train)
    if not os.path.exists(logdir):
        raise ReportError(f"{logdir} does not exist: expected a log dir with {expected}")
    if not os.path.isdir(logdir):
        raise ReportError(f"{logdir} is not a directory: expected a log dir with {expected}")
    try:
        empty = not os.listdir(logdir)
    except OSError as error:
        raise ReportError(
            f"{logdir} cannot be read ({error.strerror}): expected {expected}"
        ) from error
    if empty:
        raise ReportError(f"{logdir} is empty: expected {expected}")
    for path in (train, logdir):
        if os.path.isdir(path):
            log = _read_dir(path)
            if log.scalars or log.histograms or log.texts:
                return log
    raise ReportError(f"no kmix data in {logdir}: expected {expected}")


def _read_dir(path: str) -> KmixLog:
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    keep_all = {ea.SCALARS: 0, ea.TENSORS: 0}  # 0: every point, none sampled away
    accumulator = ea.EventAccumulator(path, size_guidance=keep_all)
    accumulator.Reload()
    found = accumulator.Tags()
    scalars: dict[str, list[tuple[int, float]]] = {}
    histograms: dict[str, list[tuple[int, np.ndarray]]] = {}
    texts: dict[str, list[tuple[int, str]]] = {}
    for tag in found.get(ea.SCALARS, []):  # summaries written as simple_value
        if tag.startswith(tags.PREFIX):
            scalars[tag] = [(e.step, e.value) for e in accumulator.Scalars(tag)]
    for tag in found.get(ea.TENSORS, []):
        if not tag.startswith(tags.PREFIX):
            continue
        plugin = accumulator.SummaryMetadata(tag).plugin_data.plugin_name
        points = [
            (e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)
        ]
        if plugin == "histograms" and tag.startswith(tags.GRAD_EXPONENT):
            variable = tag[len(tags.GRAD_EXPONENT) :]
            histograms[variable] = [(step, _exponent_counts(value)) for step, value in points]
        elif plugin == "text":
            texts[tag] = [(step, _text(value)) for step, value in points]
        elif plugin == "scalars" or np.ndim(points[0][1]) == 0:
            scalars[tag] = [(step, float(value)) for step, value in points]
    return KmixLog(
        path=path,
        scalars={tag: _series(points) for tag, points in scalars.items() if points},
        histograms={k: sorted(v, key=lambda p: p[0]) for k, v in histograms.items()},
        texts={k: sorted(v, key=lambda p: p[0]) for k, v in texts.items()},
    )


def _series(points: list[tuple[int, float]]) -> Series:
    by_step = dict(sorted(points, key=lambda p: p[0]))  # stable: the last write per step wins
    return Series(
        steps=np.fromiter(by_step.keys(), dtype=np.int64),
        values=np.fromiter(by_step.values(), dtype=np.float64),
    )


def _text(value: np.ndarray) -> str:
    items = [
        v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in np.ravel(value)
    ]
    return "\n".join(items)


def _exponent_counts(value: np.ndarray) -> np.ndarray:
    """Maps a ``[k, 3]`` (left, right, count) histogram onto the kmix exponent bins."""
    counts = np.zeros(tags.NUM_EXPONENT_BINS, dtype=np.float64)
    first_left = tags.exponent_bucket_edges()[0][0]
    for left, _, count in np.reshape(value, (-1, 3)):
        index = int(round(left - first_left))
        if 0 <= index < tags.NUM_EXPONENT_BINS:
            counts[index] += count
    return counts


# -------------------------------------------------------------------- summary
def summarize(log: KmixLog) -> dict[str, Any]:
    """Summarizes a run: steps, loss scale, skips, events, health trends, findings.

    Args:
        log: what :func:`read_log` returned.

    Returns:
        A JSON-ready dict (non-finite numbers become ``None``) with the keys
        ``logdir``, ``steps_seen``, ``loss_scale`` (``initial``, ``final``,
        ``min``, ``max``), ``skipped_steps``, ``skip_rate``, ``recent_skip_rate``,
        ``events``, ``event_counts``, ``trends``, ``underflow_by_variable``,
        ``gradient_exponents`` (see :func:`exponent_shares`), ``policy``,
        ``compute_dtype``, ``notes`` and ``findings``.
    """
    events, notes = _events_and_notes(log)
    scale = log.scalars.get(tags.LOSS_SCALE)
    skipped_series = log.scalars.get(tags.SKIPPED_STEPS)
    recent = log.scalars.get(tags.SKIP_RATE)
    steps_seen = _steps_seen(log, events)
    skipped = _skipped_steps(skipped_series, events)
    policy = log.texts.get(tags.POLICY)
    summary: dict[str, Any] = {
        "logdir": log.path,
        "steps_seen": steps_seen,
        "loss_scale": _loss_scale(scale, events),
        "skipped_steps": skipped,
        "skip_rate": skipped / steps_seen if steps_seen else 0.0,
        "recent_skip_rate": None if recent is None else _finite(recent.values[-1]),
        "events": events,
        "event_counts": dict(Counter(event["kind"] for event in events)),
        "trends": {key: _trend(log.scalars.get(tag)) for key, tag in TREND_TAGS.items()},
        "underflow_by_variable": _latest_by_variable(log),
        "gradient_exponents": {
            variable: exponent_shares(*points[-1]) for variable, points in log.histograms.items()
        },
        "policy": policy[-1][1] if policy else None,
        "compute_dtype": compute_dtype(policy[-1][1]) if policy else None,
        "notes": notes,
    }
    summary["findings"] = [dataclasses.asdict(f) for f in findings(summary)]
    return summary


def _events_and_notes(log: KmixLog) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    events, notes = [], []
    for step, text in log.texts.get(tags.EVENTS, []):
        for line in filter(None, (line.strip() for line in text.splitlines())):
            event = tags.parse_event(line)
            if event is None:
                notes.append({"step": step, "text": line})
            else:
                events.append(event)
    notes += [{"step": step, "text": text} for step, text in log.texts.get(tags.NOTES, [])]
    events.sort(key=lambda event: event["step"])
    notes.sort(key=lambda note: note["step"])
    return events, notes


def _steps_seen(log: KmixLog, events: list[dict[str, Any]]) -> int:
    last = [int(series.steps[-1]) for series in log.scalars.values()]
    last += [points[-1][0] for points in log.histograms.values()]
    last += [event["step"] for event in events[-1:]]
    return max(last, default=0)


def _skipped_steps(series: Series | None, events: list[dict[str, Any]]) -> int:
    """The counter's last value, plus skip events logged after it was last written."""
    counted, since = (0, 0) if series is None else (int(series.values[-1]), int(series.steps[-1]))
    return counted + sum(e["kind"] in SKIP_KINDS and e["step"] > since for e in events)


def _loss_scale(series: Series | None, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Initial, final, min and max scale from the scalar and the (complete) event list."""
    values = [] if series is None else list(series.values)
    values += [e[key] for e in events for key in ("old_scale", "new_scale")]
    if not values:
        return {"initial": None, "final": None, "min": None, "max": None}
    if events and (series is None or events[0]["step"] <= series.steps[0]):
        initial = events[0]["old_scale"]
    else:
        initial = series.values[0]
    if events and (series is None or events[-1]["step"] > series.steps[-1]):
        final = events[-1]["new_scale"]
    else:
        final = series.values[-1]
    return {
        "initial": _finite(initial),
        "final": _finite(final),
        "min": _finite(min(values)),
        "max": _finite(max(values)),
    }


def _trend(series: Series | None) -> dict[str, Any] | None:
    """First, last, min, max over finite points, and the direction of the change."""
    if series is None:
        return None
    finite = np.isfinite(series.values)
    values = series.values[finite]
    trend: dict[str, Any] = {
        "points": int(series.values.size),
        "nonfinite_points": int((~finite).sum()),
        "first_step": int(series.steps[0]),
        "last_step": int(series.steps[-1]),
    }
    if values.size == 0:
        return trend | dict.fromkeys(("first", "last", "min", "max", "direction"))
    return trend | {
        "first": float(values[0]),
        "last": float(values[-1]),
        "min": float(values.min()),
        "max": float(values.max()),
        "direction": _direction(values),
    }


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


def _latest_by_variable(log: KmixLog) -> dict[str, float | None]:
    latest = {
        tag[len(tags.UNDERFLOW_BY_VARIABLE) :]: _finite(series.values[-1])
        for tag, series in log.scalars.items()
        if tag.startswith(tags.UNDERFLOW_BY_VARIABLE)
    }
    return dict(sorted(latest.items(), key=lambda item: -(item[1] or 0.0)))


def compute_dtype(policy_text: str) -> str | None:
    """The model's compute dtype, read from the ``kmix/policy`` text of the monitor.

    Args:
        policy_text: the text, which names the model's policy as ``policy `NAME```.

    Returns:
        ``"float16"``, ``"bfloat16"``, ``"float32"``...; None if the text names none.
    """
    match = _MODEL_POLICY.search(policy_text)
    return None if match is None else match[1].removeprefix("mixed_")


def exponent_shares(step: int, counts: np.ndarray) -> dict[str, Any]:
    """Splits one exponent histogram into the ranges that matter for float16.

    Args:
        step: the step of the histogram.
        counts: one count per exponent bin of :mod:`kmix.tags`.

    Returns:
        ``step``, ``elements``, and the share of elements that are ``zero``,
        non-zero but ``below_normal`` (below ``2**-14``, where float16 loses
        precision and then flushes to zero), ``in_range`` (normal float16 values),
        ``above_max`` (finite, ``2**16`` or more) and ``nonfinite`` (inf/NaN).
    """
    normal = 2 + tags.FLOAT16_MIN_NORMAL_EXPONENT - tags.EXPONENT_MIN
    overflow = 2 + tags.FLOAT16_MAX_EXPONENT + 1 - tags.EXPONENT_MIN
    total = float(counts.sum())
    parts = {
        "zero": counts[0],
        "below_normal": counts[1:normal].sum(),
        "in_range": counts[normal:overflow].sum(),
        "above_max": counts[overflow:-1].sum(),
        "nonfinite": counts[-1],
    }
    shares = {key: float(value) / total if total else 0.0 for key, value in parts.items()}
    return {"step": int(step), "elements": int(total)} | shares


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


# ------------------------------------------------------------------- findings
def _percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%" if fraction < 0.1 else f"{100 * fraction:.0f}%"


def _steps_list(steps: list[int], limit: int = 5) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def _float16(summary: dict[str, Any]) -> bool:
    """Whether float16's limits apply: the model computes in float16, or it is unknown."""
    return summary["compute_dtype"] in (None, "float16")


def _rule_underflow(summary: dict[str, Any]) -> list[Finding]:
    """Underflow per variable, told apart into zeros and tiny values when histograms allow."""
    if not _float16(summary):
        return []
    found = []
    headroom = (summary["trends"]["overflow_headroom_bits"] or {}).get("last")
    for variable, fraction in summary["underflow_by_variable"].items():
        if fraction is None or fraction <= UNDERFLOW_WARN_FRACTION:
            continue
        shares = summary["gradient_exponents"].get(variable)
        if shares is None:
            found.append(
                Finding(
                    "warning",
                    "underflow",
                    f"{_percent(fraction)} of gradient elements in {variable} sit at zero or "
                    "below float16's smallest normal (2^-14) after scaling: the scale may be "
                    "too low for this layer (zeros included; histogram_freq on "
                    "MixedPrecisionMonitor tells zeros from tiny values)",
                )
            )
        elif shares["below_normal"] > UNDERFLOW_WARN_FRACTION:
            message = (
                f"{_percent(shares['below_normal'])} of gradient elements in {variable} sit "
                "below float16's smallest normal (2^-14) after scaling: the scale is too low "
                "for this layer, and its small gradients lose precision or vanish"
            )
            if headroom is not None and headroom < HEADROOM_TIGHT_BITS:
                message += (
                    f"; but the largest gradients leave only {headroom:.1f} bits of headroom, "
                    "so a higher scale would overflow them: compute this layer in float32"
                )
            found.append(Finding("warning", "underflow", message))
        else:
            found.append(
                Finding(
                    "info",
                    "zero_gradients",
                    f"{_percent(shares['zero'])} of gradient elements in {variable} are exactly "
                    f"zero (step {shares['step']}), which no loss scale changes: units that "
                    "are inactive for this data (e.g. ReLUs that output 0); only "
                    f"{_percent(shares['below_normal'])} are tiny non-zero values",
                )
            )
    overall = (summary["trends"]["underflow_fraction"] or {}).get("last")
    if not summary["underflow_by_variable"] and overall and overall > UNDERFLOW_WARN_FRACTION:
        found.append(
            Finding(
                "warning",
                "underflow",
                f"{_percent(overall)} of all gradient elements sit at zero or below float16's "
                "smallest normal (2^-14) after scaling: the loss scale may be too low",
            )
        )
    return found


def _rule_headroom(summary: dict[str, Any]) -> list[Finding]:
    last = (summary["trends"]["overflow_headroom_bits"] or {}).get("last")
    if not _float16(summary) or last is None or last >= HEADROOM_WARN_BITS:
        return []
    if last < 0:
        message = (
            f"the largest scaled gradient exceeded float16's maximum (65504) by {-last:.2f} "
            "bits at the last reading: gradients overflow, expect skipped steps"
        )
    else:
        message = (
            f"the largest scaled gradient was {last:.2f} bits below float16's maximum "
            "(65504) at the last reading: close to overflow, expect skipped steps"
        )
    return [Finding("warning", "headroom", message)]


def _rule_not_float16(summary: dict[str, Any]) -> list[Finding]:
    if _float16(summary):
        return []
    return [
        Finding(
            "info",
            "not_float16",
            f"the model computes in {summary['compute_dtype']}, not float16: float16's limits "
            "in the headroom, underflow and exponent statistics do not apply to it, and "
            "bfloat16 or float32 need no loss scaling",
        )
    ]


def _rule_skip_rate(summary: dict[str, Any]) -> list[Finding]:
    found = []
    rate, recent = summary["skip_rate"], summary["recent_skip_rate"]
    if rate > SKIP_RATE_WARN:
        found.append(
            Finding(
                "warning",
                "skip_rate",
                f"{_percent(rate)} of steps were skipped ({summary['skipped_steps']} of "
                f"{summary['steps_seen']}): those batches taught the model nothing; a lower "
                "initial_scale or a higher hysteresis skips fewer",
            )
        )
    if recent is not None and recent > RECENT_SKIP_RATE_WARN:
        found.append(
            Finding(
                "warning",
                "skip_rate",
                f"{_percent(recent)} of the most recent steps were skipped: training is "
                "stalled; LossScaleGuard stops such a run with a diagnosis",
            )
        )
    return found


def _rule_nonfinite_loss(summary: dict[str, Any]) -> list[Finding]:
    steps = [e["step"] for e in summary["events"] if not e["loss_finite"]]
    if not steps:
        return []
    return [
        Finding(
            "warning",
            "nonfinite_loss",
            f"the loss itself was non-finite at step {_steps_list(steps)}: the forward pass "
            "made the NaN/Inf, which no loss scale can fix; check the inputs, the loss, and "
            "layers that should compute in float32 (softmax, normalization)",
        )
    ]


def _rule_overflow_at_floor(summary: dict[str, Any]) -> list[Finding]:
    steps = [e["step"] for e in summary["events"] if e["kind"] == "overflow_at_floor"]
    if not steps:
        return []
    return [
        Finding(
            "warning",
            "overflow_at_floor",
            f"gradients overflowed at the lowest allowed scale (min_scale) at step "
            f"{_steps_list(steps)}: they exceed float16's range even barely scaled; "
            "compute the offending layers in float32 or clip them",
        )
    ]


def _rule_culprit(summary: dict[str, Any]) -> list[Finding]:
    variables = Counter(
        e["variable"] for e in summary["events"] if e["kind"] in SKIP_KINDS and e["variable"]
    )
    if not variables:
        return []
    variable, count = variables.most_common(1)[0]
    total = sum(variables.values())
    return [
        Finding(
            "info",
            "culprit",
            f"{variable} had the first non-finite gradient in {count} of the {total} "
            "skipped steps that named one",
        )
    ]


def _rule_overflow_episodes(summary: dict[str, Any]) -> list[Finding]:
    """The first run of consecutive skipped steps, whether training resumed, and the rest."""
    events = summary["events"]
    skips = [e for e in events if e["kind"] in SKIP_KINDS]
    if not skips:
        return []
    episode = [skips[0]]
    for event in skips[1:]:
        if event["step"] != episode[-1]["step"] + 1:
            break
        episode.append(event)
    first, last = episode[0], episode[-1]
    message = (
        f"steps {first['step']}-{last['step']}: {len(episode)} skipped step(s) in a row "
        f"backed the scale off from {format_scale(first['old_scale'])} to "
        f"{format_scale(last['new_scale'])}"
    )
    if last["step"] < summary["steps_seen"]:
        message += f"; training resumed at step {last['step'] + 1}: recovered"
    later = len(skips) - len(episode)
    growths = summary["event_counts"].get("growth", 0)
    if later or growths:
        message += (
            f". Afterwards {later} more skipped step(s) and {growths} growth(s) "
            f"kept the scale near the largest that fits; it ended at "
            f"{format_scale(summary['loss_scale']['final'])}"
        )
    return [Finding("info", "overflow_episode", message)]


def _rule_notes(summary: dict[str, Any]) -> list[Finding]:
    return [
        Finding("info", "note", f"note at step {note['step']}: {note['text']}")
        for note in summary["notes"]
    ]


RULES: tuple[Callable[[dict[str, Any]], list[Finding]], ...] = (
    _rule_nonfinite_loss,
    _rule_overflow_at_floor,
    _rule_skip_rate,
    _rule_headroom,
    _rule_underflow,
    _rule_not_float16,
    _rule_culprit,
    _rule_overflow_episodes,
    _rule_notes,
)
"""The findings rules, in the order their findings are listed."""


def findings(summary: dict[str, Any]) -> list[Finding]:
    """Applies :data:`RULES` to a summary.

    Args:
        summary: a dict from :func:`summarize` (its ``findings`` key is not read).

    Returns:
        The findings in the order of :data:`RULES`, preceded by an info saying
        "no problems found" when none is a warning (and that the rest are notes).
    """
    found = [finding for rule in RULES for finding in rule(summary)]
    if not any(f.severity == "warning" for f in found):
        message = "no problems found" + ("; notes for information:" if found else "")
        found.insert(0, Finding("info", "healthy", message))
    return found


# ------------------------------------------------------------------ formatting
def format_scale(scale: float | None) -> str:
    """Formats a loss scale, naming powers of two: ``32768 (2^15)``.

    Args:
        scale: the scale, or None when unknown.

    Returns:
        The text.
    """
    if scale is None:
        return "n/a"
    mantissa, exponent = math.frexp(scale)
    power = f" (2^{exponent - 1})" if mantissa == 0.5 else ""
    return f"{scale:.9g}{power}"


def _number(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.2f}%" if percent else f"{value:.4g}"


def format_summary(summary: dict[str, Any]) -> str:
    """Formats a summary from :func:`summarize` as text for a terminal.

    Args:
        summary: the summary.

    Returns:
        Several lines, without a trailing newline.
    """
    scale = summary["loss_scale"]
    recent = summary["recent_skip_rate"]
    lines = [
        f"kmix report: {summary['logdir']}",
        f"steps seen      {summary['steps_seen']}",
        "loss scale      "
        + ", ".join(
            f"{key} {format_scale(scale[key])}" for key in ("initial", "final", "min", "max")
        ),
        f"skipped steps   {summary['skipped_steps']} of {summary['steps_seen']} "
        f"({_number(summary['skip_rate'], True)})"
        + ("" if recent is None else f"; latest window {_number(recent, True)}"),
    ]
    if summary["policy"]:
        lines.append(f"policy          {summary['policy'].splitlines()[0]}")
    lines.append(f"scale events    {len(summary['events'])}")
    for e in summary["events"]:
        line = (
            f"  step {e['step']:>7}  {e['kind']:<17} "
            f"{format_scale(e['old_scale'])} -> {format_scale(e['new_scale'])}"
        )
        if e["variable"]:
            line += f"  first non-finite: {e['variable']} ({e['nonfinite_variables']} variables)"
        if not e["loss_finite"]:
            line += "  loss non-finite"
        lines.append(line)
    lines.append("gradient health (finite points: first -> last, min..max, trend)")
    names = {
        "overflow_headroom_bits": "overflow headroom (bits)",
        "underflow_fraction": "underflow fraction",
        "grad_norm": "gradient norm",
    }
    for key, name in names.items():
        trend, percent = summary["trends"][key], key == "underflow_fraction"
        if trend is None:
            lines.append(f"  {name:<26} not logged")
            continue
        lines.append(
            f"  {name:<26} {_number(trend['first'], percent)} -> {_number(trend['last'], percent)}"
            f", {_number(trend['min'], percent)}..{_number(trend['max'], percent)}"
            f", {trend['direction']} ({trend['points']} points"
            + (f", {trend['nonfinite_points']} non-finite" if trend["nonfinite_points"] else "")
            + ")"
        )
    if summary["underflow_by_variable"]:
        lines.append("underflow by variable (latest)")
        width = max(map(len, summary["underflow_by_variable"]))
        for variable, fraction in summary["underflow_by_variable"].items():
            lines.append(f"  {variable:<{width}}  {_number(fraction, True)}")
    if summary["gradient_exponents"]:
        lines.append("gradient exponents (latest histogram, share of elements)")
        width = max(map(len, summary["gradient_exponents"]))
        for variable, shares in summary["gradient_exponents"].items():
            lines.append(
                f"  {variable:<{width}}  step {shares['step']}: "
                + ", ".join(
                    f"{key.replace('_', ' ')} {_number(shares[key], True)}"
                    for key in ("zero", "below_normal", "in_range", "above_max", "nonfinite")
                )
            )
    else:
        lines.append(
            "no gradient exponent histograms (set histogram_freq on MixedPrecisionMonitor)"
        )
    lines.append("findings")
    marks = {"warning": "!", "info": "-"}
    lines += [f"  {marks[f['severity']]} {f['message']}" for f in summary["findings"]]
    return "\n".join(lines)


def to_json(summary: dict[str, Any]) -> str:
    """Formats a summary as strict JSON (no NaN or Infinity).

    Args:
        summary: the summary.

    Returns:
        The JSON text.
    """
    return json.dumps(summary, indent=2, allow_nan=False)


# ---------------------------------------------------------------------- plots
def write_plots(log: KmixLog, summary: dict[str, Any], out_dir: str) -> list[str]:
    """Writes the PNG plots of a run with matplotlib (no global backend is changed).

    * ``loss_scale.png``: the loss scale over steps on a log2 axis, skipped steps
      marked;
    * ``health.png``: overflow headroom, underflow fraction and gradient norm;
    * ``grad_exponents.png``: a heatmap of the latest gradient exponents per
      variable with float16's limits drawn as lines (only with histograms).

    Args:
        log: what :func:`read_log` returned.
        summary: its :func:`summarize` dict.
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
        PLOT_FILES, (_plot_loss_scale, _plot_health, _plot_exponents), strict=True
    ):
        figure = Figure(figsize=(9, 6), layout="constrained")
        if plot(figure, log, summary):
            path = os.path.join(out_dir, name)
            figure.savefig(path, dpi=100)
            written.append(path)
    return written


def _plot_loss_scale(figure: Any, log: KmixLog, summary: dict[str, Any]) -> bool:
    events = summary["events"]
    points = [(0, summary["loss_scale"]["initial"])]
    points += [(e["step"], e["new_scale"]) for e in events]
    series = log.scalars.get(tags.LOSS_SCALE)
    if series is not None:
        points += zip(series.steps.tolist(), series.values.tolist(), strict=True)
    points = sorted((step, value) for step, value in points if value)
    if not points:
        return False
    ax = figure.add_subplot()
    steps, values = zip(*points, strict=True)
    ax.step(steps, values, where="post", label="loss scale")
    for kind, marker, color in (
        ("backoff", "v", "tab:red"),
        ("skip_absorbed", "x", "tab:orange"),
        ("overflow_at_floor", "X", "black"),
        ("growth", "^", "tab:green"),
    ):
        chosen = [e for e in events if e["kind"] == kind]
        if chosen:
            label = kind if kind == "growth" else f"skipped step ({kind})"
            ax.scatter(
                [e["step"] for e in chosen],
                [e["old_scale"] for e in chosen],
                marker=marker,
                color=color,
                label=label,
                zorder=3,
            )
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale (log2)")
    ax.set_title(f"Loss scale: {summary['skipped_steps']} skipped of {summary['steps_seen']} steps")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return True


def _plot_health(figure: Any, log: KmixLog, summary: dict[str, Any]) -> bool:
    present = [key for key, tag in TREND_TAGS.items() if tag in log.scalars]
    if not present:
        return False
    axes = figure.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, present, strict=True):
        series = log.scalars[TREND_TAGS[key]]
        if key == "underflow_fraction":
            ax.plot(series.steps, 100 * series.values, label="all gradients", linewidth=2)
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


def _plot_exponents(figure: Any, log: KmixLog, summary: dict[str, Any]) -> bool:
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
