"""The TensorBoard contract shared by the writer (callbacks) and readers (report).

Nothing here imports TensorFlow or Keras, so ``kmix report`` stays light.
All kmix data lives under the ``kmix/`` prefix in ``<log_dir>/train``; the step
of every point is the attempted optimizer step, skipped steps included, from 1.

This module holds the tag names, the exponent-bin layout and the descriptions; it
re-exports the formats written and read back, and the file format that carries them,
which live in its parts:

* :mod:`kmix.tags.events`: scale events and lost-event notes, as the markdown line
  of ``kmix/events`` (:func:`format_event`, the wording of an event's line) and the
  structured record of ``kmix/event_record``;
* :mod:`kmix.tags.records`: the other structured records, ``kmix/policy_record``
  (with the scale at train begin, each variable's compute dtype, the audit's
  findings and the run id) and ``kmix/run_end``, the run-end reasons, and run ids
  (every record a run writes names it, so two runs in one log dir are told apart);
* :mod:`kmix.tags.moves`: precision moves, as the line and the structured record;
* :mod:`kmix.tags.comparison`: the record of ``kmix compare``;
* :mod:`kmix.tags.event_file` (with :mod:`kmix.tags.crc32c`): TensorBoard's event-file
  format, written and read without TensorFlow (:class:`EventWriter`, :func:`read_events`).

Import every name from here (``kmix.tags.ScaleEvent``), not from the parts.
"""

from __future__ import annotations

from kmix.tags.comparison import (
    COMPARISON,
    COMPARISON_FILE,
    COMPARISON_RECORD,
    COMPARISON_RUN,
    format_comparison,
    parse_comparison,
    read_comparison_file,
)
from kmix.tags.event_file import EventWriter, glob, makedirs, read_events
from kmix.tags.events import (
    EVENT_KINDS,
    EVENTS_LOST_RECORD,
    FLOAT16_MAX,
    RECORD_TYPES,
    SCALE_EVENT_RECORD,
    SKIP_KINDS,
    EventsLost,
    EventSource,
    ForwardOrigin,
    ScaleEvent,
    format_event,
    format_event_record,
    format_events_lost,
    inputs_words,
    parse_event,
    parse_event_record,
    parse_events_lost,
    plain_text,
    source_words,
)
from kmix.tags.float8 import (
    FLOAT8_FORMAT_MAX,
    FLOAT8_FORMAT_TINY,
    FLOAT8_FORMATS,
    FLOAT8_LOST_RECORD,
    FLOAT8_SATURATION_RECORD,
    FP8_EVENTS,
    FP8_HEADROOM_BITS,
    FP8_RECORD,
    FP8_SATURATED_STEPS,
    FP8_SCALE,
    FP8_STALENESS_BITS,
    FP8_TAG_PREFIXES,
    FP8_UNDERFLOW_FRACTION,
    ROUNDING_BITS,
    Float8Lost,
    Float8Saturation,
    amax_words,
    float8_tag,
    format_lost,
    format_lost_record,
    format_saturation,
    format_saturation_record,
    parse_float8_tag,
    parse_lost_record,
    parse_saturation_record,
)
from kmix.tags.moves import (
    FLOAT16_SHARE,
    PRECISION_MOVE_RECORD,
    PRECISION_MOVES,
    MoveRecord,
    format_precision_move,
    format_precision_move_record,
    parse_precision_move_record,
)
from kmix.tags.records import (
    COMPLETED,
    EXCEPTION,
    GUARD_RAISED,
    INTERRUPTED,
    LOSS_SCALINGS,
    RUN_END_REASONS,
    STOPPED_BY_COMPARE,
    STOPPED_BY_GUARD,
    AuditFinding,
    PolicyRecord,
    RunEnd,
    format_policy_record,
    format_run_end,
    new_run_id,
    parse_policy_record,
    parse_run_end,
    parse_run_id,
)

