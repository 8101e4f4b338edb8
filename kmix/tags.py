"""The TensorBoard contract shared by the writer (callbacks) and readers (report).

Nothing here imports TensorFlow or Keras, so ``kmix report`` stays light.
All kmix data lives under the ``kmix/`` prefix in ``<log_dir>/train``; the step
of every point is the attempted optimizer step, skipped steps included, from 1.
"""

from __future__ import annotations

import re
from typing import Any

TRAIN_DIR = "train"
PREFIX = "kmix/"

LOSS_SCALE = "kmix/loss_scale"
SKIPPED_STEPS = "kmix/skipped_steps"
SKIP_RATE = "kmix/skip_rate"
GRAD_NORM = "kmix/grad_norm"
OVERFLOW_HEADROOM_BITS = "kmix/overflow_headroom_bits"
UNDERFLOW_FRACTION = "kmix/underflow_fraction"
# Additions beyond the core table (allowed under kmix/):
MAX_ABS_SCALED_GRAD = "kmix/max_abs_scaled_grad"
NONFINITE_ELEMENTS = "kmix/nonfinite_elements"
LOSS_FINITE = "kmix/loss_finite"
UNDERFLOW_BY_VARIABLE = "kmix/underflow_fraction_by_variable/"  # + variable path
GRAD_EXPONENT = "kmix/grad_exponent/"  # + variable path
EVENTS = "kmix/events"
POLICY = "kmix/policy"
NOTES = "kmix/notes"

# Exponent histogram layout (the optimizer computes it, the writer and readers use it):
EXPONENT_MIN = -40
EXPONENT_MAX = 17
NUM_EXPONENT_BINS = EXPONENT_MAX - EXPONENT_MIN + 5
"""One integer bin per power of two:

* bin 0: exactly zero;
* bin 1: non-zero values below ``2**EXPONENT_MIN``;
* bin ``2 + e - EXPONENT_MIN``: values ``v`` with ``floor(log2(|v|)) == e``, for
  ``EXPONENT_MIN <= e <= EXPONENT_MAX`` (float16 keeps ``e`` in ``[-24, 15]``);
* bin ``NUM_EXPONENT_BINS - 2``: finite values of ``2**(EXPONENT_MAX + 1)`` or more;
* bin ``NUM_EXPONENT_BINS - 1``: inf and NaN.
"""
FLOAT16_MIN_SUBNORMAL_EXPONENT = -24
FLOAT16_MIN_NORMAL_EXPONENT = -14
FLOAT16_MAX_EXPONENT = 15  # 65504 = 1.999... * 2**15


def exponent_bucket_edges() -> list[tuple[float, float]]:
    """Returns the ``(left, right)`` log2 edges at which each bin is drawn.

    Bin ``i`` of an exponent ``e`` spans ``[e, e + 1)``. Zero is drawn at
    ``[EXPONENT_MIN - 2, EXPONENT_MIN - 1)`` and inf/NaN at
    ``[EXPONENT_MAX + 2, EXPONENT_MAX + 3)``, so every bin has its own place.
    """
    first = EXPONENT_MIN - 2
    return [(float(first + i), float(first + i + 1)) for i in range(NUM_EXPONENT_BINS)]


EVENT_KINDS = ("growth", "backoff", "skip_absorbed", "overflow_at_floor")
"""Names of the scale event kinds, in the order of kmix.scaling's codes 1, 2, 3, 4."""
SKIP_KINDS = frozenset(EVENT_KINDS[1:])
"""The kinds recorded for a skipped (non-finite) step; only growth is not one."""
_EVENT_RE = re.compile(
    r"^\*\*(?P<kind>[a-z_]+)\*\* at step (?P<step>\d+): "
    r"loss scale (?P<old>[^ ;]+) → (?P<new>[^ ;]+)"
    r"(?:; first non-finite gradient `(?P<variable>[^`]+)` \((?P<count>\d+) variables?\))?"
    r"(?P<loss_nonfinite>; the loss itself was non-finite)?"
)


def format_event(event: Any) -> str:
    """Formats a :class:`kmix.ScaleEvent` as one markdown line for ``kmix/events``.

    Args:
        event: any object with the fields of ``kmix.ScaleEvent``.

    Returns:
        A line that :func:`parse_event` reads back.
    """
    text = (
        f"**{event.kind}** at step {event.step}: "
        f"loss scale {event.old_scale:.9g} → {event.new_scale:.9g}"
    )
    if event.variable is not None:
        plural = "" if event.nonfinite_variables == 1 else "s"
        text += (
            f"; first non-finite gradient `{event.variable}` "
            f"({event.nonfinite_variables} variable{plural})"
        )
    if not event.loss_finite:
        text += "; the loss itself was non-finite"
    return text


def parse_event(line: str) -> dict[str, Any] | None:
    """Reads a line written by :func:`format_event`.

    Args:
        line: one line of a ``kmix/events`` text summary.

    Returns:
        A dict with ``kind``, ``step``, ``old_scale``, ``new_scale``, ``variable``
        (or None), ``nonfinite_variables`` and ``loss_finite``; None if the line
        is not an event (for example a note about lost events).
    """
    match = _EVENT_RE.match(line.strip())
    if match is None:
        return None
    return {
        "kind": match["kind"],
        "step": int(match["step"]),
        "old_scale": float(match["old"]),
        "new_scale": float(match["new"]),
        "variable": match["variable"],
        "nonfinite_variables": int(match["count"] or 0),
        "loss_finite": match["loss_nonfinite"] is None,
    }
