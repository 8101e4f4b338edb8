"""The shared base of kmix callbacks: count steps cheaply, read the optimizer every N.

Counting batches is plain Python; the only host synchronisation is the read that
:meth:`StepCallback._read_state` makes every ``every`` optimizer steps.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

KMIX = "kmix"
KERAS = "keras"
"""Kinds of loss-scale optimizer a callback can find; None means no loss scaling."""


def loss_scale_kind(optimizer: Any) -> str | None:
    """Says which loss-scale optimizer ``optimizer`` is.

    Returns:
        ``"kmix"`` for ``kmix.LossScaleOptimizer``, ``"keras"`` for the stock
        ``keras.mixed_precision.LossScaleOptimizer``, None for anything else.
    """
    from kmix.optimizer import LossScaleOptimizer

    if isinstance(optimizer, LossScaleOptimizer):
        return KMIX
    if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        return KERAS
    return None


def _to_int(variable: Any) -> int:
    return int(ops.convert_to_numpy(variable))


class StepCallback(keras.callbacks.Callback):
    """Counts attempted optimizer steps in Python and calls ``_on_read`` every ``every``.

    Subclasses implement ``_on_read(logs)`` and call :meth:`_read_state` there.
    With ``steps_per_execution=k`` Keras calls the batch hooks once per ``k``
    steps; the count follows the ``begin``/``end`` step indices Keras passes.

    Args:
        every: read the optimizer once this many steps have passed since the last read.
    """

    def __init__(self, every: int) -> None:
        super().__init__()
        self._every = every
        self._optimizer: Any = None
        self._kind: str | None = None
        self._steps_seen = 0
        self._steps_at_read = 0
        self._batch_begin = 0
        self._start_step = 0
        self._start_iterations = 0

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs: dict | None = None) -> None:
        """Checks the model and finds its optimizer.

        Raises:
            ValueError: the model is not compiled.
        """
        model = self.model
        if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
            raise ValueError(
                f"{type(self).__name__} needs a compiled model with an optimizer; "
                f"model {getattr(model, 'name', model)!r} is not compiled. Call "
                "`model.compile(optimizer=kmix.LossScaleOptimizer(...), loss=...)` "
                "before `model.fit`."
            )
        self._optimizer = model.optimizer
        self._kind = loss_scale_kind(self._optimizer)
        self._steps_seen = self._steps_at_read = self._batch_begin = 0
        self._start_iterations = _to_int(self._optimizer.iterations) if self._optimizer.built else 0
        # Without kmix's counter, the stock state below counts from the iterations.
        self._start_step = self._start_iterations
        self._start_step = self._read_state()["attempted_steps"]

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Notes the first step index of this execution (no host sync)."""
        self._batch_begin = batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Counts the steps of this execution; reads when ``every`` steps have passed."""
        steps = self.params.get("steps") if self.params else None
        last = min(batch, steps - 1) if steps else batch
        self._steps_seen += max(last - self._batch_begin + 1, 1)
        if self._steps_seen - self._steps_at_read >= self._every:
            self._read(logs)

    # ----------------------------------------------------------------- reading
    def _read(self, logs: dict | None = None) -> None:
        """Reads now, whatever the count (e.g. at epoch end)."""
        self._steps_at_read = self._steps_seen
        self._on_read(logs or {})

    @property
    def _unread_steps(self) -> int:
        return self._steps_seen - self._steps_at_read

    def _on_read(self, logs: dict) -> None:
        raise NotImplementedError

    def _read_state(self) -> dict[str, Any]:
        """Reads the optimizer's state once (the host sync).

        Returns:
            With ``kmix.LossScaleOptimizer``: its :meth:`read_state`. With the
            stock Keras one: ``loss_scale``, ``attempted_steps`` and
            ``skipped_steps`` (inferred: steps seen in this ``fit`` minus steps the
            inner optimizer applied). Without loss scaling: ``attempted_steps`` and
            ``skipped_steps`` (0).
        """
        if self._kind == KMIX:
            return self._optimizer.read_state()
        state: dict[str, Any] = {
            "attempted_steps": self._start_step + self._steps_seen,
            "skipped_steps": 0,
        }
        if self._kind == KERAS:
            applied = _to_int(self._optimizer.iterations) - self._start_iterations
            state["skipped_steps"] = max(self._steps_seen - applied, 0)
            built = self._optimizer.built
            scale = self._optimizer.dynamic_scale if built else self._optimizer.initial_scale
            state["loss_scale"] = float(ops.convert_to_numpy(scale))
        return state
