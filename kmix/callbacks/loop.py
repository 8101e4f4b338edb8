"""LoopDriver: kmix's callbacks in a custom training loop, on one machine or many.

``model.fit`` calls the callback hooks itself; a custom loop (for example under
``tf.distribute.MultiWorkerMirroredStrategy``, where Keras 3's ``fit`` cannot run)
needs someone to call them. The driver does, and makes the workers agree: only the
chief writes TensorBoard data, and a stop asked for on any worker stops every
worker at the same step, so none is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import keras

from kmix import backend
from kmix.backend import worker_count
from kmix.callbacks._base import end_run, reason_for, warn_user
from kmix.callbacks.autopilot import PrecisionAutopilot
from kmix.callbacks.monitor import MixedPrecisionMonitor

CHIEF_ONLY = (MixedPrecisionMonitor, keras.callbacks.TensorBoard)
"""Callbacks that write files, run on the chief worker only."""


class LoopDriver:
    """Calls Keras callbacks from a custom loop and agrees on stopping across workers.

    Example (every worker runs the same code)::

        with strategy.scope():
            model = make_model()
            opt = kmix.LossScaleOptimizer(keras.optimizers.Adam())
            model.compile(optimizer=opt)          # so callbacks find the optimizer
        callbacks = [kmix.callbacks.MixedPrecisionMonitor("runs/mw"),
                     kmix.callbacks.LossScaleGuard()]
        with kmix.callbacks.LoopDriver(model, callbacks, strategy) as driver:
            for x, y in dataset:
                train_step(x, y)                  # strategy.run(...): scale_loss + apply
                if driver.step_end():             # True on every worker, or on none
                    break

    Args:
        model: the model being trained, compiled with its optimizer (``compile``
            needs no loss for a custom loop).
        callbacks: Keras callbacks, e.g. kmix's monitor and guard.
        strategy: the ``tf.distribute`` strategy; default: the current one.
        chief_only: callback classes that run on the chief worker only.

    Raises:
        TypeError: ``callbacks`` is not a sequence.
        ValueError: an item of ``callbacks`` is not a Keras callback.
    """

    def __init__(
        self,
        model: keras.Model,
        callbacks: Sequence[keras.callbacks.Callback] = (),
        strategy: Any = None,
        chief_only: tuple[type, ...] = CHIEF_ONLY,
    ) -> None:
        if isinstance(callbacks, str | bytes) or not isinstance(callbacks, Sequence):
            raise TypeError(
                f"Invalid `callbacks` for LoopDriver: callbacks={callbacks!r} of type "
                f"{type(callbacks).__name__}. `callbacks` must be a list of Keras callbacks, "
                "e.g. [kmix.callbacks.MixedPrecisionMonitor('runs/x')], or [] for none."
            )
        callbacks = list(callbacks)
        for callback in callbacks:
            if not isinstance(callback, keras.callbacks.Callback):
                raise ValueError(
                    f"Invalid `callbacks` for LoopDriver: {callback!r} is not a "
                    "keras.callbacks.Callback. Pass callback instances, e.g. "
                    "[kmix.callbacks.MixedPrecisionMonitor('runs/x')]."
                )
        self.strategy = strategy or backend.default_strategy()
        self.is_chief = bool(getattr(self.strategy.extended, "should_save_summary", True))
        self._workers = worker_count(self.strategy)
        if not self.is_chief:
            callbacks = [c for c in callbacks if not isinstance(c, chief_only)]
        self.model = model
        self.callbacks = keras.callbacks.CallbackList(callbacks, model=model)
        self.callbacks.set_params({"epochs": 1, "steps": None, "verbose": 0})
        self.step = 0
        self._batch = 0
        self._autopilots = [c for c in callbacks if isinstance(c, PrecisionAutopilot)]
        self._moves_seen = 0  # PrecisionAutopilot moves at the last step end
        self._retraces = False  # a function of driver.function() follows the moves

    def function(self, fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        """``tf.function(fn, **kwargs)``, traced again after PrecisionAutopilot moves a layer.

        A custom loop's compiled step keeps the dtype policies it was traced with; a
        layer the autopilot moved to float32 computes in float32 only in a new trace.

        Example::

            train_step = driver.function(train_step)   # instead of @tf.function

        Args:
            fn: the Python function of the step.
            **kwargs: passed to ``tf.function`` (e.g. ``jit_compile=True``).

        Returns:
            A callable with ``fn``'s arguments.
        """
        traced: dict[str, Any] = {}
        self._retraces = True
        fn = getattr(fn, "python_function", fn)  # a tf.function already: its Python function

        def call(*args: Any, **call_kwargs: Any) -> Any:
            moves = self._move_count()
            if traced.get("moves") != moves:
                traced["moves"], traced["fn"] = moves, backend.compile_function(fn, **kwargs)
            return traced["fn"](*args, **call_kwargs)

        return call

    def _move_count(self) -> int:
        return sum(len(autopilot.moves) for autopilot in self._autopilots)

    def __enter__(self) -> LoopDriver:
        self._moves_seen = self._move_count()  # moves of an earlier loop were told then
        self.model.stop_training = False
        self.callbacks.on_train_begin()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is not None:  # the evidence is written, with why the loop ended
            end_run(self.model, *reason_for(exc))
        self.callbacks.on_train_end()

    def step_end(self, logs: dict | None = None) -> bool:
        """Tells the callbacks that one optimizer step finished.

        Args:
            logs: metrics of the step, if any (e.g. ``{"loss": float(loss)}``).

        Returns:
            True when training should stop. Every worker must call this after
            every step; they all get the same answer at the same step (with more
            than one worker, through one small collective per call).

        Raises:
            Exception: what a callback raised (e.g. ``LossScaleGuardError`` in
                ``mode="raise"``), after every worker has agreed to stop.
        """
        self.step += 1

        def hooks() -> None:
            self.callbacks.on_train_batch_begin(self._batch)
            self.callbacks.on_train_batch_end(self._batch, logs)

        stop = self._agree(hooks)
        self._batch += 1
        moves = self._move_count()
        if moves > self._moves_seen and not self._retraces:
            warn_user(
                "kmix.callbacks.LoopDriver: PrecisionAutopilot moved a layer out of float16; "
                "a tf.function traced before keeps the old policy until it is traced again. "
                "Wrap the step with `train_step = driver.function(train_step)` instead of "
                "@tf.function, so it is."
            )
        self._moves_seen = moves
        return stop

    def _agree(self, run_hooks: Any) -> bool:
        """Runs callback hooks, then agrees across workers on whether to stop."""
        error = None
        try:
            run_hooks()
        except Exception as raised:  # stop every worker before re-raising
            error = raised
        stop = self._any_worker(error is not None or bool(self.model.stop_training))
        self.model.stop_training = stop
        if error is not None:
            raise error
        return stop

    def _any_worker(self, flag: bool) -> bool:
        if self._workers == 1:  # one process: its own flag is the answer, no sync
            return flag
        return backend.any_replica(self.strategy, flag)
