"""Event files -> a typed :class:`KmixLog`, with TensorBoard's reader and no TensorFlow.

Free of printing and matplotlib: the TensorBoard plugin reuses it, building its
:class:`KmixLog` from TensorBoard's data provider through :func:`build_logs`.
:func:`scale_events_of` reads a log's scale events from their structured records. A log
dir written by several runs (a script run twice into one ``log_dir``) gives one
:class:`KmixLog` per run (:mod:`kmix.report.runs`); :func:`read_log` returns the latest.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import numpy as np

from kmix import tags
from kmix.report.runs import Point, RunInfo, point_text, split_runs

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
        run: which run of the directory this log holds; None when not known (a log
            built by :func:`build_log`).
        runs: every kmix run of the directory, oldest first (one for most log dirs).
    """

    path: str
    scalars: dict[str, Series]
    histograms: dict[str, list[tuple[int, np.ndarray]]]
    texts: dict[str, list[tuple[int, str]]]
    run: RunInfo | None = None
    runs: tuple[RunInfo, ...] = ()


def avoid_tensorflow() -> None:
    """Makes TensorBoard read event files with its TF-free stub in this process.

    TensorBoard's reader imports TensorFlow when it is installed, which takes
    seconds. ``kmix report`` calls this first; it does nothing once TensorFlow is
    imported. Do not call it in a process that will write summaries with
    TensorFlow afterwards: TensorBoard's summary ops would then find the stub.
    """
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))


def _avoid_tensorflow_off_its_backend() -> None:
    """:func:`avoid_tensorflow` in a process whose Keras runs on another backend (JAX):
    kmix writes no summary with TensorFlow there. (On Keras's TensorFlow backend,
    importing Keras imported TensorFlow, and :func:`avoid_tensorflow` does nothing.)"""
    if "keras" in sys.modules:
        avoid_tensorflow()


def read_log(logdir: str, run: int | str | None = None) -> KmixLog:
    """Reads the kmix data of a log dir, also one that is still being written.

    Args:
        logdir: the ``log_dir`` given to ``MixedPrecisionMonitor``; its ``train``
            subdirectory is read. A directory that holds the event files itself
            (e.g. ``LOGDIR/train``) is accepted too.
        run: which run, when the directory holds several: its number (1 for the
            oldest) or its id; None for the latest.

    Returns:
        A :class:`KmixLog` of that run (``runs`` lists every run of the directory).

    Raises:
        ReportError: the path is missing, not a directory, unreadable, empty, or
            holds no kmix data; or ``run`` names no run of it.
    """
    logs = read_runs(logdir)
    if run is None:
        return logs[-1]
    for log in logs:
        if log.run is not None and run in (log.run.index, log.run.run_id, str(log.run.index)):
            return log
    listed = "; ".join(f"{log.run.index}: id {log.run.run_id}" for log in logs if log.run)
    raise ReportError(
        f"no run {run!r} in {logdir}: it holds {len(logs)} kmix "
        f"{'run' if len(logs) == 1 else 'runs'} ({listed}); pass a number from 1 to "
        f"{len(logs)} or one of those ids"
    )


def read_runs(logdir: str) -> tuple[KmixLog, ...]:
    """Reads every kmix run of a log dir (:func:`read_log` reads one).

    Args:
        logdir: as for :func:`read_log`.

    Returns:
        One :class:`KmixLog` per run, oldest first (one for a log written by one run,
        or before run ids).

    Raises:
        ReportError: as :func:`read_log`.
    """
    _avoid_tensorflow_off_its_backend()
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
            logs = build_logs(path, *_read_dir(path))
            if logs:
                return logs
    raise ReportError(f"no kmix data in {logdir}: expected {expected}")


def find_logdirs(parent: str) -> list[str]:
    """The directories under ``parent`` that hold event files, as log dirs.

    A directory named ``train`` stands for its parent (the ``log_dir`` given to the
    monitor); ``parent`` itself is left out. Whether they hold kmix data is for
    :func:`read_runs` to say.

    Args:
        parent: a directory, e.g. ``runs`` holding ``runs/a/train``, ``runs/b/train``.

    Returns:
        The log dirs found, sorted.
    """
    found = set()
    for folder, _, names in os.walk(parent):
        if any("tfevents" in name for name in names):
            if os.path.basename(folder) == tags.TRAIN_DIR:
                folder = os.path.dirname(folder)
            if os.path.normpath(folder) != os.path.normpath(parent):
                found.add(folder)
    return sorted(found)


def _read_dir(path: str) -> tuple[dict[str, list[Point]], dict[str, tuple[str, list[Point]]]]:
    """Every kmix point of a directory's event files, with the wall time it was written at."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    keep_all = {ea.SCALARS: 0, ea.TENSORS: 0}  # 0: every point, none sampled away
    accumulator = ea.EventAccumulator(path, size_guidance=keep_all)
    accumulator.Reload()
    found = accumulator.Tags()
    scalars: dict[str, list[Point]] = {}
    tensors: dict[str, tuple[str, list[Point]]] = {}
    for tag in found.get(ea.SCALARS, []):  # summaries written as simple_value
        if tag.startswith(tags.PREFIX):
            scalars[tag] = [(e.step, e.value, e.wall_time) for e in accumulator.Scalars(tag)]
    for tag in found.get(ea.TENSORS, []):
        if tag.startswith(tags.PREFIX):
            plugin = accumulator.SummaryMetadata(tag).plugin_data.plugin_name
            points = [
                (e.step, tensor_util.make_ndarray(e.tensor_proto), e.wall_time)
                for e in accumulator.Tensors(tag)
            ]
            tensors[tag] = (plugin, points)
    return scalars, tensors


def build_logs(
    path: str,
    scalars: dict[str, list[Point]],
    tensors: dict[str, tuple[str, list[Point]]],
) -> tuple[KmixLog, ...]:
    """Builds one :class:`KmixLog` per run from the points of a directory.

    :func:`read_log` reads the points from event files; the TensorBoard plugin from
    TensorBoard's data provider. The runs are told apart by :func:`kmix.report.runs.
    split_runs`; each is converted by :func:`build_log`.

    Args:
        path: what the logs are named by (a directory, or a run name).
        scalars: tag -> ``[(step, value, wall_time)]`` (see :func:`build_log`).
        tensors: tag -> ``(plugin_name, [(step, array, wall_time)])``.

    Returns:
        The logs, oldest run first, each with ``run`` and ``runs`` set; empty when
        there is no kmix point.
    """
    split = split_runs(scalars, tensors)
    runs = tuple(info for info, _, _ in split)
    return tuple(
        dataclasses.replace(build_log(path, run_scalars, run_tensors), run=info, runs=runs)
        for info, run_scalars, run_tensors in split
    )


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
    return point_text(value)


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


def scale_events_of(log: KmixLog) -> EventLog:
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
