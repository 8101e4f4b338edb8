"""The autopilot's rules: which layer leaves float16, and why. Pure functions over typed values.

:class:`kmix.callbacks.PrecisionAutopilot` reads its source and asks these functions
which layers to move; nothing here reads a model, an optimizer or a clock.

* Reactive (:func:`overflow_candidates`): a skipped step whose forward pass overflowed
  names its origin layer; that layer moves. A float32 output beyond float16's range then
  overflows the cast into the next float16 layer, which is named by the next step's
  event and moves in turn, until the values are back in range.
* Proactive (:func:`headroom_candidates`): at each health step, a layer whose activation
  headroom is below the margin, or whose headroom is forecast (the report's rule,
  :func:`kmix.report.summary.forecast_zero_crossing`) to reach 0 within the horizon,
  moves before it overflows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kmix.precision_plan import base_path
from kmix.report import forecast_zero_crossing
from kmix.tags import FLOAT16_MAX, ScaleEvent

HISTORY = 64
"""Headroom readings kept per layer for the forecast."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layer the rules want out of float16.

    Attributes:
        layer: the layer's path (without a ``#k`` call suffix).
        step: the step the evidence is from.
        reason: why, in words (becomes :attr:`kmix.PrecisionMove.reason`).
        overflow: the evidence is an overflow in the layer itself (not a headroom
            reading, which, for a layer out of float16, concerns its receivers).
        upstream: the overflow started before the layer: its inputs were already
            non-finite (an op between layers, such as ``stem + res``, or the data).
    """

    layer: str
    step: int
    reason: str
    overflow: bool = False
    upstream: bool = False


def overflow_candidates(events: Iterable[ScaleEvent]) -> list[Candidate]:
    """The origin layer of each forward overflow, first occurrence of each layer.

    Args:
        events: recorded events, oldest first.

    Returns:
        One candidate per layer named as a forward origin, at its first step, with the
        reason ``"forward overflow at step s"`` (``"…: its float16 input cast overflowed,
        max |input| x"`` where a wider input was past float16's range).
    """
    found: dict[str, Candidate] = {}
    for event in events:
        origin = event.origin
        if origin is None or event.loss_finite is not False:
            continue
        layer = base_path(origin.layer)
        if layer in found:
            continue
        reason = f"forward overflow at step {event.step}"
        if not origin.inputs_finite:
            reason += f": before `{layer}`, whose inputs were already non-finite"
        elif (origin.max_abs_input or 0.0) > FLOAT16_MAX:
            reason += f": the cast of its input (max |input| {origin.max_abs_input:.6g}) overflowed"
        found[layer] = Candidate(
            layer, event.step, reason, overflow=True, upstream=not origin.inputs_finite
        )
    return list(found.values())


def unhealable_overflows(events: Iterable[ScaleEvent]) -> list[ScaleEvent]:
    """Forward overflows no move can act on: their origin layer is unknown."""
    return [e for e in events if e.loss_finite is False and e.origin is None]


class HeadroomHistory:
    """Activation headroom readings per layer, for the proactive rule."""

    def __init__(self) -> None:
        self.points: dict[str, list[tuple[int, float]]] = {}

    def add(self, step: int, headroom: Mapping[str, float]) -> None:
        """Adds one health step's headroom (layer path → bits); ``#k`` calls count as one
        layer, with their lowest headroom."""
        lowest: dict[str, float] = {}
        for path, bits in headroom.items():
            layer = base_path(path)
            lowest[layer] = min(bits, lowest.get(layer, bits))
        for layer, bits in lowest.items():
            points = self.points.setdefault(layer, [])
            points.append((step, bits))
            del points[:-HISTORY]


def falling_rate(points: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """``(step at which it reaches 0, bits lost per 100 steps)``, if falling steadily."""
    if len(points) < 2:
        return None
    steps, values = np.asarray(points, dtype=np.float64).T
    fit = forecast_zero_crossing(steps, values)
    if fit is None:
        return None
    zero, slope, _ = fit
    return zero, -100.0 * slope


def headroom_candidates(
    history: HeadroomHistory, step: int, margin_bits: float, horizon: int
) -> list[Candidate]:
    """Layers whose latest headroom is below ``margin_bits``, or forecast to reach 0 bits
    within ``horizon`` steps of ``step``.

    Args:
        history: the readings so far (the latest is the one judged).
        step: the step of the latest reading.
        margin_bits: the least headroom a float16 layer may keep.
        horizon: steps ahead the forecast must not reach 0 in (the next reads).

    Returns:
        Candidates in the order of the history, reasons ``"headroom 0.62 bits, below the
        margin of 1 bit"`` or ``"headroom 2.1 bits, falling 0.31 bits per 100 steps"``
        (the fall is added to the first where it is measured).
    """
    found = []
    for layer, points in history.points.items():
        last_step, bits = points[-1]
        if last_step != step:
            continue
        rate = falling_rate(points)
        falling = f", falling {rate[1]:.3g} bits per 100 steps" if rate else ""
        if bits < margin_bits:
            margin = f"{margin_bits:g} bit{'s' if margin_bits != 1 else ''}"
            reason = f"headroom {bits:.3g} bits, below the margin of {margin}{falling}"
        elif rate is not None and rate[0] - step <= horizon:
            reason = f"headroom {bits:.3g} bits{falling}: 0 bits forecast at step {rate[0]:.0f}"
        else:
            continue
        found.append(Candidate(layer, step, reason))
    return found
