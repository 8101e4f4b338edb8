"""Which Keras backend kmix's optimizer runs on, and the few questions whose answer differs.

A leaf: Keras and NumPy at import; TensorFlow (through :mod:`kmix._graph`) only when the
backend is TensorFlow, so kmix's optimizer on JAX never imports it.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from kmix import _graph

SUPPORTED = ("tensorflow", "jax")
"""Backends kmix.LossScaleOptimizer runs on (JAX: the core of issue 24, see the README)."""


def name() -> str:
    """The active Keras backend's name, e.g. ``"tensorflow"`` or ``"jax"``."""
    return keras.backend.backend()


def on_jax() -> bool:
    """True when the active Keras backend is JAX."""
    return name() == "jax"


def check_supported(owner: str) -> None:
    """Refuses a backend kmix cannot keep its promises on (one line, naming it).

    Args:
        owner: who asks, e.g. ``"kmix.LossScaleOptimizer"``.

    Raises:
        ValueError: the active backend is neither TensorFlow nor JAX.
    """
    backend = name()
    if backend not in SUPPORTED:
        raise ValueError(
            f"{owner} does not support the Keras backend {backend!r} yet (it runs on "
            "'tensorflow' and 'jax'): set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax "
            "before importing keras."
        )


def is_first_process() -> bool:
    """False only in a JAX process other than process 0 of a multi-process run.

    Under ``keras.distribution`` the step is one program over every process: each
    decides the same, and only process 0 writes files. TensorFlow's workers are told
    apart by :class:`kmix.callbacks.LoopDriver`.
    """
    if not on_jax():
        return True
    import jax

    return jax.process_index() == 0


def reachable(value: Any) -> bool:
    """True if ``value`` can be used where the step is being built now.

    TensorFlow: see :func:`kmix._graph.reachable`. JAX: a tracer is usable while the trace
    that made it runs (a value noted by ``scale_loss`` inside ``jax.value_and_grad`` is
    the enclosing ``jit``'s tracer, still live when ``stateless_apply`` runs); a concrete
    array always is. JAX has no public test for this: the tracer's ``_trace`` is asked
    whether it is still valid, and a value without one counts as usable.

    Args:
        value: a tensor, a JAX array or tracer.

    Returns:
        Whether ops may take ``value`` as an input now.
    """
    if name() == "tensorflow":
        return _graph.reachable(value)
    trace = getattr(value, "_trace", None)
    is_valid = getattr(trace, "is_valid", None)
    return trace is None or is_valid is None or bool(is_valid())


def rare_cond(pred: Any, true_fn: Any, false_fn: Any) -> Any:
    """A conditional whose true branch seldom runs (TensorFlow: :func:`kmix._graph.rare_cond`).

    On JAX, ``lax.cond`` under ``jit`` already runs only the branch taken; the branches
    must return values (they cannot assign variables there).

    Args:
        pred: boolean scalar.
        true_fn: the branch for True.
        false_fn: the branch for False, with outputs of the same structure.

    Returns:
        The taken branch's outputs.
    """
    if name() == "tensorflow":
        return _graph.rare_cond(pred, true_fn, false_fn)
    return keras.ops.cond(pred, true_fn, false_fn)


def retrace_all(model: Any) -> None:
    """Makes ``model``'s train, evaluate and predict functions trace again at their next
    call (a layer's dtype policy changed, which no traced function sees).

    On JAX, ``jax.jit`` caches traces by function identity, and Keras's functions jit the
    same methods again: JAX's caches are cleared (every jit in the process compiles again
    at its next call; kmix does this only when it moves a layer).

    Args:
        model: a compiled Keras model.
    """
    if on_jax():
        import jax

        jax.clear_caches()
    model.make_train_function(force=True)
    model.test_function = model.predict_function = None


def host_value(variable: Any) -> np.ndarray:
    """A Keras variable's value on the host (TensorFlow: one raw read, :mod:`kmix._graph`).

    Args:
        variable: a Keras variable.

    Returns:
        A NumPy array with the variable's current value.
    """
    if name() == "tensorflow":
        return _graph.host_value(variable)
    return np.asarray(keras.ops.convert_to_numpy(variable))


def int64_dtype() -> str:
    """The dtype kmix declares its int64 variables with: ``"int32"`` on JAX without x64.

    The record's counters and event rows are int64 (TensorFlow, JAX with
    ``jax_enable_x64``); JAX without x64 holds int64 values as int32 and warns at every
    creation, assignment and state sync, so kmix declares them int32 there. kmix's record
    computes in the dtype it is given and saturates at its end
    (:func:`kmix.record.int_max`); ``.keras`` files load across the two (values cast).
    """
    if not on_jax():
        return "int64"
    import jax

    return "int64" if jax.config.read("jax_enable_x64") else "int32"
