"""Findings in plain words: the small rules of :data:`RULES`, each over a Summary.

Free of printing and matplotlib: the TensorBoard plugin reuses it. Thresholds:

* a variable with more than :data:`UNDERFLOW_WARN_FRACTION` of its scaled gradient
  elements non-zero and below float16's smallest normal (``2**-14``): a warning
  that the scale is too low for it. The subnormal share comes from
  ``kmix/subnormal_fraction_by_variable`` when logged, else from the exponent
  histograms, else (logs of kmix 0.1.0) from ``kmix/underflow_fraction_by_variable``,
  whose warning then says zeros are included. Exact zeros are information (units
  inactive for the data), never an underflow warning;
* an overflow headroom below :data:`HEADROOM_WARN_BITS` bits at the last reading
  (gradients), or a layer's activation headroom below it: close to float16's max;
* more than :data:`SKIP_RATE_WARN` of all steps skipped, or more than
  :data:`RECENT_SKIP_RATE_WARN` of the latest window: the scale keeps backing off;
* any non-finite loss or forward overflow: the forward pass made the NaN/Inf, no
  scale can fix it (the layer where it started is named when it was recorded);
* any overflow at ``min_scale``: the gradients overflow even at the lowest scale;
* a run that did not complete (``kmix/run_end``): why it ended;
* a log dir that holds several runs (a script run twice into one ``log_dir``): which
  one the report is of, the others, and how to report them
  (:func:`kmix.report.runs.runs_message`);
* what ``kmix.audit`` found on the model at train begin (recorded in the policy
  record): its errors and warnings are warnings, its infos information;
* the skip rate's advice follows the kinds of the skipped steps and kmix's scale
  rule (:func:`kmix.report.advice.skip_advice`);
* for information: falling headroom forecast to reach 0 bits, the first overflow
  episode and the recovery from it, the variable most often first non-finite,
  exact zeros, variables of layers that do not compute in float16 (left out of
  the float16 statistics), events lost, and the writer's notes (each text once).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from kmix import tags
from kmix._words import format_scale, percent, plural, steps_list
from kmix.precision_plan import base_path
from kmix.report.advice import skip_advice
from kmix.report.float8 import float8_findings
from kmix.report.runs import RUN_END_WORDS, runs_message
from kmix.report.values import Finding, Summary

UNDERFLOW_WARN_FRACTION = 0.25
HEADROOM_WARN_BITS = 1.0
SKIP_RATE_WARN = 0.05
RECENT_SKIP_RATE_WARN = 0.5
HEADROOM_TIGHT_BITS = 4.0


def _float16(summary: Summary) -> bool:
    """Whether float16's limits apply: the model computes in float16, or it is unknown."""
    return summary.compute_dtype in (None, "float16")


def _last(trend: object) -> float | None:
    return None if trend is None else trend.last  # type: ignore[attr-defined]


def _rule_run_end(summary: Summary) -> list[Finding]:
    end = summary.run_end
    if end is None or end.reason == tags.COMPLETED:
        return []
    how = RUN_END_WORDS.get(end.reason, end.reason)
    message = f"the run did not complete: {how} at step {end.step}"
    if end.message:
        message += f": {end.message}"
    return [Finding("warning", "run_end", message)]


def _rule_runs(summary: Summary) -> list[Finding]:
    message = runs_message(summary.run, summary.runs)
    return [] if message is None else [Finding("warning", "runs", message)]


def _origin_words(origin: tags.ForwardOrigin) -> str:
    if not origin.inputs_finite:  # the first layer to see it did not make it
        return (
            f"an op before `{origin.layer}` ({origin.layer_class}), whose inputs were already "
            "non-finite (an op between layers that feed it, such as a sum, or the data)"
        )
    inputs = "finite inputs"
    if origin.max_abs_input is not None:
        inputs += f", max |input| {origin.max_abs_input:.4g}"
    return f"`{origin.layer}` ({origin.layer_class}; {inputs})"


