"""Argument checks and user warnings shared by kmix's public classes.

Every error names the argument, echoes the value and says what is valid, e.g.
"Invalid `patience` for kmix.callbacks.LossScaleGuard: patience=0. `patience` must be
an integer >= 1."
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np


def invalid(owner: str, name: str, value: Any, valid: str) -> ValueError:
    """Returns the ValueError for argument ``name`` of ``owner`` holding ``value``."""
    return ValueError(f"Invalid `{name}` for {owner}: {name}={value!r}. `{name}` must be {valid}.")


def check_int(owner: str, name: str, value: Any, low: int) -> int:
    """Returns ``value`` as an int if it is an integer ``>= low`` (bools are not).

    Raises:
        ValueError: otherwise, naming the argument and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise invalid(owner, name, value, f"an integer >= {low}")
    return int(value)


def check_real(
    owner: str,
    name: str,
    value: Any,
    low: float,
    high: float,
    valid: str | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
) -> float:
    """Returns ``value`` as a float if it is a finite number between ``low`` and ``high``.

    Args:
        owner, name, value: the class, the argument and what the user passed.
        low, high: the bounds, inclusive unless ``open_low`` / ``open_high``.
        valid: what the message says is valid; default: the interval.

    Raises:
        ValueError: otherwise, naming the argument and the value.
    """
    try:
        ok = (
            not isinstance(value, bool)
            and isinstance(value, int | float | np.number)
            and math.isfinite(value)
            and (low < value if open_low else low <= value)
            and (value < high if open_high else value <= high)
        )
    except OverflowError:  # an int too large for a float, e.g. 10**400
        ok = False
    if not ok:
        interval = f"{'(' if open_low else '['}{low:.9g}, {high:.9g}{')' if open_high else ']'}"
        raise invalid(owner, name, value, valid or f"a finite number in {interval}")
    return float(value)


def check_choice(owner: str, name: str, value: Any, choices: dict[Any, str]) -> Any:
    """Returns ``value`` if it is one of ``choices`` (a dict: choice -> what it means).

    Raises:
        ValueError: otherwise, naming the argument, the value and every choice.
    """
    if isinstance(value, bool) or value not in choices:
        valid = " or ".join(f"{choice!r} ({meaning})" for choice, meaning in choices.items())
        raise invalid(owner, name, value, valid)
    return value


def warn_user(message: str) -> None:
    """Warns once, pointing at the user's code (the first frame outside Keras, TF, kmix)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in {
        "kmix",
        "keras",
        "tensorflow",
    }:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)
