"""The forward pass, seen: per-layer activation statistics and the layer where a NaN starts.

Two parts, kept apart:

* **Pure statistics** (:func:`activation_stats`, :func:`forward_origin`): keras.ops
  functions of lists of layer outputs (and inputs), no Python control flow on tensors,
  no host synchronisation; they run inside the compiled train step.
* **A tap** (:class:`ActivationTap`) that wraps the ``call`` of every layer computing in
  float16 so that, while the train step is traced, each call appends a :class:`Record`
  ``(path, inputs, outputs, class_name)`` to a per-thread list. The optimizer reads that
  list with :meth:`ActivationTap.take` inside ``apply()``, in the same trace: the
  recorded tensors belong to the same graph (they are alive for the backward pass
  anyway), so reducing them adds ops to the step and nothing else.

Example (what the optimizer does inside ``apply``, in the replica context)::

    records = tap.take()                                   # [] when nothing was traced
    stats = activation_stats([r.outputs for r in records]) # ActivationStats of vectors
    origin = forward_origin([r.inputs for r in records], [r.outputs for r in records])
    names = [r.path for r in records]                      # Python strings, trace time

Wiring (for the optimizer and the monitor):

* The monitor, at ``on_train_begin``: ``tap = ActivationTap(self.model).install()``, hand
  it to the optimizer, and retrace (``self.model.make_train_function(force=True)``) if a
  train function was already traced without it; at ``on_train_end``: ``tap.remove()``.
  :attr:`ActivationTap.last_taken` names the entries of the vectors (paths, classes).
* The optimizer, first thing in ``apply()`` (replica context, before ``merge_call``,
  whose function runs in another thread): ``records = tap.take()``; the statistics in
  its health ``cond``, :func:`forward_origin` in a ``cond`` on the non-finite loss flag.
  The number of records and their paths are Python values at trace time.
* Cost: recording adds Python at trace time only. Reducing the records in ``apply``
  keeps the recorded activations alive until then (past the backward pass), also when
  the reduction sits in a ``cond`` not taken: peak memory can grow by the activations.

Which layers are tapped: every layer nested in the model (found by
``kmix._layers.walk_layers``, the model itself excluded) whose ``compute_dtype`` is
``"float16"``, except ``InputLayer`` and pure containers, i.e. Functional and Sequential
models whose ``call`` is Keras's own graph runner (their outputs are their layers'
outputs, already recorded). Layers with nested layers that compute themselves (a
residual block, ``MultiHeadAttention``'s softmax, a subclassed model nested in another)
are tapped too. A record is appended when a call *returns*, so a block's record follows
its inner layers' records: :func:`forward_origin` names the innermost layer first.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from kmix import _layers
from kmix._graph import reachable
from kmix.health import FLOAT16_MAX, FLOAT16_SMALLEST_NORMAL, FLOAT16_SMALLEST_SUBNORMAL

__all__ = [
    "ACTIVATION_CAPACITY",
    "ACTIVATION_FIELDS",
    "ActivationStats",
    "ActivationTap",
    "ForwardOriginTensors",
    "LayerCall",
    "Record",
    "activation_stats",
    "forward_origin",
    "measure_forward",
    "tapped_layers",
]

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


# ------------------------------------------------------------------ typed values
class ActivationStats(NamedTuple):
    """Per-layer activation statistics: float32 vectors with one entry per layer output.

    Over the floating-point tensors of one layer's output (all of them, when it returns a
    tuple, list or dict; integer and bool tensors are ignored), with ``n`` their total
    number of elements (a layer with no float element has ``n = 0`` and all fractions 0):

    Attributes:
        max_abs: largest finite ``|x|``; 0 when there is none.
        headroom_bits: ``log2(FLOAT16_MAX / max(max_abs, FLOAT16_SMALLEST_SUBNORMAL))``,
            so at most ``kmix.health.MAX_HEADROOM_BITS`` (the cap used for gradients);
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
        max_abs_input: float32; that layer's largest finite ``|input|`` (0 for -1).
        inputs_finite: bool; whether all that layer's float inputs were finite (True for
            -1).
    """

    layer_index: Any
    max_abs_input: Any
    inputs_finite: Any


class Record(NamedTuple):
    """One call of a tapped layer, as recorded during a trace.

    Attributes:
        path: the layer's path (``layer.path``, else its path in the model), with
            ``#k`` appended for its k-th call (k ≥ 2) in the same step.
        inputs: the tensors among the call's arguments, flattened, in argument order.
        outputs: what ``call`` returned (a tensor or a nested structure).
        class_name: the layer's class name, e.g. ``"Dense"``.
    """

    path: str
    inputs: tuple
    outputs: Any
    class_name: str


class LayerCall(NamedTuple):
    """A record's name, without its tensors: what the monitor needs to label vectors."""

    path: str
    class_name: str


