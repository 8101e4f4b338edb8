"""Each training step's own loss, for ``kmix compare``'s loss curves.

Keras's ``logs["loss"]`` in a batch callback is the result of the model's loss
tracker, a ``keras.metrics.Mean`` over the steps since the epoch began: one non-finite
step makes it non-finite to the end of the ``fit``, and recovering a step's loss from
two consecutive means, ``l_k = k m_k - (k - 1) m_(k-1)``, is off by up to k rounding
errors of the mean.

:func:`watch_step_loss` gives the compiled model a :class:`StepLoss` as its loss
tracker instead: every backend's ``train_step`` hands the tracker the step's loss (the
value ``compute_loss`` returned, unscaled for distribution, as Keras reports it); the
tracker keeps that value unchanged instead of adding it to a mean, so
``logs["loss"]`` is the step's own loss, exactly. It stays one of ``model.metrics``
(Keras's JAX trainer carries its variables through the step like any metric's) and
costs what the mean cost: a scalar assignment a step. It is installed on the
comparison's own models only, by this explicit call, after ``compile`` (which makes a
new tracker).

Imports Keras: :mod:`kmix.compare.comparison` imports this module when it trains.
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

__all__ = ["StepLoss", "watch_step_loss"]


class StepLoss(keras.metrics.Metric):
    """A loss tracker whose result is the latest step's loss, not a mean.

    Attributes:
        loss: the latest value (NaN after :meth:`reset_state`, which Keras calls as
            each epoch begins).
        updates: how many values it was given since it was built (never reset): 0
            after a ``fit`` says the model's own ``train_step`` does not use the loss
            tracker, and ``logs["loss"]`` is whatever that step returns.
    """

    def __init__(self, name: str = "loss") -> None:
        super().__init__(name=name)
        self.loss = self.add_variable(
            shape=(), initializer=keras.initializers.Constant(math.nan), name="loss"
        )
        self.updates = self.add_variable(shape=(), initializer="zeros", name="updates")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Keeps the step's loss (a scalar; its mean if not), ignoring its weight.

        Args:
            values: the step's loss.
            sample_weight: the examples in the batch (what a mean over steps would
                weigh it by); not used.
        """
        del sample_weight
        self.loss.assign(ops.mean(ops.cast(values, self.dtype)))
        self.updates.assign(self.updates + 1.0)

    def result(self) -> Any:
        return ops.convert_to_tensor(self.loss)

    def reset_state(self) -> None:
        self.loss.assign(math.nan)

    def updated(self) -> bool:
        """Whether any step gave it a loss (read on the host, after a ``fit``)."""
        return bool(ops.convert_to_numpy(self.updates) > 0)


def watch_step_loss(model: Any) -> StepLoss:
    """Gives ``model`` a :class:`StepLoss` as its loss tracker: ``logs["loss"]`` per step.

    Call it after ``model.compile`` (which makes a new tracker) and before ``fit``.

    Args:
        model: a compiled ``keras.Model``.

    Returns:
        The tracker.
    """
    tracker = StepLoss()
    # Set as compile sets it, outside Keras's attribute tracking (which a built
    # subclassed model has locked); model.metrics lists the loss tracker by itself.
    object.__setattr__(model, "_loss_tracker", tracker)
    return tracker
