"""Keras callbacks that show and guard mixed-precision training.

Example:
    >>> import kmix
    >>> callbacks = [                                            # doctest: +SKIP
    ...     kmix.callbacks.MixedPrecisionMonitor("runs/exp1"),
    ...     kmix.callbacks.LossScaleGuard(),
    ... ]
"""

from __future__ import annotations

from kmix.callbacks.autopilot import PrecisionAutopilot
from kmix.callbacks.guard import LossScaleGuard, LossScaleGuardError
from kmix.callbacks.loop import LoopDriver
from kmix.callbacks.monitor import MixedPrecisionMonitor

__all__ = [
    "LoopDriver",
    "LossScaleGuard",
    "LossScaleGuardError",
    "MixedPrecisionMonitor",
    "PrecisionAutopilot",
]
