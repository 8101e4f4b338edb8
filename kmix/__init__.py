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
    "ScaleEvent": "kmix.tags",
    "Float8Saturation": "kmix.tags",
    "callbacks": "kmix.callbacks",
    "PolicyComparison": "kmix.compare",
    "PolicyRow": "kmix.compare",
    "compare_policies": "kmix.compare",
}

# Light modules (no TensorFlow at import) are imported now.
from kmix._checks import (  # noqa: E402
    KmixDeprecationWarning,
    KmixWarning,
    NotFloat16Note,
    SpeedWarning,
    StateNotRestoredWarning,
)
from kmix.policy import (  # noqa: E402
    AuditReport,
    Hardware,
    PolicyChoice,
    audit,
    hardware,
    policy_scope,
    use,
)
from kmix.precision_plan import PrecisionMove, PrecisionPlan, apply_plan  # noqa: E402

if "keras" in __import__("sys").modules:  # costs nothing more once Keras is loaded
    # Registers kmix.LossScaleOptimizer, so `keras.models.load_model` finds it in a
    # .keras file after a plain `import kmix` (Keras imports no module to find a class).
    importlib.import_module("kmix.optimizer")

__all__ = [
    *_PUBLIC,
    "AuditReport",
    "Hardware",
    "KmixDeprecationWarning",
    "KmixWarning",
    "NotFloat16Note",
    "PolicyChoice",
    "PrecisionMove",
    "PrecisionPlan",
    "SpeedWarning",
    "StateNotRestoredWarning",
    "__version__",
    "apply_plan",
    "audit",
    "hardware",
    "policy_scope",
    "use",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from kmix import callbacks  # noqa: F401
    from kmix.compare import PolicyComparison, PolicyRow, compare_policies  # noqa: F401
    from kmix.optimizer import LossScaleOptimizer  # noqa: F401
    from kmix.tags import Float8Saturation, ScaleEvent  # noqa: F401


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
