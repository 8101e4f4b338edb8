"""kmix.LossScaleOptimizer's own arguments (validated) and its run-time settings."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import keras
import numpy as np
from keras import ops

from kmix import record
from kmix._checks import KmixWarning, check_int, check_real, invalid
from kmix.backend import int64_dtype

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
OWNER = "kmix.LossScaleOptimizer"
"""The name errors about the optimizer's arguments give."""


def invalid_argument(name: str, value: Any, valid: str) -> ValueError:
    """The optimizer's error for an invalid argument (see :func:`kmix._checks.invalid`)."""
    return invalid(OWNER, name, value, valid)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """kmix's own arguments of :class:`LossScaleOptimizer`, validated on creation.

    Attributes:
        rule: the scale rule's constants (:class:`kmix.record.ScaleConfig`).
        initial_scale: the starting scale, in ``[min_scale, max_scale]``.
        health_every: steps between gradient health statistics, >= 1.
        histogram_every: steps between exponent histograms, 0 for never.
        event_capacity: events the in-graph ring keeps, >= 1.

    Raises:
        ValueError: an argument is outside its range (the message names it).
    """

    rule: record.ScaleConfig
    initial_scale: float
    health_every: int
    histogram_every: int
    event_capacity: int

    def __post_init__(self) -> None:
        rule = self.rule
        # The scale is a float32 variable: its bounds must be float32 normal numbers.
        min_scale = check_real(
            OWNER,
            "min_scale",
            rule.min_scale,
            FLOAT32_TINY,
            FLOAT32_MAX,
            f"a number in [{FLOAT32_TINY:.9g}, {FLOAT32_MAX:.9g}] (the scale is float32)",
        )
        max_scale = check_real(
            OWNER,
            "max_scale",
            rule.max_scale,
            min_scale,
            FLOAT32_MAX,
            f"a number in [min_scale, {FLOAT32_MAX:.9g}] = [{min_scale:.9g}, "
            f"{FLOAT32_MAX:.9g}] (the scale is float32)",
        )
        checked = {
            "initial_scale": check_real(
                OWNER,
                "initial_scale",
                self.initial_scale,
                min_scale,
                max_scale,
                f"a finite number in [min_scale, max_scale] = [{min_scale}, {max_scale}]",
            ),
            "health_every": check_int(OWNER, "health_every", self.health_every, 1),
            "histogram_every": check_int(OWNER, "histogram_every", self.histogram_every, 0),
            "event_capacity": check_int(OWNER, "event_capacity", self.event_capacity, 1),
            "rule": dataclasses.replace(
                rule,
                min_scale=min_scale,
                max_scale=max_scale,
                growth_factor=check_real(
                    OWNER,
                    "growth_factor",
                    rule.growth_factor,
                    1.0,
                    math.inf,
                    "a finite number > 1",
                    open_low=True,
                ),
                backoff_factor=check_real(
                    OWNER,
                    "backoff_factor",
                    rule.backoff_factor,
                    0.0,
                    1.0,
                    open_low=True,
                    open_high=True,
                ),
                growth_steps=check_int(OWNER, "dynamic_growth_steps", rule.growth_steps, 1),
                hysteresis=check_int(OWNER, "hysteresis", rule.hysteresis, 1),
                backoff_on_forward_overflow=check_bool(
                    "backoff_on_forward_overflow", rule.backoff_on_forward_overflow
                ),
            ),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_arguments(cls, **arguments: Any) -> OptimizerConfig:
        """Validates the optimizer's constructor arguments (the inverse of :meth:`arguments`).

        Args:
            **arguments: the constructor's keyword arguments (``initial_scale``,
                ``dynamic_growth_steps`` and the names :meth:`arguments` returns).

        Returns:
            The validated config.

        Raises:
            ValueError: an argument is outside its range (the message names it).
        """
        rule_names = ("growth_factor", "backoff_factor", "hysteresis", "min_scale", "max_scale")
        return cls(
            rule=record.ScaleConfig(
                growth_steps=arguments["dynamic_growth_steps"],
                backoff_on_forward_overflow=arguments["backoff_on_forward_overflow"],
                **{name: arguments[name] for name in rule_names},
            ),
            initial_scale=arguments["initial_scale"],
            health_every=arguments["health_every"],
            histogram_every=arguments["histogram_every"],
            event_capacity=arguments["event_capacity"],
        )

    def arguments(self) -> dict[str, Any]:
        """kmix's constructor arguments beyond Keras's own, for ``get_config``.

        Returns:
            Argument name -> value (JSON-ready).
        """
        rule = self.rule
        return {
            "growth_factor": rule.growth_factor,
            "backoff_factor": rule.backoff_factor,
            "hysteresis": rule.hysteresis,
            "min_scale": rule.min_scale,
            "max_scale": rule.max_scale,
            "health_every": self.health_every,
            "histogram_every": self.histogram_every,
            "event_capacity": self.event_capacity,
            "backoff_on_forward_overflow": rule.backoff_on_forward_overflow,
        }


def check_bool(name: str, value: Any) -> bool:
    """Returns ``value`` as a bool if it is True or False (NumPy's included).

    Raises:
        ValueError: otherwise, naming the argument and the value.
    """
    if not isinstance(value, bool | np.bool_):
        raise invalid_argument(name, value, "True or False")
    return bool(value)


class RunSettings:
    """Run-time settings read in-graph: what to compute, and for whom.

    They steer the step but are not training state: kept out of the optimizer's
    tracked variables, they are never saved. Callbacks *request* statistics every
    N steps and release their request at train end; the value in force is the
    greatest common divisor of the open requests (0 = never for histograms), or the
    optimizer's own setting when there is none, so several monitors compose, each
    gets its steps, and the last release restores the optimizer's setting.
    """

    def __init__(self, **base: Any) -> None:
        self.base = dict(base)
        self.requests: dict[int, dict[str, int]] = {}
        self.variables: dict[str, Any] = {}
        self.on_change: Any = None  # called after a value changed (JAX: retrace the step)
        self._synced: dict[str, np.ndarray] = {}  # what the variables hold

    def value(self, name: str) -> Any:
        if name == "float16_mask":
            return self.base[name]
        requested = [r[name] for r in self.requests.values()]
        return math.gcd(*requested) if requested else self.base[name]

    def create(self) -> None:
        for name in self.base:
            value = np.asarray(self.value(name))
            self._synced[name] = value
            self.variables[name] = keras.Variable(
                value,
                dtype=int64_dtype() if value.dtype.kind in "iu" else "float32",
                trainable=False,
                aggregation="only_first_replica",
                name=name,
            )

    def synced(self, name: str) -> np.ndarray:
        """What the variable ``name`` holds now, known on the host (no read)."""
        return self._synced[name]

    def _sync(self) -> None:
        changed = False
        for name, variable in self.variables.items():
            value = np.asarray(self.value(name))
            old = self._synced.get(name)
            if old is None or old.shape != value.shape or not np.array_equal(old, value):
                changed = True
                variable.assign(value)
                self._synced[name] = value
        if changed and self.on_change is not None:
            self.on_change()

    def set_base(self, name: str, value: Any) -> None:
        self.base[name] = value
        self._sync()

    def request(self, owner: Any, **values: int) -> None:
        self.requests[id(owner)] = values
        self._sync()

    def release(self, owner: Any) -> None:
        self.requests.pop(id(owner), None)
        self._sync()


def migrated_scale(optimizer: keras.mixed_precision.LossScaleOptimizer, kwargs: dict) -> float:
    """The stock optimizer's current scale, brought inside kmix's bounds (warns if moved).

    Args:
        optimizer: the stock Keras loss-scale optimizer being migrated.
        kwargs: the kmix arguments given (their ``min_scale`` and ``max_scale``).

    Returns:
        The scale the migrated optimizer starts at.
    """
    scale = float(
        ops.convert_to_numpy(optimizer.dynamic_scale)
        if optimizer.built
        else optimizer.initial_scale
    )
    low, high = kwargs.get("min_scale", 1.0), kwargs.get("max_scale", 2.0**24)
    migrated = min(max(scale, low), high) if math.isfinite(scale) else high
    if migrated != scale:  # e.g. stock Keras halved it to 0.0
        warnings.warn(
            f"The stock optimizer's loss scale {scale:.9g} is outside kmix's "
            f"[min_scale, max_scale] = [{low:.9g}, {high:.9g}]; the migrated "
            f"optimizer starts at {migrated:.9g}.",
            KmixWarning,
            stacklevel=3,
        )
    return migrated
