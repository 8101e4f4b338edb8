"""The forward pass, measured: per-layer activation statistics and the layer where a NaN starts.

Pure statistics (:func:`activation_stats`, :func:`forward_origin`, :func:`measure_forward`):
keras.ops functions of lists of layer outputs (and inputs), no Python control flow on
tensors, no host synchronisation; they run inside the compiled train step, on the
calls the optimizer's tap (:class:`kmix.optimizer.tap.ActivationTap`) recorded, each a
:class:`TappedCall` (defined here, so the statistics need nothing of the tap).

Example (what the optimizer does inside ``apply``, in the replica context)::

    records = tap.take()                                   # [] when nothing was traced
    stats = activation_stats([r.outputs for r in records]) # ActivationStats of vectors
    origin = forward_origin([r.inputs for r in records], [r.outputs for r in records])
    names = [r.path for r in records]                      # Python strings, trace time
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from kmix.record import grouped as _grouped
from kmix.record.health import (
    FLOAT16_MAX,
    FLOAT16_SMALLEST_NORMAL,
    FLOAT16_SMALLEST_SUBNORMAL,
    sparse_slices,
)

__all__ = [
    "ACTIVATION_CAPACITY",
    "ACTIVATION_FIELDS",
    "FLOAT8_INPUTS_FIELD",
    "STORED_FIELDS",
    "ActivationStats",
    "ForwardOriginTensors",
    "LayerCall",
    "TappedCall",
    "activation_stats",
    "forward_origin",
    "measure_forward",
    "measure_origin",
    "no_origin",
]


class TappedCall(NamedTuple):
    """One call of a tapped layer, as recorded during a trace.

    Attributes:
        path: the layer's path, unique in the model (:func:`kmix._layers.walk_layers`,
            given when the tap's calls are taken), with ``#k`` appended for its k-th
            call (k ≥ 2) in the same step.
        inputs: the tensors among the call's arguments, flattened, in argument order.
        outputs: what ``call`` returned (a tensor or a nested structure).
        class_name: the layer's class name, e.g. ``"Dense"``.
        layer: the layer object (None where unknown).
    """

    path: str
    inputs: tuple
    outputs: Any
    class_name: str
    layer: Any = None


class LayerCall(NamedTuple):
    """A tapped call's name, without its tensors: what the monitor needs to label vectors."""

    path: str
    class_name: str


_LOG2_FLOAT16_MAX = math.log2(FLOAT16_MAX)

ACTIVATION_CAPACITY = 512
"""Layer calls per step whose statistics the optimizer keeps (the rest are left out)."""
ACTIVATION_FIELDS = (
    "max_abs",
    "headroom_bits",
    "nonfinite_fraction",
    "underflow_fraction",
    "zero_fraction",
    "subnormal_fraction",
)
"""Columns of the per-layer statistics the optimizer keeps (:class:`ActivationStats`)."""
FLOAT8_INPUTS_FIELD = "float8_inputs_underflow"
"""A float8 layer's inputs' underflow: the share of its non-zero inputs that its float8
scale flushes to zero in that step (``kmix.float8.inputs_underflow``); NaN for other layers."""
STORED_FIELDS = (*ACTIVATION_FIELDS, FLOAT8_INPUTS_FIELD)
"""Columns of the per-layer rows the optimizer keeps: :data:`ACTIVATION_FIELDS`, then
:data:`FLOAT8_INPUTS_FIELD`."""


# ------------------------------------------------------------------ typed values
class ActivationStats(NamedTuple):
    """Per-layer activation statistics: float32 vectors with one entry per layer output.

    Over the floating-point tensors of one layer's output (all of them, when it returns a
    tuple, list or dict; integer and bool tensors are ignored), with ``n`` their total
    number of elements. A layer whose output has no float element is not measured: every
    entry is NaN (readers leave it out; nothing is written for it).

    Attributes:
        max_abs: largest finite ``|x|``; 0 when there is none.
        headroom_bits: ``log2(FLOAT16_MAX / max(max_abs, FLOAT16_SMALLEST_SUBNORMAL))``,
            so at most ``kmix.record.health.MAX_HEADROOM_BITS`` (the cap used for gradients);
            negative means finite values beyond float16's range (a float32 output).
        nonfinite_fraction: ``count(x is inf or NaN) / n``.
        underflow_fraction: ``count(|x| < FLOAT16_SMALLEST_NORMAL) / n`` (zeros
            included, NaN not), i.e. ``zero_fraction + subnormal_fraction``.
        zero_fraction: ``count(x == 0) / n``.
        subnormal_fraction: ``count(0 < |x| < FLOAT16_SMALLEST_NORMAL) / n`` (values of
            a wider dtype below float16's smallest subnormal count here too).
    """

    max_abs: Any
    headroom_bits: Any
    nonfinite_fraction: Any
    underflow_fraction: Any
    zero_fraction: Any
    subnormal_fraction: Any


