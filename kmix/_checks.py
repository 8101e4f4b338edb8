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


class KmixWarning(UserWarning):
    """The base of every warning kmix gives (``kmix.KmixWarning``).

    Silence kmix's warnings, or one kind of them, by category, never by their words::

        warnings.filterwarnings("ignore", category=kmix.KmixWarning)
    """


class NotFloat16Note(KmixWarning):
    """The model computes in another dtype than float16: float16's range statistics
    (headroom, underflow) are not measured, so not written."""


class SpeedWarning(KmixWarning):
    """A policy is measured to be slow on this machine (``kmix.use``)."""


class StateNotRestoredWarning(KmixWarning):
    """A skipped step cannot give some of the model's variables back (integer ones)."""


class KmixDeprecationWarning(KmixWarning, DeprecationWarning):
    """A kmix name that will be removed; the message names its replacement."""


def warn_user(message: str, category: type[Warning] = KmixWarning) -> None:
    """Warns, pointing at the user's code (the first frame outside Keras, TF, kmix).

    Args:
        message: what to say.
        category: a :class:`KmixWarning` subclass.
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in {
        "kmix",
        "keras",
        "tensorflow",
    }:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class WarnOnce:
    """Says each thing once: kmix's one memory of what it has warned about.

    Example::

        said = WarnOnce()
        said("kmix: ...", StateNotRestoredWarning, key=id(model))  # warns
        said("kmix: ...", StateNotRestoredWarning, key=id(model))  # says nothing
    """

    def __init__(self) -> None:
        self._said: set = set()

    def __call__(
        self, message: str, category: type[Warning] = KmixWarning, *, key: Any = None
    ) -> bool:
        """Warns with :func:`warn_user` unless ``key`` (default: the message) was said.

        Args:
            message: what to say.
            category: a :class:`KmixWarning` subclass.
            key: what counts as the same thing said again; default: ``message``.

        Returns:
            True when it warned now.
        """
        key = message if key is None else key
        if key in self._said:
            return False
        self._said.add(key)
        warn_user(message, category)
        return True

    def clear(self) -> None:
        """Forgets what was said."""
        self._said.clear()
