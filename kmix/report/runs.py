"""Tells the kmix runs of one log dir apart: a script run twice into one ``log_dir``.

TensorBoard reads every event file of a directory as one run, so two trainings written
into ``LOGDIR/train`` arrive merged. kmix's monitor writes its policy record, which
names the run (:attr:`kmix.tags.PolicyRecord.run_id`), as the first point of every
train begin; a resumed run (a second ``fit`` continuing the optimizer's steps,
``BackupAndRestore``) writes its id again. Every TensorBoard point carries the wall
time it was written at, so a point belongs to the latest train begin written before it
(:func:`split_runs`): exact for runs written one after another. Runs written into one
directory at the same time cannot be told apart by time; the records that name their
run then show it (:attr:`RunInfo.overlaps`).

Logs without run ids (kmix 0.1.0 and versions before run ids) read as one run, as
before. Free of printing and matplotlib, like the rest of the reader.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from kmix import tags

Point = tuple[int, Any, float]
"""``(step, value, wall_time)`` of one point, as TensorBoard's readers give it."""
Scalars = dict[str, list[Point]]
Tensors = dict[str, tuple[str, list[Point]]]

RUN_END_WORDS = {
    tags.COMPLETED: "completed",
    tags.STOPPED_BY_GUARD: "stopped by LossScaleGuard",
    tags.GUARD_RAISED: "LossScaleGuard raised",
    tags.EXCEPTION: "ended by an exception",
    tags.INTERRUPTED: "interrupted (KeyboardInterrupt)",
    tags.STOPPED_BY_COMPARE: "stopped by kmix compare",
}
"""How each reason of :data:`kmix.tags.RUN_END_REASONS` is said."""
LISTED_WITH_MESSAGE = (tags.STOPPED_BY_COMPARE,)
"""The reasons whose one-line message a listing of runs shows beside them (the guard's
diagnosis and an exception's text are many lines: the run's report shows them)."""


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """One kmix run of a log dir.

    Attributes:
        index: its number in the directory, 1 for the oldest.
        run_id: its id (:func:`kmix.tags.new_run_id`); None for a log written before
            run ids.
        began: when its first train begin was written (seconds since the epoch); None
            when not known.
        first_step: the optimizer step at its first train begin (0 for a new run).
        last_step: the last step it logged anything at.
        train_begins: how many ``fit`` calls wrote into it (more than 1: resumed).
        end: how it ended (its latest ``kmix/run_end``); None if not recorded.
        overlaps: records of another run were written while this one was written:
            the runs ran at the same time, and their points cannot be told apart.
    """

    index: int
    run_id: str | None
    began: float | None
    first_step: int
    last_step: int
    train_begins: int
    end: tags.RunEnd | None
    overlaps: bool = False


def point_text(value: Any) -> str:
    """The text of a text summary's value (bytes decoded, elements joined by lines).

    Args:
        value: the tensor value of a text point.

    Returns:
        The text.
    """
    items = [
        v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in np.ravel(value)
    ]
    return "\n".join(items)


def split_runs(
    scalars: Scalars, tensors: Tensors
) -> list[tuple[RunInfo, dict[str, list[tuple[int, Any]]], dict[str, tuple[str, list]]]]:
    """Splits the kmix points of one directory into its runs.

    Args:
        scalars: tag -> ``[(step, value, wall_time)]``.
        tensors: tag -> ``(plugin name, [(step, value, wall_time)])``.

    Returns:
        One ``(info, scalars, tensors)`` per run, oldest first, its points as
        ``(step, value)`` in the order given; empty when there is no kmix point.
        Without run ids every point is one run.
    """
    scalars = {t: p for t, p in scalars.items() if t.startswith(tags.PREFIX) and p}
    tensors = {t: v for t, v in tensors.items() if t.startswith(tags.PREFIX) and v[1]}
    if not scalars and not tensors:
        return []
    begins = sorted(
        (wall, step, record.run_id)
        for step, value, wall in tensors.get(tags.POLICY_RECORD, ("", []))[1]
        if (record := tags.parse_policy_record(point_text(value))) is not None
    )
    keys = list(dict.fromkeys(run_id for _, _, run_id in begins))
    if keys in ([], [None]):  # no run ids: one run, as before
        begins, keys = [(-np.inf, step, None) for _, step, _ in begins], [None]
    walls = np.array([wall for wall, _, _ in begins] or [-np.inf])
    run_of_begin = np.array([keys.index(run_id) for _, _, run_id in begins] or [0])

    def runs_of(points: list[Point]) -> np.ndarray:
        at = np.searchsorted(walls, [wall for _, _, wall in points], side="right") - 1
        return run_of_begin[np.maximum(at, 0)]

    out_s: list[dict] = [{} for _ in keys]
    out_t: list[dict] = [{} for _ in keys]
    first: list[tuple[float, int] | None] = [None for _ in keys]
    last = [-1 for _ in keys]
    for tag, points, plugin in [(t, p, None) for t, p in scalars.items()] + [
        (t, p, plugin) for t, (plugin, p) in tensors.items()
    ]:
        runs = runs_of(points)
        for run in np.unique(runs).tolist():
            mine = [points[i] for i in np.flatnonzero(runs == run)]
            pairs = [(step, value) for step, value, _ in mine]
            if plugin is None:
                out_s[run][tag] = pairs
            else:
                out_t[run][tag] = (plugin, pairs)
            last[run] = max(last[run], max(int(step) for step, _, _ in mine))
            earliest = min((wall, int(step)) for step, _, wall in mine)
            first[run] = min(first[run] or earliest, earliest)
    infos = _infos(keys, begins, first, last, tensors, runs_of)
    return [(info, out_s[i], out_t[i]) for i, info in enumerate(infos)]


