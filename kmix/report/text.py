"""A :class:`~kmix.report.values.Summary` as terminal text, or as strict JSON; and the
listing of the log dirs under a directory that has no kmix log of its own."""

from __future__ import annotations

import dataclasses
import json

from kmix import tags
from kmix._json import json_ready
from kmix._words import format_scale, percent, plural
from kmix.report.advice import loss_scale_unused
from kmix.report.finding_rules import RUN_END_WORDS
from kmix.report.float8 import float8_lines
from kmix.report.runs import RunInfo, run_words
from kmix.report.values import Summary, Trend
from kmix.report.whatif import FLOAT8_GRADIENTS, FORMATS

_HEALTH_NAMES = {
    "overflow_headroom_bits": "overflow headroom (bits)",
    "underflow_fraction": "underflow fraction",
    "grad_norm": "gradient norm",
}
_SPLIT_NAMES = {
    "zero_fraction": "  of which exact zeros",
    "subnormal_fraction": "  of which subnormal",
}
_PERCENT = {"underflow_fraction", "zero_fraction", "subnormal_fraction"}


def _number(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.2f}%" if percent else f"{value:.4g}"


def _trend_line(name: str, trend: Trend | None, percent: bool) -> str:
    if trend is None:
        return f"  {name:<26} not logged"
    return (
        f"  {name:<26} {_number(trend.first, percent)} -> {_number(trend.last, percent)}"
        f", {_number(trend.min, percent)}..{_number(trend.max, percent)}"
        f", {trend.direction} ({plural(trend.points, 'point')}"
        + (f", {trend.nonfinite_points} non-finite" if trend.nonfinite_points else "")
        + ")"
    )


def _loss_scale_line(summary: Summary) -> str:
    unused = loss_scale_unused(summary)
    if unused is not None:
        return f"loss scale      not used: {unused}"
    scale = summary.loss_scale
    keys = ("initial", "final", "min", "max")
    words = ", ".join(f"{key} {format_scale(getattr(scale, key))}" for key in keys)
    return f"loss scale      {words}{scale_caveat(summary)}"


def _run_end_line(summary: Summary) -> str:
    end = summary.run_end
    if end is None:
        return "run ended       not recorded"
    text = f"run ended       {RUN_END_WORDS.get(end.reason, end.reason)} at step {end.step}"
    return text + (f": {end.message}" if end.message and end.reason != tags.COMPLETED else "")


def _histogram_hint(summary: Summary) -> str:
    record = summary.policy_record
    if record is not None and record.histogram_freq and record.loss_scaling != "kmix":
        return (
            f"no gradient exponent histograms: histogram_freq={record.histogram_freq} is set, "
            "but histograms need kmix.LossScaleOptimizer (loss scaling here: "
            f"{record.loss_scaling})"
        )
    if record is not None and record.histogram_freq:
        return (
            f"no gradient exponent histograms yet (histogram_freq={record.histogram_freq}: "
            "the run has not reached that step)"
        )
    return "no gradient exponent histograms (set histogram_freq on MixedPrecisionMonitor)"


def _shares(shares: object) -> str:
    return "/".join(
        _number(getattr(shares, key), True) for key in ("underflow", "subnormal", "overflow")
    )


def _whatif_lines(summary: Summary) -> list[str]:
    gradients = summary.precision_whatif.get("gradients")
    if gradients is None:
        return []
    lines = [
        f"precision what-if (gradients at step {gradients.step}; share that would "
        "underflow/be subnormal/overflow; FP8 scaled per tensor to its max)"
    ]
    real = gradients.float8_headroom_bits
    rows = {"all variables": gradients.overall} | {
        name + (" *" if name in real else ""): shares
        for name, shares in gradients.by_variable.items()
    }
    width = max(map(len, rows))
    for name, by_format in rows.items():
        lines.append(
            f"  {name:<{width}}  "
            + "  ".join(f"{fmt} {_shares(by_format[fmt])}" for fmt in FORMATS)
        )
    layers = {variable.rpartition("/")[0]: bits for variable, bits in real.items()}
    if layers:
        lines.append(
            f"  * {FLOAT8_GRADIENTS} as if held at the float8 layer's real output-gradient "
            "headroom, not scaled to its max (a proxy: Keras holds the layer's output "
            "gradients in E5M2, not these): "
            + ", ".join(f"`{layer}` {bits:.2f} bits" for layer, bits in layers.items())
        )
    return lines


