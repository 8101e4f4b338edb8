"""kmix's primitives on Keras's TensorFlow backend, and the TensorFlow tools kmix uses.

The first part has the names every backend module has (see :mod:`kmix.backend`); the
second, TensorFlow's own tools that kmix uses whatever the backend (``tf.data`` for
``kmix compare``, ``tf.distribute`` for :class:`kmix.callbacks.LoopDriver`, device
memory). TensorFlow is imported inside each function, when it is called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from kmix.backend.common import (
    alone_agrees,
    divide_each,
    new_read,
    no_step_scope,
    not_screened,
    numpy_value,
    reduce_each,
    retrace,
)
from kmix.backend.common import constant_initializer as constant_initializer  # the name, bound here

divided, screened_nonfinite_flags = divide_each, not_screened
"""The unscale one op at a time; no finite screen (the step decides in the graph)."""

USES_TENSORFLOW = True
"""Keras utilities that import TensorFlow (its TensorBoard callback, its seeding) cost
nothing more here: TensorFlow is the backend."""

retrace_all = retrace
"""Makes ``model``'s train, evaluate and predict functions trace again at their next call."""

reduce_rows = reduce_each
"""Reduces ``[k, n]`` matrices along their rows, one reduction each."""


all_processes_agree = alone_agrees
"""``ok`` as given: kmix counts no processes here (:func:`processes_and_devices`)."""

NOTES_CASTS = False
"""A float16 layer's input as it arrived is read back from the graph (:func:`as_arrived`),
so the tap does not note casts."""


def processes_and_devices() -> tuple[int, int] | None:
    """None: ``tf.distribute``'s workers and replicas are told apart by
    :class:`kmix.callbacks.LoopDriver`, not counted here."""
    return None


def is_first_process() -> bool:
    """True: TensorFlow's workers are told apart by :class:`kmix.callbacks.LoopDriver`."""
    return True


def reachable(tensor: Any) -> bool:
    """True if ``tensor`` can be used where ops are being built now.

    In eager code only eager tensors are; inside a ``tf.function`` an eager tensor is
    captured as a constant, and a symbolic one must belong to the current graph or to
    a graph enclosing it (a ``cond`` branch or loop body inside the train step).
    """
    import tensorflow as tf

    symbolic = tf.is_symbolic_tensor(tensor)
    if tf.executing_eagerly():
        return not symbolic
    if not symbolic:
        return True
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(tensor, "graph", None) is graph:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def rare_cond(pred: Any, true_fn: Any, false_fn: Any) -> Any:
    """``ops.cond`` for a branch that seldom runs, kept as a function call in the graph.

    TensorFlow lowers a graph's conditionals to switch/merge nodes, and then every node
    of the branch not taken is still visited on every step (its inputs are "dead"):
    a large rare branch costs each step nearly what running it would. Marked as not
    lowered, the conditional calls only the branch it takes. XLA compiles either form
    alike; eagerly it is a plain Python ``if``; under a strategy with several replicas
    (variables on several devices) it stays lowered.

    Args:
        pred: boolean scalar tensor.
        true_fn: the branch for True; returns a tensor (or nested tensors) or None.
        false_fn: the branch for False, with outputs of the same structure.

    Returns:
        The taken branch's outputs (None when the branches return None).
    """
    import tensorflow as tf
    from tensorflow.core.framework import attr_value_pb2

    if tf.executing_eagerly():
        return true_fn() if bool(pred) else false_fn()
    if tf.distribute.get_strategy().num_replicas_in_sync > 1:
        # A called branch cannot touch variables placed on several devices: lower it.
        return tf.cond(pred, true_fn, false_fn)
    returns = []

    def branch(fn: Any) -> Any:
        def run() -> Any:
            out = fn()
            returns.append(out is None)
            return tf.constant(0) if out is None else (tf.constant(0), out)

        return run

    result = tf.cond(pred, branch(true_fn), branch(false_fn))
    marker = result if returns[0] else result[0]
    op = marker.op
    while op.type not in ("If", "StatelessIf") and op.inputs:
        op = op.inputs[0].op
    if op.type in ("If", "StatelessIf"):
        op._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
    return None if returns[0] else result[1]


def host_value(variable: Any) -> np.ndarray:
    """A Keras variable's value on the host, with one raw read.

    ``keras.ops.convert_to_numpy`` on a variable goes through ``__array__``, an identity
    op and a NumPy version check on every call: about three times the cost of the read
    itself, which a callback checking after every step pays on every step. Variables
    that are not plain resource variables (e.g. mirrored ones under a strategy) take
    Keras's path.

    Args:
        variable: a Keras variable (or a TensorFlow variable).

    Returns:
        A NumPy array with the variable's current value.
    """
    import tensorflow as tf
    from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable

    value = getattr(variable, "value", variable)
    if isinstance(value, BaseResourceVariable):
        return tf.raw_ops.ReadVariableOp(resource=value.handle, dtype=value.dtype).numpy()
    return numpy_value(variable)


