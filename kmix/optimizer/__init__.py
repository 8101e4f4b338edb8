"""kmix.LossScaleOptimizer and what it runs: the class, its step on each backend, its hooks.

- :mod:`~kmix.optimizer.loss_scale_optimizer`: the class (Keras glue).
- :mod:`~kmix.optimizer.config`: its validated arguments and run-time settings.
- :mod:`~kmix.optimizer.recorder`: the step record's optimizer variables and host reads.
- :mod:`~kmix.optimizer.tensorflow_step` and :mod:`~kmix.optimizer.jax_step`: one step
  module per backend, side by side, each running :func:`kmix.record.advance_record`.
- :mod:`~kmix.optimizer.jax_train_function`: ``fit``'s train function on JAX while
  the forward pass is tapped.
- :mod:`~kmix.optimizer.model_hooks` and :mod:`~kmix.optimizer.tap`: what the optimizer
  attaches to the model it trains; :mod:`~kmix.optimizer.trace`: what one traced step
  leaves between them.

Code outside this folder imports these names from ``kmix.optimizer``.
"""

from __future__ import annotations

import warnings
from typing import Any

from kmix._checks import KmixDeprecationWarning
from kmix.optimizer.config import OptimizerConfig
from kmix.optimizer.loss_scale_optimizer import LossScaleOptimizer
from kmix.record import Snapshot
from kmix.tags import ScaleEvent

__all__ = ["LossScaleOptimizer", "OptimizerConfig", "ScaleEvent", "Snapshot"]

_MOVED = {"INT64_MAX": "kmix.record.INT64_MAX", "RecordedEvent": "kmix.record.RecordedEvent"}
"""Names ``kmix.optimizer`` held in kmix 0.1.0 that live elsewhere now."""


def __getattr__(name: str) -> Any:
    """The 0.1.0 names, with a :class:`kmix.KmixDeprecationWarning` (removed in 0.2)."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"kmix.optimizer.{name} is deprecated and removed in kmix 0.2: use {_MOVED[name]}.",
        KmixDeprecationWarning,
        stacklevel=2,
    )
    from kmix import record

    return getattr(record, name)
