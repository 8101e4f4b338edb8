"""kmix's primitives on Keras's JAX backend (the names every backend module has).

JAX is imported here when this module is (Keras's JAX backend has imported it already);
nothing here imports TensorFlow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import keras
import numpy as np
from jax import lax
from keras import ops

from kmix.backend.common import (
    STACK_LIMIT,
    always_initialized,
    as_one_copy,
    divide_each,
    keras_cond,
    new_read,
    no_step_scope,
    not_screened,
    numpy_value,
    retrace,
    seed_without_tensorflow,
    unchanged,
)

USES_TENSORFLOW = False
"""Keras utilities that import TensorFlow (its TensorBoard callback, its seeding) would
load it only for them: kmix avoids them here."""

host_value = numpy_value
"""A Keras variable's value on the host."""

initialized = always_initialized
"""True: variables get their value when they are created."""

replica_copies = as_one_copy
"""One copy of each variable (a sharded one is one array)."""

read_in_step = new_read
"""A new read: values here are not a graph to find an earlier read in."""

as_arrived = unchanged
"""``tensor``: on JAX the tap notes casts as they are made (:data:`NOTES_CASTS`)."""

rare_cond = keras_cond
"""``keras.ops.cond``: ``lax.cond`` under ``jit`` runs only the branch taken."""

set_random_seed = seed_without_tensorflow
"""Seeds Python, NumPy and Keras without importing TensorFlow."""

divided, screened_nonfinite_flags = divide_each, not_screened
"""The unscale one op at a time; no finite screen (the step decides in the graph)."""

NOTES_CASTS = True
"""JAX has no graph to read a cast's input back from: the tap notes each cast down to
float16 as it is made (:func:`as_arrived` then returns what it is given)."""


def is_first_process() -> bool:
    """False only in a process other than process 0 of a multi-process run.

    Under ``keras.distribution`` the step is one program over every process: each
    decides the same, and only process 0 writes files.
    """
    return jax.process_index() == 0


class _Filled(keras.initializers.Initializer):
    """``value`` everywhere, made where the variable lives (Keras's layout-aware protocol).

    Under ``keras.distribution`` Keras hands a layout-aware initializer the variable's
    layout; the value is then made on the devices by a compiled fill, never sent from the
    host. A host value is sent by ``jax.device_put``, which in a run of several processes
    checks that every process sends the same one, and NaN never equals NaN: a NaN-filled
    variable (kmix's "not measured yet") fails that check although every process holds it.
    """

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def __call__(self, shape: Any, dtype: Any = None, layout: Any = None) -> Any:
        shape, dtype = tuple(shape), keras.backend.standardize_dtype(dtype or "float32")
        if layout is None:
            return ops.full(shape, self.value, dtype)
        sharding = getattr(layout, "backend_layout", layout)
        value = self.value
        return jax.jit(lambda: jax.numpy.full(shape, value, dtype), out_shardings=sharding)()

    def get_config(self) -> dict:
        return {"value": self.value}


def constant_initializer(value: float) -> Any:
    """An initializer of ``value`` everywhere, made on the devices under a distribution.

    Args:
        value: the fill (NaN allowed: see :class:`_Filled`).
    """
    return _Filled(value)


def all_processes_agree(ok: bool) -> bool:
    """True when ``ok`` is True in every process of the run (one process: ``ok``).

    A collective over the processes: every process calls it at the same point (a
    callback's ``on_train_begin``), so a failure in one is known to all, which then
    fail together instead of one waiting for the other in the first step.
    """
    if jax.process_count() == 1:
        return bool(ok)
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(bool(ok), "int32"))))


def processes_and_devices() -> tuple[int, int] | None:
    """How many processes run the step, and on how many devices in all.

    The devices are those of ``keras.distribution``'s mesh when a distribution is set,
    else one (JAX runs the step on its default device).
    """
    distribution = keras.distribution.distribution()
    devices = 1 if distribution is None else int(distribution.device_mesh.devices.size)
    return jax.process_count(), devices


def reachable(value: Any) -> bool:
    """True if ``value`` can be used where the step is being built now.

    A tracer is usable while the trace that made it runs (a value noted by ``scale_loss``
    inside ``jax.value_and_grad`` is the enclosing ``jit``'s tracer, still live when
    ``stateless_apply`` runs); a concrete array always is. JAX has no public test for
    this: the tracer's ``_trace`` is asked whether it is still valid, and a value without
    one counts as usable.
    """
    trace = getattr(value, "_trace", None)
    is_valid = getattr(trace, "is_valid", None)
    return trace is None or is_valid is None or bool(is_valid())


