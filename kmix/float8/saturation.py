"""Float8 saturation in the step: pure functions over ``keras.ops`` values.

The step's check, for each float8 tensor (:class:`kmix.float8.tensors.Float8Tensor`)::

    amax   = new amax history[0]        (the step's largest |value|, Keras's gradient)
    limit  = scale used by the step * format max
    saturated = the step applies and amax > limit     (Keras clipped it)

A healthy step computes these two vectors and one ``any``; only a step where some tensor
saturated runs :func:`advance_float8`, which counts it and writes the ring of episodes
(an episode: consecutive saturated steps of one tensor, one ring row with its length, so
a tensor that saturates every step never floods the ring)::

    per tensor: saturated_steps += saturated; last_step = step where saturated
    continuing = saturated and last_step == step - 1 and its row is still in the ring
    a new episode gets row (episode - 1) % capacity: [step, 1, tensor, episode]
                                                      [amax, limit, amax, limit]
    a continuing one: steps += 1, its last amax and limit replaced

When the loss scale changes by ``factor``, :func:`rescaled` multiplies the output
gradients' scale and amax history by it, so their float8 range follows the loss scale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from keras import ops

from kmix.float8.tensors import FORMAT_TINY, FORMATS, Float8Tensor

__all__ = [
    "EPISODE_FLOAT_FIELDS",
    "EPISODE_INT_FIELDS",
    "FIELDS",
    "TENSOR_FIELDS",
    "Float8Record",
    "StepCheck",
    "StoredRecord",
    "advance_float8",
    "check_step",
    "inputs_underflow",
    "kept_where_zero",
    "record_shapes",
    "rescaled",
    "stored",
    "stored_shapes",
    "unstored",
    "worst_of_replicas",
]

TENSOR_FIELDS = ("saturated_steps", "last_saturated_step", "episode")
"""Columns of the per-tensor counters (one row per float8 tensor)."""
EPISODE_INT_FIELDS = ("step", "steps", "tensor", "episode")
"""Columns of the episode ring's integers: first step, length, tensor row, episode (from 1)."""
EPISODE_FLOAT_FIELDS = ("amax", "limit", "last_amax", "last_limit")
"""Columns of the episode ring's floats: at the episode's first step and at its last."""

FIELDS = ("fp8_ints", "fp8_floats")
"""The float8 record's optimizer variables, in :class:`StoredRecord`'s order (their names)."""


class Float8Record(NamedTuple):
    """The float8 part of the step record, as the step and the reads see it (kept as
    :class:`StoredRecord`; ``.keras`` files saved before 2026-12-03 keep these four fields
    as four variables, in this order).

    Attributes:
        tensors: int ``(n, 3)``: :data:`TENSOR_FIELDS` per float8 tensor.
        episode_count: int scalar: episodes started so far.
        episode_ints: int ``(capacity, 4)``: :data:`EPISODE_INT_FIELDS`.
        episode_floats: float32 ``(capacity, 4)``: :data:`EPISODE_FLOAT_FIELDS`.
    """

    tensors: Any
    episode_count: Any
    episode_ints: Any
    episode_floats: Any


class StoredRecord(NamedTuple):
    """How :class:`Float8Record` is kept: two variables, since a step compiled with XLA
    pays for each variable it may touch at every execution (about 10 us on a 2-core CPU).

    Attributes:
        ints: int ``(1 + n + capacity, 4)``: row 0 the episode count (then zeros), rows
            1 to n the tensors' :data:`TENSOR_FIELDS` (then a zero), then the ring's
            :data:`EPISODE_INT_FIELDS`.
        floats: float32 ``(capacity, 4)``: the ring's :data:`EPISODE_FLOAT_FIELDS`.
    """

    ints: Any
    floats: Any


def record_shapes(n: int, capacity: int) -> Float8Record:
    """The shapes of :class:`Float8Record`'s fields for ``n`` tensors and a ring of
    ``capacity`` episodes."""
    return Float8Record(
        (n, len(TENSOR_FIELDS)),
        (),
        (capacity, len(EPISODE_INT_FIELDS)),
        (capacity, len(EPISODE_FLOAT_FIELDS)),
    )


_ROW = len(EPISODE_INT_FIELDS)
"""The width of :class:`StoredRecord`'s integer rows (its widest: the ring's)."""


def stored_shapes(n: int, capacity: int) -> StoredRecord:
    """The shapes of :class:`StoredRecord`'s two variables for ``n`` tensors and a ring
    of ``capacity`` episodes."""
    return StoredRecord((1 + n + capacity, _ROW), (capacity, len(EPISODE_FLOAT_FIELDS)))


def unstored(stored: StoredRecord, n: int) -> Float8Record:
    """The :class:`Float8Record` that ``stored`` keeps (slices: backend values or NumPy)."""
    ints = stored.ints
    tensors = ints[1 : 1 + n, : len(TENSOR_FIELDS)]
    return Float8Record(tensors, ints[0, 0], ints[1 + n :], stored.floats)


