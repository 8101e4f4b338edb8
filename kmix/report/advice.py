"""What would skip fewer steps, from the kinds of skipped steps a run recorded; whether
a run uses its loss scale at all.

Free of printing and matplotlib, like :mod:`kmix.report.finding_rules`, whose skip-rate
rule words its advice with :func:`skip_advice`. The advice follows kmix's scale rule
(:mod:`kmix.record.scaling`), never a rule of thumb: under it every gradient overflow is
skipped whatever the hysteresis, and a forward overflow or an overflow at
``min_scale`` is skipped whatever the scale.
"""

from __future__ import annotations

from collections import Counter

from kmix import tags
from kmix._words import format_scale, plural
from kmix.report.values import Summary

__all__ = ["float16_in_use", "loss_scale_unused", "skip_advice"]


def skip_advice(summary: Summary) -> str:
    """What the recorded skipped steps were, kind by kind, and what would skip fewer.

    The advice follows kmix's scale rule (:mod:`kmix.record.scaling`): every gradient
    overflow is skipped whatever the hysteresis (a higher hysteresis only delays
    the backoff, so the scale that overflows is kept longer); a forward overflow
    and an overflow at ``min_scale`` are skipped whatever the scale. So:

    * backoffs in a row from step 1: the initial scale was too high; an
      ``initial_scale`` where they ended starts there;
    * ``skip_absorbed``: skipped at a scale the hysteresis kept; ``hysteresis=1``
      backs off at the first overflow;
    * a backoff that is the first skip after a growth: the growth overflowed; a
      larger ``dynamic_growth_steps`` grows less often;
    * ``overflow_at_floor`` and ``forward_overflow``: no loss-scale setting
      prevents them.

    Args:
        summary: the summary (its events, events lost and steps).

    Returns:
        One sentence per kind found, ``"By kind: ..."``; when no skipped step was
        recorded as an event, a sentence saying their kinds are unknown.
    """
    skips = [e for e in summary.events if e.kind in tags.SKIP_KINDS]
    if not skips:
        stock = summary.policy_record is not None and summary.policy_record.loss_scaling == "keras"
        return (
            "Which kind of overflow they were is not recorded (no skipped step was "
            "recorded as an event), so no setting can be advised from them"
            + (
                "; the stock Keras optimizer records none, kmix.LossScaleOptimizer records "
                "each skipped step and why."
                if stock
                else "."
            )
        )
    start = _start_backoffs(skips)
    after_growth = _backoffs_after_growth(summary.events)
    counts = Counter(e.kind for e in skips)
    parts = []
    if start:
        first, last = start[0], start[-1]
        parts.append(
            f"{plural(len(start), 'backoff')} in a row from step {first.step} lowered the "
            f"initial scale {format_scale(first.old_scale)} to {format_scale(last.new_scale)}: "
            f"initial_scale={last.new_scale:.9g} starts where they ended"
        )
    growth = [e for e in after_growth if e not in start]
    if growth:
        parts.append(
            f"{len(growth)} {'was' if len(growth) == 1 else 'were'} the first overflow after "
            "a growth: a larger dynamic_growth_steps grows, and so overflows, less often"
        )
    other = counts["backoff"] - len(start) - len(growth)
    if other:
        which = "other " if start or growth else ""
        parts.append(f"{other} {which}gradient {_overflows(other)} backed the scale off")
    if counts["skip_absorbed"]:
        parts.append(
            f"{counts['skip_absorbed']} {'was' if counts['skip_absorbed'] == 1 else 'were'} "
            "skipped at a scale the hysteresis kept: kmix skips every gradient overflow "
            "whatever the hysteresis, which only delays the backoff, so a higher hysteresis "
            "skips no fewer; hysteresis=1 backs off at the first overflow"
        )
    if counts["overflow_at_floor"]:
        parts.append(
            f"{counts['overflow_at_floor']} {_overflows(counts['overflow_at_floor'])} at "
            "min_scale: no loss scale prevents those"
        )
    if counts["forward_overflow"]:
        parts.append(
            f"{counts['forward_overflow']} forward {_overflows(counts['forward_overflow'])} "
            "(the loss itself non-finite): no loss scale or hysteresis prevents those, only a "
            "change to the forward pass"
        )
    text = "By kind: " + "; ".join(parts) + "."
    unknown = summary.skipped_steps - len(skips)
    if unknown > 0:
        text += f" The kind of the other {unknown} is not recorded"
        text += f" ({plural(summary.events_lost, 'event')} lost)." if summary.events_lost else "."
    return text


def _overflows(count: int) -> str:
    return "overflow" if count == 1 else "overflows"


def _start_backoffs(skips: list[tags.ScaleEvent]) -> list[tags.ScaleEvent]:
    """The backoffs in a row from step 1 (none when step 1 was not a backoff)."""
    if skips[0].step != 1 or skips[0].kind != "backoff":
        return []
    start = [skips[0]]
    for event in skips[1:]:
        if event.step != start[-1].step + 1 or event.kind != "backoff":
            break
        start.append(event)
    return start


def _backoffs_after_growth(events: tuple[tags.ScaleEvent, ...]) -> list[tags.ScaleEvent]:
    """Backoffs that are the first skipped step after a growth, from the grown scale."""
    found, grown = [], None
    for event in events:
        if event.kind == "growth":
            grown = event.new_scale
        elif event.kind in tags.SKIP_KINDS:
            if event.kind == "backoff" and grown is not None and event.old_scale == grown:
                found.append(event)
            grown = None
    return found


def float16_in_use(record: tags.PolicyRecord | None) -> bool | None:
    """Whether a run computes anything in float16, as its policy record says.

    Args:
        record: the run's policy record, or None.

    Returns:
        True when the model computes in float16 or a variable's layer does; False when
        the record says neither; None without a record (unknown).
    """
    if record is None:
        return None
    layers = (record.variable_dtypes or {}).values()
    return record.compute_dtype == "float16" or "float16" in layers


def loss_scale_unused(summary: Summary) -> str | None:
    """Why a run's loss scale is not used, or None when it is (or may be).

    A run that computes nothing in float16 (its policy record says so), whose scale
    never moved, with no skipped step and no lost event, needs no loss scaling: a
    ``kmix compare`` float32 reference is compiled with a loss-scale optimizer all the
    same. A chart of its flat scale would only suggest the scale did something, so
    ``kmix report`` draws none and says this instead, and so does the tab. A scale that
    changed, or a skip, is shown as usual.

    Args:
        summary: the run's summary.

    Returns:
        E.g. ``"this run computes in float32, which needs no loss scaling (the
        optimizer's scale stayed at 32768 (2^15) and no step was skipped)"``, or None.
    """
    record = summary.policy_record
    scale = summary.loss_scale
    if float16_in_use(record) is not False or scale.min is None or scale.min != scale.max:
        return None
    if scale.initial not in (None, scale.min):
        return None
    if summary.events or summary.skipped_steps or summary.events_lost:
        return None
    return (
        f"this run computes in {record.compute_dtype}, which needs no loss scaling (the "
        f"optimizer's scale stayed at {format_scale(scale.min)} and no step was skipped)"
    )