def _rule_nonfinite_loss(summary: Summary) -> list[Finding]:
    chosen = [e for e in summary.events if e.loss_finite is False or e.kind == "forward_overflow"]
    if not chosen:
        return []
    message = (
        f"the loss itself was non-finite at step {steps_list([e.step for e in chosen])}: the "
        "forward pass made the NaN/Inf, which no loss scale can fix; check the inputs, the "
        "loss, and layers that should compute in float32 (softmax, normalization)"
    )
    origins: dict[str, tuple[int, tags.ForwardOrigin]] = {}
    for event in chosen:
        if event.origin is not None:
            origins.setdefault(event.origin.layer, (event.step, event.origin))
    if origins:
        message += "; it started in " + ", ".join(
            f"{_origin_words(origin)} at step {step}" for step, origin in origins.values()
        )
        moved = {move.layer for move in summary.precision_moves}
        named = {base_path(layer) for layer, (_, o) in origins.items() if o.inputs_finite}
        if moved and named and named <= moved:
            message += (
                "; PrecisionAutopilot moved each of them out of float16 (see the precision "
                "moves; kmix.apply_plan makes that permanent)"
            )
        elif moved and not named:
            message += (
                "; PrecisionAutopilot moved the float16 layers feeding it out of float16 (see "
                "the precision moves; kmix.apply_plan makes that permanent)"
            )
        elif any(origin.inputs_finite for _, origin in origins.values()):
            message += ": a layer with finite inputs overflowed, compute it in float32"
    return [Finding("warning", "nonfinite_loss", message)]


def _rule_overflow_at_floor(summary: Summary) -> list[Finding]:
    steps = [e.step for e in summary.events if e.kind == "overflow_at_floor"]
    if not steps:
        return []
    return [
        Finding(
            "warning",
            "overflow_at_floor",
            f"gradients overflowed at the lowest allowed scale (min_scale) at step "
            f"{steps_list(steps)}: they exceed float16's range even barely scaled; "
            "compute the offending layers in float32 or clip them",
        )
    ]


def _rule_skip_rate(summary: Summary) -> list[Finding]:
    found = []
    rate, recent = summary.skip_rate, summary.recent_skip_rate
    if rate > SKIP_RATE_WARN:
        found.append(
            Finding(
                "warning",
                "skip_rate",
                f"{percent(rate)} of steps were skipped ({summary.skipped_steps} of "
                f"{summary.steps_seen}): those batches taught the model nothing. "
                + skip_advice(summary),
            )
        )
    if recent is not None and recent > RECENT_SKIP_RATE_WARN:
        found.append(
            Finding(
                "warning",
                "skip_rate",
                f"{percent(recent)} of the most recent steps were skipped: training is "
                "stalled; LossScaleGuard stops such a run with a diagnosis",
            )
        )
    return found


def _rule_headroom(summary: Summary) -> list[Finding]:
    last = _last(summary.trends.get("overflow_headroom_bits"))
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


def _rule_activation_headroom(summary: Summary) -> list[Finding]:
    if not _float16(summary):
        return []
    found = []
    moved = {move.layer: move.step for move in summary.precision_moves}
    for layer, trend in summary.activation_headroom.items():
        last = trend.last
        if last is None or last >= HEADROOM_WARN_BITS:
            continue
        if moved.get(base_path(layer), math.inf) <= (trend.last_step or 0):
            continue  # moved out of float16 at or before that reading: the advice is done
        if last < 0:
            where = f"exceeded float16's maximum (65504) by {-last:.2f} bits"
        else:
            where = f"came within {last:.2f} bits of float16's maximum (65504)"
        found.append(
            Finding(
                "warning",
                "activation_headroom",
                f"the outputs of layer {layer} {where} at step {trend.last_step}: a forward "
                "overflow, which no loss scale can fix, is near; compute this layer in "
                "float32 or keep its inputs smaller (normalization)",
            )
        )
    return found


def _headroom_caveat(summary: Summary) -> str:
    headroom = _last(summary.trends.get("overflow_headroom_bits"))
    if headroom is not None and headroom < HEADROOM_TIGHT_BITS:
        return (
            f"; but the largest gradients leave only {headroom:.1f} bits of headroom, "
            "so a higher scale would overflow them: compute this layer in float32"
        )
    return ""


def _zero_info(variable: str, zero: float, tiny: float, step: int | None) -> Finding:
    when = "" if step is None else f" (step {step})"
    return Finding(
        "info",
        "zero_gradients",
        f"{percent(zero)} of gradient elements in {variable} are exactly zero{when}, which "
        "no loss scale changes: units that are inactive for this data (e.g. ReLUs that "
        f"output 0); only {percent(tiny)} are tiny non-zero values",
    )


