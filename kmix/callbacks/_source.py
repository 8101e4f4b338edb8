"""Where callbacks read loss-scaling state from: one adapter per kind of optimizer.

A callback holds a :class:`Source` and asks it what it can measure, instead of
branching on the optimizer's class. Three sources: kmix's optimizer (everything,
exact), Keras's stock loss-scale optimizer (its scale, and skipped steps inferred
from its iterations at each read) and no loss scaling (steps only).

kmix's optimizer is recognised by what it offers (:class:`RecordingOptimizer`), not by
importing it: training code never imports the callbacks, and the callbacks never import
the training code back.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, runtime_checkable

import keras
import numpy as np

from kmix.backend import host_value
from kmix.precision_plan import base_path, layers_by_path
from kmix.record import RecordedEvent, Snapshot

STOCK_MIN_SCALE = 1.0
"""The floor assumed for the stock Keras optimizer, which has none (it reaches 0.0)."""


@runtime_checkable
class RecordingOptimizer(Protocol):
    """What :class:`KmixSource` reads: the public surface of ``kmix.LossScaleOptimizer``.

    ``isinstance(optimizer, RecordingOptimizer)`` is True for an object that has every
    member below (Keras's stock ``LossScaleOptimizer`` has none of the reading
    methods), so this module need not import kmix's optimizer.
    """

    config: Any
    """The optimizer's settings; ``config.rule`` has ``min_scale`` and ``max_scale``."""

    @property
    def event_capacity(self) -> int:
        """How many recent events the in-graph ring keeps."""

    @property
    def health_every(self) -> int:
        """Steps between gradient health measurements in force."""

    def read_state(self, counters_only: bool = False) -> Snapshot:
        """Reads the step record."""

    def recorded_events(self, since: int = 0) -> list[RecordedEvent]:
        """Events with index > ``since`` still held, each with its health."""

    def request_statistics(self, owner: Any, health_every: int, histogram_every: int) -> None:
        """Asks for statistics every N steps."""

    def release_statistics(self, owner: Any) -> None:
        """Withdraws ``owner``'s request."""

    def underflow_by_variable(self) -> dict[str, float]:
        """Variable path -> underflow fraction at the latest health step."""

    def subnormal_by_variable(self) -> dict[str, float]:
        """Variable path -> subnormal fraction at the latest health step."""

    def exponent_histograms_by_variable(self) -> dict[str, np.ndarray]:
        """Variable path -> exponent histogram at the latest histogram step."""

    def activations_by_layer(self) -> dict[str, dict[str, float]]:
        """Layer path -> activation statistic -> value at the latest health step."""

    def watch(self, model: keras.Model) -> list[str]:
        """Taps the model's float16 layers."""


class Source:
    """What a callback can read, without a kmix optimizer: attempted steps only.

    Attributes:
        kind: ``"kmix"``, ``"keras"`` or ``"none"`` (as in ``kmix.tags.LOSS_SCALINGS``).
        scales_loss: the optimizer has a loss scale.
        records_events: every scale event is recorded at its exact step.
        measures_health: gradient health, per-variable statistics and histograms.
        knows_loss: the snapshot says whether each step's loss was finite.
        floor_scale: the scale at or below which a run of skipped steps is at the floor
            (the guard's ``overflow_at_floor``): the optimizer's ``min_scale``, or
            :data:`STOCK_MIN_SCALE` for the stock optimizer, which has none; None
            without loss scaling.
        scale_bounds: ``(min_scale, max_scale)`` the optimizer keeps its scale within,
            as configured; None where it has none (the stock optimizer's scale can
            reach 0.0 and inf) or there is no loss scaling.
        event_capacity: how many recent events the source keeps (0: none).
    """

    kind = "none"
    scales_loss = False
    records_events = False
    measures_health = False
    knows_loss = False
    floor_scale: float | None = None
    scale_bounds: tuple[float, float] | None = None
    event_capacity = 0

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._start_step = 0
        self._trained: Any = None  # the model, weakly: JAX reads sync it first

    @property
    def optimizer_name(self) -> str:
        """The optimizer's class name, e.g. ``"SGD"``."""
        return type(self.optimizer).__name__

    def describe(self) -> str:
        """The loss scaling in words, for the policy text: ``"none (`SGD`)"``."""
        return f"none (`{self.optimizer_name}`)"

    def begin(self, model: keras.Model) -> None:
        """Notes where this ``fit`` starts and tells the optimizer about the model."""
        self._trained = weakref.ref(model)
        self._start_step = self._iterations()

    def _sync(self) -> None:
        """On JAX, ``fit`` keeps the state outside the variables until the model syncs."""
        model = self._trained() if self._trained is not None else None
        if model is not None and hasattr(model, "jax_state_sync"):
            model.jax_state_sync()

    def _iterations(self) -> int:
        if not getattr(self.optimizer, "built", False):
            return 0
        self._sync()
        return int(host_value(self.optimizer.iterations))

    def read(self, steps_seen: int, counters_only: bool = False) -> Snapshot:
        """Reads the state (the host sync).

        Args:
            steps_seen: optimizer steps the callback counted since train begin.
            counters_only: the counters suffice (kmix reads them with one transfer,
                leaving ``loss_scale`` None and ``health`` empty).

        Returns:
            The state; without kmix, the counters this source can infer.
        """
        return Snapshot(
            loss_scale=None, attempted_steps=self._start_step + steps_seen, skipped_steps=0
        )

    def events(self, since: int) -> list[RecordedEvent]:
        """Events with index > ``since`` still held (none without kmix)."""
        return []

    @property
    def health_every(self) -> int:
        """Steps between gradient health measurements in force now (0: none)."""
        return 0

    def request_statistics(self, owner: Any, health_every: int, histogram_every: int) -> None:
        """Asks for statistics every N steps (nothing to ask without kmix)."""

    def release_statistics(self, owner: Any) -> None:
        """Withdraws the request."""

    def per_variable(self) -> dict[str, dict[str, float]]:
        """Statistic -> variable path -> latest value (kmix only)."""
        return {}

    def histograms(self) -> dict[str, np.ndarray]:
        """Variable path -> latest exponent histogram (kmix only)."""
        return {}

    def per_layer(self, float16_only: bool = True) -> dict[str, dict[str, float]]:
        """Layer path -> activation statistic -> latest value (kmix only).

        Args:
            float16_only: leave out layers that no longer compute in float16 (moved by
                :class:`kmix.callbacks.PrecisionAutopilot`): float16's range no longer
                applies to them.
        """
        return {}


