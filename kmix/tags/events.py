"""Scale events in the TensorBoard contract: the markdown line and the structured record.

Part of :mod:`kmix.tags`, which re-exports every public name here; import them from
there. Each event (and each note that events were lost) is written twice at its
step: as a markdown line under ``kmix/events``, for people and TensorBoard's Text
dashboard, and as a JSON record under ``kmix/event_record``, for readers. Readers
read the records; they parse the lines only in logs that hold no record (written by
kmix 0.1.0 and by versions before the records). :func:`format_event` words an
event's line wherever one is shown: ``kmix/events``, the monitor's printed origin,
and the Mixed Precision tab (served by the plugin). Nothing here imports TensorFlow
or Keras.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from kmix._words import plural
from kmix.tags.records import json_object, record_fields, record_json

EVENT_KINDS = ("growth", "backoff", "skip_absorbed", "overflow_at_floor", "forward_overflow")
"""Names of the scale event kinds, in the order of kmix.record.scaling's codes 1, 2, 3, 4, 5.

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
class EventSource:
    """Where a skipped step's first non-finite values were, across processes or replicas.

    Attributes:
        process: the ``keras.distribution`` process whose shard of the batch held them
            (JAX, several processes); None when not known.
        replica: under ``tf.distribute``, the replica (``replica_id_in_sync_group``)
            whose gradients or loss were non-finite; under ``keras.distribution``, the
            shard of the batch (the data-parallel replica: device ``replica`` of the
            mesh's batch axis). The first one when several were; None when not known.
    """

    process: int | None = None
    replica: int | None = None


@dataclasses.dataclass(frozen=True)
class ScaleEvent:
    """One loss-scale event, as recorded in-graph at the step it happened.

    Attributes:
        index: 1-based sequence number of the event since training began; 0 when
            unknown (the record holds it; the ``kmix/events`` line does not, so
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
        source: which process and replica held the first non-finite values, where it
            is known (several processes or replicas); None otherwise.
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
    source: EventSource | None = None


_EVENT_RE = re.compile(
    r"^\*\*(?P<kind>[a-z_]+)\*\* at step (?P<step>\d+): "
    r"loss scale (?P<old>[^ ;]+) → (?P<new>[^ ;]+)"
    r"(?:; first non-finite gradient `(?P<variable>[^`]+)` \((?P<count>\d+) variables?\))?"
    r"(?:(?P<loss_nonfinite>; the loss itself was non-finite)"
    r"|(?P<loss_unknown>; whether the loss was finite is unknown))?"
    r"(?:; forward overflow starts in `(?P<layer>[^`]+)` \((?P<layer_class>[^)]*)\): "
    r"inputs (?P<inputs>finite|non-finite)(?:, max \|input\| (?P<max_input>[^ ;,]+))?"
    r"(?:, past float16's max [^;]*)?)?"
    r"(?:; first non-finite in (?:process (?P<process>\d+))?(?:, )?(?:replica (?P<replica>\d+))?)?"
)


FLOAT16_MAX = 65504.0
"""float16's largest finite value, the one definition (``kmix.record.health`` uses it too)."""


def inputs_words(origin: ForwardOrigin, digits: int = 9) -> str:
    """What a forward origin's inputs were, in the one wording of events, guard and report.

    ``inputs finite, max |input| 812``; ``inputs non-finite``; and for a finite input past
    float16's range, the cast that overflowed: ``inputs finite, max |input| 90000, past
    float16's max 65504: the cast to float16 as they enter overflows``.

    Args:
        origin: the origin (``max_abs_input`` None when it was not measured).
        digits: significant digits of the max (9 in event lines: exact for float32).

    Returns:
        The words, without a leading separator.
    """
    text = f"inputs {'finite' if origin.inputs_finite else 'non-finite'}"
    if origin.max_abs_input is None:
        return text
    text += f", max |input| {origin.max_abs_input:.{digits}g}"
    if origin.inputs_finite and origin.max_abs_input > FLOAT16_MAX:
        text += f", past float16's max {FLOAT16_MAX:g}: the cast to float16 as they enter overflows"
    return text