__all__ = [
    "FP8_EVENTS",
    "FP8_HEADROOM_BITS",
    "FP8_RECORD",
    "FP8_SATURATED_STEPS",
    "FP8_SCALE",
    "FP8_STALENESS_BITS",
    "FP8_TAG_PREFIXES",
    "FP8_UNDERFLOW_FRACTION",
    "FLOAT8_FORMATS",
    "FLOAT8_FORMAT_MAX",
    "FLOAT8_FORMAT_TINY",
    "FLOAT8_LOST_RECORD",
    "FLOAT8_SATURATION_RECORD",
    "Float8Lost",
    "Float8Saturation",
    "ROUNDING_BITS",
    "amax_words",
    "float8_tag",
    "format_lost",
    "format_lost_record",
    "format_saturation",
    "format_saturation_record",
    "parse_float8_tag",
    "parse_lost_record",
    "parse_saturation_record",
    "EventWriter",
    "glob",
    "makedirs",
    "read_events",
    "FLOAT16_MAX",
    "COMPARISON",
    "COMPARISON_FILE",
    "COMPARISON_RECORD",
    "COMPARISON_RUN",
    "format_comparison",
    "parse_comparison",
    "read_comparison_file",
    "ACTIVATION_HEADROOM_BITS",
    "ACTIVATION_MAX_ABS",
    "ACTIVATION_NONFINITE_FRACTION",
    "ACTIVATION_UNDERFLOW_FRACTION",
    "COMPLETED",
    "DESCRIPTIONS",
    "EVENTS",
    "EVENTS_LOST_RECORD",
    "EVENT_KINDS",
    "EVENT_RECORD",
    "EXCEPTION",
    "EXPONENT_BIN_OFFSET",
    "EXPONENT_MAX",
    "EXPONENT_MIN",
    "FLOAT16_MAX_EXPONENT",
    "FLOAT16_MIN_NORMAL_EXPONENT",
    "FLOAT16_MIN_SUBNORMAL_EXPONENT",
    "GRAD_EXPONENT",
    "GRAD_NORM",
    "GUARD_RAISED",
    "INTERRUPTED",
    "LOSS_FINITE",
    "LOSS_SCALE",
    "FLOAT16_SHARE",
    "LOSS_SCALE_LOG2",
    "LOSS_SCALINGS",
    "MAX_ABS_SCALED_GRAD",
    "MIN_ACTIVATION_HEADROOM_BITS",
    "NONFINITE_ELEMENTS",
    "NOTES",
    "NUM_EXPONENT_BINS",
    "OVERFLOW_HEADROOM_BITS",
    "POLICY",
    "POLICY_RECORD",
    "PRECISION_MOVES",
    "PRECISION_MOVE_RECORD",
    "PREFIX",
    "RECORD_TYPES",
    "RUN_END",
    "RUN_END_REASONS",
    "SCALE_EVENT_RECORD",
    "SKIPPED_STEPS",
    "SKIP_KINDS",
    "SKIP_RATE",
    "STOPPED_BY_COMPARE",
    "STOPPED_BY_GUARD",
    "SUBNORMAL_BY_VARIABLE",
    "SUBNORMAL_FRACTION",
    "TRAIN_DIR",
    "UNDERFLOW_BY_VARIABLE",
    "UNDERFLOW_FRACTION",
    "ZERO_FRACTION",
    "AuditFinding",
    "EventSource",
    "EventsLost",
    "ForwardOrigin",
    "MoveRecord",
    "PolicyRecord",
    "RunEnd",
    "ScaleEvent",
    "bin_exponent",
    "description",
    "exponent_bin",
    "exponent_bucket_edges",
    "format_event",
    "format_event_record",
    "format_events_lost",
    "inputs_words",
    "source_words",
    "format_policy_record",
    "format_precision_move",
    "format_precision_move_record",
    "format_run_end",
    "parse_event",
    "parse_event_record",
    "parse_events_lost",
    "plain_text",
    "parse_policy_record",
    "parse_precision_move_record",
    "parse_run_end",
    "new_run_id",
    "parse_run_id",
]

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
# Underflow told apart (kmix/underflow_fraction = zero + subnormal keeps its meaning):
ZERO_FRACTION = "kmix/zero_fraction"
"""Share of the scaled gradient elements of float16 layers that are exactly zero."""
SUBNORMAL_FRACTION = "kmix/subnormal_fraction"
"""Share that is non-zero but below float16's smallest normal ``2**-14``: what float16
loses precision on or flushes to zero."""
SUBNORMAL_BY_VARIABLE = "kmix/subnormal_fraction_by_variable/"  # + variable path
# Forward-pass statistics per layer (each + layer path), and their minimum:
ACTIVATION_MAX_ABS = "kmix/activation_max_abs/"
ACTIVATION_HEADROOM_BITS = "kmix/activation_headroom_bits/"
ACTIVATION_NONFINITE_FRACTION = "kmix/activation_nonfinite_fraction/"
ACTIVATION_UNDERFLOW_FRACTION = "kmix/activation_underflow_fraction/"
MIN_ACTIVATION_HEADROOM_BITS = "kmix/min_activation_headroom_bits"
# Structured records (JSON text summaries) beside the human-readable texts:
POLICY_RECORD = "kmix/policy_record"
"""A :class:`PolicyRecord` as JSON, written beside the markdown of ``kmix/policy``; the
first point of every train begin, so a run's points are those written after it."""
RUN_END = "kmix/run_end"
"""A :class:`RunEnd` as JSON: why and at which step ``fit`` ended."""
EVENT_RECORD = "kmix/event_record"
"""Each :class:`ScaleEvent` and :class:`EventsLost` note as a JSON record
(:func:`format_event_record`), written at the step of its ``kmix/events`` line."""

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
EXPONENT_BIN_OFFSET = 2 - EXPONENT_MIN
"""``exponent + EXPONENT_BIN_OFFSET`` is the bin of an exponent inside the range."""
FLOAT16_MIN_SUBNORMAL_EXPONENT = -24
FLOAT16_MIN_NORMAL_EXPONENT = -14
FLOAT16_MAX_EXPONENT = 15  # 65504 = 1.999... * 2**15