class KerasSource(Source):
    """Keras's stock ``LossScaleOptimizer``: the scale; skips inferred from its iterations."""

    kind = "keras"
    scales_loss = True
    floor_scale = STOCK_MIN_SCALE

    def describe(self) -> str:
        return "the stock `keras.mixed_precision.LossScaleOptimizer`"

    def read(self, steps_seen: int, counters_only: bool = False) -> Snapshot:
        opt = self.optimizer
        applied = self._iterations() - self._start_step
        scale = host_value(opt.dynamic_scale) if opt.built else opt.initial_scale
        return Snapshot(
            loss_scale=float(scale),
            attempted_steps=self._start_step + steps_seen,
            skipped_steps=max(steps_seen - applied, 0),
        )


class KmixSource(Source):
    """``kmix.LossScaleOptimizer``: everything, read from its step record."""

    kind = "kmix"
    scales_loss = True
    records_events = True
    measures_health = True
    knows_loss = True

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        rule = optimizer.config.rule
        self.floor_scale = rule.min_scale
        self.scale_bounds = (rule.min_scale, rule.max_scale)
        self.event_capacity = optimizer.event_capacity
        self._model: Any = None

    def describe(self) -> str:
        return "`kmix.LossScaleOptimizer`"

    def begin(self, model: keras.Model) -> None:
        self._model = weakref.ref(model)
        self.optimizer.watch(model)

    def read(self, steps_seen: int, counters_only: bool = False) -> Snapshot:
        return self.optimizer.read_state(counters_only=counters_only)

    def events(self, since: int) -> list[RecordedEvent]:
        return self.optimizer.recorded_events(since)

    @property
    def health_every(self) -> int:
        return self.optimizer.health_every

    def request_statistics(self, owner: Any, health_every: int, histogram_every: int) -> None:
        self.optimizer.request_statistics(owner, health_every, histogram_every)

    def release_statistics(self, owner: Any) -> None:
        self.optimizer.release_statistics(owner)

    def per_variable(self) -> dict[str, dict[str, float]]:
        return {
            "underflow_fraction": self.optimizer.underflow_by_variable(),
            "subnormal_fraction": self.optimizer.subnormal_by_variable(),
        }

    def histograms(self) -> dict[str, np.ndarray]:
        return self.optimizer.exponent_histograms_by_variable()

    def per_layer(self, float16_only: bool = True) -> dict[str, dict[str, float]]:
        layers = self.optimizer.activations_by_layer()
        model = self._model() if self._model is not None else None
        if not float16_only or model is None:
            return layers
        by_path = layers_by_path(model)
        return {
            path: values
            for path, values in layers.items()
            if getattr(by_path.get(base_path(path)), "compute_dtype", "float16") == "float16"
        }


def source_for(optimizer: Any) -> Source:
    """The source that reads ``optimizer``.

    Args:
        optimizer: the model's optimizer.

    Returns:
        A :class:`KmixSource` for an optimizer that records its steps
        (:class:`RecordingOptimizer`: kmix's), a :class:`KerasSource` for another
        ``keras.mixed_precision.LossScaleOptimizer``, else a plain :class:`Source`.
    """
    if isinstance(optimizer, RecordingOptimizer):
        return KmixSource(optimizer)
    if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        return KerasSource(optimizer)
    return Source(optimizer)
