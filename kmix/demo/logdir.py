"""The log dir of ``kmix demo``: which files it may replace, and the marker that says so.

The demo writes only to a new or empty directory, or replaces a previous demo run of its
own when asked to (``--overwrite``); it never removes a file it did not write. A demo
run is marked by the file :data:`MARKER`, which lists the files the demo wrote.

No TensorFlow here: ``kmix demo`` checks its log dir before TensorFlow starts, so a bad
``--logdir`` is a quick one-line error. The names are importable from
``kmix.demo.train`` as well.
"""

from __future__ import annotations

import contextlib
import json
import os

from kmix._words import plural

MARKER = "kmix-demo.json"
"""The file that marks a directory as a kmix demo run and lists the files the demo wrote."""


class LogdirError(ValueError):
    """The demo may not write to the log dir given; the message says why and what to do."""


def files_under(logdir: str) -> list[str]:
    """Lists the files under ``logdir``, as sorted paths relative to it.

    Args:
        logdir: a directory; a missing one has no files.

    Returns:
        Relative paths of every file (symbolic links included, not followed).
    """
    found = []
    for folder, _, names in os.walk(logdir):
        found += [os.path.relpath(os.path.join(folder, name), logdir) for name in names]
    return sorted(found)


def read_marker(logdir: str) -> list[str] | None:
    """Reads the files a previous demo run recorded in ``logdir/kmix-demo.json``.

    Args:
        logdir: the log dir.

    Returns:
        The recorded relative paths, or None when there is no readable marker (the
        directory is not a kmix demo run).
    """
    try:
        with open(os.path.join(logdir, MARKER), encoding="utf-8") as file:
            marker = json.load(file)
    except (OSError, ValueError):
        return None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return files


def files_to_replace(
    logdir: str, present: list[str], recorded: list[str] | None, overwrite: bool
) -> list[str]:
    """Decides which files preparing ``logdir`` for a new demo run removes.

    The demo writes only to a new or empty directory, or replaces a previous demo
    run of its own when asked to; it never removes a file it did not write.

    Args:
        logdir: the log dir, as given (for the messages).
        present: the files now under it, as from :func:`files_under`.
        recorded: the files a previous demo recorded, as from :func:`read_marker`.
        overwrite: whether a previous demo run may be replaced.

    Returns:
        The files to remove (relative paths): those of the previous demo run.

    Raises:
        LogdirError: the directory holds files the demo did not write, or a previous
            demo run and ``overwrite`` is False.
    """
    others = [name for name in present if name != MARKER]
    if not others:
        return []
    if recorded is None:
        raise LogdirError(
            f"--logdir {logdir} is not empty and is not a kmix demo run (it holds "
            f"{plural(len(others), 'file')}, e.g. {others[0]}): kmix demo writes only to a "
            "new or empty directory; choose another --logdir, e.g. runs/demo"
        )
    foreign = sorted(set(others) - set(recorded))
    if foreign:
        raise LogdirError(
            f"--logdir {logdir} holds a kmix demo run and {plural(len(foreign), 'file')} "
            f"the demo did not write (e.g. {foreign[0]}), which it will not remove: move "
            f"{'it' if len(foreign) == 1 else 'them'} away or choose another --logdir"
        )
    if not overwrite:
        raise LogdirError(
            f"--logdir {logdir} holds a previous kmix demo run: add --overwrite to replace "
            "it (only the files the demo wrote are removed), or choose another --logdir"
        )
    return others


def prepare_logdir(logdir: str, *, overwrite: bool = False) -> int:
    """Makes ``logdir`` ready for a demo run and marks it as one.

    Creates the directory if missing; removes a previous demo run's files only with
    ``overwrite`` (TensorBoard would otherwise draw both runs on top of each other);
    then writes the marker file :data:`MARKER`.

    Args:
        logdir: the demo's log dir.
        overwrite: replace a previous kmix demo run there.

    Returns:
        How many files of a previous demo run were removed.

    Raises:
        LogdirError: ``logdir`` is ``""`` or a file, or holds files the demo may not
            replace (see :func:`files_to_replace`).
        OSError: the directory cannot be created or written.
    """
    if not logdir:
        raise LogdirError(
            "--logdir '' is empty: give the directory to write the run to, e.g. --logdir runs/demo"
        )
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise LogdirError(f"--logdir {logdir} is a file: expected a directory (created if missing)")
    old = files_to_replace(logdir, files_under(logdir), read_marker(logdir), overwrite)
    for name in old:
        os.remove(os.path.join(logdir, name))
    for folder in _folders_inside(old):  # deepest first; logdir itself stays
        with contextlib.suppress(OSError):  # a folder that still holds something stays
            os.rmdir(os.path.join(logdir, folder))
    os.makedirs(logdir, exist_ok=True)
    record_run(logdir, files=[])
    return len(old)


def record_run(logdir: str, files: list[str] | None = None) -> None:
    """Writes the marker file: ``logdir`` is a kmix demo run made of these files.

    Args:
        logdir: the demo's log dir.
        files: the files the demo wrote; None lists every file now under ``logdir``
            (the demo started in an empty directory, so they are all its own).

    Raises:
        OSError: the marker cannot be written.
    """
    from kmix import __version__

    names = files_under(logdir) if files is None else files
    marker = {
        "kmix_demo": __version__,
        "files": [name for name in names if name != MARKER],
    }
    with open(os.path.join(logdir, MARKER), "w", encoding="utf-8") as file:
        json.dump(marker, file, indent=1)
        file.write("\n")


def _folders_inside(names: list[str]) -> list[str]:
    """The folders that hold ``names`` (relative paths), deepest first, ``""`` excluded."""
    folders = set()
    for name in names:
        folder = os.path.dirname(name)
        while folder:
            folders.add(folder)
            folder = os.path.dirname(folder)
    return sorted(folders, key=lambda folder: (-folder.count(os.sep), folder))
