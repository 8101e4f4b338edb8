"""Open runs, and how a run that ``fit`` did not finish still ends with its evidence.

``fit`` calls ``on_train_end`` only when it returns. So that a run ended any other way
still leaves its evidence on disk, every kmix callback between train begin and train
end is *open* (:data:`OPEN`, a typed registry filled by ``kmix.callbacks``, where the
callbacks of one model also find their peers), and :func:`end_run` finishes the open
ones of a model with a reason: the guard calls it before it stops or raises,
``LoopDriver`` when its loop raises, and a thin wrapper around ``keras.Model.fit`` when
``fit`` raises — another callback's exception, Ctrl-C. What is still open when the
process exits or, in IPython/Jupyter, when a cell ends, is finished then.

Importing this module changes nothing in Keras. :func:`install_fit_wrapper` installs the
wrapper, explicitly, when a kmix optimizer or callback is created (once per process; it
calls the original ``fit`` and adds only what kmix's objects ask for).

A leaf: it imports Keras and :mod:`kmix.tags` only, so the optimizer can install the
``fit`` wrapper without importing the callbacks or the report.
"""

from __future__ import annotations

import atexit
import functools
import sys
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

import keras

from kmix._checks import KmixWarning
from kmix.tags import EXCEPTION, INTERRUPTED

T = TypeVar("T")


class OpenRun(Protocol):
    """A kmix callback between train begin and train end."""

    model: Any

    def finish(self, reason: str, message: str) -> None:
        """Ends the run with ``reason`` (see :data:`kmix.tags.RUN_END_REASONS`)."""


class OpenRuns:
    """The open kmix callbacks (held weakly), and the peers of one model among them."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet = weakref.WeakSet()

    def add(self, callback: OpenRun) -> None:
        """Opens ``callback``'s run."""
        self._open.add(callback)

    def discard(self, callback: OpenRun) -> None:
        """Closes ``callback``'s run (nothing if it is not open)."""
        self._open.discard(callback)

    def __contains__(self, callback: object) -> bool:
        return callback in self._open

    def __bool__(self) -> bool:
        return len(self._open) > 0

    def __iter__(self) -> Iterator[OpenRun]:
        return iter(list(self._open))

    def of_model(self, model: Any, kind: type[T]) -> list[T]:
        """The open callbacks of class ``kind`` (subclasses included) training ``model``."""
        return [c for c in self._open if isinstance(c, kind) and c.model is model]


OPEN = OpenRuns()
"""The kmix callbacks between train begin and train end."""
_hooks_installed = False


def end_run(model: Any, reason: str, message: str) -> None:
    """Finishes every open kmix callback of ``model`` (all models if None).

    Args:
        model: the model whose run ends, or None for every open run.
        reason: one of :data:`kmix.tags.RUN_END_REASONS`.
        message: what happened, in words (e.g. the guard's diagnosis).
    """
    for callback in OPEN:
        if model is None or callback.model is model:
            try:
                callback.finish(reason, message)
            except Exception as error:  # never hide what ended the run behind our error
                OPEN.discard(callback)
                warnings.warn(
                    f"kmix: {type(callback).__name__} could not write the end of the run "
                    f"({reason}): {type(error).__name__}: {error}",
                    KmixWarning,
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


def install_fit_wrapper() -> None:
    """Wraps ``keras.Model.fit`` once per process (kmix's optimizer and callbacks call this
    when they are created; importing kmix does not).

    The wrapper calls the original ``fit``. Before, a kmix optimizer protects the model's
    forward state (:meth:`kmix.LossScaleOptimizer.protect_forward_state`: a skipped batch
    never happened); if ``fit`` raises, the open kmix runs of the model finish with the
    reason. A model trained by anything else runs exactly as before.
    """
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
