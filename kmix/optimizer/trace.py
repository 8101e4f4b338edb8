"""What one trace of the train step leaves between kmix's parts: typed, one per thread.

A train step is traced in one thread (each ``MirroredStrategy`` replica in its own), and
kmix's parts meet inside it: ``scale_loss`` notes whether the loss was finite before
``apply`` reads it; the wrapped train step hands ``apply`` the forward state it saved;
the tap gathers the calls of one trace. Each such hand-over is a field of a typed value,
kept per thread by :class:`PerThread`, kmix's one owner of ``threading.local``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PerThread", "StepTrace"]

T = TypeVar("T")


class PerThread(Generic[T]):
    """One value per thread, made by ``factory`` at the thread's first :meth:`get`.

    Example::

        trace = PerThread(StepTrace)
        trace.get().loss_nonfinite = flag     # this thread's value only
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._local = threading.local()

    def get(self) -> T:
        """This thread's value (made now if the thread has none)."""
        value = getattr(self._local, "value", None)
        if value is None:
            value = self._local.value = self._factory()
        return value

    def reset(self) -> T:
        """Replaces this thread's value with a new one and returns it."""
        value = self._local.value = self._factory()
        return value


@dataclasses.dataclass
class StepTrace:
    """What the optimizer's parts leave each other within one trace of the step.

    Attributes:
        loss_nonfinite: ``scale_loss``'s note, a boolean scalar tensor: the step's
            unscaled loss was inf or NaN (None: no loss was scaled in this trace).
        forward_state: ``(variable, value before the forward pass)`` pairs the wrapped
            train step saved (TensorFlow), for a skipped step to give back.
        jax_step: what ``stateless_apply`` left for the wrapped train step (JAX:
            :class:`kmix.optimizer.jax_step.JaxStep`).
        measuring: the step being traced measures its own forward pass (JAX; the quiet
            variant of :mod:`kmix.optimizer.jax_train_function` does not).
        forward_calls: ``(non-trainable values, x)`` of each ``compute_loss_and_updates``
            call of the step being traced (JAX), or None outside the wrapped train step.
    """

    loss_nonfinite: Any = None
    forward_state: list | None = None
    jax_step: Any = None
    measuring: bool = True
    forward_calls: list | None = None
