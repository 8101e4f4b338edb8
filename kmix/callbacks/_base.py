"""The shared base of kmix callbacks: count steps cheaply, read a source every N.

Counting batches is plain Python; the only host synchronisation is the read that
:meth:`StepCallback._read_state` makes every ``every`` optimizer steps.

Ending a run: ``fit`` calls ``on_train_end`` only when it returns. So that a run
ended any other way still leaves its evidence on disk, every kmix callback between
train begin and train end is *open*, and :func:`end_run` finishes the open ones
of a model with a reason: the guard calls it before it stops or raises,
``LoopDriver`` when its loop raises, and a thin wrapper around ``keras.Model.fit``
(installed when ``kmix.callbacks`` is imported) when ``fit`` raises — another
callback's exception, Ctrl-C. What is still open when the process exits or, in
IPython/Jupyter, when a cell ends, is finished then.
"""

from __future__ import annotations

import atexit
import functools
import sys
import warnings
import weakref
from typing import Any

import keras

from kmix.callbacks._source import Source, source_for
from kmix.record import Snapshot

COMPLETED = "completed"
STOPPED_BY_GUARD = "stopped_by_guard"
GUARD_RAISED = "guard_raised"
EXCEPTION = "exception"
INTERRUPTED = "interrupted"
"""Why a run ended (the reasons of ``kmix.tags.RunEnd``)."""

_OPEN: weakref.WeakSet = weakref.WeakSet()
_hooks_installed = False


def end_run(model: Any, reason: str, message: str) -> None:
    """Finishes every open kmix callback of ``model`` (all models if None).

    Args:
        model: the model whose run ends, or None for every open run.
        reason: one of the reasons above.
        message: what happened, in words (e.g. the guard's diagnosis).
    """
    for callback in list(_OPEN):
        if model is None or callback.model is model:
            try:
                callback.finish(reason, message)
            except Exception as error:  # never hide what ended the run behind our error
                _OPEN.discard(callback)
                warnings.warn(
                    f"kmix: {type(callback).__name__} could not write the end of the run "
                    f"({reason}): {type(error).__name__}: {error}",
                    stacklevel=2,
                )


def reason_for(error: BaseException | None) -> tuple[str, str]:
    """``(reason, message)`` for a run that ``error`` ended (None: an unknown exit)."""
    if error is None:
        return EXCEPTION, "the process ended while training was running"
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED, "training was interrupted (KeyboardInterrupt)"
    reason = getattr(error, "kmix_reason", None)
    if reason is not None:
        return reason, str(error)
    return EXCEPTION, f"training ended by {type(error).__name__}: {error}"


def _finish_at_exit() -> None:
    if _OPEN:
        end_run(None, *reason_for(getattr(sys, "last_value", None)))


def _finish_after_cell(result: Any) -> None:
    if _OPEN:
        end_run(None, *reason_for(getattr(result, "error_in_exec", None)))


def _install_hooks() -> None:
    """Registers the process-exit hook, and IPython's post-cell hook when in IPython."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_finish_at_exit)
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        shell.events.register("post_run_cell", _finish_after_cell)


def _finish_runs_when_fit_raises() -> None:
    """Wraps ``keras.Model.fit`` once: if it raises, open kmix runs of the model finish."""
    original = keras.Model.fit
    if getattr(original, "_kmix_finishes_runs", False):
        return

    @functools.wraps(original)
    def fit(self: keras.Model, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except BaseException as error:
            if _OPEN:
                end_run(self, *reason_for(error))
            raise

    fit._kmix_finishes_runs = True
    keras.Model.fit = fit


_finish_runs_when_fit_raises()


def warn_user(message: str) -> None:
    """Warns once, pointing at the user's code (the first frame outside Keras, TF, kmix)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in {
        "kmix",
        "keras",
        "tensorflow",
    }:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


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
        _install_hooks()
        _OPEN.add(self)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Notes the first step index of this execution (no host sync)."""
        self._batch_begin = batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Counts the steps of this execution; reads when ``every`` steps have passed."""
        if self not in _OPEN:
            return
        steps = self.params.get("steps") if self.params else None
        last = min(batch, steps - 1) if steps else batch
        self._steps_seen += max(last - self._batch_begin + 1, 1)
        if self._steps_seen - self._steps_at_read >= self._every:
            self._read(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        """Finishes the run as completed (unless something ended it before)."""
        if self in _OPEN:
            self.finish(COMPLETED, "fit returned", logs)

    def finish(self, reason: str, message: str, logs: dict | None = None) -> None:
        """Ends the run: subclasses write what is unwritten; then the run is closed.

        Args:
            reason: why the run ended (see the module docstring).
            message: what happened, in words.
            logs: the latest logs, if any.
        """
        _OPEN.discard(self)

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