def stored(values: Float8Record, xp: Any = ops) -> StoredRecord:
    """``values`` as :class:`StoredRecord` keeps them (the inverse of :func:`unstored`).

    Args:
        values: the record, its integers of one dtype.
        xp: ``keras.ops`` in the step; ``numpy`` for values on the host.
    """
    head = xp.pad(xp.reshape(values.episode_count, (1, 1)), ((0, 0), (0, _ROW - 1)))
    tensors = xp.pad(values.tensors, ((0, 0), (0, _ROW - len(TENSOR_FIELDS))))
    return StoredRecord(
        xp.concatenate([head, tensors, values.episode_ints], axis=0), values.episode_floats
    )


class StepCheck(NamedTuple):
    """One step's check: float32 ``amax`` and ``limit``, boolean ``saturated`` (each ``(n,)``)."""

    amax: Any
    limit: Any
    saturated: Any


def check_step(
    tensors: Sequence[Float8Tensor], grads: Sequence[Any], values: Sequence[Any], applies: Any
) -> StepCheck:
    """Each float8 tensor's amax at this step against what its scale could represent.

    Args:
        tensors: the float8 tensors (indices into ``grads`` and ``values``).
        grads: the step's gradients, one per tracked variable (Keras hands a float8
            variable its new value as gradient).
        values: the tracked variables' values before the step (the scales used).
        applies: boolean scalar: the step is applied (a skipped step changes nothing).

    Returns:
        The :class:`StepCheck`.
    """
    amax = _newest([_history_or_none(grads[t.history_index]) for t in tensors])
    scale = ops.stack([ops.cast(values[t.scale_index], "float32") for t in tensors])
    limit = ops.multiply(scale, np.asarray([t.format_max for t in tensors], "float32"))
    return StepCheck(amax, limit, ops.logical_and(applies, amax > limit))


def worst_of_replicas(amaxes: Any, limits: Any, applies: Any) -> StepCheck:
    """The step's check over several replicas, each checked against its own scales.

    Under ``tf.distribute.MirroredStrategy`` Keras assigns each replica's float8 scales
    from that replica's own share of the batch, so each replica has its own amax and its
    own limit. A tensor saturated where any replica clipped it; its amax and limit are
    those of the replica that clipped it the most (the largest amax / limit), or of the
    first replica where none did.

    Args:
        amaxes: float32 ``(replicas, n)``: each replica's :attr:`StepCheck.amax`.
        limits: float32 ``(replicas, n)``: each replica's :attr:`StepCheck.limit`.
        applies: boolean scalar: the step is applied (agreed by every replica).

    Returns:
        The :class:`StepCheck` every replica records.
    """
    clipped = amaxes > limits
    worst = ops.expand_dims(
        ops.argmax(ops.where(clipped, ops.divide(amaxes, limits), -1.0), axis=0), 0
    )
    return StepCheck(
        ops.take_along_axis(amaxes, worst, axis=0)[0],
        ops.take_along_axis(limits, worst, axis=0)[0],
        ops.logical_and(applies, ops.any(clipped, axis=0)),
    )


def _history_or_none(grad: Any) -> Any:
    """A new amax history as float32; a history without one (its layer did not run in the
    step: Keras skips a None gradient) reads as amax 0, which clips nothing."""
    return np.zeros((1,), "float32") if grad is None else ops.cast(grad, "float32")


def _newest(histories: Sequence[Any]) -> Any:
    """Each amax history's newest entry (its first), in a few ops however many there are:
    one slice of them stacked (Keras's histories all have one length by default), else one
    gather over them concatenated (not a slice each: a healthy step pays the check)."""
    lengths = [h.shape[0] for h in histories]
    if len(set(lengths)) == 1:
        return ops.stack(histories)[:, 0]
    return ops.take(ops.concatenate(histories), np.cumsum([0] + lengths[:-1]).astype("int32"))


def advance_float8(old: Float8Record, check: StepCheck, step: Any) -> Float8Record:
    """The float8 record after a step with at least one saturated tensor (pure).

    Args:
        old: the record before the step.
        check: the step's :class:`StepCheck`.
        step: the attempted step, from 1 (an integer scalar).

    Returns:
        The record after the step.
    """
    dtype = old.tensors.dtype
    saturated = check.saturated
    n = saturated.shape[0]
    capacity = old.episode_ints.shape[0]
    step = ops.cast(step, dtype)
    count, last, episode = (old.tensors[:, i] for i in range(3))
    # Continues only while its row cannot be taken by this step's new episodes (<= n).
    continuing = (
        saturated
        & (last == step - 1)
        & (episode > 0)
        & (old.episode_count + n - episode < capacity)
    )
    starts = saturated & ops.logical_not(continuing)
    started = ops.cast(starts, dtype)
    episode = ops.where(starts, old.episode_count + ops.cumsum(started), episode)
    rows = ops.mod(episode - 1, capacity)
    kept_ints = ops.take(old.episode_ints, rows, axis=0)
    kept_floats = ops.take(old.episode_floats, rows, axis=0)
    ones = ops.ones((n,), dtype)
    new_ints = ops.stack(
        [
            ops.where(starts, step * ones, kept_ints[:, 0]),
            ops.where(starts, ones, kept_ints[:, 1] + 1),
            ops.arange(n, dtype=dtype),
            episode,
        ],
        axis=1,
    )
    first = ops.stack([check.amax, check.limit], axis=1)
    new_floats = ops.concatenate(
        [ops.where(starts[:, None], first, kept_floats[:, :2]), first], axis=1
    )
    hit = ops.logical_and(
        ops.expand_dims(rows, 1) == ops.expand_dims(ops.arange(capacity, dtype=dtype), 0),
        ops.expand_dims(saturated, 1),
    )  # (n, capacity): tensor i writes row r
    written = ops.any(hit, axis=0)[:, None]
    hit_ints = ops.cast(hit, dtype)[:, :, None]
    hit_floats = ops.cast(hit, "float32")[:, :, None]
    episode_ints = ops.where(
        written, ops.sum(hit_ints * new_ints[:, None, :], axis=0), old.episode_ints
    )
    episode_floats = ops.where(
        written, ops.sum(hit_floats * new_floats[:, None, :], axis=0), old.episode_floats
    )
    tensors = ops.stack(
        [count + ops.cast(saturated, dtype), ops.where(saturated, step, last), episode], axis=1
    )
    return Float8Record(
        tensors,
        old.episode_count + ops.sum(started),
        episode_ints,
        ops.cast(episode_floats, old.episode_floats.dtype),
    )


