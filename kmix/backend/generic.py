"""The backend primitives for a Keras backend kmix's optimizer does not run on (numpy, openvino).

kmix's callbacks still read a stock Keras loss-scale optimizer there; what only kmix's
optimizer needs (:func:`exact_exponent`, :func:`reduce_rows`, ...) raises, and
:func:`kmix.backend.check_supported` refuses the optimizer before any of it is called.
"""

from __future__ import annotations

from typing import Any

import keras

from kmix.backend.common import (
    alone_agrees,
    always_initialized,
    always_reachable,
    as_one_copy,
    as_written,
    divide_each,
    keras_cond,
    new_read,
    no_step_scope,
    not_counted,
    not_screened,
    numpy_value,
    one_process,
    reduce_each,
    retrace,
    unchanged,
)
from kmix.backend.common import constant_initializer as constant_initializer  # the name, bound here

divided, screened_nonfinite_flags = divide_each, not_screened
"""The unscale one op at a time; no finite screen (the step decides in the graph)."""

compiled = as_written
"""Run as written: kmix knows no compiler of this backend."""

USES_TENSORFLOW = False
"""Keras utilities that import TensorFlow would load it only for them."""

processes_and_devices, is_first_process = not_counted, one_process
"""Not counted; the first: one process."""

reachable, rare_cond = always_reachable, keras_cond
"""Eager values are always usable; ``keras.ops.cond``."""

all_processes_agree = alone_agrees
"""``ok`` as given: kmix counts no processes here (:func:`processes_and_devices`)."""

NOTES_CASTS = False
"""No tap runs here (the optimizer is refused)."""


def int64_dtype() -> str:
    """``"int64"``."""
    return "int64"


def _unsupported(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        f"kmix's optimizer does not run on the Keras backend {keras.backend.backend()!r}"
    )


exact_exponent = summed_rows = _unsupported
retrace_all, reduce_rows, host_value, as_arrived = retrace, reduce_each, numpy_value, unchanged
initialized, read_in_step, replica_copies = always_initialized, new_read, as_one_copy


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
