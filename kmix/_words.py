"""Small wording helpers shared by every module that writes words (a leaf: no kmix imports)."""

from __future__ import annotations

import math


def format_scale(scale: float | None) -> str:
    """Formats a loss scale, naming powers of two: ``32768 (2^15)``.

    Args:
        scale: the scale, or None when unknown.

    Returns:
        The text.
    """
    if scale is None:
        return "n/a"
    mantissa, exponent = math.frexp(scale)
    power = f" (2^{exponent - 1})" if mantissa == 0.5 else ""
    return f"{scale:.9g}{power}"


def plural(count: int, word: str) -> str:
    """``"1 variable"``, ``"3 variables"``."""
    return f"{count} {word}" + ("" if count == 1 else "s")


def percent(fraction: float) -> str:
    """A share as a short percentage: one decimal below 10%."""
    return f"{100 * fraction:.1f}%" if fraction < 0.1 else f"{100 * fraction:.0f}%"


def steps_list(steps: list[int], limit: int = 5) -> str:
    """The first ``limit`` steps, and how many more."""
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f" and {len(steps) - limit} more" if len(steps) > limit else "")