def read_in_step(variable: Any) -> Any:
    """``variable``'s value in the step being traced, from the read the step already made
    (e.g. the forward pass's read of a float8 scale: the very value Keras quantized with),
    else from a new read.

    A variable read inside a ``tf.function`` is a stateful ``ReadVariableOp`` that
    TensorFlow's optimizations never merge; a healthy step pays for each. The first read of
    ``variable`` that the current graph already holds (by its captured handle) runs before
    any assignment the step makes after it. A distributed variable (under a strategy) is
    read anew.

    Args:
        variable: a Keras variable (or a TensorFlow variable).

    Returns:
        A tensor with its value.
    """
    import tensorflow as tf
    from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable

    value = getattr(variable, "value", variable)  # not a distributed one: they have no handle
    if isinstance(value, BaseResourceVariable) and not tf.executing_eagerly():
        graph = tf.compat.v1.get_default_graph()
        for external, internal in getattr(graph, "captures", ()):
            if external is value.handle:
                for op in internal.consumers():
                    if op.type == "ReadVariableOp":
                        return op.outputs[0]
                break
    return new_read(variable)


def replica_copies(variables: Sequence[Any]) -> list[list[Any]]:
    """The copies of ``variables`` that a write of values computed from them must assign
    one by one: one list per replica in a cross-replica context (a strategy's merge call),
    where a read gives the first replica's copy and an assignment writes every copy, though
    Keras keeps its float8 state per replica (aggregation ``"none"``); ``[variables]``
    elsewhere (in a replica context a read and a write take the replica's own copy).

    Args:
        variables: Keras variables (or TensorFlow variables).

    Returns:
        Lists parallel to ``variables``; a variable that is not mirrored appears as itself
        in each.
    """
    import tensorflow as tf

    values = [getattr(v, "value", v) for v in variables]
    mirrored = [v for v in values if isinstance(v, tf.distribute.DistributedValues)]
    if not mirrored or not tf.distribute.in_cross_replica_context():
        return [list(variables)]
    return [
        [v.values[i] if isinstance(v, tf.distribute.DistributedValues) else v for v in values]
        for i in range(len(mirrored[0].values))
    ]


def initialized(variable: Any) -> bool:
    """Whether ``variable`` holds a value: one created while a ``tf.function`` was traced
    gets it at that function's first run, so a trace that failed after creating it (a
    ``fit`` ended by an exception in its first step) leaves it without one.

    Args:
        variable: a Keras variable (or a TensorFlow variable).

    Returns:
        False only for a variable TensorFlow reports uninitialized.
    """
    value = getattr(variable, "value", variable)
    check = getattr(value, "is_initialized", None)
    return True if check is None else bool(check())


def int64_dtype() -> str:
    """``"int64"``: TensorFlow holds int64 variables as they are."""
    return "int64"


def exact_exponent(x: Any) -> Any:
    """``floor(log2(x))`` of positive finite float32 values, from their exponent bits.

    A bit cast (``keras.ops.view`` cannot run inside a graph); subnormals give -127.
    """
    import tensorflow as tf

    bits = tf.bitcast(tf.cast(x, tf.float32), tf.int32)
    return tf.bitwise.right_shift(bits, 23) - 127


def summed_rows(indices: Any, values: Any) -> Any:
    """Sparse slices (an embedding's gradient) summed per row: what applying them adds."""
    import tensorflow as tf

    rows, position = tf.unique(indices)
    return tf.math.unsorted_segment_sum(values, position, tf.size(rows))


