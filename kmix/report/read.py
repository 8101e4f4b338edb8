"""Event files -> a typed :class:`KmixLog`, with TensorBoard's reader and no TensorFlow.

Free of printing and matplotlib: the TensorBoard plugin reuses it, building its
:class:`KmixLog` from TensorBoard's data provider through :func:`build_log`.
:func:`read_events` reads a log's scale events from their structured records.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import numpy as np

from kmix import tags

EXPECTED = (
    "TensorBoard event files with kmix/ tags under {train} "
    "(written by kmix.callbacks.MixedPrecisionMonitor)"
)


class ReportError(ValueError):
    """A log dir that cannot be reported on; the message names the path and what was expected."""


@dataclasses.dataclass(frozen=True)
class Series:
    """One scalar tag: steps in increasing order (one value per step, the last written).

    Attributes:
        steps: int64 steps.
        values: float64 values, one per step.
    """

    steps: np.ndarray
    values: np.ndarray


@dataclasses.dataclass(frozen=True)
class KmixLog:
    """The kmix data read from one log dir.

    Attributes:
        path: the directory the event files were read from (usually ``LOGDIR/train``).
        scalars: scalar tag -> :class:`Series`.
        histograms: variable path -> ``[(step, counts)]`` in step order; ``counts``
            has one entry per exponent bin of :mod:`kmix.tags`.
        texts: text tag -> ``[(step, text)]`` in step order.
    """

    path: str
    scalars: dict[str, Series]
    histograms: dict[str, list[tuple[int, np.ndarray]]]
    texts: dict[str, list[tuple[int, str]]]


def avoid_tensorflow() -> None:
    """Makes TensorBoard read event files with its TF-free stub in this process.

    TensorBoard's reader imports TensorFlow when it is installed, which takes
    seconds. ``kmix report`` calls this first; it does nothing once TensorFlow is
    imported. Do not call it in a process that will write summaries with
    TensorFlow afterwards: TensorBoard's summary ops would then find the stub.
    """
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))


def read_log(logdir: str) -> KmixLog:
    """Reads the kmix data of a log dir, also one that is still being written.

    Args:
        logdir: the ``log_dir`` given to ``MixedPrecisionMonitor``; its ``train``
            subdirectory is read. A directory that holds the event files itself
            (e.g. ``LOGDIR/train``) is accepted too.

    Returns:
        A :class:`KmixLog`.

    Raises:
        ReportError: the path is missing, not a directory, unreadable, empty, or
            holds no kmix data.
    """
    train = os.path.join(logdir, tags.TRAIN_DIR)
    expected = EXPECTED.format(train=train)
    if not os.path.exists(logdir):
        raise ReportError(f"{logdir} does not exist: expected a log dir with {expected}")
    if not os.path.isdir(logdir):
        raise ReportError(f"{logdir} is not a directory: expected a log dir with {expected}")
    try:
        empty = not os.listdir(logdir)
    except OSError as error:
        raise ReportError(
            f"{logdir} cannot be read ({error.strerror}): expected {expected}"
        ) from error
    if empty:
        raise ReportError(f"{logdir} is empty: expected {expected}")
    for path in (train, logdir):
        if os.path.isdir(path):
            log = _read_dir(path)
            if log.scalars or log.histograms or log.texts:
                return log
    raise ReportError(f"no kmix data in {logdir}: expected {expected}")


def _read_dir(path: str) -> KmixLog:
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    keep_all = {ea.SCALARS: 0, ea.TENSORS: 0}  # 0: every point, none sampled away
    accumulator = ea.EventAccumulator(path, size_guidance=keep_all)
    accumulator.Reload()
    found = accumulator.Tags()
    scalars: dict[str, list[tuple[int, float]]] = {}
    tensors: dict[str, tuple[str, list[tuple[int, np.ndarray]]]] = {}
    for tag in found.get(ea.SCALARS, []):  # summaries written as simple_value
        if tag.startswith(tags.PREFIX):
            scalars[tag] = [(e.step, e.value) for e in accumulator.Scalars(tag)]
    for tag in found.get(ea.TENSORS, []):
        if tag.startswith(tags.PREFIX):
            plugin = accumulator.SummaryMetadata(tag).plugin_data.plugin_name
            points = [
                (e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)
            ]
            tensors[tag] = (plugin, points)
    return build_log(path, scalars, tensors)


def build_log(
    path: str,
    scalars: dict[str, list[tuple[int, float]]],
    tensors: dict[str, tuple[str, list[tuple[int, np.ndarray]]]],
) -> KmixLog:
    """Builds a :class:`KmixLog` from the points of a run, however they were read.

    :func:`read_log` reads them from event files; the TensorBoard plugin from
    TensorBoard's data provider. Both share every conversion here. Tags outside
    ``kmix/`` are ignored.

    Args:
        path: what the log is named by (a directory, or a run name).
        scalars: tag -> ``[(step, value)]`` of scalars written as ``simple_value``.
        tensors: tag -> ``(plugin_name, [(step, array)])`` of tensor summaries:
            ``"histograms"`` under ``kmix/grad_exponent/`` (``[k, 3]`` arrays of
            left edge, right edge, count), ``"text"``, and ``"scalars"`` (or any
            plugin with 0-d values).

    Returns:
        The :class:`KmixLog`: scalars one value per step (the last written wins),
        histograms and texts in step order.
    """
    merged = {tag: list(points) for tag, points in scalars.items() if tag.startswith(tags.PREFIX)}
    histograms: dict[str, list[tuple[int, np.ndarray]]] = {}
    texts: dict[str, list[tuple[int, str]]] = {}
    for tag, (plugin, points) in tensors.items():
        if not tag.startswith(tags.PREFIX) or not points:
            continue
        if plugin == "histograms" and tag.startswith(tags.GRAD_EXPONENT):
            variable = tag[len(tags.GRAD_EXPONENT) :]
            histograms[variable] = [(int(step), _exponent_counts(value)) for step, value in points]
        elif plugin == "text":
            texts[tag] = [(int(step), _text(value)) for step, value in points]
        elif plugin == "scalars" or np.ndim(points[0][1]) == 0:
            merged.setdefault(tag, []).extend((step, float(value)) for step, value in points)
    return KmixLog(
        path=path,
        scalars={tag: _series(points) for tag, points in merged.items() if points},
        histograms={k: sorted(v, key=lambda p: p[0]) for k, v in histograms.items()},
        texts={k: sorted(v, key=lambda p: p[0]) for k, v in texts.items()},
    )


def _series(points: list[tuple[int, float]]) -> Series:
    by_step = dict(sorted(points, key=lambda p: p[0]))  # stable: the last write per step wins
    return Series(
        steps=np.fromiter(by_step.keys(), dtype=np.int64),
        values=np.fromiter(by_step.values(), dtype=np.float64),
    )


def _text(value: np.ndarray) -> str:
    items = [
        v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in np.ravel(value)
    ]
    return "\n".join(items)


def _exponent_counts(value: np.ndarray) -> np.ndarray:
    """Maps a ``[k, 3]`` (left, right, count) histogram onto the kmix exponent bins."""
    counts = np.zeros(tags.NUM_EXPONENT_BINS, dtype=np.float64)
    first_left = tags.exponent_bucket_edges()[0][0]
    for left, _, count in np.reshape(value, (-1, 3)):
        index = int(round(left - first_left))
        if 0 <= index < tags.NUM_EXPONENT_BINS:
            counts[index] += count
    return counts


@dataclasses.dataclass(frozen=True)
class EventLog:
    """The scale events of a log, and the notes written beside them under ``kmix/events``.

    Attributes:
        events: every scale event, each once, in step order.
        notes: ``(step, text)`` of the notes that events were lost (and, in logs
            without records, of any other line of ``kmix/events`` that is no event),
            in step order; a note read from a record is worded by
            :func:`kmix.tags.format_events_lost`, as its line was.
        lost: how many events the notes say were lost.
        from_records: True when read from the ``kmix/event_record`` records; False
            when parsed from the ``kmix/events`` lines of a log that has no record
            (written by kmix 0.1.0 or by versions before the records).
        lost_between: ``(step, note)`` of each note that events were lost: the step
            it was written at (that of the oldest event kept after the loss, as the
            ring keeps the newest) and the note as a record.
    """

    events: tuple[tags.ScaleEvent, ...]
    notes: tuple[tuple[int, str], ...]
    lost: int
    from_records: bool
    lost_between: tuple[tuple[int, tags.EventsLost], ...] = ()

    def unknown_scale(self) -> list[tuple[int, int]]:
        """The stretches of steps whose scale the log does not know: events were lost.

        The events lost between two reads are older than every event kept after
        them, so they lie after the note's ``after_step`` and before the step the
        note was written at.

        Returns:
            ``(first, last)`` steps of each stretch, in the order of the notes.
        """
        return [
            (note.after_step, max(note.after_step, min(note.upto_step, step) - 1))
            for step, note in self.lost_between
        ]


def read_events(log: KmixLog) -> EventLog:
    """Reads the scale events of a log: the records when it has any, else the lines.

    A run resumed with ``BackupAndRestore`` writes the events before the resume
    again: one event per (step, kind, old scale, new scale) is kept.

    Args:
        log: the log, from :func:`read_log` or :func:`build_log`.

    Returns:
        The :class:`EventLog`.
    """
    records = [
        (step, record)
        for step, text in log.texts.get(tags.EVENT_RECORD, [])
        for record in map(tags.parse_event_record, _lines(text))
        if record is not None
    ]
    if records:
        said = [(step, r) for step, r in records if isinstance(r, tags.EventsLost)]
        return EventLog(
            events=_once_in_step_order([r for _, r in records if isinstance(r, tags.ScaleEvent)]),
            notes=tuple((step, tags.format_events_lost(r)) for step, r in said),
            lost=sum(r.count for _, r in said),
            from_records=True,
            lost_between=tuple(said),
        )
    events: list[tags.ScaleEvent] = []
    notes: list[tuple[int, str]] = []
    lost_between: list[tuple[int, tags.EventsLost]] = []
    for step, text in log.texts.get(tags.EVENTS, []):  # logs without records
        for line in _lines(text):
            lost_note = tags.parse_events_lost(line)
            event = None if lost_note is not None else tags.parse_event(line)
            if event is not None:
                events.append(event)
                continue
            if lost_note is not None:
                lost_between.append((step, lost_note))
            notes.append((step, line))
    return EventLog(
        _once_in_step_order(events),
        tuple(notes),
        sum(note.count for _, note in lost_between),
        from_records=False,
        lost_between=tuple(lost_between),
    )


def _lines(text: str) -> list[str]:
    """The non-blank lines of a text point, stripped."""
    return [line for line in (line.strip() for line in text.splitlines()) if line]


def _once_in_step_order(events: list[tags.ScaleEvent]) -> tuple[tags.ScaleEvent, ...]:
    """The first of each (step, kind, old scale, new scale), in step order (stable)."""
    once: dict[tuple[int, str, float, float], tags.ScaleEvent] = {}
    for event in events:
        once.setdefault((event.step, event.kind, event.old_scale, event.new_scale), event)
    return tuple(sorted(once.values(), key=lambda event: event.step))
