"""kmix: safe and visible Keras mixed-precision training.

Example:
    >>> import kmix, keras
    >>> kmix.use("mixed_float16")                                   # doctest: +SKIP
    >>> opt = kmix.LossScaleOptimizer(keras.optimizers.Adam(1e-3))  # doctest: +SKIP

Public names are imported on first use, so that ``import kmix`` (and the ``kmix``
command's ``--help``) does not load TensorFlow until a name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_PUBLIC = {
    "LossScaleOptimizer": "kmix.optimizer",
    "ScaleEvent": "kmix.optimizer",
    "use": "kmix.policy",
    "policy_scope": "kmix.policy",
    "PolicyChoice": "kmix.policy",
    "hardware": "kmix.hardware",
    "Hardware": "kmix.hardware",
    "audit": "kmix.audit",
    "AuditReport": "kmix.audit",
    "callbacks": "kmix.callbacks",
}

__all__ = [*_PUBLIC, "__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from kmix import callbacks
    from kmix.audit import AuditReport, audit
    from kmix.hardware import Hardware, hardware
    from kmix.optimizer import LossScaleOptimizer, ScaleEvent
    from kmix.policy import PolicyChoice, policy_scope, use


def __getattr__(name: str) -> Any:
    module_name = _PUBLIC.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kmix' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"kmix.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