# ------------------------------------------------------------------ statistics
def _dense(x: Any) -> Any:
    """The values of a tensor: composites (ragged, sparse) give their flat values."""
    flat_values = getattr(x, "flat_values", None)
    if flat_values is not None:
        return flat_values
    if hasattr(x, "indices") and hasattr(x, "values"):
        return x.values
    return x


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


def _count(condition: Any) -> Any:
    """Number of True elements, as float32 (counted in int64 first, so exact to 2^24)."""
    return ops.cast(ops.count_nonzero(condition), "float32")


def _layer_stats(structure: Any) -> tuple[Any, Any, Any, Any, Any]:
    """(max_abs, n, nonfinite, zeros, below_normal) over one structure's float tensors.

    Comparisons and the maximum run in the tensor's own dtype (exact in any float
    dtype, and float16's thresholds are exact in it); only scalars are cast to float32.
    """
    zero = ops.zeros((), "float32")
    max_abs, size, nonfinite, zeros, below_normal = zero, zero, zero, zero, zero
    for x in float_tensors(structure):
        magnitude = ops.abs(x)
        finite = ops.isfinite(x)
        largest = ops.max(ops.where(finite, magnitude, ops.zeros((), x.dtype)), initial=0.0)
        max_abs = ops.maximum(max_abs, ops.cast(largest, "float32"))
        size += ops.cast(ops.size(x), "float32")
        nonfinite += ops.cast(ops.size(x), "float32") - _count(finite)
        zeros += _count(ops.equal(magnitude, 0))
        # NaN compares False: only zeros and finite tiny values count.
        below_normal += _count(ops.less(magnitude, FLOAT16_SMALLEST_NORMAL))
    return max_abs, size, nonfinite, zeros, below_normal


def _vector(scalars: list[Any]) -> Any:
    return ops.stack(scalars) if scalars else ops.zeros((0,), "float32")


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
    columns: list[list[Any]] = [[], [], [], [], [], []]
    for structure in outputs:
        max_abs, size, nonfinite, zeros, below_normal = _layer_stats(structure)
        n = ops.maximum(size, 1.0)
        headroom = _LOG2_FLOAT16_MAX - ops.log2(ops.maximum(max_abs, FLOAT16_SMALLEST_SUBNORMAL))
        values = (
            max_abs,
            headroom,
            nonfinite / n,
            below_normal / n,
            zeros / n,
            (below_normal - zeros) / n,
        )
        for column, value in zip(columns, values, strict=True):
            column.append(value)
    return ActivationStats(*(_vector(column) for column in columns))


def _finite_summary(structure: Any) -> tuple[Any, Any]:
    """(all float values finite: bool scalar, largest finite |value|: float32 scalar)."""
    finite = ops.ones((), "bool")
    largest = ops.zeros((), "float32")
    for x in float_tensors(structure):
        is_finite = ops.isfinite(x)
        finite = ops.logical_and(finite, ops.all(is_finite))
        peak = ops.max(ops.where(is_finite, ops.abs(x), ops.zeros((), x.dtype)), initial=0.0)
        largest = ops.maximum(largest, ops.cast(peak, "float32"))
    return finite, largest


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
    in_finite, in_max, out_bad = [], [], []
    for layer_inputs, layer_outputs in zip(inputs, outputs, strict=True):
        finite, largest = _finite_summary(layer_inputs)
        in_finite.append(finite)
        in_max.append(largest)
        out_bad.append(ops.logical_not(_finite_summary(layer_outputs)[0]))
    in_finite_v = ops.stack(in_finite)
    nonfinite = ops.cast(ops.stack(out_bad), "int32")
    origin = nonfinite * ops.cast(in_finite_v, "int32")
    index = ops.where(
        ops.max(origin) > 0,
        ops.cast(ops.argmax(origin), "int32"),
        ops.where(ops.max(nonfinite) > 0, ops.cast(ops.argmax(nonfinite), "int32"), -1),
    )
    safe = ops.maximum(index, 0)
    found = index >= 0
    return ForwardOriginTensors(
        layer_index=index,
        max_abs_input=ops.where(found, ops.take(ops.stack(in_max), safe), 0.0),
        inputs_finite=ops.logical_or(ops.logical_not(found), ops.take(in_finite_v, safe)),
    )