def _infos(
    keys: list[str | None],
    begins: list[tuple[float, int, str | None]],
    first: list[tuple[float, int] | None],
    last: list[int],
    tensors: Tensors,
    runs_of: Any,
) -> list[RunInfo]:
    """What each run's points say of it: its train begins, last step, end and overlaps."""
    ends: dict[int, tags.RunEnd] = {}
    end_points = sorted(tensors.get(tags.RUN_END, ("", []))[1], key=lambda point: point[2])
    for point, run in zip(end_points, runs_of(end_points) if end_points else [], strict=True):
        end = tags.parse_run_end(point_text(point[1]))
        if end is not None:
            ends[int(run)] = end
    overlapping: set[int] = set()
    for tag in (tags.POLICY_RECORD, tags.EVENT_RECORD, tags.RUN_END):
        points = tensors.get(tag, ("", []))[1]
        for point, run in zip(points, runs_of(points) if points else [], strict=True):
            for line in point_text(point[1]).splitlines():
                named = tags.parse_run_id(line)
                if named is not None and named != keys[run]:
                    overlapping |= {int(run), keys.index(named) if named in keys else int(run)}
    infos = []
    for run, key in enumerate(keys):
        mine = [(wall, step) for wall, step, run_id in begins if run_id == key]
        wall, step = mine[0] if mine else (first[run] or (-np.inf, 0))
        if not np.isfinite(wall) and first[run] is not None:  # no run ids: its first point
            wall = first[run][0]
        infos.append(
            RunInfo(
                index=run + 1,
                run_id=key,
                began=float(wall) if np.isfinite(wall) else None,
                first_step=int(step),
                last_step=max(last[run], int(step)),
                train_begins=len(mine),
                end=ends.get(run),
                overlaps=run in overlapping,
            )
        )
    return infos


def ended_words(info: RunInfo) -> str:
    """How a run ended, in words: ``"completed at step 6"``.

    Args:
        info: the run.

    Returns:
        The words, with the message of a reason in :data:`LISTED_WITH_MESSAGE`;
        ``"end not recorded"`` (still running, or the process was killed) when there
        is no run-end record.
    """
    if info.end is None:
        return "end not recorded (still running, or its process was killed)"
    return end_words(info.end)


def end_words(end: tags.RunEnd) -> str:
    """A run-end record in words, as a listing of runs shows it (:func:`ended_words`).

    Args:
        end: the record.

    Returns:
        E.g. ``"stopped by kmix compare at step 12: too slow (...)"``.
    """
    words = f"{RUN_END_WORDS.get(end.reason, end.reason)} at step {end.step}"
    if end.reason in LISTED_WITH_MESSAGE and end.message:
        words += f": {end.message.splitlines()[0]}"
    return words


def run_words(info: RunInfo) -> str:
    """One run in a line: id, start, steps, and how it ended.

    Args:
        info: the run.

    Returns:
        E.g. ``"id 20250314-093000-4f1c2a, began 2025-03-14 09:30:00, steps 0..6,
        completed at step 6"``.
    """
    parts = [f"id {info.run_id}"] if info.run_id is not None else ["no run id"]
    if info.began is not None:
        parts.append("began " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.began)))
    parts.append(f"steps {info.first_step}..{info.last_step}")
    if info.train_begins > 1:
        parts.append(f"resumed {info.train_begins - 1}x")
    parts.append(ended_words(info))
    return ", ".join(parts)


def runs_message(run: RunInfo | None, runs: tuple[RunInfo, ...]) -> str | None:
    """What a report of one run says when its log dir holds several.

    Args:
        run: the run reported.
        runs: every run of the directory, oldest first.

    Returns:
        The message; None when the directory holds one run (or it is not known).
    """
    if run is None or len(runs) < 2:
        return None
    which = "the latest" if run.index == len(runs) else f"run {run.index}"
    counts = (
        "records naming one run lie among the points of another: runs written into one "
        "directory at the same time cannot be told apart, so its counts may mix them"
        if any(r.overlaps for r in runs)
        else "its counts are of that run alone"
    )
    others = "; ".join(f"run {r.index}: {run_words(r)}" for r in runs if r is not run)
    return (
        f"this log dir holds {len(runs)} kmix runs (a script run twice into one "
        f"log_dir?): this report is of {which} (run {run.index} of {len(runs)}: "
        f"{run_words(run)}), and {counts}. Others: {others}. Report another with "
        "`kmix report LOGDIR --run N`; give each run its own log dir, e.g. "
        "runs/<name>-<date>"
    )