def _rule_underflow(summary: Summary) -> list[Finding]:
    """Underflow per variable: what float16 loses (subnormals), told apart from zeros."""
    if not _float16(summary):
        return []
    found = []
    variables = list(summary.underflow_by_variable)
    variables += [v for v in summary.subnormal_by_variable if v not in variables]
    for variable in variables:
        fraction = summary.underflow_by_variable.get(variable)
        subnormal = summary.subnormal_by_variable.get(variable)
        shares = summary.gradient_exponents.get(variable)
        if subnormal is not None:
            zero, step = (None, None) if fraction is None else (fraction - subnormal, None)
            if zero is None and shares is not None:
                zero, step = shares.zero, shares.step
        elif shares is not None:
            if fraction is not None and fraction <= UNDERFLOW_WARN_FRACTION:
                continue
            subnormal, zero, step = shares.below_normal, shares.zero, shares.step
        else:
            if fraction is not None and fraction > UNDERFLOW_WARN_FRACTION:
                found.append(
                    Finding(
                        "warning",
                        "underflow",
                        f"{percent(fraction)} of gradient elements in {variable} sit at zero "
                        "or below float16's smallest normal (2^-14) after scaling: the scale "
                        "may be too low for this layer (zeros included; histogram_freq on "
                        "MixedPrecisionMonitor tells zeros from tiny values)",
                    )
                )
            continue
        if subnormal > UNDERFLOW_WARN_FRACTION:
            message = (
                f"{percent(subnormal)} of gradient elements in {variable} sit below "
                "float16's smallest normal (2^-14) after scaling: the scale is too low for "
                "this layer, and its small gradients lose precision or vanish"
            )
            found.append(Finding("warning", "underflow", message + _headroom_caveat(summary)))
        elif zero is not None and zero > UNDERFLOW_WARN_FRACTION:
            found.append(_zero_info(variable, zero, subnormal, step))
    if not variables:
        found += _overall_underflow(summary)
    return found


def _overall_underflow(summary: Summary) -> list[Finding]:
    subnormal = _last(summary.underflow_split.get("subnormal_fraction"))
    zero = _last(summary.underflow_split.get("zero_fraction"))
    overall = _last(summary.trends.get("underflow_fraction"))
    if subnormal is not None:
        if subnormal > UNDERFLOW_WARN_FRACTION:
            return [
                Finding(
                    "warning",
                    "underflow",
                    f"{percent(subnormal)} of all gradient elements sit below float16's "
                    "smallest normal (2^-14) after scaling: the loss scale is too low",
                )
            ]
        if zero is not None and zero > UNDERFLOW_WARN_FRACTION:
            return [_zero_info("all variables", zero, subnormal, None)]
        return []
    if overall is not None and overall > UNDERFLOW_WARN_FRACTION:
        return [
            Finding(
                "warning",
                "underflow",
                f"{percent(overall)} of all gradient elements sit at zero or below float16's "
                "smallest normal (2^-14) after scaling: the loss scale may be too low "
                "(zeros included)",
            )
        ]
    return []


def _rule_not_float16(summary: Summary) -> list[Finding]:
    if _float16(summary):
        return []
    return [
        Finding(
            "info",
            "not_float16",
            f"the model computes in {summary.compute_dtype}, not float16: float16's limits "
            "in the headroom, underflow and exponent statistics do not apply to it, and "
            "bfloat16 or float32 need no loss scaling",
        )
    ]


def _rule_forecast(summary: Summary) -> list[Finding]:
    if not _float16(summary):
        return []
    return [
        Finding(
            "info",
            "forecast",
            f"headroom of the {f.series} is falling steadily ({f.last_bits:.2f} bits at step "
            f"{f.last_step}, {-1000 * f.bits_per_step:.3g} bits lost per 1000 steps over the "
            f"last {plural(f.points, 'point')}): at this trend it reaches 0 bits (float16's "
            f"maximum, 65504) at about step {f.zero_step}",
        )
        for f in summary.forecasts
    ]


