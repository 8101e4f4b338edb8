"""TensorBoard event files, written and read without TensorFlow: kmix's one owner of the format.

On Keras's JAX backend a process must not import TensorFlow for kmix, so the monitor and
``kmix compare`` write their event files here, with the ``tensorboard`` package's protos
only. The records are those ``tf.summary.text`` and ``tf.summary.scalar`` write: an
``Event`` with ``file_version`` ``"brain.Event:2"`` first, then one ``Event`` per summary
with its wall time and step; text is a ``DT_STRING`` scalar tensor with the ``text``
plugin's metadata, a scalar a ``DT_FLOAT`` scalar tensor with the ``scalars`` plugin's
metadata. Each is framed as a TFRecord, its checksums by :mod:`kmix.tags.crc32c` (TensorBoard's
pure-Python one is ten times slower).

Local paths use Python's ``open``, ``os`` and ``glob``. A URL-like path (one holding
``://``, e.g. ``gs://bucket/run``) goes through ``tf.io.gfile``, imported only then, so
remote log dirs keep working where TensorFlow is installed.

File names follow TensorFlow's, with ``kmix`` before the ``.v2``:
``events.out.tfevents.<seconds>.<host>.<pid>.<counter>.kmix.v2``. TensorFlow's own
writer truncates a file of the name it picks, and its counter is its own; the ``kmix``
part keeps a TensorFlow writer in the same directory, process and second (Keras's
TensorBoard callback beside the monitor) from ever picking a kmix file's name. A kmix
file is opened exclusively: on a name already taken the counter moves on.

Example:
    >>> writer = EventWriter("runs/exp1/train")              # doctest: +SKIP
    >>> writer.scalar("kmix/loss_scale", 32768.0, step=1)    # doctest: +SKIP
    >>> writer.close()                                       # doctest: +SKIP
"""

from __future__ import annotations

import glob as _glob
import itertools
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from kmix.tags.crc32c import masked_crc32c

FILE_VERSION = "brain.Event:2"
"""The ``file_version`` of the first event of every file (TensorFlow 2's summaries)."""

WRITER_NAME = "kmix"
"""The ``source_metadata.writer`` of the first event."""

_COUNTER = itertools.count()  # process-wide: two writers never share a name
_MAX_TRIES = 1000


def is_url(path: str | os.PathLike) -> bool:
    """True for a URL-like path (``gs://``, ``s3://``, ``hdfs://``): TensorFlow's file system."""
    return "://" in os.fspath(path)


def makedirs(path: str | os.PathLike) -> None:
    """Creates a directory and its parents; nothing when it exists.

    Args:
        path: a local path, or a URL-like one (through ``tf.io.gfile``).

    Raises:
        OSError: it cannot be created (a file of that name, no permission, ...).
    """
    if not is_url(path):
        os.makedirs(path, exist_ok=True)
        return
    tf = _tf()
    try:
        tf.io.gfile.makedirs(os.fspath(path))
    except tf.errors.OpError as error:
        raise OSError(f"cannot create {os.fspath(path)!r}: {error}") from error


def glob(pattern: str) -> list[str]:
    """The paths matching a glob pattern, sorted; none for a missing directory.

    Args:
        pattern: e.g. ``LOGDIR/train/*tfevents*``; local or URL-like.

    Returns:
        The matching paths, sorted.

    Raises:
        OSError: a URL-like pattern cannot be listed.
    """
    if not is_url(pattern):
        return sorted(_glob.glob(pattern))
    tf = _tf()
    try:
        return sorted(tf.io.gfile.glob(pattern))
    except tf.errors.NotFoundError:
        return []
    except tf.errors.OpError as error:
        raise OSError(f"cannot list {pattern!r}: {error}") from error


class EventWriter:
    """Writes one new event file in a directory: text, scalar, layout and raw summaries.

    Writes are buffered; :meth:`flush` makes them visible to readers, and :meth:`close`
    flushes everything before closing. Not thread-safe: one thread writes.

    Args:
        directory: the run directory (e.g. ``LOGDIR/train``); created if missing.

    Raises:
        OSError: the directory or the file cannot be created.

    Attributes:
        path: the event file written.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        directory = os.fspath(directory)
        makedirs(directory)
        seconds = int(time.time())
        self.path, self._file = _open_new(directory, seconds)
        self._write_event(_event(float(seconds), file_version=FILE_VERSION))
        self.flush()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._file is None

    def text(self, tag: str, text: str, step: int, description: str | None = None) -> None:
        """Writes a text point, as ``tf.summary.text`` does (markdown in TensorBoard).

        Args:
            tag: the tag, e.g. ``kmix/notes``.
            text: the text (UTF-8).
            step: the step it belongs to.
            description: the tag's description, if any.
        """
        from tensorboard.plugins.text import metadata

        described = metadata.create_summary_metadata(None, description)
        self.raw(_string_summary(tag, str(text).encode("utf-8"), described), step)

    def layout(self, layout: Any, step: int) -> None:
        """Writes a Custom Scalars layout, as ``tensorboard.plugins.custom_scalar.summary.pb``.

        (That function imports TensorFlow; this writes the same summary without it.)

        Args:
            layout: a ``tensorboard.plugins.custom_scalar.layout_pb2.Layout``.
            step: the step it belongs to.
        """
        from tensorboard.plugins.custom_scalar import metadata

        data = layout.SerializeToString()
        summary = _string_summary(
            metadata.CONFIG_SUMMARY_TAG, data, metadata.create_summary_metadata()
        )
        self.raw(summary, step)

    def scalar(self, tag: str, value: float, step: int, description: str | None = None) -> None:
        """Writes a scalar point, as ``tf.summary.scalar`` does (float32).

        Args:
            tag: the tag, e.g. ``kmix/loss_scale``.
            value: the value; stored as float32.
            step: the step it belongs to.
            description: the tag's description, if any.
        """
        from tensorboard.compat.proto import summary_pb2, types_pb2
        from tensorboard.plugins.scalar import metadata

        point = summary_pb2.Summary.Value(
            tag=tag, metadata=metadata.create_summary_metadata(None, description)
        )
        point.tensor.dtype = types_pb2.DT_FLOAT
        point.tensor.tensor_shape.SetInParent()
        with np.errstate(over="ignore"):  # beyond float32's range: inf, as tf.cast gives
            point.tensor.tensor_content = np.asarray(value, dtype="<f4").tobytes()
        self.raw(summary_pb2.Summary(value=[point]), step)

    def raw(self, summary: Any, step: int) -> None:
        """Writes a ``Summary`` proto at a step, as ``tf.summary.experimental.write_raw_pb``.

        Args:
            summary: a ``tensorboard.compat.proto.summary_pb2.Summary``.
            step: the step it belongs to.

        Raises:
            ValueError: the writer is closed.
        """
        self._write_event(_event(time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        """Makes everything written so far visible to readers of the file."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Flushes and closes the file; closing again does nothing."""
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write_event(self, event: Any) -> None:
        if self._file is None:
            raise ValueError(f"EventWriter for {self.path!r} is closed: open a new one.")
        self._file.write(frame(event.SerializeToString()))