class ForwardOriginTensors(NamedTuple):
    """Where a non-finite value entered the forward pass; scalar tensors.

    Attributes:
        layer_index: int32; index into the lists given to :func:`forward_origin` of the
            first layer whose output is non-finite while all its inputs are finite; if
            there is none but some output is non-finite (the value came with the data),
            the first layer with a non-finite output; -1 when every output is finite.
        max_abs_input: float32; that layer's largest finite ``|input|`` over its float and
            integer inputs, as they arrived (before Keras cast them to float16: see
            :func:`kmix.backend.as_arrived`); NaN when it has neither; 0 for -1.
        inputs_finite: bool; whether all that layer's float inputs were finite (True for
            -1).
    """

    layer_index: Any
    max_abs_input: Any
    inputs_finite: Any


# ------------------------------------------------------------------ statistics
def _dense(x: Any) -> Any:
    """The values of a tensor: composites (ragged, sparse) give their flat values."""
    flat_values = getattr(x, "flat_values", None)
    if flat_values is not None:
        return flat_values
    sparse = sparse_slices(x)
    return x if sparse is None else sparse[1]


def _is_float_array(x: Any) -> bool:
    """True for a tensor or array of a floating-point dtype (not Python scalars)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        return False
    try:
        return "float" in keras.backend.standardize_dtype(dtype)
    except (TypeError, ValueError):
        return False


def float_tensors(structure: Any) -> list[Any]:
    """The floating-point tensors of a tensor or nested structure, as dense tensors.

    Args:
        structure: a tensor, array, or tuple/list/dict nesting of them; other leaves
            (integer and bool tensors, Python values, ``None``) are dropped.

    Returns:
        A list of tensors, in ``keras.tree.flatten`` order.
    """
    leaves = keras.tree.flatten(structure)
    return [ops.convert_to_tensor(_dense(x)) for x in leaves if _is_float_array(_dense(x))]


_LEAF_WIDTH = 5
"""Columns of :func:`_leaf_rows`: size, non-finite, zeros, below normal, largest |x|."""


def _leaf_rows(rows: Any) -> Any:
    """Per row of a ``[k, n]`` stack of one dtype: ``[n, non-finite, zeros, below float16's
    smallest normal, largest finite |x|]``, a float32 ``[k, 5]`` matrix (integer rows:
    ``[n, 0, 0, 0, max |x|]``).

    Comparisons and the maximum run in the tensor's own dtype (exact in any float dtype,
    and float16's thresholds are exact in it); counts are int32, so exact; only the
    results are cast to float32.
    """
    magnitude = ops.abs(rows)
    if _is_float_array(rows):
        finite = ops.isfinite(rows)
        counted = [
            ops.logical_not(finite),
            ops.equal(magnitude, 0),
            # NaN compares False: only zeros and finite tiny values count.
            ops.less(magnitude, FLOAT16_SMALLEST_NORMAL),
        ]
        columns = [ops.cast(c, "int32") for c in counted]
        columns.append(ops.where(finite, magnitude, ops.zeros((), rows.dtype)))
        reduced = _grouped.reduce_rows(columns, ("sum", "sum", "sum", "max"))
    else:
        largest = _grouped.reduce_rows([magnitude], ("max",))[0]
        reduced = [ops.zeros_like(largest)] * 3 + [largest]
    return ops.stack([_grouped.row_sizes(rows), *(ops.cast(r, "float32") for r in reduced)], axis=1)


def _leaf_table(layers: list[list[Any]]) -> tuple[list[Any], list[list[int]]]:
    """Each tensor once (a layer's output is often the next one's input), and per layer
    the positions of its tensors among them."""
    unique: list[Any] = []
    where: dict[int, int] = {}
    positions = []
    for layer in layers:
        for x in layer:
            if id(x) not in where:
                where[id(x)] = len(unique)
                unique.append(x)
        positions.append([where[id(x)] for x in layer])
    return unique, positions


def _per_layer(rows: Any, positions: list[list[int]]) -> Any:
    """:func:`_leaf_rows` per layer: its tensors' sums (the largest ``|x|``: their maximum).

    Args:
        rows: the rows of every tensor (:func:`_leaf_table`'s order).
        positions: per layer, the rows of its tensors (none: a row of zeros).

    Returns:
        A float32 ``[len(positions), 5]`` matrix.
    """
    flat = [row for layer in positions for row in layer]
    if not flat:
        return ops.zeros((len(positions), _LEAF_WIDTH), "float32")
    taken = rows if flat == list(range(ops.shape(rows)[0])) else ops.take(rows, flat, axis=0)
    owners = [i for i, layer in enumerate(positions) for _ in layer]
    if owners == list(range(len(positions))):  # one tensor each: its row
        return taken
    ids = ops.convert_to_tensor(np.asarray(owners, "int32"))
    sums = ops.segment_sum(taken[:, :-1], ids, num_segments=len(positions))
    largest = ops.segment_max(taken[:, -1], ids, num_segments=len(positions))
    return ops.concatenate([sums, ops.maximum(largest, 0.0)[:, None]], axis=1)


def _layer_rows(layers: list[list[Any]]) -> Any:
    """:func:`_per_layer` of the given tensors, measured here."""
    unique, positions = _leaf_table(layers)
    return _per_layer(_grouped.rows_per_tensor(unique, _leaf_rows, _LEAF_WIDTH), positions)


def activation_stats(outputs: list[Any]) -> ActivationStats:
    """Computes :class:`ActivationStats`, one entry per element of ``outputs``.

    Args:
        outputs: one entry per layer call: its output, a tensor or a nested structure
            of tensors (e.g. ``[r.outputs for r in tap.take()]``).

    Returns:
        An :class:`ActivationStats` of float32 vectors of length ``len(outputs)``.
        Definitions are in :class:`ActivationStats`; e.g. a layer whose outputs peak at
        1024 has ``max_abs == 1024`` and ``headroom_bits == log2(65504 / 1024)``
        (5.99930...).
    """
    return _stats_of(_layer_rows([float_tensors(s) for s in outputs]))


def _stats_of(layer_rows: Any) -> ActivationStats:
    """:class:`ActivationStats` from the per-layer rows of the layers' outputs."""
    size, nonfinite, zeros, below_normal, max_abs = ops.unstack(layer_rows, num=_LEAF_WIDTH, axis=1)
    n = ops.maximum(size, 1.0)
    headroom = _LOG2_FLOAT16_MAX - ops.log2(ops.maximum(max_abs, FLOAT16_SMALLEST_SUBNORMAL))
    unmeasured = ops.equal(size, 0.0)  # no float element: nothing to say, NaN
    values = (
        max_abs,
        headroom,
        nonfinite / n,
        below_normal / n,
        zeros / n,
        (below_normal - zeros) / n,
    )
    return ActivationStats(*(ops.where(unmeasured, np.float32(np.nan), v) for v in values))


def _is_int_array(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        return False
    try:
        return keras.backend.standardize_dtype(dtype).startswith(("int", "uint"))
    except (TypeError, ValueError):
        return False


def _input_tensors(structure: Any) -> list[Any]:
    """A layer's float and integer inputs (an integer id's magnitude counts: an
    Embedding's inputs are its ids)."""
    ints = [ops.convert_to_tensor(x) for x in keras.tree.flatten(structure) if _is_int_array(x)]
    return float_tensors(structure) + ints


def forward_origin(inputs: list[Any], outputs: list[Any]) -> ForwardOriginTensors:
    """Finds the layer where a non-finite value starts, in the order of the lists.

    Rule (per layer ``i``, with "finite" meaning every float element is finite)::

        origin[i]   = not finite(outputs[i]) and finite(inputs[i])
        nonfinite[i] = not finite(outputs[i])
        index = first i with origin[i]        if any(origin)
              = first i with nonfinite[i]     elif any(nonfinite)   # came with the data
              = -1                            otherwise

    computed with ``argmax`` over stacked flags (no Python control flow on tensors).

    Args:
        inputs: one entry per layer call: its inputs (a tensor or nested structure,
            e.g. ``[r.inputs for r in records]``).
        outputs: one entry per layer call: its outputs, aligned with ``inputs``.

    Returns:
        A :class:`ForwardOriginTensors` of scalars.

    Raises:
        ValueError: ``inputs`` and ``outputs`` differ in length.
    """
    if len(inputs) != len(outputs):
        raise ValueError(
            "forward_origin() needs one inputs entry per outputs entry; received "
            f"len(inputs)={len(inputs)} and len(outputs)={len(outputs)}. Pass "
            "[r.inputs for r in records] and [r.outputs for r in records]."
        )
    if not outputs:
        return ForwardOriginTensors(
            ops.convert_to_tensor(-1, "int32"),
            ops.zeros((), "float32"),
            ops.ones((), "bool"),
        )
    return _origin_of(*_inputs_and_outputs(inputs, outputs))


def _inputs_and_outputs(inputs: list[Any], outputs: list[Any]) -> tuple[Any, list[bool], Any]:
    """Per layer: the rows of its inputs, whether it has any, the rows of its outputs;
    every tensor measured once (a layer's output is often the next one's input)."""
    layer_inputs = [_input_tensors(s) for s in inputs]
    unique, positions = _leaf_table(layer_inputs + [float_tensors(s) for s in outputs])
    rows = _grouped.rows_per_tensor(unique, _leaf_rows, _LEAF_WIDTH)
    return (
        _per_layer(rows, positions[: len(inputs)]),
        [bool(x) for x in layer_inputs],
        _per_layer(rows, positions[len(inputs) :]),
    )


def _origin_of(input_rows: Any, measured: list[bool], output_rows: Any) -> ForwardOriginTensors:
    """:class:`ForwardOriginTensors` from the per-layer rows of inputs and outputs.

    Args:
        input_rows: per layer, the rows of its float and integer inputs.
        measured: per layer, whether it has such an input (else its largest is NaN).
        output_rows: per layer, the rows of its float outputs.
    """
    largest = ops.where(np.asarray(measured), input_rows[:, -1], np.float32(np.nan))
    in_finite = ops.equal(input_rows[:, 1], 0.0)
    nonfinite = output_rows[:, 1] > 0
    origin = ops.logical_and(nonfinite, in_finite)
    # One reduction finds both firsts: an origin ranks i, a non-finite output n + i.
    n = len(measured)
    order = np.arange(n, dtype="int32")
    first = ops.min(ops.where(origin, order, ops.where(nonfinite, order + n, np.int32(2 * n))))
    index = ops.where(first < n, first, ops.where(first < 2 * n, first - n, np.int32(-1)))
    safe = ops.maximum(index, 0)
    found = index >= 0
    return ForwardOriginTensors(
        layer_index=index,
        max_abs_input=ops.where(found, ops.take(largest, safe), 0.0),
        inputs_finite=ops.logical_or(ops.logical_not(found), ops.take(in_finite, safe)),
    )


def _origin_vector(found: ForwardOriginTensors) -> Any:
    """``[layer index, inputs finite, max |input|]`` as float32, as the record keeps it."""
    return ops.stack(
        [
            ops.cast(found.layer_index, "float32"),
            ops.cast(found.inputs_finite, "float32"),
            ops.cast(found.max_abs_input, "float32"),
        ]
    )


def no_origin() -> Any:
    """The origin vector of a step without one: ``[-1, 1, NaN]`` (see :func:`measure_forward`)."""
    return ops.convert_to_tensor([-1.0, 1.0, np.nan], "float32")


def measure_origin(records: list[TappedCall]) -> Any:
    """The forward origin of ``records`` as the vector :func:`measure_forward` returns.

    For a pass whose loss is known to be non-finite (no condition inside).

    Args:
        records: a tapped pass's records (in this trace).

    Returns:
        float32 ``[layer index, inputs finite, max |input|]`` (see :func:`forward_origin`).
    """
    return _origin_vector(forward_origin([r.inputs for r in records], [r.outputs for r in records]))


def measure_forward(
    records: list[TappedCall],
    loss_nonfinite: Any,
    health_due: Any,
    measure: Any = None,
    float8_inputs: Callable[[], Any] | None = None,
) -> tuple[Any, Any]:
    """What the optimizer keeps of one step's forward pass, computed only when needed.

    Args:
        records: the tap's records of this step (in this graph).
        loss_nonfinite: boolean scalar: the step's unscaled loss was inf/NaN.
        health_due: boolean scalar: statistics are due at this step.
        measure: ``loss_nonfinite or health_due``, where the step has read it already
            (a Python bool on torch); None computes it here.
        float8_inputs: computes the :data:`FLOAT8_INPUTS_FIELD` column (a float32 vector,
            one entry per record) where statistics are due, in the same branch; None:
            NaN.

    Returns:
        ``(origin, stats)``: ``origin`` is ``[layer index, inputs finite, max |input|]``
        (float32; ``[-1, 1, NaN]`` unless the loss was non-finite, see
        :func:`forward_origin`); ``stats`` is ``[len(records), len(STORED_FIELDS)]``
        (NaN unless due). On other steps a called conditional skips all of it.
    """
    from kmix.backend import rare_cond

    unmeasured = ops.full((len(records), len(STORED_FIELDS)), np.nan, "float32")

    def measured() -> tuple[Any, Any]:
        rows = _inputs_and_outputs([r.inputs for r in records], [r.outputs for r in records])
        measured = _stats_of(rows[2])
        column = (
            ops.full((len(records),), np.nan, "float32")
            if float8_inputs is None
            else ops.cast(float8_inputs(), "float32")
        )
        stats = ops.stack([*(getattr(measured, f) for f in ACTIVATION_FIELDS), column], axis=1)
        return (
            ops.where(loss_nonfinite, _origin_vector(_origin_of(*rows)), no_origin()),
            ops.where(health_due, stats, unmeasured),
        )

    if measure is None:
        measure = ops.logical_or(loss_nonfinite, health_due)
    return rare_cond(measure, measured, lambda: (no_origin(), unmeasured))
