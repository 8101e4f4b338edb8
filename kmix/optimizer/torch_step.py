"""kmix.LossScaleOptimizer's step on Keras's torch backend: decide, apply or skip, record.

On torch ``fit`` runs each step eagerly (Keras's default; ``torch.compile`` with
``jit_compile=True``): the train step computes the forward pass, calls ``scale_loss``,
``backward()``, and then ``optimizer.apply(grads, variables)`` under ``torch.no_grad()``.
The step is TensorFlow's without replicas (:mod:`kmix.optimizer.assigned_step`): the
flags, then the inner optimizer or a skip, then the record's new values assigned. A
skipped step gives back the float state the forward pass assigned, which the wrapped
train step saved (:mod:`kmix.optimizer.model_hooks`); the wrapped step also opens the
step's scope (:func:`kmix.backend.step_scope`), so the tap records its forward pass.

Host reads: an eager step decides on the host, and each read of a device value is a sync.
kmix's step reads its counters and flags at once and decides there
(:func:`kmix.optimizer.assigned_step.read_decisions`: apply or skip, quiet or not, measure
the forward pass or not): one read a step, where stock Keras's reads two (whether the
gradients are finite, whether the scale grows); float8 layers' check is read with them. The
flags come from a screen (:func:`kmix.backend.screened_nonfinite_flags`, one norm per
gradient); a step it does not prove finite is decided again on the exact flags, with a
second read (a skip, or a finite gradient whose squares overflow). Statistics are computed
only where they are due.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from keras import ops

from kmix import backend, record
from kmix.optimizer import assigned_step

__all__ = ["apply", "check_at_creation", "protect_forward_state", "stateless_apply"]


def apply(optimizer: Any, grads: list, trainable_variables: list | None) -> None:
    """``optimizer.apply`` on torch: one decision, then apply or skip, then record.

    Args:
        optimizer: a built ``kmix.LossScaleOptimizer``.
        grads: gradients of the scaled loss, one per variable (``None`` allowed).
        trainable_variables: the variables; None for those the optimizer was built with.

    Raises:
        ValueError: variables the optimizer was not built with.
    """
    parts = optimizer.parts
    variables = parts.tracked if trainable_variables is None else list(trainable_variables)
    aligned = assigned_step.aligned_gradients(parts, grads, variables)
    loss = parts.loss_flags()
    flags = ops.concatenate([backend.screened_nonfinite_flags(aligned), loss])
    float8 = optimizer.float8  # its check read with the flags: the scales before the step
    check = float8.before_apply(aligned, True) if float8.active else None
    decided = assigned_step.read_decisions(optimizer, flags, len(aligned), check)  # one read
    if not decided.applies:  # a skip, or a suspicion: the exact flags decide (a second read)
        flags = ops.concatenate([record.nonfinite_flags(aligned), loss])
        decided = assigned_step.read_decisions(optimizer, flags, len(aligned), check)
    before, forward, forward_state = assigned_step.measured_step(optimizer, aligned, flags, decided)
    apply_inner = functools.partial(assigned_step.apply_inner, optimizer, grads, variables)
    assigned_step.step(
        optimizer, aligned, flags, before, forward_state, apply_inner, forward, decided
    )


def stateless_apply(
    optimizer: Any, optimizer_variables: list, grads: list, variables: list
) -> tuple[list, list]:
    """Refused on torch: ``fit`` never calls it there, and Keras's torch optimizers
    update their variables in place.

    Raises:
        ValueError: always, saying what to call instead.
    """
    raise ValueError(
        "kmix.LossScaleOptimizer.stateless_apply() is not supported on the torch backend "
        "(Keras's torch optimizers update variables in place); call "
        "optimizer.apply(grads, variables), or use KERAS_BACKEND=jax."
    )


def check_at_creation(optimizer: Any) -> None:
    """Nothing to say at creation on torch."""


def protect_forward_state(optimizer: Any, model: Any) -> None:
    """Wraps ``model``'s train step: its forward state given back on a skip, its scope open.

    Args:
        optimizer: a ``kmix.LossScaleOptimizer``.
        model: the model it trains.
    """
    optimizer.hooks.protect(model)
    wrapped = model.train_step
    if getattr(wrapped, "kmix_step_scope", False):
        return
    owner = weakref.ref(optimizer)

    @functools.wraps(wrapped)
    def train_step(data: Any) -> Any:
        if owner() is None:
            return wrapped(data)
        with backend.step_scope():
            return wrapped(data)

    train_step.kmix_step_scope = True
    model.train_step = train_step
