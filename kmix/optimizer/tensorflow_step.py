"""kmix.LossScaleOptimizer's step on Keras's TensorFlow backend: decide, apply or skip, record.

``fit`` traces the step into a ``tf.function`` and calls ``optimizer.apply`` in it, in the
replica context of the strategy in scope. The step agrees the non-finite flags across
replicas (and workers) before any update, so every replica takes the same decision, then
applies the inner optimizer or skips, and assigns the record's new values
(:meth:`kmix.optimizer.recorder.StepRecorder.record`, over the one pure step
:func:`kmix.record.advance_record`). A skipped step gives back the float state the forward
pass assigned, which the wrapped train step saved (:mod:`kmix.optimizer.model_hooks`).

The functions here are those every step module has (:mod:`kmix.optimizer.jax_step`):
:func:`apply`, :func:`stateless_apply`, :func:`protect_forward_state`,
:func:`check_at_creation`. They take the optimizer and use its public attributes and
``optimizer.parts`` (:class:`kmix.optimizer.loss_scale_optimizer.StepParts`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from kmix import record
from kmix._checks import KmixWarning
from kmix.backend import worker_count
from kmix.optimizer.model_hooks import restore
from kmix.optimizer.recorder import Before

__all__ = ["apply", "check_at_creation", "protect_forward_state", "stateless_apply"]


def apply(optimizer: Any, grads: list, trainable_variables: list | None) -> None:
    """``optimizer.apply`` in a replica context: one decision for every replica.

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        grads: gradients of the scaled loss, one per variable (``None`` allowed).
        trainable_variables: the variables; None for those the optimizer was built with.

    Raises:
        ValueError: called in a cross-replica context, or with variables the optimizer
            was not built with.
    """
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "kmix.LossScaleOptimizer.apply() must be called in a replica context, "
            "e.g. inside `strategy.run(...)`."
        )
    parts = optimizer.parts
    variables = parts.tracked if trainable_variables is None else list(trainable_variables)
    parts.check_known(variables)
    # Align gradients with the variables the optimizer tracks, so per-variable
    # state has a fixed layout whatever subset this call updates.
    aligned = [None] * len(parts.tracked)
    for grad, variable in zip(grads, variables, strict=True):
        aligned[parts.index_of(variable)] = grad
    flags = ops.concatenate([record.nonfinite_flags(aligned), parts.loss_flags()])
    # Replicas agree: every replica sees the same flags before any update.
    context = tf.distribute.get_replica_context()
    if context.num_replicas_in_sync > 1:
        flags = context.all_reduce(tf.distribute.ReduceOp.SUM, flags)
    hooks, recorder = optimizer.hooks, optimizer.recorder
    forward_state = hooks.take_forward_state()
    before = recorder.before_step()
    forward = hooks.forward_statistics(flags[len(aligned)] > 0, before.due[0])
    recorder.layers, recorder.not_float16 = hooks.layers, hooks.not_float16
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        apply_inner = functools.partial(_apply_inner, optimizer, grads, variables)
        _step(optimizer, aligned, flags, before, forward_state, apply_inner, forward)
    else:  # the cross-replica step reads the first replica's forward statistics
        context.merge_call(
            _merged_step,
            args=(optimizer, aligned, flags, before, forward_state, forward, grads, variables),
        )


def stateless_apply(
    optimizer: Any, optimizer_variables: list, grads: list, variables: list
) -> tuple[list, list]:
    """Refused on TensorFlow, as Keras refuses its own optimizers' (``fit`` never calls it
    there; Keras's inner optimizers cannot run it under ``tf.distribute``).

    Raises:
        ValueError: always, saying what to call instead.
    """
    raise ValueError(
        "kmix.LossScaleOptimizer.stateless_apply() is not supported on the TensorFlow "
        "backend (Keras's optimizers refuse it there: it is incompatible with "
        "tf.distribute); call optimizer.apply(grads, variables), or use KERAS_BACKEND=jax."
    )


def protect_forward_state(optimizer: Any, model: keras.Model) -> None:
    """Wraps ``model``'s train step so that a skipped step gives its forward state back."""
    optimizer.hooks.protect(model)


FIT_UNDER_MULTI_WORKER = (
    "kmix.LossScaleOptimizer was created under tf.distribute.MultiWorkerMirroredStrategy: "
    "model.fit cannot train under this strategy with Keras {version} (keras-team/keras#20585: "
    "it fails before the first step with 'Attempt to convert a value (PerReplica...)'), so "
    "train with a custom loop driven by kmix.callbacks.LoopDriver, as in the README section "
    "'Distributed training'."
)


def check_at_creation(optimizer: Any) -> None:
    """Says at creation what would otherwise surprise later: under
    MultiWorkerMirroredStrategy, what Keras would say with a deep traceback."""
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    if worker_count(strategy) > 1:  # one worker alone trains with fit fine
        warnings.warn(
            FIT_UNDER_MULTI_WORKER.format(version=keras.version()), KmixWarning, stacklevel=3
        )


def _apply_inner(optimizer: Any, grads: list, variables: list) -> None:
    """Unscales the gradients and applies the inner optimizer (replica context)."""
    scale, overwrites = optimizer.dynamic_scale, optimizer.parts.overwrites
    optimizer.inner_optimizer.apply(
        [
            g if g is None or overwrites(v) else ops.divide(g, scale)
            for g, v in zip(grads, variables, strict=True)
        ],
        variables,
    )


def _merged_step(
    distribution: Any,
    optimizer: Any,
    aligned: list,
    flags: Any,
    before: Before,
    forward_state: list,
    forward: tuple[Any, Any] | None,
    grads: list,
    variables: list,
) -> None:
    """Cross-replica part: one decision for all (the flags are already all-reduced)."""

    def first(value: Any) -> Any:
        return None if value is None else distribution.experimental_local_results(value)[0]

    _step(
        optimizer,
        [first(g) for g in aligned],
        first(flags),
        keras.tree.map_structure(first, before),
        [(v, first(old)) for v, old in forward_state],
        lambda: distribution.extended.call_for_each_replica(
            _apply_inner, args=(optimizer, grads, variables)
        ),
        None if forward is None else tuple(first(t) for t in forward),
    )


def _step(
    optimizer: Any,
    aligned: list,
    flags: Any,
    before: Before,
    forward_state: list,
    apply_inner: Any,
    forward: tuple[Any, Any] | None,
) -> None:
    """Applies when every gradient and the loss are finite; records the step either way."""
    applies = ops.logical_not(ops.any(flags[: len(aligned) + 1] > 0))
    float8, recorder = optimizer.float8, optimizer.recorder
    if float8.active:  # the scales this step used, read before the inner optimizer assigns
        check, old_scale = float8.before_apply(aligned, applies), ops.copy(recorder.scale)
    ops.cond(applies, apply_inner, _noop)
    on_skip = (lambda: restore(forward_state)) if forward_state else None
    recorder.record(aligned, flags, before, forward, on_skip)
    if float8.active:  # saturations counted; the output gradients follow the scale
        float8.after_record(check, before.packed, old_scale, ops.copy(recorder.scale))


def _noop() -> None:
    return None
