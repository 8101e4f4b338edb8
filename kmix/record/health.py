"""Gradient health statistics, as pure keras.ops functions that run in-graph.

Everything here reads the *scaled* gradients (what float16 actually held) and
is computed in float32, with no host synchronisation.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from keras import ops

from kmix import backend, tags
from kmix.backend import exact_exponent
from kmix.record import grouped as _grouped

FLOAT16_MAX = tags.FLOAT16_MAX  # 65504.0, defined with the formats (readers need no TF)
FLOAT16_SMALLEST_NORMAL = 2.0**-14
FLOAT16_SMALLEST_SUBNORMAL = 2.0**-24
MAX_HEADROOM_BITS = math.log2(FLOAT16_MAX / FLOAT16_SMALLEST_SUBNORMAL)
"""Headroom reported when every gradient is below float16's smallest subnormal."""

EXPONENT_MIN = tags.EXPONENT_MIN
EXPONENT_MAX = tags.EXPONENT_MAX
NUM_EXPONENT_BINS = tags.NUM_EXPONENT_BINS  # bin layout documented in kmix.tags


class GradientHealth(NamedTuple):
    """Statistics of one step's gradients; float32 scalars unless noted.

    Attributes:
        grad_norm: global L2 norm of the unscaled gradients' finite elements.
        max_abs_scaled: largest finite absolute scaled gradient.
        headroom_bits: ``log2(FLOAT16_MAX / max_abs_scaled)``, capped at
            ``MAX_HEADROOM_BITS``; negative means finite values beyond float16.
        underflow_fraction: share of scaled elements that are zero or below
            ``FLOAT16_SMALLEST_NORMAL`` in absolute value (``zero_fraction +
            subnormal_fraction``).
        zero_fraction: share of scaled elements that are exactly zero (inactive
            units, masked positions: no loss scale changes them).
        subnormal_fraction: share of scaled elements that are non-zero and below
            ``FLOAT16_SMALLEST_NORMAL``: what float16 rounds coarsely or flushes.
        nonfinite_elements: count of inf/NaN scaled elements (float32).
        float16_elements: how many elements the range statistics counted (those of
            float16 variables); 0 means ``max_abs_scaled``, ``headroom_bits`` and the
            fractions were not measured.
        underflow_per_variable: float32 vector, ``underflow_fraction`` per gradient.
        subnormal_per_variable: float32 vector, ``subnormal_fraction`` per gradient.
    """

    grad_norm: Any
    max_abs_scaled: Any
    headroom_bits: Any
    underflow_fraction: Any
    zero_fraction: Any
    subnormal_fraction: Any
    nonfinite_elements: Any
    float16_elements: Any
    underflow_per_variable: Any
    subnormal_per_variable: Any


def sparse_slices(x: Any) -> tuple[Any, Any] | None:
    """``(indices, values)`` of sparse slices (TensorFlow's ``IndexedSlices``), else None.

    A torch tensor has ``indices`` and ``values`` too, as methods (of its sparse layouts):
    only attributes that are values count.
    """
    indices, values = getattr(x, "indices", None), getattr(x, "values", None)
    if indices is None or values is None or callable(indices) or callable(values):
        return None
    return indices, values


def dense_values(grad: Any) -> Any:
    """Returns a gradient's values as a float32 tensor (the values of sparse slices)."""
    sparse = sparse_slices(grad)
    return ops.cast(grad if sparse is None else sparse[1], "float32")


def row_values(grad: Any) -> Any:
    """Returns a gradient's values as float32, sparse slices summed per row first.

    An embedding's gradient repeats a row once per lookup; applying it adds the
    repeats up, so statistics must see the sums, not the pieces. The sum runs only
    on health steps; the per-step finite check reads the pieces, which is exact:
    a row is non-finite if and only if one of its pieces is (short of float32
    overflow in the sum itself).
    """
    sparse = sparse_slices(grad)
    if sparse is None:
        return dense_values(grad)
    return ops.cast(backend.summed_rows(*sparse), "float32")


def nonfinite_flags(grads: list[Any]) -> Any:
    """Returns a float32 vector: 1.0 where a gradient holds an inf or NaN, else 0.0.

    Args:
        grads: gradients; ``None`` entries count as finite.
    """
    if not grads:
        return ops.zeros((0,), "float32")
    # Two ops per gradient, as stock Keras's own finite check; one vector op after.
    finite = ops.stack(
        [
            ops.convert_to_tensor(True) if g is None else ops.all(ops.isfinite(dense_values(g)))
            for g in grads
        ]
    )
    return ops.cast(ops.logical_not(finite), "float32")


