"""Headroom forecasts while training: say, before the NaN, when float16's max is near.

The fit is the report's (:func:`kmix.report.summary.forecast_zero_crossing`), applied to
what the callbacks read at each health step, so the warning comes during the run.
"""

from __future__ import annotations

import numpy as np

from kmix.report import HEADROOM_WARN_BITS, forecast_zero_crossing

HISTORY = 128
"""Readings kept per series (the fit uses the latest half, see the report's rule)."""


def headroom_series(
    health: dict[str, float], layers: dict[str, dict[str, float]]
) -> dict[str, float]:
    """Series name -> headroom (bits) of one health step: each layer's activations.

    The gradients' headroom is not forecast: under dynamic loss scaling it falls toward 0
    and bounces back on every run, healthy ones too (the scale grows until the largest
    gradient nears float16's max, then backs off): that is the scale doing its job.

    Args:
        health: a snapshot's health (unused: the gradients' headroom is not forecast).
        layers: layer path -> activation statistics (``headroom_bits``).
    """
    series = {}
    for path, values in layers.items():
        if "headroom_bits" in values:  # float16 outputs only
            series[f"activations of {path}"] = values["headroom_bits"]
    return series


class HeadroomForecast:
    """Collects headroom per series and tells, once per series, when it will run out."""

    def __init__(self) -> None:
        self._points: dict[str, list[tuple[int, float]]] = {}
        self._told: set[str] = set()

    def add(self, step: int, series: dict[str, float]) -> list[str]:
        """Adds one health step's headroom values.

        Args:
            step: the step they were measured at.
            series: series name -> headroom in bits (see :func:`headroom_series`).

        Returns:
            A message for each series newly forecast to reach 0 bits (float16's max)
            at its current rate (the report's rule, :func:`forecast_zero_crossing`,
            horizon included); series already below the warning line are left to
            the headroom warnings.
        """
        messages = []
        for name, bits in series.items():
            points = self._points.setdefault(name, [])
            points.append((step, bits))
            del points[:-HISTORY]
            if name in self._told or not bits >= HEADROOM_WARN_BITS:
                continue
            steps, values = np.asarray(points, dtype=np.float64).T
            fit = forecast_zero_crossing(steps, values)
            if fit is None:
                continue
            zero, slope, fitted = fit
            self._told.add(name)
            messages.append(
                f"headroom of the {name} is falling steadily ({bits:.2f} bits at step {step}, "
                f"{-1000 * slope:.4g} bits lost per 1000 steps over the last {fitted} "
                f"readings): at this rate it reaches 0 bits (float16's maximum, 65504) at "
                f"about step {int(round(zero))}"
            )
        return messages
