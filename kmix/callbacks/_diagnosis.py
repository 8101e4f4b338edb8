"""The guard's diagnoses: a trip and the events before it, in words a user can act on.

Pure: each function formats typed values (a :data:`kmix.callbacks._trip.Trip`, the
recorded :class:`kmix.tags.ScaleEvent` values), so every wording is tested without
``fit``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kmix import tags
from kmix._words import plural
from kmix.callbacks._trip import NonfiniteLoss, OverflowAtFloor, SkipRate, Trip
from kmix.precision_plan import PrecisionMove
from kmix.tags import ScaleEvent

UNRECORDED_VARIABLE = {
    "keras": "unknown (the stock Keras optimizer does not record it; kmix.LossScaleOptimizer does)",
    "none": (
        "unknown (this run has no loss-scale optimizer, so nothing records which gradient "
        "went non-finite first; kmix.LossScaleOptimizer does)"
    ),
}
"""Why the first non-finite gradient is unknown, by the run's loss scaling (not kmix)."""


def first_variable(events: Sequence[ScaleEvent], loss_scaling: str) -> str:
    """Where the latest recorded event says the gradients first went non-finite.

    Args:
        events: the recent events, newest first.
        loss_scaling: the run's loss scaling, as ``kmix.tags.LOSS_SCALINGS`` spells it
            (``"kmix"`` records events; ``"keras"`` and ``"none"`` do not).

    Returns:
        The variable in backquotes, or why there is none.
    """
    if loss_scaling in UNRECORDED_VARIABLE:
        return UNRECORDED_VARIABLE[loss_scaling]
    for event in events:
        if event.variable is not None:
            return f"`{event.variable}`"
    return "none (the gradients stayed finite)"


def forward_origin(events: Sequence[ScaleEvent]) -> str:
    """Where the latest recorded event says the forward pass first went non-finite.

    Args:
        events: the recent events, newest first.

    Returns:
        A sentence starting with a space, or ``""`` when no event measured an origin.
    """
    origin = next((event.origin for event in events if event.origin is not None), None)
    if origin is None:
        return ""
    if not origin.inputs_finite:
        return (
            f" The first non-finite layer output is in `{origin.layer}` "
            f"({origin.layer_class}), whose inputs were already non-finite: the "
            "NaN/Inf comes with the data or from outside the tapped layers."
        )
    return (
        f" Forward overflow in `{origin.layer}` ({origin.layer_class}): "
        f"{tags.inputs_words(origin, digits=6)}; keep this layer in float32 with "
        "`kmix.policy_scope('float32')` or `dtype='float32'`."
    )


def nonfinite_loss_text(
    trip: NonfiniteLoss, patience: int, events: Sequence[ScaleEvent], loss_scaling: str
) -> str:
    """The diagnosis of ``nonfinite_loss``.

    Args:
        trip: the trip.
        patience: the guard's ``patience``.
        events: the events of the last ``patience`` indices, newest first.
        loss_scaling: the run's loss scaling (see :func:`first_variable`).

    Returns:
        The message.
    """
    step, streak = trip.step, trip.streak
    produced = (
        "The forward pass produces it (this run does not scale the loss)."
        if loss_scaling == "none"
        else "The forward pass produces it, so lowering the loss scale cannot help."
    )
    return (
        f"kmix.LossScaleGuard stopped training at step {step}: the loss has been "
        f"NaN/Inf{'' if loss_scaling == 'none' else ' before any loss scaling'} for "
        f"{streak} consecutive steps (since step {step - streak + 1}; patience={patience}). "
        f"{produced}{forward_origin(events)} First "
        f"non-finite gradient: {first_variable(events, loss_scaling)}. Usual causes: "
        "NaN/Inf in the input data or labels; a learning rate so high that the weights "
        "diverged; log, sqrt or division of zero or negative values in the model or the "
        "loss; an activation or reduction (softmax, exp, large sums) overflowing float16 — "
        "keep such layers in float32 (dtype='float32'); run kmix.audit(model)."
    )