def frame(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC-32C of the length, the data, its masked CRC-32C.

    Args:
        data: a serialized proto.

    Returns:
        The record's bytes.
    """
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def read_events(path: str, limit: int | None = None) -> Iterator[Any]:
    """The ``Event`` protos of an event file, in order, up to a record cut short.

    Args:
        path: the file, local or URL-like.
        limit: read at most this many events; None reads all.

    Yields:
        ``tensorboard.compat.proto.event_pb2.Event`` protos.

    Raises:
        OSError: the file cannot be opened.
        ValueError: a record's checksum does not match (the file is corrupt there).
    """
    from tensorboard.compat.proto import event_pb2

    with _open_read(path) as file:
        for _ in itertools.count() if limit is None else range(limit):
            header = file.read(12)
            if len(header) < 12:
                return
            (length,) = struct.unpack("<Q", header[:8])
            (header_crc,) = struct.unpack("<I", header[8:])
            if masked_crc32c(header[:8]) != header_crc:
                raise ValueError(f"{path}: a record's length fails its checksum")
            body = file.read(length + 4)
            if len(body) < length + 4:
                return  # cut short: still being written, or the writer died
            data = body[:length]
            if masked_crc32c(data) != struct.unpack("<I", body[length:])[0]:
                raise ValueError(f"{path}: a record fails its checksum")
            yield event_pb2.Event.FromString(data)


def _string_summary(tag: str, data: bytes, metadata: Any) -> Any:
    """A ``Summary`` of one ``DT_STRING`` scalar tensor (shape ``[]``) with its metadata."""
    from tensorboard.compat.proto import summary_pb2, types_pb2

    value = summary_pb2.Summary.Value(tag=tag, metadata=metadata)
    value.tensor.dtype = types_pb2.DT_STRING
    value.tensor.tensor_shape.SetInParent()  # a scalar: shape []
    value.tensor.string_val.append(data)
    return summary_pb2.Summary(value=[value])


def _event(wall_time: float, **fields: Any) -> Any:
    from tensorboard.compat.proto import event_pb2

    event = event_pb2.Event(wall_time=wall_time, **fields)
    if "file_version" in fields:
        event.source_metadata.writer = WRITER_NAME
    return event


def _open_new(directory: str, seconds: int) -> tuple[str, BinaryIO]:
    """A new file of a name no file in ``directory`` has, opened for writing."""
    host, pid = socket.gethostname(), os.getpid()
    for _ in range(_MAX_TRIES):
        name = f"events.out.tfevents.{seconds:010d}.{host}.{pid}.{next(_COUNTER)}.kmix.v2"
        path = os.path.join(directory, name) if not is_url(directory) else f"{directory}/{name}"
        try:
            return path, _open_exclusive(path)
        except FileExistsError:
            continue
    raise OSError(f"no free event file name in {directory!r} after {_MAX_TRIES} tries")


def _open_exclusive(path: str) -> BinaryIO:
    if not is_url(path):
        return open(path, "xb")  # closed by EventWriter.close
    tf = _tf()
    try:
        if tf.io.gfile.exists(path):  # a remote store has no exclusive create
            raise FileExistsError(path)
        return tf.io.gfile.GFile(path, "wb")
    except tf.errors.OpError as error:
        raise OSError(f"cannot create {path!r}: {error}") from error


def _open_read(path: str) -> BinaryIO:
    if not is_url(path):
        return open(path, "rb")
    tf = _tf()
    try:
        return tf.io.gfile.GFile(path, "rb")
    except tf.errors.OpError as error:
        raise OSError(f"cannot open {path!r}: {error}") from error


def _tf() -> Any:
    """TensorFlow, for URL-like paths only (local ones never import it)."""
    import tensorflow as tf

    return tf
