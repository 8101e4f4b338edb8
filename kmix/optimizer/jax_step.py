"""kmix.LossScaleOptimizer's step on Keras's JAX backend: values in, values out.

On JAX, ``model.fit`` runs one ``jax.jit`` step that calls ``optimizer.stateless_apply(
optimizer_variables, grads, trainable_variables)`` and never ``apply``; the branches of a
``lax.cond`` cannot assign variables, so the step returns every new value, by the same
pure rules as on TensorFlow (:func:`kmix.record.advance_record`)::

    flags = per-gradient non-finite, then [loss non-finite, loss unknown] (from scale_loss)
    applies = no flag among the gradients and the loss
    trainable, inner = cond(applies, inner.stateless_apply(unscaled grads), unchanged)
    record = advance_record(record, grads, flags, statistics, forward)

The forward pass runs inside ``jax.value_and_grad``, and its tapped records are usable
only there: the model's ``compute_loss_and_updates`` is wrapped to measure them
(:func:`kmix.record.measure_forward`) and hand the measurement out with its auxiliary
values; the model's wrapped ``train_step`` takes it back out and finishes the record with
it (:class:`JaxStep`). Under ``jit`` with a tap, ``fit`` runs this measuring step only
where statistics are due and a quiet one elsewhere (:mod:`kmix.optimizer.jax_train_function`),
which on a non-finite loss runs the pass again for its origin (:func:`origin_again`).
A skipped step returns the trainable values, the inner optimizer's
values and the float state its forward pass assigned, bit for bit. During ``fit`` JAX
keeps the state outside the variables (purged until ``model.jax_state_sync()``), so host
reads first sync the model the optimizer trains (:func:`protect_forward_state`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from kmix import backend as _backend
from kmix import record
from kmix._checks import StateNotRestoredWarning, WarnOnce
from kmix._layers import forward_state_variables
from kmix.optimizer import jax_shards
from kmix.optimizer import jax_train_function as _jax_train_function
from kmix.optimizer.model_hooks import warn_unrestored

__all__ = [
    "JaxStep",
    "apply",
    "check_at_creation",
    "protect_forward_state",
    "stateless_apply",
]

_said = WarnOnce()


class JaxStep(NamedTuple):
    """What :func:`stateless_apply` leaves for the wrapped train step, in the same trace.

    Attributes:
        applies: boolean scalar: the inner optimizer applied (False: a skipped step).
        loss_nonfinite: boolean scalar: the step's unscaled loss was inf or NaN.
        finish: the forward measurement (or None) and the source of the first
            non-finite values (:mod:`kmix.optimizer.jax_shards`) -> the optimizer's
            values after the step. The forward pass is measured inside
            ``jax.value_and_grad`` and comes out with its auxiliary values, which
            ``stateless_apply`` does not see.
        scale: the loss scale the step used.
    """

    applies: Any
    loss_nonfinite: Any
    finish: Callable[..., list]
    scale: Any


def stateless_apply(
    optimizer: Any, optimizer_variables: list, grads: list, trainable_variables: list
) -> tuple[list, list]:
    """kmix's step as values: apply or skip, then record (what ``fit`` calls on JAX).

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        optimizer_variables: values of ``optimizer.variables``, in that order.
        grads: gradients of the scaled loss, one per tracked trainable variable.
        trainable_variables: values of the tracked trainable variables.

    Returns:
        ``(trainable_values, optimizer_values)`` after the step, recorded without the
        forward pass (the wrapped train step records it with: :class:`JaxStep`).

    Raises:
        ValueError: the optimizer is not built, or the values do not match its variables.
    """
    if not optimizer.built:
        raise ValueError(
            "kmix.LossScaleOptimizer.stateless_apply() needs a built optimizer: call "
            "optimizer.build(model.trainable_variables) first."
        )
    variables, grads = optimizer.variables, list(grads)
    tracked = optimizer.parts.tracked
    if len(grads) != len(tracked):
        raise ValueError(
            f"kmix.LossScaleOptimizer was built for {len(tracked)} trainable variables and "
            f"now gets {len(grads)} gradients: the model's trainable variables changed since "
            "(e.g. layers were frozen or unfrozen). Keras optimizers keep per-variable "
            "state, so create a new optimizer (kmix.LossScaleOptimizer(...)) and compile "
            "the model again."
        )
    if len(optimizer_variables) != len(variables):
        raise ValueError(
            "kmix.LossScaleOptimizer.stateless_apply(): got "
            f"{len(optimizer_variables)} optimizer values and {len(grads)} gradients; "
            f"expected {len(variables)} (optimizer.variables) and {len(tracked)} (one per "
            "variable the optimizer was built with, in that order)."
        )
    values = list(optimizer_variables)
    where = {id(v): i for i, v in enumerate(variables)}
    own = optimizer.parts.own_count
    recorder = optimizer.recorder
    slots = [where[id(getattr(recorder, field))] for field in record.RECORD_FIELDS]
    old = record.RecordValues(*(values[i] for i in slots))
    flags = ops.concatenate([record.nonfinite_flags(grads), optimizer.parts.loss_flags()])
    applies = ops.logical_not(ops.any(flags[: len(grads) + 1] > 0))
    inner_values = values[own:]
    float8 = optimizer.float8
    assigned = float8.kept(grads, trainable_variables) if float8.active else grads

    def apply_inner() -> tuple[list, list]:
        unscaled = [
            g if g is None or optimizer.parts.overwrites(v) else g / old.scale
            for g, v in zip(assigned, tracked, strict=True)
        ]
        new_trainable, new_inner = optimizer.inner_optimizer.stateless_apply(
            inner_values, unscaled, trainable_variables
        )
        return list(new_trainable), list(new_inner)

    def skip() -> tuple[list, list]:  # the batch never happened: the values as given
        return list(trainable_variables), list(inner_values)

    new_trainable, new_inner = ops.cond(applies, apply_inner, skip)
    statistics = recorder.statistics()

    rule = optimizer.config.rule
    due = statistics.due(old.counters)
    float8_new = (
        float8.step_values(values, where, grads, trainable_variables, applies, old.counters)
        if float8.active
        else {}
    )

    def finish(
        forward: tuple[Any, Any] | None, source: record.NonfiniteSource = record.NO_SOURCE
    ) -> list:
        new = record.record_step(
            old.counters,
            due,
            flags,
            rule,
            count=lambda delta: old._replace(counters=old.counters + delta),
            advance=lambda: record.advance_record(
                old, grads, flags, statistics, forward, rule, source
            ),
            write=lambda values, outcome: values,
            cond=ops.cond,
        )
        out = list(values[:own])
        for slot, value in zip(slots, new, strict=True):
            out[slot] = value
        for slot, value in float8_new.items():
            out[slot] = value
        return out + list(new_inner)

    optimizer.parts.trace.get().jax_step = JaxStep(
        applies, flags[len(grads)] > 0, finish, old.scale
    )
    new_values = finish(None)
    if float8.active:  # the output gradients' float8 state follows the scale's change
        new_trainable = float8.rescaled(list(new_trainable), new_values[slots[0]] / old.scale)
    return new_trainable, new_values


def apply(optimizer: Any, grads: list, trainable_variables: list | None) -> None:
    """``optimizer.apply`` on JAX (a custom loop, outside ``jit``): the step, then assign.

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        grads: gradients of the scaled loss, one per variable.
        trainable_variables: the variables, all those the optimizer tracks, in its
            order; None for those.

    Raises:
        ValueError: ``trainable_variables`` is not every tracked variable in order.
    """
    tracked = optimizer.parts.tracked
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
    )
    optimizer.parts.trace.get().jax_step = None  # no train step here to take the decision
    for variable, value in zip(variables, new_trainable, strict=True):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_values, strict=True):
        variable.assign(value)


def check_at_creation(optimizer: Any) -> None:
    """Nothing to say at creation on JAX."""


def protect_forward_state(optimizer: Any, model: Any) -> None:
    """Host reads of ``optimizer`` sync ``model`` first; the model's step is wrapped.

    JAX's trainer keeps the state outside the variables during ``fit`` until
    ``model.jax_state_sync()`` (Keras 3.15 purges the variables' values meanwhile: reading
    one raises): the optimizer's reads (``read_state``, ``scale_events``...) call it, so
    they are true during and after fit. A change of the statistics settings retraces the
    train step (they are constants in it). The model's ``train_step`` and
    ``compute_loss_and_updates`` are wrapped (:func:`wrap_train_step`).

    Args:
        optimizer: a ``kmix.LossScaleOptimizer``.
        model: the model it trains (held weakly).
    """
    ref = weakref.ref(model)

    def sync() -> None:
        held = ref()
        if held is not None and hasattr(held, "jax_state_sync"):
            held.jax_state_sync()

    def settings_changed() -> None:
        held, settings = ref(), optimizer.recorder.settings
        if held is not None:
            retrace(held, tuple(np.asarray(settings.value(n)).tobytes() for n in settings.base))

    optimizer.recorder.sync = sync
    optimizer.recorder.settings.on_change = settings_changed
    optimizer.hooks.attach(model)
    wrap_train_step(optimizer, model)


def retrace(model: Any, key: tuple) -> None:
    """Makes ``fit`` run the train step traced with the settings ``key`` names.

    ``make_train_function(force=True)`` alone is not enough on JAX: ``jax.jit`` caches
    its trace by the step function's identity, so a new ``jit`` of the same
    ``model.train_step`` reuses the old trace and its constants. A function object
    delegating to the step, one per settings seen, is traced once per settings: a
    ``fit`` that requests what an earlier one did (a monitor's every fit) reuses its trace.

    Args:
        model: a model whose ``train_step`` kmix wrapped (:func:`wrap_train_step`).
        key: the settings' values, hashable.
    """
    step = getattr(model.train_step, "__wrapped__", model.train_step)  # no chain of them
    delegates = step.__dict__.setdefault("kmix_delegates", {})  # they live with the step
    delegate = delegates.get(key)
    if delegate is None:

        def delegate(state: tuple, data: Any) -> tuple:
            return step(state, data)

        delegate.__wrapped__ = step
        delegates[key] = delegate
    model.train_step = delegate
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)


def measuring(optimizer: Any) -> bool:
    """Whether the step being traced measures its own forward pass (statistics due).

    :mod:`kmix.optimizer.jax_train_function` traces two variants of the step and sets this while
    it traces each; a step traced another way (a user's own ``jax.jit`` of
    ``model.train_step``) measures its own pass.
    """
    return optimizer.parts.trace.get().measuring


def _measure_forward(
    optimizer: Any, model: Any, unscaled_loss: Any, optimizer_values: list, trainable: list
) -> Any:
    """The tapped forward pass measured, inside ``value_and_grad``; None without records.

    ``trainable``: the step's values of ``model.trainable_variables`` (a float8 layer's
    inputs' scale is read from them: the variable itself holds no traced value here).
    """
    hooks, recorder = optimizer.hooks, optimizer.recorder
    if not hooks.tapping or not measuring(optimizer):
        return None
    counters = optimizer_values[[id(v) for v in optimizer.variables].index(id(recorder.counters))]
    due = recorder.statistics().due(counters)
    nonfinite = ops.logical_not(ops.all(ops.isfinite(unscaled_loss)))
    where = {id(v): i for i, v in enumerate(model.trainable_variables)}
    forward = hooks.forward_statistics(
        nonfinite, due[0], value_of=lambda variable: trainable[where[id(variable)]]
    )
    recorder.layers, recorder.not_float16 = hooks.layers, hooks.not_float16
    recorder.float8_inputs = hooks.float8_inputs
    return forward


def origin_again(
    optimizer: Any, model: Any, step: JaxStep, new_trainable: list, calls: list[tuple]
) -> tuple[Any, Any] | None:
    """The forward origin of a step whose loss is non-finite, from its pass run again.

    A step that does not measure its own pass (the operands of a conditional are made and
    kept at every step) runs the pass again when its loss is non-finite, which skips the
    step: the trainable values after it are those before, bit for bit; with the
    non-trainable values and the inputs the step's ``compute_loss_and_updates`` gave the
    model (the seed state included), the pass has the step's own inputs. It is compiled
    apart from the step's, so on another device its last bits could differ. The weights
    are read after the update so that XLA copies none.

    Args:
        optimizer: the ``kmix.LossScaleOptimizer`` whose step is traced (tapping).
        model: the model.
        step: what ``stateless_apply`` left for this step.
        new_trainable: the trainable values the step returns.
        calls: ``(non-trainable values, x)`` of each ``compute_loss_and_updates`` call
            of the step; other than one (a ``train_step`` of the user's own): no origin.

    Returns:
        ``(origin, stats)`` with statistics unmeasured (NaN), or None without records.
    """
    hooks, recorder = optimizer.hooks, optimizer.recorder
    hooks.take_records()  # the step's own pass, not measured in this variant
    if len(calls) != 1 or not all(_backend.reachable(v) for v in keras.tree.flatten(calls)):
        return None
    non_trainable, x = calls[0]
    kwargs = {"training": True} if model._call_has_training_arg else {}
    layers: list = []

    def again() -> Any:
        with hooks.recording():
            model.stateless_call(new_trainable, non_trainable, x, **kwargs)
        records = hooks.take_records()
        layers[:] = hooks.layers
        return record.measure_origin(records) if records else record.no_origin()

    origin = _backend.rare_cond(step.loss_nonfinite, again, record.no_origin)
    if not layers:
        return None
    recorder.layers = layers
    return origin, ops.full((len(layers), len(record.STORED_FIELDS)), np.nan, "float32")


def _forward_inputs(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """``(non-trainable values, x)`` of a ``compute_loss_and_updates`` call (Keras's
    signature: trainable, non-trainable, metrics, x, y, sample weight)."""
    non_trainable = args[1] if len(args) > 1 else kwargs.get("non_trainable_variables")
    return non_trainable, args[3] if len(args) > 3 else kwargs.get("x")


def wrap_train_step(optimizer: Any, model: Any) -> None:
    """Wraps the model's JAX ``train_step`` and ``compute_loss_and_updates`` for kmix.

    ``compute_loss_and_updates`` (inside ``value_and_grad``) measures the tapped forward
    pass and appends the measurement to its non-trainable values; ``train_step`` takes
    it back out, finishes the optimizer's record with it (:class:`JaxStep`), and on a
    skipped step returns the float variables the layers declare non-trainable (what the
    forward pass assigned: BatchNormalization's statistics) as they were, as kmix does on
    TensorFlow. Integer ones keep the update and are named once. Idempotent for the same
    optimizer; remakes a train function made before the wrapper.

    Args:
        optimizer: a ``kmix.LossScaleOptimizer``.
        model: the model it trains.
    """
    warn_unrestored(model)
    if keras.config.is_nnx_enabled() and forward_state_variables(model):
        _said(  # Keras then calls the class's train_step, not the model's attribute
            "kmix on the JAX backend with Flax NNX enabled: a skipped step does not give "
            "back the float state the forward pass assigned (Keras calls the class's "
            "train_step, which kmix does not wrap); disable NNX to have it given back.",
            StateNotRestoredWarning,
        )
    wrapped_for = getattr(model, "_kmix_jax_train_step_of", None)
    if wrapped_for is not None and wrapped_for() is optimizer:
        return
    original_step = type(model).train_step.__get__(model)
    original_loss = type(model).compute_loss_and_updates.__get__(model)
    owner = weakref.ref(optimizer)

    def compute_loss_and_updates(*args: Any, **kwargs: Any) -> tuple:
        loss, aux = original_loss(*args, **kwargs)
        held, values = owner(), kwargs.get("optimizer_variables")
        if held is None or held is not model.optimizer or not kwargs.get("training"):
            return loss, aux
        calls = held.parts.trace.get().forward_calls
        if calls is not None:
            calls.append(_forward_inputs(args, kwargs))
        if values is None:
            return loss, aux
        forward = _measure_forward(
            held, model, aux[0], values, args[0] if args else kwargs["trainable_variables"]
        )
        if forward is None:
            return loss, aux
        return loss, (aux[0], aux[1], [*aux[2], *forward], *aux[3:])

    def train_step(state: tuple, data: Any) -> tuple:
        held = owner()
        if held is None or held is not model.optimizer:  # compiled again with another
            return original_step(state, data)
        trace = held.parts.trace.get()
        trace.forward_calls = calls = []
        try:
            logs, new_state = original_step(state, data)
        finally:
            trace.forward_calls = None
        n = len(state[1])
        non_trainable, forward = list(new_state[1][:n]), tuple(new_state[1][n:]) or None
        step, trace.jax_step = trace.jax_step, None
        if step is None or not _backend.reachable(step.applies):
            return logs, (new_state[0], non_trainable, *new_state[2:])
        if forward is None and held.hooks.tapping and not measuring(held):
            forward = origin_again(held, model, step, new_state[0], calls)
        source = jax_shards.shard_source(
            model, state, data, step.scale, ops.logical_not(step.applies)
        )
        if source is not None and held.hooks.tapping:
            held.hooks.take_records()  # the shards' passes are not the step's
        given = {id(v) for v in forward_state_variables(model)}
        pairs = zip(model.non_trainable_variables, state[1], non_trainable, strict=True)
        kept = [
            ops.where(step.applies, new, old) if id(v) in given else new for v, old, new in pairs
        ]
        if forward is None and source is None:
            optimizer_values = new_state[2]
        else:
            optimizer_values = step.finish(forward, source or record.NO_SOURCE)
        return logs, (new_state[0], kept, optimizer_values, *new_state[3:])

    model.train_step = train_step
    model.compute_loss_and_updates = compute_loss_and_updates
    model._kmix_jax_train_step_of = owner  # weak: the model is not saved with it
    _jax_train_function.install(optimizer, model)
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)