def exponent_bin(exponent: int) -> int:
    """The bin of a non-zero finite value ``v`` with ``floor(log2(|v|)) == exponent``.

    The one formula of the layout above: exponents below ``EXPONENT_MIN`` land in
    bin 1, those above ``EXPONENT_MAX`` in bin ``NUM_EXPONENT_BINS - 2``. In-graph
    code computes the same with ``clip(e + EXPONENT_BIN_OFFSET, 1, NUM_EXPONENT_BINS - 2)``.

    Args:
        exponent: the base-2 exponent.

    Returns:
        The bin index, in ``[1, NUM_EXPONENT_BINS - 2]``.
    """
    return min(max(int(exponent) + EXPONENT_BIN_OFFSET, 1), NUM_EXPONENT_BINS - 2)


def bin_exponent(index: int) -> int | None:
    """The exponent ``e`` whose values bin ``index`` holds, inverse of :func:`exponent_bin`.

    Args:
        index: a bin index.

    Returns:
        ``e`` for the bins of one power of two; ``EXPONENT_MIN - 1`` for bin 1 and
        ``EXPONENT_MAX + 1`` for the bin of larger finite values (their nearest
        exponent: bounds, not exact); None for the zero and inf/NaN bins.
    """
    if index <= 0 or index >= NUM_EXPONENT_BINS - 1:
        return None
    return int(index) - EXPONENT_BIN_OFFSET


def exponent_bucket_edges() -> list[tuple[float, float]]:
    """Returns the ``(left, right)`` log2 edges at which each bin is drawn.

    Bin ``i`` of an exponent ``e`` spans ``[e, e + 1)``. Zero is drawn at
    ``[EXPONENT_MIN - 2, EXPONENT_MIN - 1)`` and inf/NaN at
    ``[EXPONENT_MAX + 2, EXPONENT_MAX + 3)``, so every bin has its own place.
    """
    first = EXPONENT_MIN - 2
    return [(float(first + i), float(first + i + 1)) for i in range(NUM_EXPONENT_BINS)]


LOSS_SCALE_LOG2 = "kmix/loss_scale_log2"
"""log2 of ``kmix/loss_scale``: whole numbers, readable on TensorBoard's linear axis."""

