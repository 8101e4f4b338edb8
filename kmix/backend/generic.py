"""The backend primitives for a Keras backend kmix's optimizer does not run on (numpy, openvino).

kmix's callbacks still read a stock Keras loss-scale optimizer there; what only kmix's
optimizer needs (:func:`exact_exponent`, :func:`reduce_rows`, ...) raises, and
:func:`kmix.backend.check_supported` refuses the optimizer before any of it is called.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from kmix.backend.common import (
    alone_agrees,
    no_step_scope,
    numpy_value,
    reduce_each,
    retrace,
    unchanged,
)
from kmix.backend.common import constant_initializer as constant

USES_TENSORFLOW = False
"""Keras utilities that import TensorFlow would load it only for them."""

constant_initializer = constant
"""An initializer of ``value`` everywhere: ``keras.initializers.Constant``."""

all_processes_agree = alone_agrees
"""``ok`` as given: kmix counts no processes here (:func:`processes_and_devices`)."""

NOTES_CASTS = False
"""No tap runs here (the optimizer is refused)."""


def processes_and_devices() -> tuple[int, int] | None:
    """None: not known here."""
    return None


def is_first_process() -> bool:
    """True: one process."""
    return True


def reachable(value: Any) -> bool:
    """True: eager values are always usable."""
    return True


def rare_cond(pred: Any, true_fn: Any, false_fn: Any) -> Any:
    """``keras.ops.cond``."""
    return ops.cond(pred, true_fn, false_fn)


def int64_dtype() -> str:
    """``"int64"``."""
    return "int64"


def _unsupported(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        f"kmix's optimizer does not run on the Keras backend {keras.backend.backend()!r}"
    )


exact_exponent = summed_rows = _unsupported
retrace_all, reduce_rows, host_value, as_arrived = retrace, reduce_each, numpy_value, unchanged


def trace_root(outputs: Any) -> Any:
    """None: no trace is recorded."""
    return None


def is_traced(outputs: Any) -> bool:
    """False: no trace is recorded."""
    return False


def set_random_seed(seed: int) -> None:
    """``keras.utils.set_random_seed``."""
    keras.utils.set_random_seed(seed)


step_scope = no_step_scope
"""Nothing to open: no step of kmix's runs here."""
