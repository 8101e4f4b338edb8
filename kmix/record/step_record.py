"""The step record: what kmix.LossScaleOptimizer remembers of every step, as values.

The optimizer keeps one variable per field below and does nothing else with them
than ``read -> pure update -> assign``. Everything here is a pure function of
keras.ops tensors (no control flow on tensors, no host sync), tested step by step
against plain Python in ``tests/record/test_step_record.py``.

Per step (every step, one assignment of the packed counters)::

    step = attempted_steps + 1
    skipped = any gradient non-finite or the unscaled loss non-finite
    scale, good_steps, hysteresis_left, event = scaling.update_scale(...)
    skipped_steps += skipped;  consecutive_skips = skipped ? +1 : 0
    last_overflow_step = skipped ? step : last_overflow_step
    loss_state = FINITE | NONFINITE | UNKNOWN (scale_loss not seen in this step's graph)
    consecutive_nonfinite_loss = loss non-finite ? +1 : 0
    health_step = step if periodic health is due (a skipped step's health goes with its event)
    histogram_step = step if histograms are due
    event_count += event != NONE

Events go to a ring of ``capacity`` rows (only when one happens, so in a rare
branch): an int row and a float row, encoded and decoded side by side below.
Counters saturate at their dtype's maximum instead of wrapping: int64's, or int32's on
JAX without ``jax_enable_x64`` (where an int64 variable holds int32 values).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from keras import backend, ops

from kmix.record import scaling
from kmix.tags import EventSource, ForwardOrigin, ScaleEvent

INT64_MAX = 2**63 - 1


def int_dtype_of(value: Any) -> str:
    """The integer dtype a counter (tensor, NumPy value, Python int) computes in: its own
    (``"int32"`` for an int64 variable's value on JAX without x64), int64 for an int."""
    dtype = getattr(value, "dtype", None)
    return "int64" if dtype is None else backend.standardize_dtype(dtype)


def int_max(dtype: str) -> int:
    """The largest value of the integer ``dtype`` (e.g. ``"int64"``: ``2**63 - 1``), where a
    saturating counter stops.

    Raises:
        ValueError: ``dtype`` is not an integer dtype.
    """
    if np.dtype(dtype).kind not in "iu":
        raise ValueError(f"int_max: dtype={dtype!r} is not an integer dtype; pass e.g. 'int64'.")
    return int(np.iinfo(dtype).max)


LOSS_NONFINITE = 0
LOSS_FINITE = 1
LOSS_UNKNOWN = -1
"""Codes of ``Counters.loss_state``: what the step knew about its unscaled loss."""

HEALTH_FIELDS = (
    "grad_norm",
    "max_abs_scaled",
    "headroom_bits",
    "underflow_fraction",
    "zero_fraction",
    "subnormal_fraction",
    "nonfinite_elements",
    "float16_elements",
)
"""The float health vector's layout (kmix.record.health.GradientHealth scalars, in order)."""


class Counters(NamedTuple):
    """The integer part of the record; packed into one int64 vector variable."""

    attempted_steps: Any
    skipped_steps: Any
    good_steps: Any
    hysteresis_left: Any
    consecutive_skips: Any
    last_overflow_step: Any
    loss_state: Any
    consecutive_nonfinite_loss: Any
    event_count: Any
    health_step: Any
    histogram_step: Any


class StepRecord(NamedTuple):
    """The record updated on every step: the float32 ``scale`` and the :class:`Counters`."""

    scale: Any
    counters: Counters


class StepOutcome(NamedTuple):
    """What one step did, for the optimizer's rare branches.

    Attributes:
        step: the attempted step, from 1 (int64).
        skipped: True when the update was not applied.
        event: the scale event code (``scaling.NONE`` when none).
        health_due: gradient health is due (periodic).
        histogram_due: exponent histograms are due.
        statistics_due: health is to be computed (due, or the step was skipped).
    """

    step: Any
    skipped: Any
    event: Any
    health_due: Any
    histogram_due: Any
    statistics_due: Any


def initial_counters(hysteresis: int) -> Counters:
    """The counters of an optimizer that has not stepped yet (plain ints)."""
    values = dict.fromkeys(Counters._fields, 0)
    values.update(hysteresis_left=hysteresis, loss_state=LOSS_FINITE)
    return Counters(**values)


def pack(counters: Counters, dtype: str = "int64") -> Any:
    """Stacks the counters into one integer vector (the variable's layout).

    Args:
        counters: the counters.
        dtype: the vector's dtype: the counters variable's (int32 on JAX without x64).

    Returns:
        The vector.
    """
    return ops.stack([ops.cast(value, dtype) for value in counters])


def unpack(vector: Any) -> Counters:
    """Splits the int64 vector written by :func:`pack` into :class:`Counters` (one op)."""
    return Counters(*ops.unstack(vector, num=len(Counters._fields)))


def saturating_add(counter: Any, amount: Any) -> Any:
    """``counter + amount``, stopping at the maximum of the counter's dtype (:func:`int_max`)."""
    dtype = int_dtype_of(counter)
    top = np.asarray(int_max(dtype), dtype)  # typed: a Python int becomes int32 on torch
    amount = ops.cast(amount, dtype)
    return ops.where(ops.greater(counter, ops.subtract(top, amount)), top, ops.add(counter, amount))


def due(step: Any, every: Any, xp: Any = ops) -> Any:
    """True when ``every > 0`` and ``step`` is a multiple of it (``xp``: as :func:`due_now`)."""
    every = xp.cast(every, int_dtype_of(step))
    return xp.logical_and(every > 0, xp.equal(xp.mod(step, xp.maximum(every, 1)), 0))


def advance(
    record: StepRecord,
    grads_finite: Any,
    loss_state: Any,
    config: scaling.ScaleConfig,
    health_every: Any,
    histogram_every: Any,
) -> tuple[StepRecord, StepOutcome]:
    """Applies one attempted step to the record (the rule in the module docstring).

    Args:
        record: the record before the step.
        grads_finite: boolean scalar, True when every gradient of every replica is finite.
        loss_state: int scalar, ``LOSS_FINITE``, ``LOSS_NONFINITE`` or ``LOSS_UNKNOWN``.
        config: the scale rule's constants.
        health_every: steps between health statistics (int scalar).
        histogram_every: steps between histograms; 0 means never.

    Returns:
        ``(new_record, outcome)``; every new value depends on ``grads_finite``, so
        nothing is assigned before the step's data exist (an exhausted input
        pipeline aborts the step before any counter moves).
    """
    c = record.counters
    loss_state = ops.cast(loss_state, int_dtype_of(c.attempted_steps))
    loss_nonfinite = ops.equal(loss_state, LOSS_NONFINITE)
    scale_state, event = scaling.update_scale(
        scaling.ScaleState(record.scale, c.good_steps, c.hysteresis_left),
        grads_finite,
        config,
        loss_finite=ops.logical_not(loss_nonfinite),
    )
    skipped = ops.logical_or(ops.logical_not(grads_finite), loss_nonfinite)
    # `where(grads_finite, 1, 1)`: the step depends on the gradients' flags, hence on
    # the data, so the counters cannot move in a step whose input never arrived.
    step = saturating_add(c.attempted_steps, ops.where(grads_finite, 1, 1))
    health_due = due(step, health_every)
    histogram_due = due(step, histogram_every)
    statistics_due = ops.logical_or(health_due, skipped)
    counters = Counters(
        attempted_steps=step,
        skipped_steps=saturating_add(c.skipped_steps, skipped),
        good_steps=scale_state.good_steps,
        hysteresis_left=scale_state.hysteresis_left,
        consecutive_skips=ops.where(skipped, saturating_add(c.consecutive_skips, 1), 0),
        last_overflow_step=ops.where(skipped, step, c.last_overflow_step),
        loss_state=loss_state,
        consecutive_nonfinite_loss=ops.where(
            loss_nonfinite, saturating_add(c.consecutive_nonfinite_loss, 1), 0
        ),
        event_count=saturating_add(c.event_count, ops.not_equal(event, scaling.NONE)),
        health_step=ops.where(health_due, step, c.health_step),
        histogram_step=ops.where(histogram_due, step, c.histogram_step),
    )
    outcome = StepOutcome(step, skipped, event, health_due, histogram_due, statistics_due)
    return StepRecord(scale_state.scale, counters), outcome


QUIET_DELTA = Counters(
    **(dict.fromkeys(Counters._fields, 0) | {"attempted_steps": 1, "good_steps": 1})
)
"""What a quiet step adds to the counters (nothing else changes, the scale included)."""


def due_now(packed: Any, every: Any, xp: Any = ops) -> Any:
    """``[health_due, histogram_due]`` for the step after the ``packed`` counters.

    The same as :func:`advance`'s ``outcome.health_due`` and ``outcome.histogram_due``,
    computed as one vector before the step (a few ops instead of two scalar chains).

    Args:
        packed: the counters before the step, as :func:`pack` lays them out.
        every: int64 vector ``[health_every, histogram_every]`` (0 means never).
        xp: ``keras.ops``, or :data:`kmix.record.HOST_OPS` for NumPy values.

    Returns:
        A boolean vector of two.
    """
    attempted = packed[Counters._fields.index("attempted_steps")]
    dtype = int_dtype_of(attempted)
    step = xp.minimum(attempted, np.asarray(int_max(dtype) - 1, dtype)) + 1  # as advance counts
    return due(step, every, xp)


def quiet_bounds(
    config: scaling.ScaleConfig, dtype: str = "int64"
) -> tuple[np.ndarray, np.ndarray]:
    """Per counter, the ``[low, high]`` inside which a clean step is quiet.

    A quiet step follows a quiet step (the last loss known finite, no skip or
    non-finite loss streak), does not grow the scale and does not reach int64's end.

    Args:
        config: the scale rule's constants (its ``growth_steps``).
        dtype: the counters' dtype (int32 on JAX without ``jax_enable_x64``).

    Returns:
        ``(low, high)``: vectors of ``dtype`` in :func:`pack`'s layout.
    """
    top = int_max(dtype)
    low = dict.fromkeys(Counters._fields, -top - 1)
    high = dict.fromkeys(Counters._fields, top)
    exact = {"loss_state": LOSS_FINITE, "consecutive_skips": 0, "consecutive_nonfinite_loss": 0}
    low |= exact
    high |= exact | {"good_steps": min(config.growth_steps - 2, top), "attempted_steps": top - 2}
    return np.asarray(list(Counters(**low)), dtype), np.asarray(list(Counters(**high)), dtype)


def is_quiet(
    packed: Any, flags: Any, due_vector: Any, config: scaling.ScaleConfig, xp: Any = ops
) -> Any:
    """True when :func:`advance` would only add :data:`QUIET_DELTA`: the common step.

    A quiet step is clean (every flag 0: gradients finite, the loss finite and known),
    lies inside :func:`quiet_bounds` and is not a statistics step. The optimizer then
    adds one constant vector instead of running the whole rule (``tests/record/test_step_record.py``
    checks the two agree).

    Args:
        packed: the counters before the step, as :func:`pack` lays them out.
        flags: float vector, 0.0 for each clean item: one per gradient (non-finite),
            then the loss non-finite, then the loss unknown.
        due_vector: :func:`due_now`'s ``[health_due, histogram_due]``.
        config: the scale rule's constants.
        xp: ``keras.ops``, or :data:`kmix.record.HOST_OPS` for NumPy values.

    Returns:
        A boolean scalar.
    """
    low, high = quiet_bounds(config, int_dtype_of(packed))
    inside = xp.all(xp.logical_and(xp.greater_equal(packed, low), xp.less_equal(packed, high)))
    clean = xp.logical_not(xp.any(flags > 0))
    return xp.logical_and(xp.logical_and(clean, inside), xp.logical_not(xp.any(due_vector)))


# ------------------------------------------------------------------ event ring
EVENT_INT_FIELDS = (
    "step",
    "kind",
    "first_variable",  # index into the optimizer's variables, -1 if none
    "nonfinite_variables",
    "loss_state",
    "origin_layer",  # index into the forward tap's layers, -1 if none
    "origin_inputs_finite",
    "source_process",  # the process whose shard was first non-finite, -1 if unknown
    "source_replica",  # the replica (or shard of the batch) first non-finite, -1 if unknown
)
EVENT_FLOAT_FIELDS = ("old_scale", "new_scale", "origin_max_abs_input", *HEALTH_FIELDS)
"""Columns of the ring's int and float rows; health is the step's, when measured. A saved
format: new int columns go at the end (rings saved before them load padded with -1)."""


class EventRing(NamedTuple):
    """The last ``capacity`` events: int64 rows, float32 rows (slot = (index - 1) % capacity)."""

    ints: Any
    floats: Any


class EventOrigin(NamedTuple):
    """The forward origin of a non-finite loss, as tensors (layer -1: none known)."""

    layer: Any
    inputs_finite: Any
    max_abs_input: Any


NO_ORIGIN = EventOrigin(-1, 0, 0.0)


class NonfiniteSource(NamedTuple):
    """Which process and replica held a step's first non-finite values (-1: unknown)."""

    process: Any
    replica: Any


NO_SOURCE = NonfiniteSource(-1, -1)


def encode_event(
    step: Any,
    event: Any,
    scales: tuple[Any, Any],
    var_bad: Any,
    loss_state: Any,
    health: Any,
    origin: EventOrigin = NO_ORIGIN,
    int_dtype: str = "int64",
    source: NonfiniteSource = NO_SOURCE,
) -> tuple[Any, Any]:
    """Encodes one event as the ring's ``(int_row, float_row)``.

    Args:
        step: the attempted step.
        event: the event code.
        scales: ``(old_scale, new_scale)``.
        var_bad: boolean vector, True for each variable with a non-finite gradient.
        loss_state: the loss code of the step.
        health: float32 vector laid out as :data:`HEALTH_FIELDS` (NaN where unmeasured).
        origin: the forward origin, if known.
        int_dtype: the int row's dtype: the ring variable's (int32 on JAX without x64).
        source: where the first non-finite values were, if known.

    Returns:
        The int row and the float32 row.
    """
    bad = ops.cast(var_bad, "int32")
    first = ops.where(ops.any(var_bad), ops.cast(ops.argmax(bad), int_dtype), -1)
    ints = ops.stack(
        [
            ops.cast(value, int_dtype)
            for value in (step, event, first, ops.sum(bad), loss_state, *origin[:2], *source)
        ]
    )
    floats = ops.concatenate(
        [
            ops.stack([ops.cast(v, "float32") for v in (*scales, origin.max_abs_input)]),
            ops.cast(health, "float32"),
        ]
    )
    return ints, floats


def write_event(ring: EventRing, event_index: Any, ints: Any, floats: Any) -> EventRing:
    """Writes the event numbered ``event_index`` (from 1) into its slot of the ring."""
    capacity = ops.shape(ring.ints)[0]
    dtype = int_dtype_of(ring.ints)
    slot = ops.equal(
        ops.arange(capacity, dtype=dtype), ops.mod(ops.cast(event_index, dtype) - 1, capacity)
    )[:, None]
    return EventRing(
        ops.where(slot, ints[None, :], ring.ints), ops.where(slot, floats[None, :], ring.floats)
    )


class RecordedEvent(NamedTuple):
    """An event with the gradient health measured at its step (empty if unmeasured)."""

    event: ScaleEvent
    health: dict[str, float]


def decode_events(
    ints: np.ndarray,
    floats: np.ndarray,
    event_count: int,
    since: int,
    variables: Sequence[str],
    layers: Sequence[tuple[str, str]] = (),
) -> list[RecordedEvent]:
    """Reads the events with ``index > since`` that the ring (host copies) still holds.

    Args:
        ints: the ring's int rows, ``[capacity, len(EVENT_INT_FIELDS)]``.
        floats: its float rows, ``[capacity, len(EVENT_FLOAT_FIELDS)]``.
        event_count: events recorded since training began.
        since: the index of the last event already seen.
        variables: variable paths, in the optimizer's order.
        layers: ``(path, class name)`` of the forward tap's layers, in its order.

    Returns:
        The events in order, each with its step's health; fewer than
        ``event_count - since`` if the ring overflowed.
    """
    capacity = len(ints)
    events = []
    for index in range(max(since, event_count - capacity) + 1, event_count + 1):
        slot = (index - 1) % capacity
        row = dict.fromkeys(EVENT_INT_FIELDS, -1)  # a narrower ring: older columns only
        row |= dict(zip(EVENT_INT_FIELDS, (int(x) for x in ints[slot]), strict=False))
        values = dict(zip(EVENT_FLOAT_FIELDS, (float(x) for x in floats[slot]), strict=True))
        origin = None
        if 0 <= row["origin_layer"] < len(layers):
            path, layer_class = layers[row["origin_layer"]]
            max_abs = values["origin_max_abs_input"]
            origin = ForwardOrigin(
                layer=path,
                layer_class=layer_class,
                inputs_finite=bool(row["origin_inputs_finite"]),
                max_abs_input=max_abs if np.isfinite(max_abs) else None,
            )
        first = row["first_variable"]
        event = ScaleEvent(
            index=index,
            step=row["step"],
            kind=scaling.EVENT_KINDS[row["kind"]],
            old_scale=values["old_scale"],
            new_scale=values["new_scale"],
            variable=variables[first] if 0 <= first < len(variables) else None,
            nonfinite_variables=row["nonfinite_variables"],
            loss_finite=loss_finite_from_state(row["loss_state"]),
            origin=origin,
            source=event_source(row["source_process"], row["source_replica"]),
        )
        events.append(RecordedEvent(event, event_health(floats[slot])))
    return events


def event_source(process: int, replica: int) -> EventSource | None:
    """The ring's source columns as an :class:`kmix.tags.EventSource`; None if unknown."""
    if process < 0 and replica < 0:
        return None
    return EventSource(process if process >= 0 else None, replica if replica >= 0 else None)


def loss_finite_from_state(loss_state: int) -> bool | None:
    """``Counters.loss_state`` as a Python value: True, False or None (unknown)."""
    return None if loss_state == LOSS_UNKNOWN else bool(loss_state == LOSS_FINITE)


def event_health(floats_row: np.ndarray) -> dict[str, float]:
    """The health measured at an event's step (see :func:`measured_health`)."""
    return measured_health(floats_row[len(EVENT_FLOAT_FIELDS) - len(HEALTH_FIELDS) :])


RANGE_FIELDS = frozenset(HEALTH_FIELDS) - {"grad_norm", "nonfinite_elements", "float16_elements"}
"""Health fields that describe float16's range: measured only where float16 computes."""


def measured_health(values: Sequence[float]) -> dict[str, float]:
    """The health vector as a dict of what was measured.

    Args:
        values: floats laid out as :data:`HEALTH_FIELDS`; NaN marks "not measured".

    Returns:
        Field -> finite value: nothing when the statistics did not run, no range field
        when no float16 element was counted, and no headroom when every value that
        was not zero was inf/NaN.
    """
    health = {name: float(v) for name, v in zip(HEALTH_FIELDS, values, strict=True)}
    if not math.isfinite(health["float16_elements"]):
        return {}
    health = {name: v for name, v in health.items() if math.isfinite(v)}
    if health.get("max_abs_scaled") == 0 and health.get("nonfinite_elements", 0) > 0:
        health.pop("headroom_bits", None)  # no finite non-zero value: nothing to measure it from
    if health["float16_elements"] == 0:
        health = {k: v for k, v in health.items() if k not in RANGE_FIELDS}
    return health
