"""The backend primitives for a Keras backend kmix's optimizer does not run on (torch).

kmix's callbacks still read a stock Keras loss-scale optimizer there; what only kmix's
optimizer needs (:func:`exact_exponent`, :func:`reduce_rows`, ...) raises, and
:func:`kmix.backend.check_supported` refuses the optimizer before any of it is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

USES_TENSORFLOW = False
"""Keras utilities that import TensorFlow would load it only for them."""

NOTES_CASTS = False
"""No tap runs here (the optimizer is refused)."""


def is_first_process() -> bool:
    """True: one process."""
    return True


def reachable(value: Any) -> bool:
    """True: eager values are always usable."""
    return True


def rare_cond(pred: Any, true_fn: Any, false_fn: Any) -> Any:
    """``keras.ops.cond``."""
    return ops.cond(pred, true_fn, false_fn)


def retrace_all(model: Any) -> None:
    """Makes ``model``'s train, evaluate and predict functions trace again at their next call."""
    model.make_train_function(force=True)
    model.test_function = model.predict_function = None


def host_value(variable: Any) -> np.ndarray:
    """A Keras variable's value on the host."""
    return np.asarray(ops.convert_to_numpy(variable))


def int64_dtype() -> str:
    """``"int64"``."""
    return "int64"


def _unsupported(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        f"kmix's optimizer does not run on the Keras backend {keras.backend.backend()!r}"
    )


def reduce_rows(columns: Sequence[Any], kinds: Sequence[str]) -> list[Any]:
    """Reduces ``[k, n]`` matrices along their rows, one ``keras.ops`` reduction each."""
    return [
        ops.sum(c, axis=1) if kind == "sum" else ops.max(c, axis=1, initial=0)
        for c, kind in zip(columns, kinds, strict=True)
    ]


exact_exponent = summed_rows = _unsupported


def trace_root(outputs: Any) -> Any:
    """None: no trace is recorded."""
    return None


def is_traced(outputs: Any) -> bool:
    """False: no trace is recorded."""
    return False


def as_arrived(tensor: Any) -> Any:
    """``tensor`` as it is."""
    return tensor


def set_random_seed(seed: int) -> None:
    """``keras.utils.set_random_seed``."""
    keras.utils.set_random_seed(seed)
