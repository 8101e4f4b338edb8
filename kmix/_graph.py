"""The TensorFlow-specific questions kmix asks: which graph a tensor belongs to, how to keep
a rare branch out of the common step, how to read a variable on the host cheaply."""

from __future__ import annotations

from typing import Any

import numpy as np


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
    from keras import ops
    from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable

    value = getattr(variable, "value", variable)
    if isinstance(value, BaseResourceVariable):
        return tf.raw_ops.ReadVariableOp(resource=value.handle, dtype=value.dtype).numpy()
    return np.asarray(ops.convert_to_numpy(variable))
