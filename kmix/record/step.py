"""One attempted step applied to the whole step record, as values in and values out.

:mod:`kmix.record.step_record` says what a step does to the scale, the counters and the event ring;
this module adds what is measured at the step (gradient health and exponent histograms
when due, the forward pass's activation statistics and origin) and returns every field's
new value. Nothing is assigned, so it runs where variables cannot be written (the
branches of JAX's ``lax.cond`` inside ``model.fit``'s ``jit`` step)::

    new, outcome = record.advance(...)                   # the rule, the counters
    health, per-variable fractions  <- measured when health is due, else kept
    histograms                      <- measured when due, else kept
    activations                     <- the forward pass's, when health is due
    ring                            <- the step's event written, when there is one

The event carries the health measured at its step and the forward origin, exactly as
on TensorFlow (:class:`kmix.optimizer.recorder.StepRecorder`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import keras
import numpy as np
from keras import ops

from kmix.backend import rare_cond
from kmix.record import health, scaling
from kmix.record import step_record as record
from kmix.record.activations import ACTIVATION_CAPACITY, STORED_FIELDS
from kmix.record.step_record import HEALTH_FIELDS

__all__ = [
    "FIELDS",
    "RecordValues",
    "Statistics",
    "advance_record",
    "first_flagged",
    "loss_state_of",
    "record_step",
]

FIELDS = (
    "scale",
    "counters",
    "health",
    "underflow_per_variable",
    "subnormal_per_variable",
    "exponent_histograms",
    "activation_stats",
    "event_ints",
    "event_floats",
)
"""The step recorder's variables, in :class:`RecordValues`' order (attribute names)."""


class RecordValues(NamedTuple):
    """The step record's values: one per :data:`FIELDS` entry, in that order."""

    scale: Any
    counters: Any
    health: Any
    underflow_per_variable: Any
    subnormal_per_variable: Any
    exponent_histograms: Any
    activation_stats: Any
    event_ints: Any
    event_floats: Any


class Statistics(NamedTuple):
    """What decides which statistics a step measures.

    Attributes:
        health_every: steps between gradient health measurements (>= 1).
        histogram_every: steps between exponent histograms (0: never).
        float16_mask: 1.0 per variable whose layer computes in float16.
        not_gradients: positions of the tracked variables whose "gradient" is their new
            value (Keras's float8 scales and amax histories: ``overwrite_with_gradient``):
            left out of health and histograms, kept in the non-finite flags (static).
    """

    health_every: Any
    histogram_every: Any
    float16_mask: Any
    not_gradients: tuple[int, ...] = ()

    def measured(self, grads: list) -> list:
        """``grads`` with ``None`` for :attr:`not_gradients` (what statistics measure)."""
        if not self.not_gradients:
            return grads
        left_out = frozenset(self.not_gradients)
        return [None if i in left_out else g for i, g in enumerate(grads)]

    def due(self, counters: Any) -> Any:
        """``[health_due, histogram_due]`` at the step after ``counters`` (packed)."""
        return record.due_now(counters, ops.stack([self.health_every, self.histogram_every]))


def loss_state_of(flags: Any, n: int) -> Any:
    """``record.LOSS_*`` from the step's flags: ``n`` gradient flags, then the loss's two."""
    return ops.where(
        flags[n] > 0,
        record.LOSS_NONFINITE,
        ops.where(flags[n + 1] > 0, record.LOSS_UNKNOWN, record.LOSS_FINITE),
    )


def first_flagged(flags: Any) -> Any:
    """The index of the first positive entry of ``flags`` (a replica's or shard's flag),
    -1 when none is."""
    flagged = ops.cast(flags > 0, "int32")
    return ops.where(ops.any(flags > 0), ops.cast(ops.argmax(flagged), "int32"), -1)


def _health(grads: list, scale: Any, mask: Any) -> tuple[Any, Any, Any]:
    stats = health.gradient_health(grads, scale, mask)
    vector = ops.stack([ops.cast(getattr(stats, f), "float32") for f in HEALTH_FIELDS])
    return vector, stats.underflow_per_variable, stats.subnormal_per_variable