DESCRIPTIONS = {
    FP8_SCALE: "Delayed float8 scale of a float8 layer's tensor (Keras's <tensor>_scale): "
    "the tensor is divided by it, then clipped to the format's range (448 for E4M3, 57344 "
    "for E5M2).",
    FP8_HEADROOM_BITS: "log2(scale x format max / the newest amax) of a float8 tensor: "
    "doublings left before Keras clips it at the scale in force; below 0: the next step "
    "clips at this amax.",
    FP8_SATURATED_STEPS: "Cumulative steps at which a float8 tensor's amax exceeded what its "
    "scale could represent (Keras clipped it, silently).",
    FP8_UNDERFLOW_FRACTION: "Share of a float8 layer's non-zero values that flush to zero: "
    "its kernel's at the kernel scale in force, its inputs' (measured in the step) at the "
    "inputs scale that step used.",
    FP8_STALENESS_BITS: "log2(largest amax in the history / the newest amax): how many bits "
    "coarser than needed the delayed scale is (a stale spike keeps it coarse for up to the "
    "history's length).",
    FP8_EVENTS: "Float8 saturation episodes, one line each at its first step; and the "
    "episodes lost (overwritten in the optimizer's ring before a read), counted.",
    LOSS_SCALE: "Loss scale (a power of two) multiplying the loss before backprop; written "
    "at every read and at the steps before and after each change. Read it on a log axis: "
    "kmix/loss_scale_log2, or the Mixed Precision tab.",
    LOSS_SCALE_LOG2: "log2 of kmix/loss_scale: whole numbers, readable on a linear axis.",
    SKIPPED_STEPS: "Cumulative skipped steps (non-finite gradients or loss); the weights "
    "were not updated on them.",
    SKIP_RATE: "Skipped ÷ attempted steps since the previous read: 0 healthy, 1 every step "
    "skipped.",
    GRAD_NORM: "Global L2 norm of the unscaled gradients at the measured step.",
    OVERFLOW_HEADROOM_BITS: "log2(65504 ÷ max |scaled gradient|) over float16 layers: "
    "doublings of the scale left before float16 overflows. Below 1: close; below 0: "
    "overflowed.",
    UNDERFLOW_FRACTION: "Share of scaled gradient elements of float16 layers that are zero "
    "or below 2^-14 (float16's smallest normal): kmix/zero_fraction + kmix/subnormal_fraction.",
    ZERO_FRACTION: "Share of scaled gradient elements of float16 layers that are exactly "
    "zero (inactive units, masked positions): no loss scale changes them.",
    SUBNORMAL_FRACTION: "Share of scaled gradient elements of float16 layers that are "
    "non-zero and below 2^-14: what float16 rounds coarsely or flushes to zero.",
    MAX_ABS_SCALED_GRAD: "Largest |scaled gradient| element of float16 layers; float16 "
    "overflows above 65504.",
    NONFINITE_ELEMENTS: "inf/NaN elements in the scaled gradients at the measured step "
    "(also written at every skipped step).",
    LOSS_FINITE: "1 if the unscaled loss was finite at the read, 0 if the forward pass made "
    "inf/NaN (no loss scale fixes that).",
    UNDERFLOW_BY_VARIABLE: "kmix/underflow_fraction for one variable.",
    GRAD_EXPONENT: "log2 of |scaled gradient| of one variable, one bin per power of two; "
    f"float16 holds 2**{FLOAT16_MIN_SUBNORMAL_EXPONENT} to 65504 (2**{FLOAT16_MAX_EXPONENT + 1}); "
    f"zero is drawn at {EXPONENT_MIN - 2}, inf/NaN at {EXPONENT_MAX + 2}.",
    ACTIVATION_MAX_ABS: "Largest finite |output| of one float16 layer at the measured step; "
    "float16 overflows above 65504.",
    ACTIVATION_HEADROOM_BITS: "log2(65504 ÷ max |output|) of one float16 layer: doublings "
    "left before its output overflows float16.",
    ACTIVATION_NONFINITE_FRACTION: "Share of one float16 layer's outputs that are inf/NaN.",
    ACTIVATION_UNDERFLOW_FRACTION: "Share of one float16 layer's outputs that are zero or "
    "below 2^-14.",
    MIN_ACTIVATION_HEADROOM_BITS: "The smallest activation headroom over the float16 layers "
    "at the measured step (kmix/activation_headroom_bits/<layer> says which).",
    SUBNORMAL_BY_VARIABLE: "kmix/subnormal_fraction for one variable.",
    FLOAT16_SHARE: "Share of the model's estimated multiply-adds (parameters where unknown) "
    "still computed in float16: at train begin and after each layer PrecisionAutopilot "
    "moved out of float16 (kmix/precision_moves says which).",
}
"""Tag (or tag prefix, ending in ``/``) -> the description written with its summaries."""


def description(tag: str) -> str:
    """The description of ``tag`` (a per-variable tag takes its prefix's), "" if none."""
    if tag in DESCRIPTIONS:
        return DESCRIPTIONS[tag]
    prefix = tag[: tag.rfind("/") + 1] if "/" in tag[len(PREFIX) :] else ""
    while prefix and prefix not in DESCRIPTIONS:
        prefix = prefix[: prefix[:-1].rfind("/") + 1]
    return DESCRIPTIONS.get(prefix, "")
