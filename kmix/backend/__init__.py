"""The Keras backend kmix runs on, chosen once, and the primitives whose answer differs.

Keras reads ``KERAS_BACKEND`` once, when it is imported; this package asks Keras once,
when it is first imported, and binds the names below to the module of that backend
(:mod:`kmix.backend.tensorflow`, :mod:`kmix.backend.jax`, :mod:`kmix.backend.torch`;
:mod:`kmix.backend.generic` for a backend kmix's optimizer does not run on). Each module
defines the same names, as ``keras/src/backend/__init__.py`` does for Keras. Nothing else
in kmix asks which backend it runs on: a new backend is a module here (and a line in
``_MODULES``) and a step module in :mod:`kmix.optimizer`.

Also here, whatever the backend: TensorFlow's own tools that kmix uses (``tf.data`` for
``kmix compare``, ``tf.distribute`` for :class:`kmix.callbacks.LoopDriver`, device memory),
imported when called.
"""

from __future__ import annotations

import importlib
from typing import Any

import keras

from kmix.backend.common import STACK_LIMIT
from kmix.backend.tensorflow import (
    any_replica,
    compile_function,
    dataset_from_arrays,
    default_strategy,
    first_gpu,
    is_dataset,
    is_out_of_memory,
    peak_memory,
    reset_peak_memory,
)

SUPPORTED = ("tensorflow", "jax", "torch")
"""Backends kmix.LossScaleOptimizer runs on."""

_MODULES = {
    "tensorflow": "kmix.backend.tensorflow",
    "jax": "kmix.backend.jax",
    "torch": "kmix.backend.torch",
}

NAME: str = keras.backend.backend()
"""The Keras backend of this process, e.g. ``"tensorflow"`` or ``"jax"``."""

_active = importlib.import_module(_MODULES.get(NAME, "kmix.backend.generic"))

USES_TENSORFLOW: bool = _active.USES_TENSORFLOW
NOTES_CASTS: bool = _active.NOTES_CASTS
is_first_process = _active.is_first_process
all_processes_agree = _active.all_processes_agree
processes_and_devices = _active.processes_and_devices
constant_initializer = _active.constant_initializer
reachable = _active.reachable
rare_cond = _active.rare_cond
retrace_all = _active.retrace_all
host_value = _active.host_value
initialized = _active.initialized
compiled = _active.compiled
read_in_step = _active.read_in_step
replica_copies = _active.replica_copies
int64_dtype = _active.int64_dtype
exact_exponent = _active.exact_exponent
summed_rows = _active.summed_rows
reduce_rows = _active.reduce_rows
trace_root = _active.trace_root
is_traced = _active.is_traced
as_arrived = _active.as_arrived
set_random_seed = _active.set_random_seed
step_scope = _active.step_scope
divided = _active.divided
screened_nonfinite_flags = _active.screened_nonfinite_flags

__all__ = [
    "NAME",
    "NOTES_CASTS",
    "STACK_LIMIT",
    "SUPPORTED",
    "USES_TENSORFLOW",
    "all_processes_agree",
    "any_replica",
    "as_arrived",
    "check_single_process",
    "check_supported",
    "compile_function",
    "compiled",
    "constant_initializer",
    "dataset_from_arrays",
    "default_strategy",
    "divided",
    "exact_exponent",
    "first_gpu",
    "host_value",
    "initialized",
    "int64_dtype",
    "is_dataset",
    "is_first_process",
    "is_out_of_memory",
    "is_traced",
    "peak_memory",
    "processes_and_devices",
    "rare_cond",
    "reachable",
    "read_in_step",
    "reduce_rows",
    "replica_copies",
    "reset_peak_memory",
    "retrace_all",
    "screened_nonfinite_flags",
    "set_random_seed",
    "step_scope",
    "summed_rows",
    "trace_root",
    "worker_count",
]


def check_supported(owner: str) -> None:
    """Refuses a backend kmix cannot keep its promises on (one line, naming it).

    Args:
        owner: who asks, e.g. ``"kmix.LossScaleOptimizer"``.

    Raises:
        ValueError: the active backend is not one of :data:`SUPPORTED`.
    """
    if NAME not in SUPPORTED:
        raise ValueError(
            f"{owner} does not support the Keras backend {NAME!r} yet (it runs on "
            "'tensorflow', 'jax' and 'torch'): set KERAS_BACKEND to one of them before "
            "importing keras."
        )


def check_single_process(owner: str, error: type[ValueError] = ValueError) -> None:
    """Refuses a tool that trains, times and writes as one process, in a run of several.

    Args:
        owner: the tool, e.g. ``"kmix compare"``.
        error: the error to raise (a ``ValueError``).

    Raises:
        ValueError: ``keras.distribution`` runs more than one process here.
    """
    shape = processes_and_devices()
    if shape is None or shape[0] == 1:
        return
    raise error(
        f"{owner} is a single-process tool, but keras.distribution runs {shape[0]} "
        f"processes here ({shape[1]} devices): run it in one process, without "
        "keras.distribution.initialize(). To train across processes, use "
        "kmix.LossScaleOptimizer and kmix's callbacks in your own model.fit (README: "
        "'Across processes')."
    )


def worker_count(strategy: Any) -> int:
    """The number of tasks in a ``tf.distribute`` strategy's cluster; 1 without a cluster.

    Args:
        strategy: a ``tf.distribute`` strategy (MultiWorkerMirroredStrategy has a
            cluster resolver; single-process strategies have none or an empty one).

    Returns:
        The task count, at least 1.
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    tasks = resolver.cluster_spec().as_dict().values()
    return max(sum(len(t) for t in tasks), 1)