def format_event(event: ScaleEvent) -> str:
    """Formats a :class:`ScaleEvent` as one markdown line for ``kmix/events``.

    The one wording of an event's line: the tab shows this line too.

    The line, with its optional parts in this order::

        **backoff** at step 7: loss scale 32768 → 16384
        ; first non-finite gradient `dense/kernel` (2 variables)
        ; the loss itself was non-finite      (or: ; whether the loss was finite is unknown)
        ; forward overflow starts in `block_3/ffn_out` (Dense): inputs finite, max |input| 812
        ; first non-finite in process 1, replica 3   (only where known: see EventSource)

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
            + inputs_words(origin)
        )
    source = getattr(event, "source", None)
    if source is not None:
        text += "; " + source_words(source)
    return text


def source_words(source: EventSource) -> str:
    """``first non-finite in process 1, replica 3``: the known parts of ``source``."""
    parts = [
        f"{name} {value}"
        for name, value in (("process", source.process), ("replica", source.replica))
        if value is not None
    ]
    return "first non-finite in " + ", ".join(parts)


def plain_text(line: str) -> str:
    """A markdown line of this module without its markup, for a terminal.

    Args:
        line: e.g. :func:`format_event`'s line.

    Returns:
        The same words without ``**`` and backticks.
    """
    return line.replace("**", "").replace("`", "")


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
    source = None
    if match["process"] is not None or match["replica"] is not None:
        found = match.group("process", "replica")
        source = EventSource(*(None if v is None else int(v) for v in found))
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
        source=source,
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


# ------------------------------------------------------------ structured records
SCALE_EVENT_RECORD = "scale_event"
EVENTS_LOST_RECORD = "events_lost"
RECORD_TYPES = (SCALE_EVENT_RECORD, EVENTS_LOST_RECORD)
"""The ``"type"`` of each record of ``kmix/event_record``: a :class:`ScaleEvent` or an
:class:`EventsLost` note."""


def format_event_record(item: ScaleEvent | EventsLost, run_id: str | None = None) -> str:
    """Formats an event, or a note that events were lost, as one JSON record.

    The record holds every field (``index`` too, which the line does not), the
    event's ``origin`` as a nested object or null, and ``"type"``: one of
    :data:`RECORD_TYPES`. For example::

        {"index": 3, "kind": "backoff", "loss_finite": true, "new_scale": 16384.0,
         "nonfinite_variables": 2, "old_scale": 32768.0, "origin": null, "step": 7,
         "type": "scale_event", "variable": "dense/kernel"}

    Args:
        item: a :class:`ScaleEvent` or an :class:`EventsLost`.
        run_id: the run that wrote it (``kmix.tags.PolicyRecord.run_id``), written
            as ``"run_id"`` when given (:func:`kmix.tags.parse_run_id` reads it).

    Returns:
        The JSON text (on one line) that :func:`parse_event_record` reads back.

    Raises:
        TypeError: ``item`` is neither.
    """
    run = {} if run_id is None else {"run_id": run_id}
    if isinstance(item, ScaleEvent):  # ``source`` only where known (older records lack it)
        return record_json(item, drop_none=("source",), type=SCALE_EVENT_RECORD, **run)
    if isinstance(item, EventsLost):
        return record_json(item, type=EVENTS_LOST_RECORD, **run)
    raise TypeError(
        f"item={item!r} is a {type(item).__name__}; expected a kmix.tags.ScaleEvent or "
        "kmix.tags.EventsLost"
    )


def parse_event_record(text: str) -> ScaleEvent | EventsLost | None:
    """Reads a record written by :func:`format_event_record`.

    Keys added by later versions are ignored (also inside ``origin``); fields that
    have a default (``origin``, ``capacity``) may be missing.

    Args:
        text: one ``kmix/event_record`` text.

    Returns:
        The :class:`ScaleEvent` or :class:`EventsLost`; None if the text is not such
        a record (not JSON, another ``"type"``, a field missing or of the wrong type).
    """
    data = json_object(text)
    kind = None if data is None else data.get("type")
    parse = _RECORD_PARSERS.get(kind) if isinstance(kind, str) else None
    if data is None or parse is None:
        return None
    try:
        return parse(data)
    except TypeError:
        return None


def _scale_event(data: dict[str, Any]) -> ScaleEvent | None:
    fields = record_fields(data, ScaleEvent)
    if fields is None:
        return None
    origin = fields.get("origin")
    if origin is not None:
        known = record_fields(origin if isinstance(origin, dict) else None, ForwardOrigin)
        if known is None:
            return None
        origin = ForwardOrigin(
            layer=_text(known["layer"]),
            layer_class=_text(known["layer_class"]),
            inputs_finite=_flag(known["inputs_finite"]),
            max_abs_input=_optional(known["max_abs_input"], _number),
        )
    source = fields.get("source")
    if source is not None:
        known = record_fields(source if isinstance(source, dict) else None, EventSource)
        if known is None:
            return None
        source = EventSource(
            process=_optional(known.get("process"), _integer),
            replica=_optional(known.get("replica"), _integer),
        )
    return ScaleEvent(
        index=_integer(fields["index"]),
        step=_integer(fields["step"]),
        kind=_text(fields["kind"]),
        old_scale=_number(fields["old_scale"]),
        new_scale=_number(fields["new_scale"]),
        variable=_optional(fields["variable"], _text),
        nonfinite_variables=_integer(fields["nonfinite_variables"]),
        loss_finite=_optional(fields["loss_finite"], _flag),
        origin=origin,
        source=source,
    )


def _events_lost(data: dict[str, Any]) -> EventsLost | None:
    fields = record_fields(data, EventsLost)
    if fields is None:
        return None
    return EventsLost(
        count=_integer(fields["count"]),
        after_step=_integer(fields["after_step"]),
        upto_step=_integer(fields["upto_step"]),
        capacity=_optional(fields.get("capacity"), _integer),
    )


_RECORD_PARSERS: dict[str, Callable[[dict[str, Any]], ScaleEvent | EventsLost | None]] = {
    SCALE_EVENT_RECORD: _scale_event,
    EVENTS_LOST_RECORD: _events_lost,
}


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _optional(value: Any, convert: Callable[[Any], Any]) -> Any:
    return None if value is None else convert(value)