def _rule_culprit(summary: Summary) -> list[Finding]:
    variables = Counter(
        e.variable for e in summary.events if e.kind in tags.SKIP_KINDS and e.variable
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


def _rule_overflow_episodes(summary: Summary) -> list[Finding]:
    """The first run of consecutive skipped steps, whether training resumed, and the rest."""
    skips = [e for e in summary.events if e.kind in tags.SKIP_KINDS]
    if not skips:
        return []
    episode = [skips[0]]
    for event in skips[1:]:
        if event.step != episode[-1].step + 1:
            break
        episode.append(event)
    first, last = episode[0], episode[-1]
    if first.old_scale == last.new_scale:
        change = f"kept the scale at {format_scale(first.old_scale)}"
    else:
        change = (
            f"backed the scale off from {format_scale(first.old_scale)} to "
            f"{format_scale(last.new_scale)}"
        )
    message = f"steps {first.step}-{last.step}: {len(episode)} skipped step(s) in a row {change}"
    if last.step < summary.steps_seen:
        message += f"; training resumed at step {last.step + 1}: recovered"
    later = len(skips) - len(episode)
    growths = summary.event_counts.get("growth", 0)
    if later or growths:
        message += (
            f". Afterwards {later} more skipped step(s) and {growths} growth(s) "
            f"kept the scale near the largest that fits; it ended at "
            f"{format_scale(summary.loss_scale.final)}"
        )
    return [Finding("info", "overflow_episode", message)]


def _rule_notes(summary: Summary) -> list[Finding]:
    """The writer's notes, each text once (a note written again at a later begin is one)."""
    steps: dict[str, list[int]] = {}
    for note in summary.notes:
        steps.setdefault(note.text, []).append(note.step)
    return [
        Finding("info", "note", f"note at step {steps_list(at)}: {text}")
        for text, at in steps.items()
    ]


AUDIT_SEVERITY = {"error": "warning", "warning": "warning", "info": "info"}
"""A finding of ``kmix.audit`` (recorded in the policy record) -> the report's severity."""


def _rule_audit(summary: Summary) -> list[Finding]:
    """The findings of ``kmix.audit`` on the model, as recorded at train begin."""
    record = summary.policy_record
    if record is None or not record.audit_findings:
        return []
    return [
        Finding(
            AUDIT_SEVERITY.get(f.severity, "warning"),
            "audit",
            f"the audit of the model at train begin found ({f.severity}): "
            + (f"`{f.layer}`: " if f.layer else "")
            + f"{f.message}; fix: {f.fix}",
        )
        for f in record.audit_findings
    ]


def _rule_other_dtypes(summary: Summary) -> list[Finding]:
    other = summary.variables_not_float16
    if not other or not _float16(summary):
        return []
    dtypes = sorted(set(other.values()))
    return [
        Finding(
            "info",
            "not_float16_variables",
            f"{plural(len(other), 'variable')} ({steps_list(list(other), 3)}) belong to "
            f"layers computing in {' and '.join(dtypes)}: float16's range does not apply to "
            "them, so they are left out of the per-variable underflow and exponent "
            "statistics",
        )
    ]


RULES: tuple[Callable[[Summary], list[Finding]], ...] = (
    _rule_runs,
    _rule_run_end,
    _rule_nonfinite_loss,
    _rule_overflow_at_floor,
    _rule_skip_rate,
    _rule_headroom,
    _rule_activation_headroom,
    _rule_underflow,
    _rule_audit,
    _rule_not_float16,
    _rule_other_dtypes,
    float8_findings,
    _rule_forecast,
    _rule_culprit,
    _rule_overflow_episodes,
    _rule_notes,
)
"""The findings rules, in the order their findings are listed."""


def findings(summary: Summary) -> list[Finding]:
    """Applies :data:`RULES` to a summary.

    Args:
        summary: a :class:`kmix.report.Summary` (its ``findings`` are not read).

    Returns:
        The findings in the order of :data:`RULES`, preceded by an info saying
        "no problems found" when none is a warning (and how many notes follow).
        A run that did not complete always has a warning, so it is never called
        healthy.
    """
    found = [finding for rule in RULES for finding in rule(summary)]
    if not any(f.severity == "warning" for f in found):
        message = "no problems found"
        if found:
            follow = "follows" if len(found) == 1 else "follow"
            message += f"; {plural(len(found), 'note')} for information {follow}"
        found.insert(0, Finding("info", "healthy", message))
    return found