# ------------------------------------------------------------------ the tap
def _is_container(layer: Any) -> bool:
    """True for Functional/Sequential models whose ``call`` is Keras's graph runner."""
    from keras.src.models.functional import Functional

    call = getattr(type(layer), "call", None)
    return call is Functional.call or call is keras.Sequential.call


def tapped_layers(model: Any) -> list[tuple[str, Any]]:
    """The layers an :class:`ActivationTap` instruments, with their paths.

    Args:
        model: a model (built or not; a lazily built Sequential's layers already exist).

    Returns:
        ``(path, layer)`` pairs, depth first: layers nested in ``model`` whose
        ``compute_dtype`` is ``"float16"``, except ``InputLayer`` and pure containers
        (Functional and Sequential models that do not override ``call``).
    """
    return [
        (path, layer)
        for path, layer in _layers.walk_layers(model)
        if getattr(layer, "compute_dtype", None) == "float16"
        and not isinstance(layer, keras.layers.InputLayer)
        and not _is_container(layer)
    ]


def _in_symbolic_scope() -> bool:
    """True while Keras infers shapes (``compute_output_spec``) in a scratch graph."""
    try:
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    except ImportError:  # pragma: no cover - Keras moved it; record anyway
        return False
    return bool(in_symbolic_scope())


