"""The shared base of kmix callbacks: count steps cheaply, read a source every N.

Counting batches is plain Python; the only host synchronisation is the read that
:meth:`StepCallback._read_state` makes every ``every`` optimizer steps. Between train
begin and train end a callback is open (:mod:`kmix._runs`), so a run that ``fit`` does
not finish still ends with its evidence on disk; creating one installs kmix's ``fit``
wrapper (:func:`kmix._runs.install_fit_wrapper`).
"""

from __future__ import annotations

import keras

from kmix import _runs
from kmix._checks import warn_user  # noqa: F401  (re-exported for the callbacks)
from kmix._runs import end_run, reason_for  # noqa: F401  (re-exported for the callbacks)
from kmix.callbacks._source import Source, source_for
from kmix.record import Snapshot
from kmix.tags import COMPLETED


class StepCallback(keras.callbacks.Callback):
    """Counts attempted optimizer steps in Python and calls ``_on_read`` every ``every``.

    Subclasses implement ``_on_read(logs)`` (calling :meth:`_read_state` there) and
    may extend :meth:`finish`. With ``steps_per_execution=k`` Keras calls the batch
    hooks once per ``k`` steps; the count follows the ``begin``/``end`` step indices
    Keras passes.

    Args:
        every: read the source once this many steps have passed since the last read.
    """

    def __init__(self, every: int) -> None:
        super().__init__()
        _runs.install_fit_wrapper()  # a run that fit does not finish still ends
        self._every = every
        self._source: Source = Source(None)
        self._steps_seen = 0
        self._steps_at_read = 0
        self._batch_begin = 0

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs: dict | None = None) -> None:
        """Checks the model, finds its source and opens the run.

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
        self._source = source_for(model.optimizer)
        self._source.begin(model)
        self._steps_seen = self._steps_at_read = self._batch_begin = 0
        _runs.install_hooks()
        _runs.OPEN.add(self)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Notes the first step index of this execution (no host sync)."""
        self._batch_begin = batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Counts the steps of this execution; reads when ``every`` steps have passed."""
        if self not in _runs.OPEN:
            return
        steps = self.params.get("steps") if self.params else None
        last = min(batch, steps - 1) if steps else batch
        self._steps_seen += max(last - self._batch_begin + 1, 1)
        if self._steps_seen - self._steps_at_read >= self._every:
            self._read(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        """Finishes the run as completed (unless something ended it before)."""
        if self in _runs.OPEN:
            self.finish(COMPLETED, "fit returned", logs)

    def finish(self, reason: str, message: str, logs: dict | None = None) -> None:
        """Ends the run: subclasses write what is unwritten; then the run is closed.

        Args:
            reason: why the run ended (see the module docstring).
            message: what happened, in words.
            logs: the latest logs, if any.
        """
        _runs.OPEN.discard(self)

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

    def _read_state(self, counters_only: bool = False) -> Snapshot:
        """Reads the source once (the host sync); see :meth:`Source.read`."""
        return self._source.read(self._steps_seen, counters_only)
