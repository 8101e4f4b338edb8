"""How the demo's training steps are called, and how long they took: a clock in ``fit``.

The demo trains its model in the chosen policy, then the same model in float32; their
step times, side by side, say whether that policy is fast on this machine, in the same
words as the speed probe (:func:`kmix.policy.demo_check.step_line`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import keras


class StepClock(keras.callbacks.Callback):
    """Times each execution of the train function, per step (no host sync of its own).

    With ``steps_per_execution=k`` Keras calls the batch hooks once per ``k`` steps; the
    time between them is divided by the steps the execution ran. The first execution
    (tracing, compiling) is left out. Put it first among the callbacks, so that the time
    it measures is the step's, not other callbacks' work.

    Attributes:
        per_step: each execution's time over its steps, in seconds, the first left out.
        steps_a_call: the most steps one execution ran (0 before any ran).
    """

    def __init__(self) -> None:
        super().__init__()
        self.per_step: list[float] = []
        self.steps_a_call = 0
        self._begin, self._start, self._executions = 0, 0.0, 0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Starts the clock of this execution."""
        self._begin, self._start = batch, time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Stops it: the execution's time over its steps, after the first execution."""
        elapsed = time.perf_counter() - self._start
        steps = max(batch - self._begin + 1, 1)
        self.steps_a_call = max(self.steps_a_call, steps)
        self._executions += 1
        if self._executions > 1:
            self.per_step.append(elapsed / steps)

    @property
    def median_step_s(self) -> float | None:
        """The median time of a step in seconds; None before two executions ran."""
        return statistics.median(self.per_step) if self.per_step else None


def compile_model(model: Any, optimizer: Any, steps_per_execution: int) -> None:
    """Compiles the demo's model, with ``steps_per_execution`` where Keras's trainer runs it.

    Keras's torch trainer runs one step a call only: it refuses more when it makes the
    train function (a ``ValueError``). The demo asks the trainer, by making the function
    once, rather than the backend's name; refused, it compiles with one step a call.
    """

    def compile_with(steps: int) -> None:
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            steps_per_execution=steps,
        )

    compile_with(steps_per_execution)
    if steps_per_execution > 1:
        try:
            model.make_train_function()
        except ValueError as error:  # steps_per_execution must be 1 on this backend's trainer
            if "steps_per_execution" not in str(error):
                raise
            compile_with(1)
