"""Per-tensor statistics in a few ops: tensors of one shape and dtype are measured together.

kmix measures many tensors one by one (a row of sums per gradient, per layer output).
On Keras's JAX backend each reduction XLA compiles costs every call of the train step,
whether its conditional branch runs or not: the CPU runtime sets up every buffer of the
program, those of branches not taken included, at each execution. Reduced one by one,
the statistics of the 82-variable stack put about 1,400 buffers into the step, ~20 % of a
quiet step (``bench/history/``, the JAX passes). Stacked by shape and dtype, a model of
repeated blocks has a few groups, so a few reductions; the stacking copies run only in
the branch that measures. A stack is a copy, so a tensor of :data:`STACK_LIMIT` elements
or more is measured alone (stacked, an MLP's kernels took one more gradient's memory in
the step XLA compiled; alone, a large tensor's few reductions cost little next to it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from kmix import backend
from kmix.backend import STACK_LIMIT

__all__ = ["reduce_rows", "row_sizes", "rows_per_tensor"]


def _group_key(tensor: Any, index: int) -> tuple:
    """Tensors with equal keys stack: one fully known shape and one dtype, and small.

    A large tensor stands alone: its stack would be a copy of it (more memory at the
    steps that measure), while its own reductions are cheap next to its size.
    """
    shape = tuple(tensor.shape)
    if any(dim is None for dim in shape) or math.prod(shape) >= STACK_LIMIT:
        return ("alone", index)  # unknown size (a graph tensor), or large
    return (shape, keras.backend.standardize_dtype(tensor.dtype))


def rows_per_tensor(
    tensors: Sequence[Any | None], measure: Callable[[Any], Any], width: int
) -> Any:
    """``measure`` applied to every tensor, one row each, a group of equal tensors at a time.

    Args:
        tensors: tensors of any shapes and dtypes; ``None`` gets a row of zeros.
        measure: maps a ``[k, n]`` stack of ``k`` flattened tensors of one dtype to a
            float32 ``[k, width]`` matrix, row ``i`` depending on row ``i`` only.
        width: the number of columns ``measure`` returns.

    Returns:
        A float32 ``[len(tensors), width]`` matrix, in the order of ``tensors``.
    """
    groups: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor is not None:
            groups.setdefault(_group_key(tensor, index), []).append(index)
    parts = []
    for members in groups.values():
        flat = [ops.reshape(tensors[i], (1, -1)) for i in members]
        parts.append(measure(flat[0] if len(flat) == 1 else ops.concatenate(flat, axis=0)))
    order = [i for members in groups.values() for i in members]
    parts.append(ops.zeros((1, width), "float32"))  # the row of every None, after the rest
    rows = ops.concatenate(parts, axis=0)
    row_of = [len(order)] * len(tensors)
    for row, index in enumerate(order):
        row_of[index] = row
    if row_of == list(range(len(tensors))):
        return rows[: len(tensors)]
    return ops.take(rows, np.asarray(row_of, "int32"), axis=0)


def row_sizes(rows: Any) -> Any:
    """The element count of each tensor in a ``[k, n]`` stack: a float32 ``[k]`` of ``n``.

    Args:
        rows: a stack as :func:`rows_per_tensor` hands to ``measure``.

    Returns:
        ``n`` once per row, float32.
    """
    return ops.ones((ops.shape(rows)[0],), "float32") * ops.cast(ops.shape(rows)[1], "float32")


def reduce_rows(columns: Sequence[Any], kinds: Sequence[str]) -> list[Any]:
    """Reduces ``[k, n]`` matrices along their rows: ``"sum"`` or ``"max"`` (from 0) each.

    How is the backend's (:func:`kmix.backend.reduce_rows`): on JAX, in few reductions
    (each one XLA compiles costs every step, see above); elsewhere one reduction each.

    Args:
        columns: ``[k, n]`` tensors of equal shape (each keeps its dtype).
        kinds: ``"sum"`` or ``"max"`` per column; a max starts from 0 (magnitudes).

    Returns:
        One ``[k]`` tensor per column, in its dtype.
    """
    return backend.reduce_rows(columns, kinds)
