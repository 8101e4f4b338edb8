"""A plain-Python step record and a fit loop without TensorFlow steps, for fast callback tests.

:class:`FakeRecorder` offers what ``KmixSource`` reads of ``kmix.LossScaleOptimizer``
(``kmix.callbacks._source.RecordingOptimizer``): counters, an event ring of
``event_capacity`` events, health steps, statistics requests. A test scripts its steps
(``None``: applied; ``"skip"``: a gradient overflow, a backoff above the floor and
``overflow_at_floor`` at it; ``"nan"``: a non-finite loss, ``forward_overflow``;
``"growth"``: applied, the scale doubles) and :func:`fake_fit` calls the callbacks'
hooks as ``model.fit`` does, so the guard's and the monitor's glue run in milliseconds.
The same scenarios through ``model.fit`` stay in the slow tier.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import keras

from kmix import _runs
from kmix.record.host_read import Snapshot
from kmix.record.step_record import RecordedEvent
from kmix.tags import ScaleEvent


class FakeRecorder:
    """The record of kmix's optimizer, advanced by :meth:`step` instead of a train step.

    Args:
        initial_scale: the scale at the start.
        min_scale: the floor.
        max_scale: the ceiling.
        event_capacity: events the ring keeps.
        health_every: the optimizer's own health period (requests compose by gcd).
        variable: the variable named by every gradient overflow.
        nan_variable: the first variable named at a non-finite loss (every gradient is
            NaN then; None: none named).
    """

    def __init__(
        self,
        initial_scale: float = 64.0,
        min_scale: float = 64.0,
        max_scale: float = 2.0**24,
        event_capacity: int = 128,
        health_every: int = 100,
        variable: str = "b/kernel",
        nan_variable: str | None = "a/kernel",
    ) -> None:
        self.config = SimpleNamespace(
            rule=SimpleNamespace(min_scale=min_scale, max_scale=max_scale)
        )
        self.event_capacity = event_capacity
        self.loss_scale = initial_scale
        self.attempted_steps = self.skipped_steps = 0
        self.consecutive_skips = self.consecutive_nonfinite_loss = 0
        self.health_step = 0
        self.loss_finite: bool | None = None
        self.events: list[ScaleEvent] = []
        self.reads: list[int] = []  # attempted_steps at each read_state (the host syncs)
        self.watched: list[Any] = []
        self._health_every = health_every
        self._requests: dict[int, int] = {}
        self._variable = variable
        self._nan_variable = nan_variable

    # ------------------------------------------------------------------ steps
    def step(self, kind: str | None = None) -> None:
        """One attempted step: applied (None, ``"growth"``) or skipped (``"skip"``, ``"nan"``)."""
        self.attempted_steps += 1
        step, old = self.attempted_steps, self.loss_scale
        if kind is None or kind == "growth":
            self.consecutive_skips = self.consecutive_nonfinite_loss = 0
            self.loss_finite = True
            if kind == "growth":
                self.loss_scale = min(old * 2, self.config.rule.max_scale)
                self._record(step, "growth", old, None, True)
        elif kind == "nan":
            self._skip()
            self.consecutive_nonfinite_loss += 1
            self.loss_finite = False
            self._record(step, "forward_overflow", old, self._nan_variable, False)
        elif kind == "skip":
            self._skip()
            self.consecutive_nonfinite_loss = 0
            self.loss_finite = True
            floor = self.config.rule.min_scale
            self.loss_scale = max(old / 2, floor)
            self._record(
                step, "backoff" if old > floor else "overflow_at_floor", old, self._variable, True
            )
        else:
            raise ValueError(f"unknown step kind {kind!r}")
        if step % self.health_every == 0:
            self.health_step = step

    def _skip(self) -> None:
        self.skipped_steps += 1
        self.consecutive_skips += 1

    def _record(self, step: int, kind: str, old: float, variable: str | None, finite: bool) -> None:
        self.events.append(
            ScaleEvent(
                index=len(self.events) + 1,
                step=step,
                kind=kind,
                old_scale=old,
                new_scale=self.loss_scale,
                variable=variable,
                nonfinite_variables=int(variable is not None),
                loss_finite=finite,
            )
        )

    # ---------------------------------------------------- what KmixSource reads
    @property
    def health_every(self) -> int:
        return math.gcd(self._health_every, *self._requests.values())

    def read_state(self, counters_only: bool = False) -> Snapshot:
        self.reads.append(self.attempted_steps)
        return Snapshot(
            loss_scale=None if counters_only else self.loss_scale,
            attempted_steps=self.attempted_steps,
            skipped_steps=self.skipped_steps,
            consecutive_skips=self.consecutive_skips,
            loss_finite=self.loss_finite,
            consecutive_nonfinite_loss=self.consecutive_nonfinite_loss,
            event_count=len(self.events),
            health_step=self.health_step,
        )

    def recorded_events(self, since: int = 0) -> list[RecordedEvent]:
        """The held events after ``since`` (one counters read first, as kmix's does)."""
        count = self.read_state(counters_only=True).event_count
        if count == since:
            return []
        held = self.events[-self.event_capacity :]
        return [RecordedEvent(event, {}) for event in held if event.index > since]

    def request_statistics(self, owner: Any, health_every: int, histogram_every: int) -> None:
        self._requests[id(owner)] = health_every

    def release_statistics(self, owner: Any) -> None:
        self._requests.pop(id(owner), None)

    def underflow_by_variable(self) -> dict[str, float]:
        return {}

    def subnormal_by_variable(self) -> dict[str, float]:
        return {}

    def exponent_histograms_by_variable(self) -> dict[str, Any]:
        return {}

    def activations_by_layer(self) -> dict[str, dict[str, float]]:
        return {}

    def watch(self, model: Any) -> list[str]:
        self.watched.append(model)
        return []


class FakeModel:
    """What the callbacks read of a compiled model, around ``optimizer``."""

    def __init__(
        self, optimizer: Any, steps_per_execution: int = 1, policy: str = "mixed_float16"
    ) -> None:
        self.compiled = True
        self.optimizer = optimizer
        self.steps_per_execution = steps_per_execution
        self.stop_training = False
        self.name = "fake"
        self.dtype_policy = keras.DTypePolicy(policy)

    def _flatten_layers(self, include_self: bool = False, recursive: bool = True) -> list:
        return []  # no layers: the monitor's dtype table is empty


def stock_step(optimizer: keras.mixed_precision.LossScaleOptimizer):
    """A stock Keras step, through its variables: a skip halves the scale, else it applies."""

    def step(kind: str | None) -> None:
        if kind is None:
            optimizer.iterations.assign_add(1)
        else:
            optimizer.dynamic_scale.assign(optimizer.dynamic_scale / 2)

    return step


def built_stock(initial_scale: float) -> keras.mixed_precision.LossScaleOptimizer:
    """Keras's stock loss-scale optimizer, built (its scale and iterations are variables)."""
    optimizer = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=initial_scale
    )
    optimizer.build([keras.Variable(0.0)])
    return optimizer


