"""kmix.LossScaleOptimizer's step on Keras's JAX backend: values in, values out.

On JAX, ``model.fit`` runs one ``jax.jit`` step that calls ``optimizer.stateless_apply(
optimizer_variables, grads, trainable_variables)`` and never ``apply``; the branches of a
``lax.cond`` cannot assign variables, so the step returns every new value. Here the
same pure rules as on TensorFlow (:func:`kmix.record.advance` over
:func:`kmix.scaling.update_scale`, :func:`kmix.record.encode_event` and
:func:`kmix.record.write_event`) run as one value update::

    flags = per-gradient non-finite, then [loss non-finite, loss unknown] (from scale_loss)
    applies = no flag among the gradients and the loss
    trainable, inner = cond(applies, inner.stateless_apply(unscaled grads), unchanged)
    scale, counters = record.advance(...)           # health and histograms: not yet on JAX
    ring = event ? write_event(ring, ...) : ring

A skipped step returns the trainable values and the inner optimizer's values it was
given, bit for bit, and the model's wrapped train step returns the float state its forward
pass assigned as it was (:func:`give_back_forward_state`). During ``fit`` JAX keeps the
state outside the variables (purged until ``model.jax_state_sync()``), so host reads
first sync the model the optimizer trains (:func:`remember`). Not yet on JAX (each says so
once, at run time): gradient health and histograms, the activation tap and forward origin,
and kmix's callbacks that request statistics.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
import numpy as np
from keras import ops

from kmix import _backend, health, record, scaling
from kmix._checks import warn_user
from kmix._layers import forward_state_variables, unrestored_state_variables

__all__ = [
    "apply_now",
    "give_back_forward_state",
    "record_step",
    "refuse_statistics",
    "remember",
    "stateless_apply",
    "warn_no_tap",
    "warn_what_is_missing",
]

_told: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _told:
        _told.add(key)
        warn_user(message)


def warn_what_is_missing(health_every: int, histogram_every: int) -> None:
    """Says once per process what kmix does not measure on the JAX backend yet."""
    _warn_once(
        "missing",
        "kmix.LossScaleOptimizer on the JAX backend: the bounded scale, skipped steps, "
        "counters and events run as on TensorFlow; gradient health "
        f"(health_every={health_every}), exponent histograms "
        f"(histogram_every={histogram_every}), the activation tap and the forward origin "
        "of a non-finite loss are not computed on JAX yet (issue 24).",
    )


def record_step(
    scale: Any,
    packed: Any,
    ring: record.EventRing,
    var_bad: Any,
    loss_state: Any,
    rule: scaling.ScaleConfig,
) -> tuple[Any, Any, record.EventRing]:
    """One attempted step applied to the record's values (pure; no statistics).

    Args:
        scale: the float32 scale before the step.
        packed: the counters before the step, as :func:`kmix.record.pack` lays them out
            (their dtype is kept: int32 on JAX without ``jax_enable_x64``).
        ring: the event ring before the step.
        var_bad: boolean vector, True for each variable with a non-finite gradient.
        loss_state: ``record.LOSS_FINITE``, ``LOSS_NONFINITE`` or ``LOSS_UNKNOWN``.
        rule: the scale rule's constants.

    Returns:
        ``(scale, packed, ring)`` after the step; the ring holds the step's event, if any,
        with its health unmeasured (NaN).
    """
    new, outcome = record.advance(
        record.StepRecord(scale, record.unpack(packed)),
        ops.logical_not(ops.any(var_bad)),
        loss_state,
        rule,
        0,  # health statistics and histograms are not computed on JAX yet
        0,
    )
    int_dtype = record.int_dtype_of(ring.ints)
    ints, floats = record.encode_event(
        outcome.step,
        outcome.event,
        (scale, new.scale),
        var_bad,
        loss_state,
        np.full(len(record.HEALTH_FIELDS), np.nan, "float32"),
        int_dtype=int_dtype,
    )
    written = record.write_event(ring, new.counters.event_count, ints, floats)
    happened = ops.not_equal(outcome.event, scaling.NONE)
    ring = record.EventRing(
        ops.where(happened, written.ints, ring.ints),
        ops.where(happened, written.floats, ring.floats),
    )
    return new.scale, record.pack(new.counters, record.int_dtype_of(packed)), ring


def stateless_apply(
    optimizer: Any,
    optimizer_variables: list,
    grads: list,
    trainable_variables: list,
    loss_flags: Any,
) -> tuple[list, list]:
    """kmix's step as values: apply or skip, then record (what ``fit`` calls on JAX).

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        optimizer_variables: values of ``optimizer.variables``, in that order.
        grads: gradients of the scaled loss, one per tracked trainable variable.
        trainable_variables: values of the tracked trainable variables.
        loss_flags: float32 ``[loss non-finite, loss unknown]`` as 1.0/0.0.

    Returns:
        ``(trainable_values, optimizer_values)`` after the step.

    Raises:
        ValueError: the optimizer is not built, or the values do not match its variables.
    """
    if not optimizer.built:
        raise ValueError(
            "kmix.LossScaleOptimizer.stateless_apply() needs a built optimizer: call "
            "optimizer.build(model.trainable_variables) first."
        )
    variables, grads = optimizer.variables, list(grads)
    tracked = optimizer._trainable_variables
    if len(optimizer_variables) != len(variables) or len(grads) != len(tracked):
        raise ValueError(
            "kmix.LossScaleOptimizer.stateless_apply(): got "
            f"{len(optimizer_variables)} optimizer values and {len(grads)} gradients; "
            f"expected {len(variables)} (optimizer.variables) and {len(tracked)} (one per "
            "variable the optimizer was built with, in that order)."
        )
    values = list(optimizer_variables)
    where = {id(v): i for i, v in enumerate(variables)}
    own = len(optimizer._variables)
    recorder = optimizer.recorder
    scale = values[where[id(recorder.scale)]]
    flags = ops.concatenate([health.nonfinite_flags(grads), loss_flags])
    n = len(grads)
    applies = ops.logical_not(ops.any(flags[: n + 1] > 0))
    inner_values = values[own:]

    def apply_inner() -> tuple[list, list]:
        unscaled = [
            g if g is None or optimizer._overwrite_variable_with_gradient(v) else g / scale
            for g, v in zip(grads, tracked, strict=True)
        ]
        new_trainable, new_inner = optimizer.inner_optimizer.stateless_apply(
            inner_values, unscaled, trainable_variables
        )
        return list(new_trainable), list(new_inner)

    def skip() -> tuple[list, list]:  # the batch never happened: the values as given
        return list(trainable_variables), list(inner_values)

    new_trainable, new_inner = ops.cond(applies, apply_inner, skip)
    optimizer._trace.jax_applied = applies  # for the train step's forward state
    loss_state = ops.where(
        flags[n] > 0,
        record.LOSS_NONFINITE,
        ops.where(flags[n + 1] > 0, record.LOSS_UNKNOWN, record.LOSS_FINITE),
    )
    ring = record.EventRing(
        values[where[id(recorder.event_ints)]], values[where[id(recorder.event_floats)]]
    )
    new_scale, packed, ring = record_step(
        scale,
        values[where[id(recorder.counters)]],
        ring,
        flags[:n] > 0,
        loss_state,
        optimizer.config.rule,
    )
    for variable, value in (
        (recorder.scale, new_scale),
        (recorder.counters, packed),
        (recorder.event_ints, ring.ints),
        (recorder.event_floats, ring.floats),
    ):
        values[where[id(variable)]] = value
    return new_trainable, values[:own] + new_inner


def apply_now(
    optimizer: Any, grads: list, trainable_variables: list | None, loss_flags: Any
) -> None:
    """``optimizer.apply`` on JAX (a custom loop, outside ``jit``): the step, then assign.

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        grads: gradients of the scaled loss, one per variable.
        trainable_variables: the variables, all those the optimizer tracks, in its
            order; None for those.
        loss_flags: as for :func:`stateless_apply`.

    Raises:
        ValueError: ``trainable_variables`` is not every tracked variable in order.
    """
    tracked = optimizer._trainable_variables
    variables = tracked if trainable_variables is None else list(trainable_variables)
    if [id(v) for v in variables] != [id(v) for v in tracked]:
        raise ValueError(
            "kmix.LossScaleOptimizer.apply() on the JAX backend needs a gradient for every "
            f"variable it was built with, in that order ({len(tracked)}); got "
            f"trainable_variables with {len(variables)} entries. Pass all of them "
            "(None-free), or train with model.fit."
        )
    new_trainable, new_values = stateless_apply(
        optimizer,
        [v.value for v in optimizer.variables],
        grads,
        [v.value for v in variables],
        loss_flags,
    )
    optimizer._trace.jax_applied = None  # no train step here to take the decision
    for variable, value in zip(variables, new_trainable, strict=True):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_values, strict=True):
        variable.assign(value)


def remember(optimizer: Any, model: Any) -> None:
    """Host reads of ``optimizer`` sync ``model`` first; a skip gives its forward state back.

    JAX's trainer keeps the state outside the variables during ``fit`` until
    ``model.jax_state_sync()`` (Keras 3.15 purges the variables' values meanwhile: reading
    one raises): the optimizer's reads (``read_state``, ``scale_events``...) call it, so
    they are true during and after fit. The model's train step is wrapped
    (:func:`give_back_forward_state`) so that a skipped step returns the float variables
    its forward pass assigned (BatchNormalization's statistics) as they were.

    Args:
        optimizer: a ``kmix.LossScaleOptimizer``.
        model: the model it trains (held weakly by the reads).
    """
    ref = weakref.ref(model)

    def sync() -> None:
        held = ref()
        if held is not None and hasattr(held, "jax_state_sync"):
            held.jax_state_sync()

    optimizer.recorder.sync = sync
    give_back_forward_state(optimizer, model)


def give_back_forward_state(optimizer: Any, model: Any) -> None:
    """Wraps ``model.train_step(state, data)`` so a skipped step keeps the forward state.

    Keras's JAX train step returns the non-trainable values its forward pass computed
    whatever the optimizer decided; :func:`stateless_apply` leaves its decision for this
    wrapper (in the same trace), which returns the old values of the float variables the
    layers declare non-trainable on a skipped step, as kmix does on TensorFlow. Integer
    ones keep the update and are named once. Idempotent for the same optimizer; remakes a
    train function made before the wrapper.

    Args:
        optimizer: a ``kmix.LossScaleOptimizer``.
        model: the model it trains.
    """
    unrestored = [v.path for v in unrestored_state_variables(model)]
    if unrestored:
        _warn_once(
            f"integer-{id(model)}",
            "kmix: a skipped step gives back the float variables the forward pass "
            "assigned (BatchNormalization's statistics); these integer variables keep "
            f"the skipped step's update: {', '.join(unrestored)}.",
        )
    if keras.config.is_nnx_enabled() and forward_state_variables(model):
        _warn_once(  # Keras then calls the class's train_step, not the model's attribute
            "nnx",
            "kmix on the JAX backend with Flax NNX enabled: a skipped step does not give "
            "back the float state the forward pass assigned (Keras calls the class's "
            "train_step, which kmix does not wrap); disable NNX to have it given back.",
        )
    wrapped_for = getattr(model, "_kmix_jax_train_step_of", None)
    if wrapped_for is not None and wrapped_for() is optimizer:
        return
    original = type(model).train_step.__get__(model)
    owner = weakref.ref(optimizer)

    def train_step(state: tuple, data: Any) -> tuple:
        logs, new_state = original(state, data)
        held = owner()
        applied = None if held is None else getattr(held._trace, "jax_applied", None)
        if held is not None:
            held._trace.jax_applied = None
        if applied is None or not _backend.reachable(applied):
            return logs, new_state
        given = {id(v) for v in forward_state_variables(model)}
        pairs = zip(model.non_trainable_variables, state[1], new_state[1], strict=True)
        kept = [ops.where(applied, new, old) if id(v) in given else new for v, old, new in pairs]
        return logs, (new_state[0], kept, *new_state[2:])

    model.train_step = train_step
    model._kmix_jax_train_step_of = owner  # weak: the model is not saved with it
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)


def warn_no_tap() -> None:
    """Says once that the activation tap and forward origin are not on JAX yet."""
    _warn_once(
        "tap",
        "kmix on the JAX backend: the activation tap (activation statistics and the layer "
        "where a non-finite loss starts) is not supported yet (issue 24); the forward "
        "overflow is still detected, skipped and recorded, without its origin.",
    )


def refuse_statistics(owner: Any) -> None:
    """Raises for a callback that needs gradient statistics on the JAX backend.

    Raises:
        ValueError: always, naming the backend, the callback and what works instead.
    """
    raise ValueError(
        f"kmix: {type(owner).__name__} is not yet supported on the JAX backend: it needs "
        "gradient statistics, which kmix.LossScaleOptimizer does not compute on JAX yet "
        "(issue 24). On JAX, train without it and read optimizer.read_state() and "
        "optimizer.scale_events() (true during and after fit), or train with "
        "KERAS_BACKEND=tensorflow."
    )