def _moves_lines(summary: Summary) -> list[str]:
    """The layers PrecisionAutopilot moved, the float16 share, and the plan's code."""
    share = summary.float16_share
    if not summary.precision_moves and share is None:
        return []
    lines = [f"precision moves {len(summary.precision_moves)} (PrecisionAutopilot)"]
    lines += [
        "  " + tags.plain_text(tags.format_precision_move(move)) for move in summary.precision_moves
    ]
    if share is not None and share.first is not None and share.last is not None:
        lines.append(
            f"  float16 share (estimated multiply-adds; parameters where unknown, see the "
            f"notes): {percent(share.first)} at train begin, {percent(share.last)} at the end"
        )
    if summary.precision_moves:
        lines.append("  to start the next run healed, before compile:")
        lines.append("    " + summary.precision_plan.code().splitlines()[0])
    return lines


def format_summary(summary: Summary) -> str:
    """Formats a summary as text for a terminal.

    Args:
        summary: what :func:`kmix.report.summarize` returned.

    Returns:
        Several lines, without a trailing newline.
    """
    recent = summary.recent_skip_rate
    lines = [
        f"kmix report: {summary.logdir}",
        *_run_line(summary),
        f"steps seen      {summary.steps_seen}",
        _loss_scale_line(summary),
        f"skipped steps   {summary.skipped_steps} of {summary.steps_seen} "
        f"({_number(summary.skip_rate, True)})"
        + ("" if recent is None else f"; latest window {_number(recent, True)}"),
        _run_end_line(summary),
    ]
    if summary.policy:
        lines.append(f"policy          {summary.policy.splitlines()[0]}")
    elif summary.policy_record is not None:
        record = summary.policy_record
        lines.append(
            f"policy          model `{record.model_name}` policy `{record.model_policy}`; "
            f"loss scaling: {record.loss_scaling}"
        )
    lines += _processes_line(summary)
    lines.append(f"scale events    {len(summary.events)}")
    lines += ["  " + tags.plain_text(tags.format_event(event)) for event in summary.events]
    if summary.events_lost:
        lines.append(f"events lost     {summary.events_lost} (see the notes)")
    lines += _moves_lines(summary)
    lines.append("gradient health (finite points: first -> last, min..max, trend)")
    for key, name in _HEALTH_NAMES.items():
        lines.append(_trend_line(name, summary.trends.get(key), key in _PERCENT))
        if key == "underflow_fraction":
            lines += [
                _trend_line(split, summary.underflow_split.get(part), True)
                for part, split in _SPLIT_NAMES.items()
                if summary.underflow_split.get(part) is not None
            ]
    quoted = None
    if any(trend is None for trend in summary.trends.values()):
        why = [n.text for n in summary.notes if tags.parse_events_lost(n.text) is None]
        if why:
            quoted = why[-1]
            lines.append(f"  not logged because: {quoted}")
    for title, by_variable in (
        ("underflow by variable (latest, zeros included)", summary.underflow_by_variable),
        ("subnormal by variable (latest)", summary.subnormal_by_variable),
    ):
        if by_variable:
            lines.append(title)
            width = max(map(len, by_variable))
            for variable, fraction in by_variable.items():
                lines.append(f"  {variable:<{width}}  {_number(fraction, True)}")
    if summary.variables_not_float16:
        lines.append(
            "not float16 (left out of the float16 statistics by variable): "
            + ", ".join(f"{v} ({d})" for v, d in summary.variables_not_float16.items())
        )
    if summary.activation_headroom:
        lines.append("activation headroom by layer (bits)")
        width = max(map(len, summary.activation_headroom))
        for layer, trend in summary.activation_headroom.items():
            lines.append(_trend_line(f"{layer:<{width}}", trend, False))
    if summary.gradient_exponents:
        lines.append("gradient exponents (latest histogram, share of elements)")
        width = max(map(len, summary.gradient_exponents))
        for variable, shares in summary.gradient_exponents.items():
            lines.append(
                f"  {variable:<{width}}  step {shares.step}: "
                + ", ".join(
                    f"{key.replace('_', ' ')} {_number(getattr(shares, key), True)}"
                    for key in ("zero", "below_normal", "in_range", "above_max", "nonfinite")
                )
            )
    elif summary.precision_whatif.get("gradients") is not None:
        lines.append(
            "gradient exponents: only of variables whose layers do not compute in float16 "
            "(see the what-if)"
        )
    else:
        lines.append(_histogram_hint(summary))
    lines += _whatif_lines(summary)
    lines += float8_lines(summary.float8)
    lines.append("findings")
    marks = {"warning": "!", "info": "-"}
    for f in summary.findings:
        message = f.message
        if quoted and f.rule == "note" and message.endswith(f": {quoted}"):
            message = message[: -len(quoted)] + "quoted above under 'not logged because'"
        lines.append(f"  {marks[f.severity]} {message}")  # each note's text once
    return "\n".join(lines)