def gradient_health(
    scaled_grads: list[Any], scale: Any, float16_mask: Any = None
) -> GradientHealth:
    """Computes the statistics of :class:`GradientHealth` for one step.

    Args:
        scaled_grads: gradients of the scaled loss; ``None`` entries are ignored
            (their per-variable underflow is 0).
        scale: the loss scale the gradients carry.
        float16_mask: optional float32 vector, 1.0 for variables whose layer
            computes in float16 and 0.0 otherwise. Float16's range concerns only
            the former, so ``max_abs_scaled``, ``headroom_bits`` and
            ``underflow_fraction`` count only them; default: all variables.

    Returns:
        A :class:`GradientHealth` of float32 tensors.
    """
    if not scaled_grads:
        empty = ops.zeros((0,), "float32")
        zero = ops.zeros((), "float32")
        headroom = ops.convert_to_tensor(MAX_HEADROOM_BITS, "float32")
        return GradientHealth(zero, zero, headroom, zero, zero, zero, zero, zero, empty, empty)
    scale = ops.cast(scale, "float32")
    # One row of sums per variable; variables of one shape are summed together.
    size, sum_sq, largest, tiny, exact_zero, finite = ops.unstack(
        _grouped.rows_per_tensor(
            [None if g is None else row_values(g) for g in scaled_grads],
            lambda rows: _row_sums(rows, scale),
            6,
        ),
        axis=1,
    )
    n = len(scaled_grads)
    mask = ops.ones((n,), "float32") if float16_mask is None else ops.cast(float16_mask, "float32")
    max_abs = ops.max(largest * mask)
    # The totals in one reduction (each reduction costs every step on JAX: kmix.record.grouped).
    counted_size, zeros, subnormal, total_sq, nonfinite = ops.unstack(
        ops.sum(
            ops.stack(
                [size * mask, exact_zero * mask, (tiny - exact_zero) * mask, sum_sq, size - finite],
                axis=1,
            ),
            axis=0,
        )
    )
    headroom = math.log2(FLOAT16_MAX) - ops.log2(ops.maximum(max_abs, FLOAT16_SMALLEST_SUBNORMAL))
    counted = ops.maximum(counted_size, 1.0)
    return GradientHealth(
        grad_norm=ops.sqrt(total_sq),
        max_abs_scaled=max_abs,
        headroom_bits=headroom,
        underflow_fraction=(zeros + subnormal) / counted,
        zero_fraction=zeros / counted,
        subnormal_fraction=subnormal / counted,
        nonfinite_elements=nonfinite,
        float16_elements=counted_size,
        underflow_per_variable=tiny / ops.maximum(size, 1.0),
        subnormal_per_variable=(tiny - exact_zero) / ops.maximum(size, 1.0),
    )


def _row_sums(rows: Any, scale: Any) -> Any:
    """``[size, sum of (|g|/scale)^2, max |g|, tiny, zeros, finite]`` per row of a float32
    ``[k, n]`` stack of flattened gradients, over their finite values (tiny: zero or
    below float16's smallest normal; NaN is never tiny): a float32 ``[k, 6]`` matrix."""
    sums = _grouped.reduce_rows(_terms(rows, scale), ("sum", "max", "sum", "sum", "sum"))
    return ops.stack([_grouped.row_sizes(rows), *sums], axis=1)


def _terms(values: Any, scale: Any) -> tuple[Any, ...]:
    """Per element: ``(|g|/scale)^2``, ``|g|`` (0 where not finite), then 1.0/0.0 for
    tiny, exactly zero and finite: what :func:`_row_sums` sums (or takes the max of)."""
    finite = ops.isfinite(values)
    absolute = ops.abs(values)
    magnitude = ops.where(finite, absolute, 0.0)

    def count(condition: Any) -> Any:
        return ops.cast(condition, "float32")

    return (
        ops.square(magnitude / scale),
        magnitude,
        count(absolute < FLOAT16_SMALLEST_NORMAL),
        count(ops.equal(absolute, 0.0)),
        count(finite),
    )


def flatten_all(grads: list[Any]) -> tuple[Any, Any, Any]:
    """All gradients' values in one float32 vector, so statistics are a few ops, not per variable.

    Args:
        grads: gradients (``None`` entries contribute nothing); sparse slices are
            summed per row first (:func:`row_values`).

    Returns:
        ``(values, ids, sizes)``: the concatenated values, the int32 index of the
        gradient each value comes from (sorted), and each gradient's element count
        (float32, 0 for ``None``).
    """
    flat = [
        ops.zeros((0,), "float32") if g is None else ops.reshape(row_values(g), (-1,))
        for g in grads
    ]
    counts = ops.stack([ops.shape(f)[0] for f in flat])
    # ids shaped like each gradient (not `repeat`, whose size XLA cannot bound exactly).
    ids = ops.concatenate([ops.zeros_like(f, dtype="int32") + i for i, f in enumerate(flat)])
    return ops.concatenate(flat), ids, ops.cast(counts, "float32")


def exponent_histograms(grads: list[Any]) -> Any:
    """Counts every gradient's elements per power of two, in one reduction.

    Args:
        grads: the scaled gradients (dense or sparse slices); ``None`` counts nothing.

    Returns:
        An int32 matrix ``[len(grads), NUM_EXPONENT_BINS]`` (layout in ``kmix.tags``).
    """
    values, ids, _ = flatten_all(grads)
    combined = ids * NUM_EXPONENT_BINS + _exponent_bins(values)
    counts = ops.segment_sum(
        ops.ones_like(combined), combined, num_segments=len(grads) * NUM_EXPONENT_BINS
    )
    return ops.reshape(counts, (len(grads), NUM_EXPONENT_BINS))


def _exponent_bins(values: Any) -> Any:
    """The exponent bin of every value of a float32 vector (int32 bin numbers)."""
    magnitude = ops.abs(values)
    # kmix.tags.exponent_bin, with tensors: the offset and the clipping are the same.
    exponent_bin = ops.clip(
        exact_exponent(magnitude) + tags.EXPONENT_BIN_OFFSET, 1, NUM_EXPONENT_BINS - 2
    )
    return ops.where(
        ops.isfinite(values),
        ops.where(magnitude > 0, exponent_bin, 0),
        NUM_EXPONENT_BINS - 1,
    )


def exponent_histogram(grad: Any) -> Any:
    """Counts one gradient's elements per power of two (layout in ``kmix.tags``).

    Args:
        grad: one scaled gradient (dense or sparse slices), not ``None``.

    Returns:
        An int32 vector of length ``NUM_EXPONENT_BINS``.
    """
    return exponent_histograms([grad])[0]