def floor_text(
    trip: OverflowAtFloor, patience: int, events: Sequence[ScaleEvent], loss_scaling: str
) -> str:
    """The diagnosis of ``overflow_at_floor``.

    Args:
        trip: the trip.
        patience: the guard's ``patience``.
        events: the events of the last ``patience`` indices, newest first.
        loss_scaling: the run's loss scaling (see :func:`first_variable`).

    Returns:
        The message.
    """
    step, streak = trip.step, trip.streak
    return (
        f"kmix.LossScaleGuard stopped training at step {step}: the loss scale is "
        f"{trip.loss_scale:g}, at or below its floor {trip.floor:g}, and the gradients "
        f"have overflowed for {streak} consecutive steps (since step "
        f"{step - streak + 1}; patience={patience}), so every step is skipped. "
        f"First non-finite gradient: {first_variable(events, loss_scaling)}. Float16 "
        "cannot hold these gradients even unscaled. Usual causes: exploding gradients "
        "(lower the learning rate or clip, e.g. clipnorm=1.0); a layer whose float16 output "
        "overflows (run kmix.audit(model) and keep it in float32). 'mixed_bfloat16' "
        "has float32's range, where the hardware supports it."
    )


def skip_rate_text(trip: SkipRate, max_skip_rate: float, events: Sequence[ScaleEvent] = ()) -> str:
    """The diagnosis of ``skip_rate``.

    Args:
        trip: the trip.
        max_skip_rate: the guard's ``max_skip_rate``.
        events: the latest recorded events, newest first (none without kmix).

    Returns:
        The message, naming the span: "the last N steps" when it ends at the trip's
        step, "the N steps up to step E" otherwise; when the latest skipped steps were
        forward overflows (the loss itself non-finite), it says so and names the layer
        instead of blaming the gradients.
    """
    step, end, steps, skipped = trip.step, trip.end, trip.steps, trip.skipped
    which = f"the last {steps} steps" if end == step else f"the {steps} steps up to step {end}"
    head = (
        f"kmix.LossScaleGuard stopped training at step {step}: {skipped} of {which} "
        f"({skipped / steps:.0%}) were skipped"
    )
    skips = [e for e in events if e.kind in tags.SKIP_KINDS]
    forward = [e for e in skips if e.kind == "forward_overflow"]
    if forward and len(forward) * 2 >= len(skips):
        return (
            f"{head}, more than max_skip_rate={max_skip_rate:g}, so the model barely trains. "
            f"{len(forward)} of the latest {plural(len(skips), 'skipped step')} were forward "
            "overflows: the loss itself was non-finite, which no loss scale fixes."
            f"{forward_origin(forward)} Or let kmix.callbacks.PrecisionAutopilot move it "
            "during training."
        )
    return (
        f"{head} for non-finite gradients, "
        f"more than max_skip_rate={max_skip_rate:g}, so the model barely trains. "
        "Usual causes: gradients that overflow float16 at every scale the optimizer "
        "tries (lower the learning rate or clip, e.g. clipnorm=1.0), or a scale that "
        "grows too often (raise dynamic_growth_steps or hysteresis of "
        "kmix.LossScaleOptimizer). Run kmix.audit(model) and look at kmix/events in "
        "TensorBoard."
    )


def diagnosis(
    trip: Trip,
    *,
    patience: int,
    max_skip_rate: float,
    events: Sequence[ScaleEvent] = (),
    loss_scaling: str = "none",
) -> str:
    """The message for any trip.

    Args:
        trip: the trip.
        patience: the guard's ``patience``.
        max_skip_rate: the guard's ``max_skip_rate``.
        events: the events of the last ``patience`` indices, newest first.
        loss_scaling: the run's loss scaling (see :func:`first_variable`).

    Returns:
        The message.
    """
    if isinstance(trip, NonfiniteLoss):
        return nonfinite_loss_text(trip, patience, events, loss_scaling)
    if isinstance(trip, OverflowAtFloor):
        return floor_text(trip, patience, events, loss_scaling)
    return skip_rate_text(trip, max_skip_rate, events)


def moves_text(moves: Sequence[PrecisionMove], max_layers: int) -> str:
    """What ``PrecisionAutopilot`` did before the guard stopped the run.

    Args:
        moves: the autopilot's moves, oldest first (may be empty).
        max_layers: its ``max_layers``.

    Returns:
        A paragraph naming every move, and that moving did not help (or reached
        ``max_layers``); "" without moves.
    """
    if not moves:
        return ""
    listed = "; ".join(
        f"`{m.layer}` ({m.layer_class}) to {m.to_policy} at step {m.step}, {m.reason}"
        for m in moves
    )
    why = (
        f"it reached max_layers={max_layers}"
        if len(moves) >= max_layers
        else "the rule still held after them"
    )
    return (
        f"PrecisionAutopilot moved {plural(len(moves), 'layer')} out of float16 before "
        f"this ({listed}); {why}."
    )