def processes_words(summary: Summary) -> str | None:
    """How many processes and devices ran the step, where more than one did; else None.

    Args:
        summary: what :func:`kmix.report.summarize` returned.
    """
    record = summary.policy_record
    if record is None or record.processes is None:
        return None
    devices = record.devices or 1
    if record.processes == 1 and devices == 1:
        return None
    processes = f"{record.processes} process" + ("" if record.processes == 1 else "es")
    return (
        f"{processes}, {plural(devices, 'device')} in all (keras.distribution); this log is "
        "process 0's, counters and events are global"
    )


def _processes_line(summary: Summary) -> list[str]:
    words = processes_words(summary)
    return [] if words is None else [f"processes       {words}"]


def _run_line(summary: Summary) -> list[str]:
    """Which run of several the report is of, and how to see the others."""
    run, runs = summary.run, summary.runs
    if run is None or len(runs) < 2:
        return []
    latest = " (the latest)" if run.index == len(runs) else ""
    others = [str(r.index) for r in runs if r is not run]
    which = f"run {others[0]}" if len(others) == 1 else f"runs {', '.join(others)}"
    number = others[0] if len(others) == 1 else "N"
    return [
        f"run             {run.index} of {len(runs)} in this log dir{latest}; see {which} "
        f"with: kmix report {summary.logdir} --run {number}"
    ]


def format_logdirs(parent: str, found: list[tuple[str, tuple[RunInfo, ...]]]) -> str:
    """Lists the log dirs with kmix data under a directory that has none of its own.

    Args:
        parent: the directory given to ``kmix report``.
        found: each log dir and its runs (oldest first), in the order to list them.

    Returns:
        Several lines: every run (its log dir, and its number there when the log dir
        holds several) with its steps and how it ended, then how to report one.
    """
    count = sum(len(runs) for _, runs in found)
    lines = [
        f"kmix report: {parent} has no kmix log of its own; under it, "
        f"{plural(count, 'kmix run')} in {plural(len(found), 'log dir')}:"
    ]
    width = max(len(logdir) for logdir, _ in found)
    for logdir, runs in found:
        for info in runs:
            which = f"run {info.index} of {len(runs)}: " if len(runs) > 1 else ""
            lines.append(f"  {logdir:<{width}}  {which}{run_words(info)}")
    example = found[0][0]
    lines.append(
        f"report one with: kmix report {example}  (the latest run of a log dir; "
        "--run N for another)"
    )
    return "\n".join(lines)


def logdirs_json(parent: str, found: list[tuple[str, tuple[RunInfo, ...]]]) -> str:
    """The listing of :func:`format_logdirs` as strict JSON.

    Args:
        parent: the directory given to ``kmix report``.
        found: each log dir and its runs, oldest first.

    Returns:
        ``{"parent": ..., "logdirs": [{"logdir": ..., "runs": [RunInfo as a dict]}]}``.
    """
    data = {
        "parent": parent,
        "logdirs": [
            {"logdir": logdir, "runs": [dataclasses.asdict(info) for info in runs]}
            for logdir, runs in found
        ],
    }
    return json.dumps(json_ready(data), indent=2, allow_nan=False)


def scale_caveat(summary: Summary) -> str:
    """What the loss-scale line cannot say when scale events were lost.

    Args:
        summary: the summary.

    Returns:
        ``""`` when no event was lost; else a parenthesis, with a leading space,
        saying which of initial, min and max are unknown or only over the scales
        the log holds.
    """
    if not summary.events_lost:
        return ""
    lost = plural(summary.events_lost, "scale event")
    if summary.loss_scale.initial is None:
        return f" (initial, min and max unknown: {lost} lost before the first scale the log holds)"
    return f" (min and max of the scales the log holds: {lost} lost)"


def to_json(summary: Summary) -> str:
    """Formats a summary as strict JSON (no NaN or Infinity): :meth:`Summary.to_dict`.

    Args:
        summary: the summary.

    Returns:
        The JSON text.
    """
    return json.dumps(summary.to_dict(), indent=2, allow_nan=False)