def rescaled(
    tensors: Sequence[Float8Tensor], values: Sequence[Any] | Mapping[int, Any], factor: Any
) -> dict[int, Any]:
    """The output gradients' scales and amax histories multiplied by ``factor``.

    Args:
        tensors: the float8 tensors.
        values: the tracked variables' values after the step, by tracked index (at least
            the output gradients' scales and histories).
        factor: the loss scale's change at this step (new / old; 1 when unchanged).

    Returns:
        Tracked index -> new value, for each ``outputs_grad`` scale and history: the value
        itself where ``factor`` is 1 (TensorFlow's and XLA's CPU kernels flush float32
        subnormals in a multiplication, even by 1), so a step that does not change the
        loss scale changes nothing.
    """
    factor = ops.cast(factor, "float32")
    unchanged = ops.equal(factor, 1.0)
    found = {}
    for t in tensors:
        if t.tensor == "outputs_grad":
            for index in (t.scale_index, t.history_index):
                value = ops.cast(values[index], "float32")
                found[index] = ops.where(unchanged, value, value * factor)
    return found


def kept_where_zero(
    tensors: Sequence[Float8Tensor], grads: Sequence[Any], values: Sequence[Any]
) -> list[Any]:
    """``grads`` with each float8 tensor whose new scale is 0 given its scale and amax
    history as they were, so the step leaves them unchanged (JAX).

    Keras hands a float8 scale its new value as its gradient. A layer called without
    ``training=True`` computes none: TensorFlow and torch then give None, which Keras
    skips, but JAX's gradient of a value the step did not update is 0, which Keras would
    assign; the next step divides by that scale (the loss turns NaN). A scale Keras
    computes is never 0 but where ``format max / amax`` overflows float32 (an amax below
    about 1e-36), the same division by zero.

    Args:
        tensors: the float8 tensors.
        grads: the step's gradients, one per tracked variable.
        values: the tracked variables' values before the step.

    Returns:
        The gradients, those of such tensors' scale and history replaced by their values.
    """
    kept = list(grads)
    for t in tensors:
        new_scale = grads[t.scale_index]
        if new_scale is None:
            continue
        zero = ops.equal(ops.cast(new_scale, "float32"), 0.0)
        for index in (t.scale_index, t.history_index):
            if grads[index] is not None:
                kept[index] = ops.where(zero, values[index], grads[index])
    return kept


def inputs_underflow(inputs: Any, scale: Any, compute_dtype: str) -> Any:
    """The share of a float8 layer's non-zero inputs that its scale flushes to zero.

    As Keras quantizes them (``keras.quantizers.quantize_and_dequantize``): the inputs in
    the layer's compute dtype divided by the scale cast to it, then rounded to the nearest
    float8 (E4M3), ties to even, so a quotient of at most half the format's smallest
    subnormal becomes 0 (one that underflows the compute dtype itself too).

    Args:
        inputs: the layer's inputs as they arrived (cast here, as Keras casts them).
        scale: the ``inputs_scale`` the step used (float32 scalar).
        compute_dtype: the layer's compute dtype, e.g. ``"float16"``.

    Returns:
        A float32 scalar; NaN where no input is non-zero (inf counts as non-zero, NaN
        does not).
    """
    x = ops.cast(inputs, compute_dtype)
    quotient = ops.abs(ops.divide(x, ops.cast(scale, compute_dtype)))
    nonzero = ops.greater(ops.abs(x), 0)
    flushed = ops.logical_and(nonzero, ops.less_equal(quotient, FORMAT_TINY[FORMATS["inputs"]] / 2))
    count = ops.cast(ops.sum(ops.cast(nonzero, "int32")), "float32")  # exact counts
    share = ops.cast(ops.sum(ops.cast(flushed, "int32")), "float32") / ops.maximum(count, 1.0)
    return ops.where(count > 0, share, np.float32(np.nan))
