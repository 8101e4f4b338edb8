"""Memory ``kmix compare`` computes from a built model: its weights and one step's outputs.

Computed from shapes and dtypes, not measured (measured peaks come from
:mod:`kmix.compare.memory`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["activation_bytes", "weights_bytes"]


def weights_bytes(model: Any) -> int:
    """The bytes of the model's variables (trainable and not), in their own dtypes.

    Args:
        model: a built ``keras.Model``.

    Returns:
        The sum of every variable's elements times its dtype's size.
    """
    return sum(
        math.prod(variable.shape) * np.dtype(variable.dtype).itemsize for variable in model.weights
    )


def activation_bytes(model: Any, batch_size: int | None) -> int | None:
    """The bytes of every layer's output for one batch: what a step's forward pass keeps.

    From each layer's symbolic output shape and dtype (the compute dtype of a mixed
    policy); a functional or sequential model has them, a subclassed one may not.

    Args:
        model: a built ``keras.Model``.
        batch_size: examples per step; None when unknown.

    Returns:
        The bytes, or None when the batch size or a layer's output shape is unknown.
    """
    if not batch_size:
        return None
    total = 0
    try:
        layers = list(model.layers)
        for layer in layers:
            if type(layer).__name__ == "InputLayer":
                continue
            for output in _flat(layer.output):
                shape = tuple(output.shape)[1:]
                if any(size is None for size in shape):
                    return None
                total += batch_size * math.prod(shape) * np.dtype(output.dtype).itemsize
    except (AttributeError, ValueError, TypeError):
        return None
    return total if layers else None


def _flat(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [item for part in value.values() for item in _flat(part)]
    if isinstance(value, list | tuple):
        return [item for part in value for item in _flat(part)]
    return [value]
