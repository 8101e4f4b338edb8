"""kmix's primitives on Keras's torch backend (the names every backend module has).

torch is imported here when this module is (Keras's torch backend has imported it
already); nothing here imports TensorFlow. On torch ``fit`` runs each step eagerly (or
through ``torch.compile`` with ``jit_compile=True``): there is no trace to tell a train
step's forward pass from any other call, so kmix's torch step opens one
(:func:`step_scope`) around each train step, and the tap records the calls made in it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from keras import ops

from kmix.backend.common import (
    alone_agrees,
    always_initialized,
    always_reachable,
    as_one_copy,
    keras_cond,
    new_read,
    not_counted,
    numpy_value,
    one_process,
    reduce_each,
    retrace,
    seed_without_tensorflow,
    unchanged,
)
from kmix.backend.common import constant_initializer as constant_initializer  # the name, bound here


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run op by op (eager ops are cheap one by one), without autograd: what kmix
    compiles is a host read, never differentiated, so reading trainable parameters
    through it records no graph to throw away."""

    def call(*args: Any) -> Any:
        with torch.no_grad():
            return fn(*args)

    return call


USES_TENSORFLOW = False
"""Keras utilities that import TensorFlow (its TensorBoard callback, its seeding) would
load it only for them: kmix avoids them here."""

processes_and_devices, is_first_process = not_counted, one_process
"""Not counted; the first: kmix on torch runs in one process."""

reachable, rare_cond = always_reachable, keras_cond
"""Eager values are always usable; a conditional is a Python ``if`` (a host read)."""

all_processes_agree = alone_agrees
"""``ok`` as given: kmix counts no processes here (:func:`processes_and_devices`)."""

NOTES_CASTS = True
"""Eager torch keeps no graph to read a cast's input back from: the tap notes each cast
down to float16 as it is made (:func:`as_arrived` then returns what it is given)."""

host_value = numpy_value
"""A Keras variable's value on the host (a sync with the device)."""

initialized = always_initialized
"""True: variables get their value when they are created."""

replica_copies = as_one_copy
"""One copy of each variable: kmix on torch runs on one device."""

read_in_step = new_read
"""A new read: values here are not a graph to find an earlier read in."""

as_arrived = unchanged
"""``tensor``: on torch the tap notes casts as they are made (:data:`NOTES_CASTS`)."""

retrace_all = retrace
"""Makes ``model``'s train, evaluate and predict functions be made again at their next call
(eager steps hold no trace; a ``torch.compile``-d one compiles again)."""

reduce_rows = reduce_each
"""Reduces ``[k, n]`` matrices along their rows, one reduction each."""

set_random_seed = seed_without_tensorflow
"""Seeds Python, NumPy and Keras (torch's generator included) without importing TensorFlow."""

_STEP: contextvars.ContextVar[object | None] = contextvars.ContextVar("kmix_torch_step")


@contextlib.contextmanager
def step_scope() -> Iterator[None]:
    """The block of one train step: the layer calls made in it are one step's pass.

    Each block is a new step (:func:`trace_root`), so records of an earlier call of the
    model (outside ``fit``, or a step that raised) are never taken for this one's.
    """
    token = _STEP.set(object())
    try:
        yield
    finally:
        _STEP.reset(token)


def int64_dtype() -> str:
    """``"int32"``: Keras's ops on torch compute two int64 operands in int32.

    ``keras.ops.minimum`` of two int64 tensors is int32 there (Keras's type promotion
    maps int64 to int32 on every backend but TensorFlow), so a counter near the int64
    maximum would wrap. kmix declares its counters int32, as on JAX without x64; the
    record saturates at the end of the dtype it is given
    (:func:`kmix.record.step_record.int_max`), and ``.keras`` files load across the two.
    """
    return "int32"


def exact_exponent(x: Any) -> Any:
    """``floor(log2(x))`` of positive finite float32 values, from their exponent bits."""
    bits = ops.cast(x, "float32").contiguous().view(torch.int32)
    return torch.bitwise_right_shift(bits, 23) - 127


def screened_nonfinite_flags(values: list[Any]) -> Any:
    """float32 flags, 0.0 for each tensor proven finite, 1.0 for one that may not be.

    One ``torch._foreach_norm`` over all of them (float32 accumulation; float64 tensors in
    a second call, in float64): a finite L2 norm proves every element finite; an inf or NaN
    makes it non-finite. So does a finite tensor whose squares overflow (|values| near 1e19
    in float32): a flag here is only a suspicion, which the exact check
    (:func:`kmix.record.nonfinite_flags`) settles. A quarter to a tenth of the exact check's
    time on a CPU (measured in ``bench/history/2026-12-02-torch.md``).

    Args:
        values: tensors (or arrays), or None; None and integer tensors count as finite.

    Returns:
        A float32 vector, one entry per value.
    """
    tensors = [v if v is None or torch.is_tensor(v) else ops.convert_to_tensor(v) for v in values]
    rows = [i for i, t in enumerate(tensors) if t is not None and t.is_floating_point()]
    wide = [i for i in rows if tensors[i].dtype == torch.float64]
    if rows and len(rows) == len(values) and not wide:  # the common case: float32 gradients
        return _suspected(tensors, torch.float32)
    device = tensors[rows[0]].device if rows else None
    flags = torch.zeros(len(values), dtype=torch.float32, device=device)
    for group, dtype in (
        ([i for i in rows if i not in wide], torch.float32),
        (wide, torch.float64),
    ):
        if group:
            flags[group] = _suspected([tensors[i] for i in group], dtype)
    return flags


def _suspected(tensors: list[Any], dtype: torch.dtype) -> Any:
    """1.0 where a tensor's L2 norm, accumulated in ``dtype``, is not finite (float32)."""
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=dtype))
    return torch.logical_not(torch.isfinite(norms)).to(torch.float32)


def divided(values: list[Any], divisor: Any) -> list[Any]:
    """Each value divided by the float32 scalar ``divisor``, as ``keras.ops.divide`` gives it.

    The float32 tensors (every gradient of a mixed-precision model's float32 variables) in
    one ``torch._foreach_div``: the same division, element by element; any other (another
    dtype, a NumPy array) through ``keras.ops.divide``, as stock Keras divides.

    Args:
        values: tensors (or arrays).
        divisor: a float32 scalar (the loss scale).

    Returns:
        One tensor per value.
    """
    divisor = ops.convert_to_tensor(divisor)
    fast = [i for i, v in enumerate(values) if torch.is_tensor(v) and v.dtype == divisor.dtype]
    quotients = torch._foreach_div([values[i] for i in fast], divisor) if fast else []
    found = dict(zip(fast, quotients, strict=True))
    return [found[i] if i in found else ops.divide(v, divisor) for i, v in enumerate(values)]


def summed_rows(indices: Any, values: Any) -> Any:
    """Never called: gradients are dense on torch (sparse slices are TensorFlow's)."""
    raise NotImplementedError("sparse gradient slices exist only on the TensorFlow backend")


def trace_root(outputs: Any) -> Any:
    """The train step open in this context (:func:`step_scope`), or None outside one."""
    return _STEP.get(None)


def is_traced(outputs: Any) -> bool:
    """True inside a train step (:func:`step_scope`)."""
    return _STEP.get(None) is not None
