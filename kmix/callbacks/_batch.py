"""Summaries written in batches: one file-writer op per step, not one per value.

``tf.summary.scalar`` is an eager op per call; a monitor read that writes hundreds of
per-variable and per-layer values would pay hundreds of them. :class:`SummaryBatch`
collects the values as TensorBoard summary protos (the same protos the TF ops write:
plugin metadata plus a tensor) and writes each step's values with one raw write.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np


class SummaryBatch:
    """Collects scalar and histogram points by step; :meth:`write` flushes them."""

    def __init__(self) -> None:
        self._values: dict[int, list[Any]] = defaultdict(list)
        self._described: set[str] = set()

    def _metadata(self, tag: str, plugin: Any, description: str) -> Any:
        if tag in self._described:  # TensorBoard keeps the first metadata of a tag
            return None
        self._described.add(tag)
        return plugin.create_summary_metadata(display_name="", description=description)

    def scalar(self, tag: str, value: float, step: int, description: str = "") -> None:
        """Adds one scalar point (float32, as ``tf.summary.scalar`` writes it)."""
        from tensorboard.compat.proto import tensor_pb2, types_pb2
        from tensorboard.plugins.scalar import metadata

        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[value])
        tensor.tensor_shape.SetInParent()  # a scalar: shape []
        self._add(tag, tensor, step, self._metadata(tag, metadata, description))

    def histogram(self, tag: str, buckets: np.ndarray, step: int, description: str = "") -> None:
        """Adds one histogram: ``[k, 3]`` rows of (left edge, right edge, count)."""
        from tensorboard.compat.proto import tensor_pb2, types_pb2
        from tensorboard.plugins.histogram import metadata

        values = np.ascontiguousarray(buckets, np.float64)
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, tensor_content=values.tobytes())
        for size in values.shape:
            tensor.tensor_shape.dim.add(size=size)
        self._add(tag, tensor, step, self._metadata(tag, metadata, description))

    def _add(self, tag: str, tensor: Any, step: int, metadata: Any) -> None:
        from tensorboard.compat.proto import summary_pb2

        proto = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
        if metadata is not None:
            proto.metadata.CopyFrom(metadata)
        self._values[int(step)].append(proto)

    def write(self) -> None:
        """Writes what was added, one raw summary per step, to the default writer."""
        import tensorflow as tf
        from tensorboard.compat.proto import summary_pb2

        for step in sorted(self._values):
            summary = summary_pb2.Summary(value=self._values[step])
            tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=step)
        self._values.clear()
