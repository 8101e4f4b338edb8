"""How long the demo's training steps took: a clock in ``fit``, read after it.

The demo trains its model in the chosen policy, then the same model in float32; their
step times, side by side, say whether that policy is fast on this machine, in the same
words as the speed probe (:func:`kmix.policy.demo_check.step_line`).
"""

from __future__ import annotations

import statistics
import time

import keras


class StepClock(keras.callbacks.Callback):
    """Times each execution of the train function, per step (no host sync of its own).

    With ``steps_per_execution=k`` Keras calls the batch hooks once per ``k`` steps; the
    time between them is divided by the steps the execution ran. The first execution
    (tracing, compiling) is left out. Put it first among the callbacks, so that the time
    it measures is the step's, not other callbacks' work.
    """

    def __init__(self) -> None:
        super().__init__()
        self.per_step: list[float] = []
        self._begin, self._start, self._executions = 0, 0.0, 0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Starts the clock of this execution."""
        self._begin, self._start = batch, time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Stops it: the execution's time over its steps, after the first execution."""
        elapsed = time.perf_counter() - self._start
        self._executions += 1
        if self._executions > 1:
            self.per_step.append(elapsed / max(batch - self._begin + 1, 1))

    @property
    def median_step_s(self) -> float | None:
        """The median time of a step in seconds; None before two executions ran."""
        return statistics.median(self.per_step) if self.per_step else None
