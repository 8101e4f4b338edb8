"""The dynamic loss-scale rule, written once as a pure function with keras.ops.

The rule, for one attempted optimizer step (all arithmetic in float32)::

    if all_finite and not forward_overflow:  # every gradient, on every replica
        good_steps += 1
        if good_steps == growth_steps:    # enough consecutive good steps
            scale = min(scale * growth_factor, max_scale)
            good_steps = 0
            hysteresis_left = hysteresis  # the overflow budget refills
            event = GROWTH if scale changed else NONE
    elif forward_overflow and not config.backoff_on_forward_overflow:
        good_steps = 0                    # the unscaled loss was non-finite: skipped,
        event = FORWARD_OVERFLOW          # scale and hysteresis kept (no scale fixes it)
    else:                                 # the step is skipped
        good_steps = 0
        hysteresis_left -= 1
        if hysteresis_left == 0:          # budget spent: back off
            scale = max(scale * backoff_factor, min_scale)
            hysteresis_left = hysteresis
            event = BACKOFF if scale changed else OVERFLOW_AT_FLOOR
        else:
            event = SKIP_ABSORBED         # tolerated by hysteresis

``forward_overflow`` means the unscaled loss was non-finite: the forward pass made the
NaN/Inf, and lowering the scale cannot fix it (``backoff_on_forward_overflow=True``
restores the classic rule, which treats it as any overflow). With ``hysteresis=1``
every gradient overflow backs off, as Keras's own optimizer does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from keras import ops

from kmix import tags

NONE = 0
GROWTH = 1
BACKOFF = 2
SKIP_ABSORBED = 3
OVERFLOW_AT_FLOOR = 4
FORWARD_OVERFLOW = 5

EVENT_KINDS = dict(enumerate(tags.EVENT_KINDS, start=GROWTH))
"""Event code -> name, as the names appear in records and logs (kmix.tags)."""


@dataclass(frozen=True)
class ScaleConfig:
    """Constants of the rule (validated by the optimizer that owns them)."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_steps: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    backoff_on_forward_overflow: bool = False


class ScaleState(NamedTuple):
    """State of the rule: float32 ``scale``, integer ``good_steps``, ``hysteresis_left``."""

    scale: Any
    good_steps: Any
    hysteresis_left: Any


def update_scale(
    state: ScaleState, all_finite: Any, config: ScaleConfig, loss_finite: Any = True
) -> tuple[ScaleState, Any]:
    """Applies the rule above to one step, without control flow on tensors.

    Args:
        state: the state before the step; integer fields of any int dtype.
        all_finite: boolean scalar, True when every gradient of the step is finite.
        config: the rule's constants.
        loss_finite: boolean scalar, False when the unscaled loss was non-finite
            (a forward overflow); True when finite or unknown.

    Returns:
        ``(new_state, event)``: the state after the step, with the input dtypes,
        and an int32 scalar event kind (``NONE``, ``GROWTH``, ``BACKOFF``,
        ``SKIP_ABSORBED``, ``OVERFLOW_AT_FLOOR`` or ``FORWARD_OVERFLOW``).
    """
    forward = ops.logical_not(ops.convert_to_tensor(loss_finite))
    if config.backoff_on_forward_overflow:
        return _gradient_rule(state, ops.logical_and(all_finite, ops.logical_not(forward)), config)
    new_state, event = _gradient_rule(state, ops.logical_or(all_finite, forward), config)
    zero = ops.zeros((), ops.dtype(state.good_steps))
    kept = ScaleState(
        ops.where(forward, ops.cast(state.scale, "float32"), new_state.scale),
        ops.where(forward, zero, new_state.good_steps),
        ops.where(forward, state.hysteresis_left, new_state.hysteresis_left),
    )
    return kept, ops.where(forward, ops.convert_to_tensor(FORWARD_OVERFLOW, "int32"), event)


def _gradient_rule(
    state: ScaleState, all_finite: Any, config: ScaleConfig
) -> tuple[ScaleState, Any]:
    """The rule for gradient overflows alone (the ``if``/``else`` of the docstring)."""
    scale = ops.cast(state.scale, "float32")
    int_dtype = ops.dtype(state.good_steps)
    good_next = state.good_steps + 1
    left_next = state.hysteresis_left - 1
    grow = ops.logical_and(all_finite, good_next >= config.growth_steps)
    back = ops.logical_and(ops.logical_not(all_finite), left_next <= 0)

    grown = ops.minimum(scale * config.growth_factor, config.max_scale)
    backed = ops.maximum(scale * config.backoff_factor, config.min_scale)
    new_scale = ops.where(grow, grown, ops.where(back, backed, scale))
    changed = ops.not_equal(new_scale, scale)

    zero = ops.zeros((), int_dtype)
    refill = ops.cast(config.hysteresis, int_dtype)
    new_good = ops.where(ops.logical_and(all_finite, ops.logical_not(grow)), good_next, zero)
    new_left = ops.where(
        ops.logical_or(grow, back),
        refill,
        ops.where(all_finite, state.hysteresis_left, left_next),
    )

    def kind(value: int) -> Any:
        return ops.convert_to_tensor(value, "int32")

    event = ops.where(
        all_finite,
        ops.where(ops.logical_and(grow, changed), kind(GROWTH), kind(NONE)),
        ops.where(
            back,
            ops.where(changed, kind(BACKOFF), kind(OVERFLOW_AT_FLOOR)),
            kind(SKIP_ABSORBED),
        ),
    )
    return ScaleState(new_scale, new_good, new_left), event
