"""The kmix runs a log dir already holds, so the monitor tells a resume from another run.

The monitor opens one event file per ``fit`` under ``LOGDIR/train`` and writes its
policy record (``kmix/policy_record``, which names the run) as the first point of
that file. So the first :data:`HEAD_EVENTS` events of each file say which run wrote it
and at which step that ``fit`` began; nothing else is read, which takes milliseconds
whatever the size of the files.

A ``fit`` resumes the latest run of the directory when its optimizer continues that
run's steps: it begins past step 0 and not before the step the latest run began at (a
second ``fit`` on the same model, ``BackupAndRestore`` after a crash, a model loaded
from that run's checkpoint). Then it writes the latest run's id again (also None, for a
run written before run ids, so that such a log still reads as one run); otherwise it
starts a new run, and the monitor warns when the directory already holds one.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from kmix import tags
from kmix._words import plural

HEAD_EVENTS = 16
"""Events read from the start of each event file (the policy record is among the first 4)."""


@dataclasses.dataclass(frozen=True)
class Begin:
    """One train begin found at the head of an event file.

    Attributes:
        run_id: the run it belongs to; None for a log written before run ids (or a
            file with kmix data but no policy record at its head).
        step: the attempted optimizer step at that train begin.
        wall_time: when it was written, in seconds since the epoch.
    """

    run_id: str | None
    step: int
    wall_time: float


def begins_in(train_dir: str, known: dict[str, Begin] | None = None) -> list[Begin]:
    """The train begins of kmix runs written into a directory, in the order written.

    Args:
        train_dir: ``LOGDIR/train``; a missing or unreadable one holds none.
        known: file path -> :class:`Begin` of files read before (a file's head does
            not change once written); the files read now are added to it. A ``fit``
            called once per epoch then reads each file once, not once per ``fit``.

    Returns:
        One :class:`Begin` per event file whose head holds kmix data, by wall time.
    """
    known = {} if known is None else known
    try:
        paths = tags.glob(os.path.join(train_dir, "*tfevents*"))
    except OSError:
        return []
    for path in paths:
        if path not in known and (begin := _head_begin(path)) is not None:
            known[path] = begin
    found = [known[path] for path in paths if path in known]
    return sorted(found, key=lambda begin: begin.wall_time)


def _head_begin(path: str) -> Begin | None:
    """The policy record among the first events of a file; else its first kmix point."""
    from tensorboard.util import tensor_util

    first = None
    try:
        for event in tags.read_events(path, limit=HEAD_EVENTS):
            for value in event.summary.value:
                if not value.tag.startswith(tags.PREFIX):
                    continue
                if value.tag == tags.POLICY_RECORD and value.HasField("tensor"):
                    text = _text(tensor_util.make_ndarray(value.tensor))
                    record = tags.parse_policy_record(text)
                    if record is not None:
                        return Begin(record.run_id, int(event.step), event.wall_time)
                if first is None:
                    first = Begin(None, int(event.step), event.wall_time)
    except Exception:  # a file cut short or unreadable: what was read stands
        pass
    return first


def _text(value: np.ndarray) -> str:
    return "\n".join(
        v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in np.ravel(value)
    )


def resumed_run(begins: list[Begin], step: int) -> Begin | None:
    """The run a ``fit`` beginning at ``step`` resumes, if any (see the module docstring).

    Args:
        begins: what :func:`begins_in` found, in the order written.
        step: the optimizer's attempted step at this train begin.

    Returns:
        The latest :class:`Begin` when ``step`` is past 0 and not before it; else None.
    """
    if step <= 0 or not begins:
        return None
    latest = begins[-1]
    return latest if latest.step <= step else None


def another_run_warning(log_dir: str, begins: list[Begin], step: int) -> str:
    """What the monitor says when a new run goes into a log dir that holds kmix runs.

    Args:
        log_dir: the monitor's ``log_dir``.
        begins: the train begins found there (at least one), in the order written.
        step: the optimizer's attempted step at this train begin.

    Returns:
        The warning: what the directory holds, why this is a new run, what the
        report and the tab do about it, and what to do.
    """
    runs = plural(len({begin.run_id for begin in begins}), "kmix run")
    latest = begins[-1]
    began = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(latest.wall_time))
    why = (
        "its optimizer starts at step 0"
        if step <= 0
        else f"its optimizer is at step {step}, before step {latest.step} where the latest began"
    )
    return (
        f"MixedPrecisionMonitor: log_dir {log_dir!r} already holds {runs} (the latest "
        f"began {began}), and this fit starts a new one there: {why}, so it continues "
        "none of them. TensorBoard's charts will draw the runs over each other; `kmix "
        f"report {log_dir}` and the Mixed Precision tab show the latest run and say how "
        "many the directory holds. Give each run its own log dir, e.g. "
        "runs/<name>-<date>."
    )