def trace_root(outputs: Any) -> Any:
    """The outermost function graph being built now; None when executing eagerly."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    while isinstance(getattr(graph, "outer_graph", None), tf.__internal__.FuncGraph):
        graph = graph.outer_graph
    return graph


def is_traced(outputs: Any) -> bool:
    """True while a graph is being built (``tf.function``, the compiled train step)."""
    import tensorflow as tf

    return not tf.executing_eagerly()


_WIDER_FLOATS = frozenset({"float32", "float64"})


def as_arrived(tensor: Any) -> Any:
    """The value a layer was given, before ``Layer.__call__`` cast it to float16.

    A float16 layer's ``call`` sees its float inputs after Keras's autocast: a finite
    float32 value beyond 65504 arrives in ``call`` as inf. In a traced graph the cast is
    a ``Cast`` op from a wider float type to float16; its input is the value as it came
    (from the data, or from a float32 layer), which is what a forward origin must judge.

    Args:
        tensor: one input tensor of a tapped call.

    Returns:
        The cast's float32/float64 input when ``tensor`` is a graph tensor made by such a
        cast; ``tensor`` itself otherwise (eager tensors, other ops, other dtypes).
    """
    try:
        op = tensor.op
    except AttributeError:  # an eager tensor (or not a TensorFlow tensor): no op to read
        return tensor
    if op is None or op.type != "Cast" or tensor.dtype.name != "float16":
        return tensor
    source = op.inputs[0]
    return source if source.dtype.name in _WIDER_FLOATS else tensor


def set_random_seed(seed: int) -> None:
    """Seeds Python, NumPy, Keras and TensorFlow: ``keras.utils.set_random_seed``."""
    keras.utils.set_random_seed(seed)


# ---------------------------------------------------------------- TensorFlow's tools


def default_strategy() -> Any:
    """The ``tf.distribute`` strategy in scope (the default one outside any scope)."""
    import tensorflow as tf

    return tf.distribute.get_strategy()


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a ``tf.function`` (traced again only for arguments of a new number, dtype
    or rank; shapes are relaxed): one dispatch a call, where TensorFlow's eager ops cost a
    dispatch each.

    Each call goes straight to the concrete function kept for its arguments' structure,
    dtypes and shapes: ``tf.function``'s own dispatch canonicalizes every argument on
    every call, which costs as much as running a small function. Arguments that are not
    tensors or variables (NumPy arrays, Python numbers) are made tensors first, so a new
    value is never a new trace.

    Hand it tensors or TensorFlow variables, alone or in lists, tuples and dicts (a
    variable is passed by its handle; a Keras variable is read before the call: pass its
    ``value`` to hand the variable itself); settings that fix what ``fn`` computes
    (dtypes, strings, flags) belong in its closure, not its arguments. A distributed
    variable (under a ``tf.distribute`` strategy) is read first, its first replica's
    copy: ``tf.function`` would keep the one it was first traced with.
    """
    import tensorflow as tf

    traced = compile_function(fn, autograph=False, reduce_retracing=True)
    concrete: dict[Any, Any] = {}

    def call(*args: Any) -> Any:
        handed = tf.nest.map_structure(_handed, args)
        key = _signature(handed)
        if key not in concrete:
            concrete[key] = traced.get_concrete_function(*handed)
        return concrete[key](*handed)

    return call


def _handed(value: Any) -> Any:
    """What :func:`compiled` hands its ``tf.function``: a tensor or a variable as it is, a
    distributed variable's value, anything else as a tensor."""
    import tensorflow as tf

    if isinstance(value, tf.distribute.DistributedValues) or not isinstance(
        value, (tf.Tensor, tf.Variable)
    ):
        return tf.convert_to_tensor(value)
    return value


def _signature(value: Any, seen: dict[int, int] | None = None) -> Any:
    """A hashable key of what ``tf.function`` traces for ``value``: its structure (lists,
    tuples and dicts), each leaf's kind (variable or tensor), dtype and shape, and which
    variables are one (a variable handed twice is traced as one) and which are trainable.

    Args:
        value: what :func:`compiled` hands its ``tf.function`` (after :func:`_handed`).
        seen: ``id`` of each variable met so far -> its number (filled here).
    """
    import tensorflow as tf

    seen = {} if seen is None else seen
    if isinstance(value, dict):
        return ("dict", tuple((k, _signature(value[k], seen)) for k in sorted(value)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v, seen) for v in value))
    if isinstance(value, tf.Variable):
        return (
            seen.setdefault(id(value), len(seen)),
            value.trainable,
            value.dtype,
            tuple(value.shape),
        )
    return (None, None, value.dtype, tuple(value.shape))


def compile_function(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``tf.function(fn, **kwargs)``."""
    import tensorflow as tf

    return tf.function(fn, **kwargs)


def any_replica(strategy: Any, flag: bool) -> bool:
    """True when ``flag`` is True in any replica of ``strategy`` (a collective)."""
    import tensorflow as tf

    value = strategy.run(lambda: tf.constant(int(flag)))
    return bool(strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None) > 0)


def is_dataset(data: Any) -> bool:
    """True for a ``tf.data.Dataset`` (False, and TensorFlow not imported, before it is:
    no dataset can exist then)."""
    import sys

    if "tensorflow" not in sys.modules:
        return False
    import tensorflow as tf

    return isinstance(data, tf.data.Dataset)


def dataset_from_arrays(x: Any, y: Any, batch_size: int | None = None) -> Any:
    """``(x, y)`` as a ``tf.data.Dataset``, batched (the remainder dropped) when asked."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    return dataset if batch_size is None else dataset.batch(batch_size, drop_remainder=True)


def first_gpu() -> str | None:
    """The first logical GPU's device name (``"GPU:0"``), or None without one."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name.removeprefix("/device:") if gpus else None


def reset_peak_memory(device: str) -> None:
    """Starts ``device``'s peak memory count again."""
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats(device)


def peak_memory(device: str) -> int:
    """``device``'s peak memory in bytes since its last reset."""
    import tensorflow as tf

    return int(tf.config.experimental.get_memory_info(device)["peak"])


def is_out_of_memory(error: BaseException) -> bool:
    """True for TensorFlow's out-of-memory error."""
    import tensorflow as tf

    return isinstance(error, tf.errors.ResourceExhaustedError)


step_scope = no_step_scope
"""Nothing to open: the step is traced (the tap tells its pass by the trace)."""