def _root_graph(tf: Any) -> Any:
    """The outermost function graph being built now; ``None`` when executing eagerly."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    while isinstance(getattr(graph, "outer_graph", None), tf.__internal__.FuncGraph):
        graph = graph.outer_graph
    return graph


def _record_reachable(record: Record, tf: Any) -> bool:
    tensors = tf.nest.flatten((record.inputs, record.outputs), expand_composites=True)
    return all(reachable(t) for t in tensors if tf.is_tensor(t))


class ActivationTap:
    """Records every float16 layer's inputs and outputs while a train step is traced.

    Recording: when ``auto_record`` (the default), every call traced into a graph
    (``tf.function``, the compiled train step, with or without ``jit_compile``) is
    recorded; eager calls are recorded only inside ``with tap.recording():``. Shape
    inference (Keras's symbolic calls) is never recorded. Each thread has its own list
    (each ``MirroredStrategy`` replica records its own calls); a list holds the calls
    of one trace and is emptied by :meth:`take` or when another trace starts recording.

    Example::

        tap = ActivationTap(model).install()
        @tf.function
        def step(x):
            y = model(x)
            records = tap.take()
            return activation_stats([r.outputs for r in records])

    Args:
        model: a Functional, Sequential (built or not) or subclassed model.
        auto_record: record calls traced into graphs without :meth:`recording`.
    """

    def __init__(self, model: Any, *, auto_record: bool = True) -> None:
        self.model = model
        self.auto_record = auto_record
        self.last_taken: tuple[LayerCall, ...] = ()
        """Paths and classes of the records the last :meth:`take` returned (any thread)."""
        self._forced = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._installed: dict[int, tuple[Any, bool, Any, str, Any]] = {}

    # -- installing
    @property
    def installed(self) -> bool:
        """Whether the tap currently wraps any layer."""
        return bool(self._installed)

    @property
    def paths(self) -> list[str]:
        """The paths of the wrapped layers, depth first, as records name their first call.

        ``layer.path`` where Keras has set it (a built layer), else the layer's path in
        the model at install time.
        """
        return [getattr(e[0], "path", None) or e[3] for e in self._installed.values()]

    def install(self) -> ActivationTap:
        """Wraps ``call`` of every layer of :func:`tapped_layers` (idempotent).

        The wrapper is set on the layer instance and keeps the original signature
        (``inspect.signature`` follows ``__wrapped__``), so Keras still sees the
        ``training`` and ``mask`` arguments. A model's train function traced before
        ``install()`` does not see the tap: retrace it (``model.make_train_function(
        force=True)``) to record.

        Returns:
            ``self``, so ``tap = ActivationTap(model).install()`` reads naturally.
        """
        for path, layer in tapped_layers(self.model):
            if id(layer) in self._installed:
                continue
            had_own = "call" in vars(layer)
            original = layer.call
            wrapper = self._wrap(layer, path, original)
            object.__setattr__(layer, "call", wrapper)
            self._installed[id(layer)] = (layer, had_own, original, path, wrapper)
        return self

    def remove(self) -> None:
        """Restores every wrapped layer's original ``call`` exactly (idempotent)."""
        for layer, had_own, original, _path, wrapper in self._installed.values():
            if vars(layer).get("call") is not wrapper:
                continue  # wrapped again by someone else: our wrapper stays, inert
            if had_own:
                object.__setattr__(layer, "call", original)
            else:
                object.__delattr__(layer, "call")
        self._installed.clear()

    def _wrap(self, layer: Any, path: str, original: Any) -> Any:
        tap = self

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            outputs = original(*args, **kwargs)
            if id(layer) in tap._installed and tap._should_record():
                tap._append(layer, path, args, kwargs, outputs)
            return outputs

        return call

    # -- recording
    @contextlib.contextmanager
    def recording(self) -> Iterator[ActivationTap]:
        """Records every call in the block, eager ones included (all threads)."""
        with self._lock:
            self._forced += 1
        try:
            yield self
        finally:
            with self._lock:
                self._forced -= 1

    def _should_record(self) -> bool:
        if _in_symbolic_scope():
            return False
        if self._forced > 0:
            return True
        import tensorflow as tf

        return self.auto_record and not tf.executing_eagerly()

    def _state(self) -> threading.local:
        local = self._local
        if not hasattr(local, "records"):
            local.records, local.counts, local.root = [], {}, None
        return local

    def _append(self, layer: Any, path: str, args: tuple, kwargs: dict, outputs: Any) -> None:
        import tensorflow as tf

        state = self._state()
        root = _root_graph(tf)
        if root is not state.root:  # another trace: its records are not this one's
            state.records, state.counts, state.root = [], {}, root
        base = getattr(layer, "path", None) or path
        calls = state.counts.get(base, 0) + 1
        state.counts[base] = calls
        inputs = tuple(x for x in keras.tree.flatten((args, kwargs)) if ops.is_tensor(x))
        name = base if calls == 1 else f"{base}#{calls}"
        state.records.append(Record(name, inputs, outputs, type(layer).__name__))

    def take(self) -> list[Record]:
        """Returns this thread's records of the current trace, and forgets them all.

        Call it where the statistics are built (the optimizer's ``apply``, in the
        replica context, before any ``merge_call``), in the same trace as the forward
        pass. Records whose tensors belong to another graph (another trace, a
        ``while_loop`` body such as an RNN cell's) are dropped, never returned.

        Returns:
            The :class:`Record` list in the order the calls returned; ``[]`` when
            nothing usable was recorded.
        """
        import tensorflow as tf

        state = self._state()
        records = state.records
        state.records, state.counts, state.root = [], {}, None
        usable = [r for r in records if _record_reachable(r, tf)]
        if usable:
            self.last_taken = tuple(LayerCall(r.path, r.class_name) for r in usable)
        return usable


def measure_forward(records: list[Record], loss_nonfinite: Any, health_due: Any) -> tuple[Any, Any]:
    """What the optimizer keeps of one step's forward pass, computed only when needed.

    Args:
        records: the tap's records of this step (in this graph).
        loss_nonfinite: boolean scalar: the step's unscaled loss was inf/NaN.
        health_due: boolean scalar: statistics are due at this step.

    Returns:
        ``(origin, stats)``: ``origin`` is ``[layer index, inputs finite, max |input|]``
        (float32; ``[-1, 1, NaN]`` unless the loss was non-finite, see
        :func:`forward_origin`); ``stats`` is ``[len(records), len(ACTIVATION_FIELDS)]``
        (NaN unless due). On other steps a called conditional skips all of it.
    """
    from kmix._graph import rare_cond

    no_origin = ops.convert_to_tensor([-1.0, 1.0, np.nan], "float32")
    unmeasured = ops.full((len(records), len(ACTIVATION_FIELDS)), np.nan, "float32")

    def origin() -> Any:
        found = forward_origin([r.inputs for r in records], [r.outputs for r in records])
        return ops.stack(
            [
                ops.cast(found.layer_index, "float32"),
                ops.cast(found.inputs_finite, "float32"),
                ops.cast(found.max_abs_input, "float32"),
            ]
        )

    def stats() -> Any:
        measured = activation_stats([r.outputs for r in records])
        return ops.stack([getattr(measured, f) for f in ACTIVATION_FIELDS], axis=1)

    def measure() -> tuple[Any, Any]:
        return (
            ops.cond(loss_nonfinite, origin, lambda: no_origin),
            ops.cond(health_due, stats, lambda: unmeasured),
        )

    return rare_cond(
        ops.logical_or(loss_nonfinite, health_due), measure, lambda: (no_origin, unmeasured)
    )
