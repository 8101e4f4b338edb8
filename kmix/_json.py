"""Values made ready for strict JSON: kmix's one sanitiser (a leaf: no kmix imports)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def json_ready(value: Any) -> Any:
    """A value ``json.dumps(..., allow_nan=False)`` accepts and round-trips.

    Containers are walked: dict keys become strings, tuples and NumPy arrays lists, NumPy
    scalars Python numbers, and non-finite floats (NaN, inf) None: JSON has none of them,
    and a statistic that was not a number is shown as absent.

    Args:
        value: a JSON-like value (``dataclasses.asdict`` output, NumPy values inside).

    Returns:
        The value, ready.
    """
    if isinstance(value, dict):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    if isinstance(value, np.ndarray):
        return json_ready(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
