"""Open runs, and how a run that ``fit`` did not finish still ends with its evidence.

``fit`` calls ``on_train_end`` only when it returns. So that a run ended any other way
still leaves its evidence on disk, every kmix callback between train begin and train
end is *open* (:data:`OPEN`, filled by ``kmix.callbacks``), and :func:`end_run`
finishes the open ones of a model with a reason: the guard calls it before it stops or
raises, ``LoopDriver`` when its loop raises, and a thin wrapper around
``keras.Model.fit`` (installed when this module is imported) when ``fit`` raises —
another callback's exception, Ctrl-C. What is still open when the process exits or, in
IPython/Jupyter, when a cell ends, is finished then.

A leaf: it imports Keras and :mod:`kmix.tags` only, so the optimizer can install the
``fit`` wrapper without importing the callbacks or the report.
"""

from __future__ import annotations

import atexit
import functools
import sys
import warnings
import weakref
from typing import Any

import keras

from kmix.tags import EXCEPTION, INTERRUPTED

OPEN: weakref.WeakSet = weakref.WeakSet()
"""The kmix callbacks between train begin and train end (each has ``model`` and ``finish``)."""
_hooks_installed = False


def end_run(model: Any, reason: str, message: str) -> None:
    """Finishes every open kmix callback of ``model`` (all models if None).

    Args:
        model: the model whose run ends, or None for every open run.
        reason: one of :data:`kmix.tags.RUN_END_REASONS`.
        message: what happened, in words (e.g. the guard's diagnosis).
    """
    for callback in list(OPEN):
        if model is None or callback.model is model:
            try:
                callback.finish(reason, message)
            except Exception as error:  # never hide what ended the run behind our error
                OPEN.discard(callback)
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
    if OPEN:
        end_run(None, *reason_for(getattr(sys, "last_value", None)))


def _finish_after_cell(result: Any) -> None:
    if OPEN:
        end_run(None, *reason_for(getattr(result, "error_in_exec", None)))


def install_hooks() -> None:
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
    """Wraps ``keras.Model.fit`` once: a kmix optimizer protects the model's forward state
    first; if ``fit`` raises, open kmix runs of the model finish."""
    original = keras.Model.fit
    if getattr(original, "_kmix_finishes_runs", False):
        return

    @functools.wraps(original)
    def fit(self: keras.Model, *args: Any, **kwargs: Any) -> Any:
        protect = getattr(getattr(self, "optimizer", None), "protect_forward_state", None)
        if callable(protect):  # kmix's optimizer: a skipped batch never happened
            protect(self)
        try:
            return original(self, *args, **kwargs)
        except BaseException as error:
            if OPEN:
                end_run(self, *reason_for(error))
            raise

    fit._kmix_finishes_runs = True
    keras.Model.fit = fit


_finish_runs_when_fit_raises()
