"""``fit``'s train function on JAX while kmix taps the forward pass: two steps, one chosen.

XLA's CPU runtime sets up every buffer of a compiled step at every execution, those of
conditional branches not taken included, and the activations a conditional measures
are its operands: made and kept at every step, measured or not (measured: bench/history,
the JAX passes). So the step is traced twice:

* *measuring*: the step measures its own forward pass (origin and statistics), as on
  TensorFlow;
* *quiet*: no statistics; a non-finite loss runs the pass again for its origin
  (:func:`kmix.optimizer.jax_step.origin_again`).

Before each execution the train function chooses on the host: *measuring* where gradient
health (and with it the activation statistics) is due at one of the execution's steps,
from the attempted steps and ``health_every``, both known there. The attempted steps
are read from the state once (a new ``fit``, a state synced or loaded since) and counted
on after; the step itself still decides on the device, so a miscount can only leave a
due step's statistics unmeasured (absent, never stale), not move an event.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from kmix import record

__all__ = ["TrainFunction", "due_within", "install"]

_ATTEMPTED = record.Counters._fields.index("attempted_steps")


def due_within(attempted: int, steps: int, every: int, int_max: int) -> bool:
    """Whether health is due at one of the ``steps`` steps after ``attempted`` attempts.

    The same rule as :func:`kmix.record.step_record.due_now` applied step by step: the n-th next
    step is ``min(attempted + n, int_max)`` (the counter saturates), due when ``every > 0``
    divides it.

    Args:
        attempted: attempted steps before the execution (the record's counter).
        steps: steps the execution may run (``steps_per_execution``).
        every: ``health_every``; 0 or less: never.
        int_max: the counters' largest value.

    Returns:
        True when a multiple of ``every`` lies in ``[attempted + 1, attempted + steps]``
        (clipped to ``int_max``).
    """
    if every <= 0 or steps <= 0:
        return False
    first, last = min(attempted + 1, int_max), min(attempted + steps, int_max)
    return last // every * every >= first


class _Counted:
    """An iterator that counts what is taken from it (an execution's steps)."""

    def __init__(self, iterator: Iterator) -> None:
        self._iterator, self.taken = iterator, 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        item = next(self._iterator)
        self.taken += 1
        return item


class TrainFunction:
    """``(state, iterator) -> (logs, state)``: the quiet or the measuring execution.

    Args:
        optimizer: the ``kmix.LossScaleOptimizer`` the model trains with.
        model: the model.
        quiet: Keras's train function of the quiet step.
        measuring: Keras's train function of the measuring step.
    """

    def __init__(self, optimizer: Any, model: Any, quiet: Callable, measuring: Callable) -> None:
        recorder = optimizer.recorder
        self._model = weakref.ref(model)
        self._quiet, self._measuring = quiet, measuring
        self._slot = [id(v) for v in optimizer.variables].index(id(recorder.counters))
        self._every = int(np.asarray(recorder.settings.variables["health_every"].value))
        self._int_max = int(np.iinfo(keras.backend.standardize_dtype(recorder.counters.dtype)).max)
        self._counters: Any = None  # the counters the last execution returned
        self._attempted = 0
        self.measured_executions = 0
        """Executions that ran the measuring step (for tests and benches)."""

    def __call__(self, state: tuple, iterator: Iterator) -> tuple:
        counters = state[2][self._slot]
        if counters is not self._counters:  # not the last execution's: read it (ready)
            if not getattr(counters, "is_fully_addressable", True):  # several processes
                counters = counters.addressable_data(0)
            self._attempted = int(np.asarray(counters)[_ATTEMPTED])
        model = self._model()
        steps = getattr(model, "steps_per_execution", 1) if model is not None else 1
        due = due_within(self._attempted, int(steps), self._every, self._int_max)
        counted = _Counted(iterator)
        logs, new_state = (self._measuring if due else self._quiet)(state, counted)
        self.measured_executions += int(due)
        self._attempted = min(self._attempted + counted.taken, self._int_max)
        self._counters = new_state[2][self._slot]
        return logs, new_state


def _variant(optimizer: Any, step: Callable, measuring: bool) -> Callable:
    """``step`` traced as the measuring or the quiet variant; one function object per
    ``(step, variant)``, kept with ``step``: ``jax.jit`` caches traces by identity."""
    own = isinstance(step, types.FunctionType)  # a bound method's __dict__ is its class's
    variants = step.__dict__.setdefault("kmix_variants", {}) if own else {}
    found = variants.get(measuring)
    if found is not None:
        return found
    owner = weakref.ref(optimizer)

    def variant(state: tuple, data: Any) -> tuple:
        held = owner()
        trace = held.parts.trace.get() if held is not None else None
        if trace is not None:
            trace.measuring = measuring
        try:
            return step(state, data)
        finally:
            if trace is not None:
                trace.measuring = True

    variants[measuring] = variant
    return variant


def install(optimizer: Any, model: Any) -> None:
    """Makes ``model.make_train_function`` build a :class:`TrainFunction` while tapped.

    Without a tap (no forward statistics to measure), when the model was compiled again
    with another optimizer, without ``jit`` (``jit_compile=False``, ``run_eagerly``: no
    compiled program whose buffers a branch would cost), or with Flax NNX (Keras then
    calls the class's ``train_step``), Keras's own train function is made: its step
    measures its own pass.

    Args:
        optimizer: the ``kmix.LossScaleOptimizer`` (held weakly).
        model: the model it trains.
    """
    original = type(model).make_train_function.__get__(model)
    owner = weakref.ref(optimizer)

    def make_train_function(force: bool = False) -> None:
        if model.train_function is not None and not force:
            return
        held = owner()
        tapped = held is not None and held.hooks.tapping and model.optimizer is held
        compiled = model.jit_compile and not model.run_eagerly  # else no buffers to spare
        if not tapped or not compiled or keras.config.is_nnx_enabled():
            original(force=True)
            return
        step = model.train_step
        made = []
        try:
            for measuring in (False, True):
                model.train_step = _variant(held, step, measuring)
                original(force=True)
                made.append(model.train_function)
        finally:
            model.train_step = step
        model.train_function = TrainFunction(held, model, *made)

    model.make_train_function = make_train_function