def retrace_all(model: Any) -> None:
    """Makes ``model``'s train, evaluate and predict functions trace again at their next call.

    ``jax.jit`` caches traces by function identity, and Keras's functions jit the same
    methods again: JAX's caches are cleared (every jit in the process compiles again at
    its next call; kmix does this only when it moves a layer).
    """
    jax.clear_caches()
    retrace(model)


def int64_dtype() -> str:
    """The dtype kmix declares its int64 variables with: ``"int32"`` without x64.

    JAX without ``jax_enable_x64`` holds int64 values as int32 and warns at every
    creation, assignment and state sync, so kmix declares them int32 there. kmix's record
    computes in the dtype it is given and saturates at its end
    (:func:`kmix.record.step_record.int_max`); ``.keras`` files load across the two.
    """
    return "int64" if jax.config.read("jax_enable_x64") else "int32"


def exact_exponent(x: Any) -> Any:
    """``floor(log2(x))`` of positive finite float32 values, from their exponent bits."""
    bits = lax.bitcast_convert_type(ops.cast(x, "float32"), "int32")
    return lax.shift_right_arithmetic(bits, np.int32(23)) - np.int32(127)


def summed_rows(indices: Any, values: Any) -> Any:
    """Never called: gradients are dense on JAX (sparse slices are TensorFlow's)."""
    raise NotImplementedError("sparse gradient slices exist only on the TensorFlow backend")


def reduce_rows(columns: Sequence[Any], kinds: Sequence[str]) -> list[Any]:
    """Reduces ``[k, n]`` matrices along their rows in few reductions.

    A small stack's columns of one kind and dtype are stacked and reduced together (two
    reductions for XLA's runtime to set up, the copy under :data:`STACK_LIMIT`
    elements); a larger stack's are read in one pass by one variadic reduction (no copy;
    its reducer has a buffer per column and operand).
    """

    def combine(a: tuple, b: tuple) -> tuple:
        return tuple(
            x + y if kind == "sum" else jax.numpy.maximum(x, y)
            for x, y, kind in zip(a, b, kinds, strict=True)
        )

    # Statistics are never differentiated; JAX's derivative of a variadic reduction fails
    # where one is traced inside ``jax.value_and_grad`` (the forward pass's).
    columns = tuple(lax.stop_gradient(c) for c in columns)
    if math.prod(columns[0].shape) * len(columns) < STACK_LIMIT:
        return _stacked(columns, kinds)
    zeros = tuple(jax.numpy.zeros((), c.dtype) for c in columns)
    return list(lax.reduce(columns, zeros, combine, (1,)))


def _stacked(columns: Sequence[Any], kinds: Sequence[str]) -> list[Any]:
    """:func:`reduce_rows` of small columns: those of one kind and dtype stacked, reduced
    at once."""
    out: list[Any] = [None] * len(columns)
    together: dict[tuple, list[int]] = {}
    for i, (column, kind) in enumerate(zip(columns, kinds, strict=True)):
        together.setdefault((kind, keras.backend.standardize_dtype(column.dtype)), []).append(i)
    for (kind, _), members in together.items():
        stack = ops.stack([columns[i] for i in members], axis=1)  # [k, m, n]
        reduced = ops.sum(stack, axis=2) if kind == "sum" else ops.max(stack, axis=2, initial=0)
        for j, i in enumerate(members):
            out[i] = reduced[:, j]
    return out


def trace_root(outputs: Any) -> Any:
    """The outermost JAX trace ``outputs`` belong to (the ``jit``'s), or None if concrete.

    A forward pass traced under ``jax.value_and_grad`` inside ``jax.jit`` makes tracers of
    the gradient's trace, whose ``parent_trace`` chain ends at the ``jit``'s trace and
    then at JAX's evaluation trace; the last trace before that one names the step.
    """
    for x in keras.tree.flatten(outputs):
        trace = getattr(x, "_trace", None)
        if trace is None:
            continue
        while getattr(getattr(trace, "parent_trace", None), "parent_trace", None) is not None:
            trace = trace.parent_trace
        return trace
    return None


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.jit(fn)``: one dispatch a call (a trace per argument shapes)."""
    return jax.jit(fn)


def is_traced(outputs: Any) -> bool:
    """True when ``outputs`` are tracers of a live trace."""
    return trace_root(outputs) is not None


step_scope = no_step_scope
"""Nothing to open: the step is traced (the tap tells its pass by the trace)."""
