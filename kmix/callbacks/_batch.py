"""Summaries written in batches: one event per step, not one per value.

A monitor read writes hundreds of per-variable and per-layer values; one event each
would repeat the wall time, step and record framing hundreds of times.
:class:`SummaryBatch` collects the values as TensorBoard summary protos (the same protos
``tf.summary.scalar`` and ``tf.summary.histogram`` write: plugin metadata plus a tensor)
and writes each step's values as one raw summary through
:class:`kmix.tags.event_file.EventWriter`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from kmix.tags import EventWriter


class SummaryBatch:
    """Collects scalar and histogram points by step; :meth:`write` flushes them.

    Each point is built in place in its step's summary proto (no intermediate protos
    copied in): a read of a large model adds hundreds of points.
    """

    def __init__(self, describe: Callable[[str], str] = lambda tag: "") -> None:
        """An empty batch.

        Args:
            describe: tag -> its description, written with the tag's first point.
        """
        from tensorboard.compat.proto import summary_pb2

        self._summaries: dict[int, Any] = defaultdict(summary_pb2.Summary)
        self._describe = describe
        self._described: set[str] = set()

    def _value(self, tag: str, step: int, plugin: Any) -> Any:
        """A new value of the step's summary, with the tag's metadata the first time."""
        value = self._summaries[int(step)].value.add(tag=tag)
        if tag not in self._described:  # TensorBoard keeps the first metadata of a tag
            self._described.add(tag)
            value.metadata.CopyFrom(
                plugin.create_summary_metadata(display_name="", description=self._describe(tag))
            )
        return value

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Adds one scalar point (float32, as ``tf.summary.scalar`` writes it)."""
        from tensorboard.compat.proto import types_pb2
        from tensorboard.plugins.scalar import metadata

        tensor = self._value(tag, step, metadata).tensor
        tensor.dtype = types_pb2.DT_FLOAT
        tensor.float_val.append(value)
        tensor.tensor_shape.SetInParent()  # a scalar: shape []

    def histogram(self, tag: str, buckets: np.ndarray, step: int) -> None:
        """Adds one histogram: ``[k, 3]`` rows of (left edge, right edge, count)."""
        from tensorboard.compat.proto import types_pb2
        from tensorboard.plugins.histogram import metadata

        values = np.ascontiguousarray(buckets, np.float64)
        tensor = self._value(tag, step, metadata).tensor
        tensor.dtype = types_pb2.DT_DOUBLE
        tensor.tensor_content = values.tobytes()
        for size in values.shape:
            tensor.tensor_shape.dim.add(size=size)

    def write(self, writer: EventWriter) -> None:
        """Writes what was added, one raw summary per step, and empties the batch.

        Args:
            writer: the event file to write to.
        """
        for step in sorted(self._summaries):
            writer.raw(self._summaries[step], step)
        self._summaries.clear()
