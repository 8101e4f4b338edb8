"""The step where the optimizer assigns its variables (TensorFlow, torch): decide, apply or skip.

On TensorFlow (a traced ``tf.function``) and on torch (eager), ``fit`` calls
``optimizer.apply(grads, variables)`` and the step assigns what changes. The backend's step
module says where the decision is agreed (TensorFlow's replicas) and calls these::

    aligned = aligned_gradients(parts, grads, variables)
    flags = non-finite flags of aligned, then the loss's (then agreed across replicas)
    decided = read_decisions(optimizer, flags, n)      # torch: its decisions, one host read
                                                       # (screened flags; exact ones if not applied)
    before, forward, forward_state = measured_step(optimizer, aligned, flags, decided)
    step(optimizer, aligned, flags, before, forward_state, apply_inner, forward, decided)
        -> the inner optimizer applies when every flag is 0; the recorder records either way

Traced (TensorFlow), ``decided`` is None: the decisions are made in the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from keras import ops

from kmix import backend, record
from kmix.float8 import StepCheck
from kmix.optimizer.model_hooks import restore
from kmix.optimizer.recorder import Before

__all__ = [
    "Decisions",
    "aligned_gradients",
    "applies_of",
    "apply_inner",
    "measured_step",
    "read_decisions",
    "step",
]


def aligned_gradients(parts: Any, grads: list, variables: list) -> list:
    """The gradients in the order of the variables the optimizer tracks (None elsewhere).

    Per-variable state then has a fixed layout whatever subset a call updates.

    Args:
        parts: the optimizer's :class:`kmix.optimizer.StepParts`.
        grads: one gradient per variable in ``variables``.
        variables: tracked variables (checked to be known).

    Returns:
        One entry per tracked variable.

    Raises:
        ValueError: a variable the optimizer was not built with (Keras's message).
    """
    parts.check_known(variables)
    aligned = [None] * len(parts.tracked)
    for grad, variable in zip(grads, variables, strict=True):
        aligned[parts.index_of(variable)] = grad
    return aligned


def apply_inner(optimizer: Any, grads: list, variables: list) -> None:
    """Unscales the gradients and applies the inner optimizer (a replica's, on TensorFlow).

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        grads: the scaled gradients, one per variable (None allowed).
        variables: the variables they update.
    """
    scale, overwrites = optimizer.dynamic_scale, optimizer.parts.overwrites
    scaled = [
        i
        for i, (g, v) in enumerate(zip(grads, variables, strict=True))
        if g is not None and not overwrites(v)
    ]
    unscaled = list(grads)
    for i, g in zip(scaled, backend.divided([grads[i] for i in scaled], scale), strict=True):
        unscaled[i] = g
    optimizer.inner_optimizer.apply(unscaled, variables)


def measured_step(
    optimizer: Any, aligned: list, flags: Any, decided: Decisions | None = None
) -> tuple[Before, Any, list]:
    """What the step reads before deciding: the counters, the forward pass, its state.

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        aligned: :func:`aligned_gradients`' result.
        flags: the step's agreed non-finite flags.
        decided: the step's decisions read on the host already (:func:`read_decisions`,
            with its ``before``), or None: they are made in the step.

    Returns:
        ``(before, forward, forward_state)``: the recorder's :class:`Before`, the forward
        measurement (or None), and ``(variable, value before the pass)`` pairs.
    """
    hooks, recorder = optimizer.hooks, optimizer.recorder
    forward_state = hooks.take_forward_state()
    if decided is not None and decided.quiet:  # the record only counts: nothing measured
        hooks.drop_records()
        return decided.before, None, forward_state
    before = recorder.before_step() if decided is None else decided.before
    measure = None if decided is None else decided.measure
    forward = hooks.forward_statistics(flags[len(aligned)] > 0, before.due[0], measure)
    recorder.layers, recorder.not_float16 = hooks.layers, hooks.not_float16
    recorder.float8_inputs = hooks.float8_inputs
    return before, forward, forward_state


def applies_of(flags: Any, n: int, xp: Any = ops) -> Any:
    """True when no gradient of the ``n`` and not the loss is flagged non-finite (``xp``:
    ``keras.ops``, or :data:`kmix.record.HOST_OPS` for NumPy flags)."""
    return xp.logical_not(xp.any(flags[: n + 1] > 0))


class Decisions(NamedTuple):
    """An eager step's decisions, read on the host at once (Python bools).

    Attributes:
        before: the counters before the step and what is due.
        applies: the inner optimizer applies (no non-finite flag).
        quiet: the record only counts (:func:`kmix.record.step_record.is_quiet`).
        measure: the forward pass is measured (the loss is non-finite, or statistics due).
        float8: the float8 check made before the read, as if the step applied (None
            without float8 layers).
    """

    before: Before
    applies: bool
    quiet: bool
    measure: bool
    float8: StepCheck | None = None


def read_decisions(optimizer: Any, flags: Any, n: int, check: StepCheck | None = None) -> Decisions:
    """The step's decisions from one host read (where each read is a sync: torch).

    The counters and the flags are read together, with whether a float8 tensor saturated
    (``check``: a saturation makes the step not quiet); what is due, whether the step is
    quiet and whether it applies are then worked out on the host
    (:data:`kmix.record.HOST_OPS`), by the functions the traced step uses.

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        flags: the step's non-finite flags (``n`` gradients, then the loss's two).
        n: the number of tracked variables.
        check: the step's float8 check (:meth:`kmix.float8.Float8State.before_apply`, made
            as if the step applied), or None without float8 layers.

    Returns:
        The :class:`Decisions`.
    """
    read = flags  # what quiet asks: every flag 0, and no float8 tensor saturated
    if check is not None:
        read = ops.concatenate([flags, ops.cast(ops.any(check.saturated), "float32")[None]])
    before, counters, flagged = optimizer.recorder.host_before_step(read)
    quiet = record.is_quiet(counters, flagged, before.due, optimizer.config.rule, record.HOST_OPS)
    measure = bool(flagged[n] > 0 or before.due[0])
    applies = bool(applies_of(flagged, n, record.HOST_OPS))
    return Decisions(before, applies, bool(quiet), measure, check)


def step(
    optimizer: Any,
    aligned: list,
    flags: Any,
    before: Before,
    forward_state: list,
    apply: Callable[[], None],
    forward: tuple[Any, Any] | None,
    decided: Decisions | None = None,
    source: record.NonfiniteSource = record.NO_SOURCE,
    float8_check: Callable[[Any], StepCheck | None] | None = None,
) -> None:
    """Applies when every gradient and the loss are finite; records the step either way.

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        aligned: the scaled gradients, one per tracked variable.
        flags: the agreed flags (per gradient, loss non-finite, loss unknown).
        before: the counters before the step (:meth:`StepRecorder.before_step`).
        forward_state: what a skipped step gives back (:func:`measured_step`).
        apply: applies the inner optimizer (:func:`apply_inner` bound).
        forward: the forward measurement, or None.
        decided: the decisions read on the host already, or None (made in the step).
        source: which replica held the first non-finite values, where known.
        float8_check: traced, makes the float8 check from ``applies`` (TensorFlow: agreed
            by every replica); None: :meth:`kmix.float8.Float8State.before_apply`. Eager,
            the check is ``decided``'s.
    """
    applies = applies_of(flags, len(aligned)) if decided is None else decided.applies
    float8, recorder = optimizer.float8, optimizer.recorder
    quiet, also = (None if decided is None else decided.quiet), None
    if float8.active:  # the scales this step used, read before the inner optimizer assigns
        if decided is None:
            check = (
                float8.before_apply(aligned, applies)
                if float8_check is None
                else float8_check(applies)
            )
            quiet = ops.logical_and(  # a saturation makes the step not quiet
                record.is_quiet(before.packed, flags, before.due, optimizer.config.rule),
                ops.logical_not(ops.any(check.saturated)),
            )
        else:  # eager: checked before the one read (``quiet`` counts it); a skip saturates none
            check = decided.float8._replace(
                saturated=ops.logical_and(applies, decided.float8.saturated)
            )

        def also(old_scale: Any, new_scale: Any) -> None:  # in the record's full branch:
            float8.write_after(check, before.packed, old_scale, new_scale)  # counted, followed

    ops.cond(applies, apply, _noop)
    on_skip = (lambda: restore(forward_state)) if forward_state else None
    recorder.record(aligned, flags, before, forward, on_skip, quiet, source, also)


def _noop() -> None:
    return None
