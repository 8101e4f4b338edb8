"""The TensorBoard contract shared by the writer (callbacks) and readers (report).

Nothing here imports TensorFlow or Keras, so ``kmix report`` stays light.
All kmix data lives under the ``kmix/`` prefix in ``<log_dir>/train``; the step
of every point is the attempted optimizer step, skipped steps included, from 1.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from kmix._words import plural

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
"""A :class:`PolicyRecord` as JSON, written beside the markdown of ``kmix/policy``."""
RUN_END = "kmix/run_end"
"""A :class:`RunEnd` as JSON: why and at which step ``fit`` ended."""

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


EVENT_KINDS = ("growth", "backoff", "skip_absorbed", "overflow_at_floor", "forward_overflow")
"""Names of the scale event kinds, in the order of kmix.scaling's codes 1, 2, 3, 4, 5.

``forward_overflow`` is a skipped step whose unscaled loss was non-finite: no scale
can fix the forward pass, so the scale is kept.
"""
SKIP_KINDS = frozenset(EVENT_KINDS[1:])
"""The kinds recorded for a skipped (non-finite) step; only growth is not one."""


@dataclasses.dataclass(frozen=True)
class ForwardOrigin:
    """The first layer whose output went non-finite in the forward pass of a step.

    Attributes:
        layer: the layer's path, e.g. ``"block_3/ffn_out"``.
        layer_class: the layer's class name, e.g. ``"Dense"``.
        inputs_finite: whether the layer's inputs were all finite (True: the layer
            itself overflowed).
        max_abs_input: the largest absolute input value, None if not measured.
    """

    layer: str
    layer_class: str
    inputs_finite: bool
    max_abs_input: float | None


@dataclasses.dataclass(frozen=True)
class ScaleEvent:
    """One loss-scale event, as recorded in-graph at the step it happened.

    Attributes:
        index: 1-based sequence number of the event since training began; 0 when
            unknown (the ``kmix/events`` line does not hold it, so
            :func:`parse_event` gives 0).
        step: attempted optimizer step, skipped steps included, counted from 1.
        kind: one of :data:`EVENT_KINDS`: ``"growth"``, ``"backoff"``,
            ``"skip_absorbed"`` (a skipped step the hysteresis tolerated),
            ``"overflow_at_floor"`` (skipped at ``min_scale``) or
            ``"forward_overflow"`` (skipped, the unscaled loss was non-finite, the
            scale is kept).
        old_scale: loss scale before the step.
        new_scale: loss scale after the step.
        variable: path of the first variable whose gradient was non-finite, if any.
        nonfinite_variables: how many variables had a non-finite gradient.
        loss_finite: whether the unscaled loss itself was finite (False means the
            forward pass made the NaN/Inf, which no loss scale can fix); None when
            unknown.
        origin: where the forward pass first went non-finite, if it was measured.
    """

    index: int
    step: int
    kind: str
    old_scale: float
    new_scale: float
    variable: str | None
    nonfinite_variables: int
    loss_finite: bool | None
    origin: ForwardOrigin | None = None


_EVENT_RE = re.compile(
    r"^\*\*(?P<kind>[a-z_]+)\*\* at step (?P<step>\d+): "
    r"loss scale (?P<old>[^ ;]+) → (?P<new>[^ ;]+)"
    r"(?:; first non-finite gradient `(?P<variable>[^`]+)` \((?P<count>\d+) variables?\))?"
    r"(?:(?P<loss_nonfinite>; the loss itself was non-finite)"
    r"|(?P<loss_unknown>; whether the loss was finite is unknown))?"
    r"(?:; forward overflow starts in `(?P<layer>[^`]+)` \((?P<layer_class>[^)]*)\): "
    r"inputs (?P<inputs>finite|non-finite)(?:, max \|input\| (?P<max_input>[^ ;]+))?)?"
)


def format_event(event: ScaleEvent) -> str:
    """Formats a :class:`ScaleEvent` as one markdown line for ``kmix/events``.

    The line, with its optional parts in this order::

        **backoff** at step 7: loss scale 32768 → 16384
        ; first non-finite gradient `dense/kernel` (2 variables)
        ; the loss itself was non-finite      (or: ; whether the loss was finite is unknown)
        ; forward overflow starts in `block_3/ffn_out` (Dense): inputs finite, max |input| 812

    Scales and ``max |input|`` are written with 9 significant digits (exact for
    float32 values). The ``index`` is not written.

    Args:
        event: the event (any object with its fields; ``origin`` may be missing).

    Returns:
        A line that :func:`parse_event` reads back.
    """
    text = (
        f"**{event.kind}** at step {event.step}: "
        f"loss scale {event.old_scale:.9g} → {event.new_scale:.9g}"
    )
    if event.variable is not None:
        text += (
            f"; first non-finite gradient `{event.variable}` "
            f"({plural(event.nonfinite_variables, 'variable')})"
        )
    if event.loss_finite is None:
        text += "; whether the loss was finite is unknown"
    elif not event.loss_finite:
        text += "; the loss itself was non-finite"
    origin = getattr(event, "origin", None)  # also objects with the fields of 0.1.0
    if origin is not None:
        text += (
            f"; forward overflow starts in `{origin.layer}` ({origin.layer_class}): "
            f"inputs {'finite' if origin.inputs_finite else 'non-finite'}"
        )
        if origin.max_abs_input is not None:
            text += f", max |input| {origin.max_abs_input:.9g}"
    return text


def parse_event(line: str) -> ScaleEvent | None:
    """Reads a line written by :func:`format_event`, also by kmix 0.1.0.

    Args:
        line: one line of a ``kmix/events`` text summary.

    Returns:
        The :class:`ScaleEvent`, with ``index`` 0 (the line does not hold it);
        None if the line is not an event (for example a note about lost events,
        which :func:`parse_events_lost` reads).
    """
    match = _EVENT_RE.match(line.strip())
    if match is None:
        return None
    origin = None
    if match["layer"] is not None:
        origin = ForwardOrigin(
            layer=match["layer"],
            layer_class=match["layer_class"],
            inputs_finite=match["inputs"] == "finite",
            max_abs_input=None if match["max_input"] is None else float(match["max_input"]),
        )
    loss_finite = None if match["loss_unknown"] else match["loss_nonfinite"] is None
    return ScaleEvent(
        index=0,
        step=int(match["step"]),
        kind=match["kind"],
        old_scale=float(match["old"]),
        new_scale=float(match["new"]),
        variable=match["variable"],
        nonfinite_variables=int(match["count"] or 0),
        loss_finite=loss_finite,
        origin=origin,
    )


@dataclasses.dataclass(frozen=True)
class EventsLost:
    """A note that the optimizer's event ring overflowed between two reads.

    Attributes:
        count: how many events were lost.
        after_step: the step of the read before the loss.
        upto_step: the step of the read that found it.
        capacity: the optimizer's ``event_capacity``, None if not written.
    """

    count: int
    after_step: int
    upto_step: int
    capacity: int | None = None


_EVENTS_LOST_RE = re.compile(
    r"^\*\*(?P<count>\d+) scale events? lost\*\* between steps (?P<after>\d+) and "
    r"(?P<upto>\d+)(?:.*?\(event_capacity=(?P<capacity>\d+)\))?"
)


def format_events_lost(lost: EventsLost) -> str:
    """Formats the note written to ``kmix/events`` when events were lost.

    Args:
        lost: what was lost.

    Returns:
        A markdown line that :func:`parse_events_lost` reads back and
        :func:`parse_event` does not take for an event.
    """
    capacity = "" if lost.capacity is None else f" (event_capacity={lost.capacity})"
    return (
        f"**{plural(lost.count, 'scale event')} lost** between steps {lost.after_step} "
        f"and {lost.upto_step}: more happened between two reads than the optimizer's "
        f"event ring holds{capacity}. Lower `update_freq` or raise `event_capacity` of "
        "kmix.LossScaleOptimizer."
    )


def parse_events_lost(line: str) -> EventsLost | None:
    """Reads a note written by :func:`format_events_lost`, also by kmix 0.1.0.

    Args:
        line: one line of a ``kmix/events`` text summary.

    Returns:
        The :class:`EventsLost`, or None if the line is not such a note.
    """
    match = _EVENTS_LOST_RE.match(line.strip())
    if match is None:
        return None
    return EventsLost(
        count=int(match["count"]),
        after_step=int(match["after"]),
        upto_step=int(match["upto"]),
        capacity=None if match["capacity"] is None else int(match["capacity"]),
    )


# ------------------------------------------------------------- structured records
LOSS_SCALINGS = ("kmix", "keras", "none")
"""What scales the loss: kmix's optimizer, Keras's stock one, or nothing."""


@dataclasses.dataclass(frozen=True)
class PolicyRecord:
    """What a run was configured with, written once at train begin.

    Attributes:
        global_policy: ``keras.config.dtype_policy().name``.
        model_name: the model's name.
        model_policy: the model's dtype policy name, e.g. ``"mixed_float16"``.
        compute_dtype: the model's compute dtype, e.g. ``"float16"``.
        variable_dtype: the model's variable dtype, e.g. ``"float32"``.
        loss_scaling: one of :data:`LOSS_SCALINGS`.
        min_scale: the lowest loss scale allowed; None unless ``loss_scaling`` is
            ``"kmix"``.
        max_scale: the highest; None unless ``loss_scaling`` is ``"kmix"``.
        update_freq: the monitor's ``update_freq``.
        histogram_freq: the monitor's ``histogram_freq`` (0: no histograms).
    """

    global_policy: str
    model_name: str
    model_policy: str
    compute_dtype: str
    variable_dtype: str
    loss_scaling: str
    min_scale: float | None
    max_scale: float | None
    update_freq: int
    histogram_freq: int


def _record_json(record: Any) -> str:
    return json.dumps(dataclasses.asdict(record), sort_keys=True)


def _record_fields(text: str, cls: type) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return None
    names = [field.name for field in dataclasses.fields(cls)]
    if not isinstance(data, dict) or not set(names) <= set(data):
        return None
    return {name: data[name] for name in names}


def format_policy_record(record: PolicyRecord) -> str:
    """Formats a :class:`PolicyRecord` as the JSON text of ``kmix/policy_record``.

    Args:
        record: the record.

    Returns:
        A JSON object with one key per field (scales may be ``Infinity``, as
        Python's ``json`` writes it).
    """
    return _record_json(record)


def parse_policy_record(text: str) -> PolicyRecord | None:
    """Reads the text written by :func:`format_policy_record`.

    Args:
        text: the ``kmix/policy_record`` text.

    Returns:
        The :class:`PolicyRecord`; None if the text is not such a record (keys
        added by later versions are ignored).
    """
    fields = _record_fields(text, PolicyRecord)
    if fields is None:
        return None
    for name in ("min_scale", "max_scale"):
        if fields[name] is not None:
            fields[name] = float(fields[name])
    return PolicyRecord(**fields)


COMPLETED = "completed"
STOPPED_BY_GUARD = "stopped_by_guard"
GUARD_RAISED = "guard_raised"
EXCEPTION = "exception"
INTERRUPTED = "interrupted"
RUN_END_REASONS = (COMPLETED, STOPPED_BY_GUARD, GUARD_RAISED, EXCEPTION, INTERRUPTED)
"""Why ``fit`` ended: it ran all its steps; ``LossScaleGuard`` stopped it or raised;
another exception; ``KeyboardInterrupt``. The only spelling of these reasons."""


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """How a run ended, written once when ``fit`` ends (whatever ends it).

    Attributes:
        step: the last attempted optimizer step.
        reason: one of :data:`RUN_END_REASONS`.
        message: the diagnosis or exception message, "" when there is none.
    """

    step: int
    reason: str
    message: str


def format_run_end(run_end: RunEnd) -> str:
    """Formats a :class:`RunEnd` as the JSON text of ``kmix/run_end``.

    Args:
        run_end: how the run ended.

    Returns:
        A JSON object with the keys ``step``, ``reason`` and ``message``.
    """
    return _record_json(run_end)


def parse_run_end(text: str) -> RunEnd | None:
    """Reads the text written by :func:`format_run_end`.

    Args:
        text: the ``kmix/run_end`` text.

    Returns:
        The :class:`RunEnd`; None if the text is not such a record.
    """
    fields = _record_fields(text, RunEnd)
    if fields is None or not isinstance(fields["step"], int):
        return None
    return RunEnd(step=fields["step"], reason=str(fields["reason"]), message=str(fields["message"]))


LOSS_SCALE_LOG2 = "kmix/loss_scale_log2"
"""log2 of ``kmix/loss_scale``: whole numbers, readable on TensorBoard's linear axis."""

DESCRIPTIONS = {
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