def scripted(n: int, **kinds: Any) -> list[str | None]:
    """``n`` steps, applied except at the 1-based steps given, e.g. ``skip=[3, 7]``."""
    steps: list[str | None] = [None] * n
    for kind, at in kinds.items():
        for step in at:
            steps[step - 1] = kind
    return steps


def fake_fit(
    model: FakeModel,
    callbacks: list[keras.callbacks.Callback],
    steps: list[str | None],
    epochs: int = 1,
    step=None,
) -> int:
    """Calls the callbacks' hooks as ``model.fit`` does, advancing the record per step.

    Args:
        model: the fake model; ``model.optimizer.step(kind)`` runs each step.
        callbacks: the callbacks.
        steps: one kind per step of an epoch (see :class:`FakeRecorder`).
        epochs: epochs to run.
        step: a function of the kind that runs a step (default: the optimizer's).

    Returns:
        How many executions (calls of ``on_train_batch_end``) ran.

    Raises:
        BaseException: what a callback raised, after the open kmix runs of the model
            are ended as kmix's ``fit`` wrapper ends them.
    """
    step = step or model.optimizer.step
    k = model.steps_per_execution
    for callback in callbacks:
        callback.set_model(model)
        callback.set_params({"epochs": epochs, "steps": len(steps), "verbose": 0})
    model.stop_training = False
    executions, logs = 0, {"loss": 0.0}
    try:
        for callback in callbacks:
            callback.on_train_begin()
        for epoch in range(epochs):
            nan_seen = False
            for callback in callbacks:
                callback.on_epoch_begin(epoch)
            for begin in range(0, len(steps), k):
                end = min(begin + k, len(steps)) - 1
                for callback in callbacks:
                    callback.on_train_batch_begin(begin)
                for kind in steps[begin : end + 1]:
                    step(kind)
                    nan_seen = nan_seen or kind == "nan"
                logs = {"loss": math.nan if nan_seen else 0.0}  # the epoch's running mean
                for callback in callbacks:
                    callback.on_train_batch_end(end, logs)
                executions += 1
                if model.stop_training:
                    break
            for callback in callbacks:
                callback.on_epoch_end(epoch, logs)
            if model.stop_training:
                break
        for callback in callbacks:
            callback.on_train_end(logs)
    except BaseException as error:
        _runs.end_run(model, *_runs.reason_for(error))
        raise
    return executions
