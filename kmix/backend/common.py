"""What every backend module shares: a size, and the primitives plain ``keras.ops`` answer.

A leaf of the backend package: each backend module binds from here what needs nothing of
its own library, so the face's names mean one thing wherever they agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

STACK_LIMIT = 1 << 16
"""Elements from which a tensor is measured alone rather than stacked with others of its
shape (:mod:`kmix.record.grouped`), and below which JAX stacks a reduction's columns
(:func:`kmix.backend.jax.reduce_rows`): a stack is a copy, cheap only when small."""


def reduce_each(columns: Sequence[Any], kinds: Sequence[str]) -> list[Any]:
    """Reduces ``[k, n]`` matrices along their rows, one ``keras.ops`` reduction each:
    ``"sum"``, or ``"max"`` from 0 (magnitudes)."""
    return [
        ops.sum(c, axis=1) if kind == "sum" else ops.max(c, axis=1, initial=0)
        for c, kind in zip(columns, kinds, strict=True)
    ]


def alone_agrees(ok: bool) -> bool:
    """``ok``: one process agrees with itself (a backend whose processes are not counted)."""
    return bool(ok)


def retrace(model: Any) -> None:
    """Makes ``model``'s train, evaluate and predict functions trace again at their next call."""
    model.make_train_function(force=True)
    model.test_function = model.predict_function = None


def numpy_value(variable: Any) -> np.ndarray:
    """A Keras variable's value on the host, through Keras."""
    return np.asarray(ops.convert_to_numpy(variable))


def new_read(variable: Any) -> Any:
    """``variable``'s value as a tensor (a read where the backend has reads)."""
    return ops.convert_to_tensor(variable)


def as_one_copy(variables: Sequence[Any]) -> list[list[Any]]:
    """``[variables]``: each variable is one copy (nothing here keeps one per replica)."""
    return [list(variables)]


def as_written(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` itself, run op by op (the generic backend)."""
    return fn


def always_initialized(variable: Any) -> bool:
    """True: eager backends give a variable its value when they create it."""
    return True


def not_counted() -> tuple[int, int] | None:
    """None: the processes and devices that run the step are not counted here."""
    return None


def one_process() -> bool:
    """True: this process is the first (and, here, the only one kmix tells apart)."""
    return True


def always_reachable(value: Any) -> bool:
    """True: eager values are always usable."""
    return True


def keras_cond(pred: Any, true_fn: Any, false_fn: Any) -> Any:
    """``keras.ops.cond`` (eagerly, a Python ``if`` on the predicate: a host read)."""
    return ops.cond(pred, true_fn, false_fn)


def no_step_scope() -> contextlib.AbstractContextManager:
    """The block of one train step, where the step is traced (nothing to open)."""
    return contextlib.nullcontext()


def constant_initializer(value: float) -> Any:
    """An initializer of ``value`` everywhere: ``keras.initializers.Constant``."""
    return keras.initializers.Constant(value)


def unchanged(tensor: Any) -> Any:
    """``tensor`` as it is (where a cast's input is not read back from a graph)."""
    return tensor


def seed_without_tensorflow(seed: int) -> None:
    """Seeds Python, NumPy and Keras as ``keras.utils.set_random_seed`` does, without
    importing TensorFlow (Keras's function seeds TensorFlow too, for ``tf.data``).

    Keras's lazy handle on TensorFlow is told, for the call, that TensorFlow is absent;
    once TensorFlow is imported anyway, or where that handle is not as expected (another
    Keras version), Keras's function runs as is.
    """
    import sys

    if "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    try:
        from keras.src.utils import rng_utils

        handle = rng_utils.tf
        was = handle._available
    except (ImportError, AttributeError):
        keras.utils.set_random_seed(seed)
        return
    handle._available = False
    try:
        keras.utils.set_random_seed(seed)
    finally:
        handle._available = was


def divide_each(values: list[Any], divisor: Any) -> list[Any]:
    """Each value divided by ``divisor``, one ``keras.ops.divide`` each (the unscale).

    Args:
        values: tensors; divisor: the loss scale.

    Returns:
        One tensor per value.
    """
    return [ops.divide(v, divisor) for v in values]


def not_screened(values: list[Any]) -> Any:
    """Never called: only an eager step (torch) screens its finite check before its read.

    Raises:
        NotImplementedError: always (a traced step decides in its graph).
    """
    raise NotImplementedError("the finite screen is for an eager step (Keras's torch backend)")
