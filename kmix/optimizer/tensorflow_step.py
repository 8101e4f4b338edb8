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
from kmix._checks import KmixWarning, WarnOnce
from kmix.backend import worker_count
from kmix.float8 import StepCheck, worst_of_replicas
from kmix.optimizer import assigned_step
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
    aligned = assigned_step.aligned_gradients(parts, grads, variables)
    flags = ops.concatenate([record.nonfinite_flags(aligned), parts.loss_flags()])
    context = tf.distribute.get_replica_context()
    flags, source = agreed(context, flags, len(aligned))
    before, forward, forward_state = assigned_step.measured_step(optimizer, aligned, flags)
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        apply_inner = functools.partial(assigned_step.apply_inner, optimizer, grads, variables)
        assigned_step.step(
            optimizer,
            aligned,
            flags,
            before,
            forward_state,
            apply_inner,
            forward,
            source=source,
            float8_check=functools.partial(float8_check, optimizer, context, aligned),
        )
    else:  # the cross-replica step reads the first replica's forward statistics
        applies = assigned_step.applies_of(flags, len(aligned))
        context.merge_call(
            _merged_step,
            args=(optimizer, aligned, flags, before, forward_state, forward, grads, variables),
            kwargs={"source": source, "check": float8_check(optimizer, context, aligned, applies)},
        )


def agreed(context: Any, flags: Any, n: int) -> tuple[Any, record.NonfiniteSource]:
    """The flags every replica sees, and the first replica whose own were non-finite.

    One all-reduce: each replica adds, after its flags, a one-hot row of the replicas
    set where its gradients or loss were non-finite; the sum says which were.

    Args:
        context: the replica context.
        flags: this replica's flags (``n`` gradients, then the loss's two).
        n: how many gradient flags there are.

    Returns:
        ``(flags, source)``: the summed flags, and the first non-finite replica
        (``replica_id_in_sync_group``; -1 when none, or with one replica).
    """
    replicas = context.num_replicas_in_sync
    if replicas == 1:
        return flags, record.NO_SOURCE
    mine = tf.one_hot(context.replica_id_in_sync_group, replicas, dtype=flags.dtype)
    bad = tf.cast(tf.reduce_any(flags[: n + 1] > 0), flags.dtype)
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat([flags, mine * bad], 0))
    return summed[:-replicas], record.NonfiniteSource(
        tf.constant(-1), record.first_flagged(summed[-replicas:])
    )


_SAID = WarnOnce()
PER_REPLICA_FLOAT8 = (
    "kmix: under {strategy} with {replicas} replicas, Keras assigns each replica's float8 "
    "scales and amax histories from that replica's own share of the batch (they are mirrored "
    "variables created with aggregation 'none'), so the replicas' float8 scales drift apart and "
    "a saved model keeps the first replica's. kmix checks every replica against its own scales "
    "and reports a saturation on any of them; the kmix/fp8_* health it writes is the first "
    "replica's."
)


def float8_check(optimizer: Any, context: Any, aligned: list, applies: Any) -> StepCheck | None:
    """The step's float8 check, the same on every replica; None without float8 layers.

    Made before the inner optimizer assigns (the scales this step used). With several
    replicas each checks against its own scales (Keras keeps one set per replica: said
    once, :data:`PER_REPLICA_FLOAT8`), and one all-reduce of every replica's amax and
    limit gives all of them :func:`kmix.float8.worst_of_replicas`, so a saturation on any
    replica is recorded and every replica takes the same branch of the record.

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        context: the replica context.
        aligned: the scaled gradients, one per tracked variable.
        applies: boolean scalar: the step applies (agreed by every replica).

    Returns:
        The agreed :class:`kmix.float8.StepCheck`, or None.
    """
    float8 = optimizer.float8
    if not float8.active:
        return None
    check = float8.before_apply(aligned, applies)
    replicas = context.num_replicas_in_sync
    if replicas == 1:
        return check
    strategy = type(tf.distribute.get_strategy()).__name__
    _SAID(PER_REPLICA_FLOAT8.format(strategy=strategy, replicas=replicas), KmixWarning)
    mine = tf.one_hot(context.replica_id_in_sync_group, replicas, on_value=True, off_value=False)
    rows = tf.where(mine[:, None, None], tf.stack([check.amax, check.limit])[None], 0.0)
    every = context.all_reduce(tf.distribute.ReduceOp.SUM, rows)  # (replicas, 2, n)
    return worst_of_replicas(every[:, 0], every[:, 1], applies)


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


def _each_copy(distribution: Any, variable: Any, value: Any) -> list[tuple[Any, Any]]:
    """``(copy, value)`` pairs that give each replica's copy of ``variable`` its own
    ``value`` back in a cross-replica context (Keras keeps per-replica state, e.g. a batch
    normalization's moving statistics, with aggregation ``"none"``: one assignment there
    would copy the first replica's value to all)."""
    values = distribution.experimental_local_results(value)
    copies = getattr(variable, "value", variable)
    if isinstance(copies, tf.distribute.DistributedValues):
        return list(zip(copies.values, values, strict=True))
    return [(variable, values[0])]


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
    source: record.NonfiniteSource = record.NO_SOURCE,
    check: StepCheck | None = None,
) -> None:
    """Cross-replica part: one decision for all (the flags and the float8 check are
    already agreed)."""

    def first(value: Any) -> Any:
        return None if value is None else distribution.experimental_local_results(value)[0]

    assigned_step.step(
        optimizer,
        [first(g) for g in aligned],
        first(flags),
        keras.tree.map_structure(first, before),
        [pair for v, old in forward_state for pair in _each_copy(distribution, v, old)],
        lambda: distribution.extended.call_for_each_replica(
            assigned_step.apply_inner, args=(optimizer, grads, variables)
        ),
        None if forward is None else tuple(first(t) for t in forward),
        source=record.NonfiniteSource(*(v if isinstance(v, int) else first(v) for v in source)),
        float8_check=None if check is None else lambda applies: StepCheck(*map(first, check)),
    )