def advance_record(
    old: RecordValues,
    grads: list,
    flags: Any,
    statistics: Statistics,
    forward: tuple[Any, Any] | None,
    rule: scaling.ScaleConfig,
    source: record.NonfiniteSource = record.NO_SOURCE,
) -> tuple[RecordValues, record.StepOutcome]:
    """The record after one attempted step (pure; statistics only where due).

    Args:
        old: the record's values before the step (the counters packed as
            :func:`kmix.record.step_record.pack` lays them out, in their own dtype).
        grads: the scaled gradients, one per tracked variable.
        flags: float vector: per gradient non-finite, then loss non-finite, then loss
            unknown.
        statistics: what is measured and when.
        forward: ``(origin, stats)`` of :func:`kmix.record.activations.measure_forward`, or
            None without a tapped forward pass.
        rule: the scale rule's constants.
        source: which process and replica held the first non-finite values, where the
            backend's step knows it (written with the step's event).

    Returns:
        ``(values, outcome)``: the record's values after the step (those not due as
        given) and what the step was (:class:`kmix.record.step_record.StepOutcome`).
    """
    n = len(grads)
    var_bad = flags[:n] > 0
    loss_state = loss_state_of(flags, n)
    int_dtype = record.int_dtype_of(old.counters)
    new, outcome = record.advance(
        record.StepRecord(old.scale, record.unpack(old.counters)),
        ops.logical_not(ops.any(var_bad)),
        loss_state,
        rule,
        statistics.health_every,
        statistics.histogram_every,
    )
    measured_grads = statistics.measured(grads)
    unmeasured = ops.full((len(HEALTH_FIELDS),), np.nan, "float32")
    # Called conditionals (TensorFlow: kept out of the steps that do not take them).
    measured, underflow, subnormal = rare_cond(
        outcome.statistics_due,
        lambda: _health(measured_grads, old.scale, statistics.float16_mask),
        lambda: (unmeasured, old.underflow_per_variable, old.subnormal_per_variable),
    )
    due = outcome.health_due
    histograms = rare_cond(
        outcome.histogram_due,
        lambda: ops.cast(health.exponent_histograms(measured_grads), old.exponent_histograms.dtype),
        lambda: old.exponent_histograms,
    )
    activations, origin = old.activation_stats, record.NO_ORIGIN
    if forward is not None:
        rows = ops.shape(forward[1])[0]
        padded = ops.concatenate(
            [forward[1], ops.full((ACTIVATION_CAPACITY - rows, len(STORED_FIELDS)), np.nan)]
        )
        activations = ops.where(due, padded, activations)
        origin = record.EventOrigin(*ops.unstack(forward[0]))
    ints, floats = record.encode_event(
        outcome.step,
        outcome.event,
        (old.scale, new.scale),
        var_bad,
        loss_state,
        measured,
        origin,
        int_dtype=record.int_dtype_of(old.event_ints),
        source=source,
    )
    ring = record.EventRing(old.event_ints, old.event_floats)
    written = record.write_event(ring, new.counters.event_count, ints, floats)
    happened = ops.not_equal(outcome.event, scaling.NONE)
    values = RecordValues(
        scale=new.scale,
        counters=record.pack(new.counters, int_dtype),
        health=ops.where(due, measured, old.health),
        underflow_per_variable=ops.where(due, underflow, old.underflow_per_variable),
        subnormal_per_variable=ops.where(due, subnormal, old.subnormal_per_variable),
        exponent_histograms=histograms,
        activation_stats=activations,
        event_ints=ops.where(happened, written.ints, ring.ints),
        event_floats=ops.where(happened, written.floats, ring.floats),
    )
    return values, outcome


T = TypeVar("T")


def record_step(
    counters: Any,
    due: Any,
    flags: Any,
    rule: scaling.ScaleConfig,
    *,
    count: Callable[[np.ndarray], T],
    advance: Callable[[], tuple[RecordValues, record.StepOutcome]],
    write: Callable[[RecordValues, record.StepOutcome], T],
    cond: Callable[[Any, Callable[[], T], Callable[[], T]], T],
    quiet: Any = None,
) -> T:
    """One attempted step recorded: the choice every backend's step makes, made here once.

    A quiet step (:func:`kmix.record.step_record.is_quiet`: finite, nothing due, no
    event) adds one constant to the counters; any other runs :func:`advance_record`.
    The backend's step says only what "adds" and "writes" mean there: TensorFlow
    assigns the variables inside the branch, JAX returns the values.

    Args:
        counters: the packed counters before the step.
        due: what is due at this step (:meth:`Statistics.due` of ``counters``).
        flags: the step's non-finite flags (per gradient, loss non-finite, loss unknown).
        rule: the scale rule's constants.
        count: the quiet step: takes the constant to add to the counters (NumPy, in
            their dtype).
        advance: the full step's values: :func:`advance_record` over the record.
        write: the full step: takes its values and outcome.
        cond: the backend's conditional for a branch that seldom runs
            (:func:`kmix.backend.rare_cond`, or ``keras.ops.cond``).
        quiet: :func:`kmix.record.step_record.is_quiet` of these values, where the step
            has read it already (an eager step reads its decisions at once); None
            computes it here.

    Returns:
        What the branch taken returns.
    """
    delta = np.asarray(record.QUIET_DELTA, keras.backend.standardize_dtype(counters.dtype))
    return cond(
        record.is_quiet(counters, flags, due, rule) if quiet is None else quiet,
        lambda: count(delta),
        lambda: write(*advance()),
    )
