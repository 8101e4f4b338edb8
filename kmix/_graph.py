"""Which graph a tensor belongs to: the one TensorFlow-specific question kmix asks twice."""

from __future__ import annotations

from typing import Any


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
