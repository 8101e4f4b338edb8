"""What ``kmix demo`` does differently on Keras's JAX backend: nothing there imports TensorFlow.

Two Keras utilities the demo uses import TensorFlow whatever the backend, when it is
installed (it is, for kmix): ``keras.utils.set_random_seed`` seeds TensorFlow too (for
``tf.data``), and ``keras.callbacks.TensorBoard`` writes with ``tf.summary``. On JAX the
demo seeds Python, NumPy and Keras without TensorFlow (:func:`set_random_seed`) and writes
the epoch scalars Keras's callback would (``epoch_loss``, ``epoch_accuracy`` under
``train`` and ``validation``) with kmix's own event writer (:class:`EpochScalars`). On
TensorFlow both are Keras's own.
"""

from __future__ import annotations

import os
import sys

import keras

from kmix import _event_writer


def set_random_seed(seed: int) -> None:
    """Seeds Python, NumPy and Keras as ``keras.utils.set_random_seed`` does.

    On the TensorFlow backend, or once TensorFlow is imported anyway, that is Keras's
    function as is. On another backend, Keras's lazy handle on TensorFlow is told, for
    the call, that TensorFlow is absent, so Keras seeds everything else without importing
    it; where that handle is not as expected (another Keras version), Keras's function
    runs as is, importing TensorFlow.

    Args:
        seed: the seed.
    """
    if keras.backend.backend() == "tensorflow" or "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    try:
        from keras.src.utils import rng_utils

        handle = rng_utils.tf
        was = handle._available
    except (ImportError, AttributeError):
        keras.utils.set_random_seed(seed)
        return
    handle._available = False
    try:
        keras.utils.set_random_seed(seed)
    finally:
        handle._available = was


def tensorboard_callback(logdir: str) -> keras.callbacks.Callback:
    """The callback that writes the epoch scalars Keras's TensorBoard callback writes.

    Args:
        logdir: the TensorBoard log dir.

    Returns:
        ``keras.callbacks.TensorBoard(logdir)`` on the TensorFlow backend, else
        :class:`EpochScalars` (no TensorFlow).
    """
    if keras.backend.backend() == "tensorflow":
        return keras.callbacks.TensorBoard(logdir)
    return EpochScalars(logdir)


class EpochScalars(keras.callbacks.Callback):
    """Writes each epoch's logs as TensorBoard scalars, as Keras's TensorBoard callback does.

    ``loss`` and the metrics go to ``LOGDIR/train`` as ``epoch_loss``, ``epoch_accuracy``;
    the ``val_`` ones to ``LOGDIR/validation`` under the same names; the step is the epoch
    (from 0). Files are written with :class:`kmix._event_writer.EventWriter`: no TensorFlow.

    Args:
        logdir: the TensorBoard log dir.
    """

    def __init__(self, logdir: str) -> None:
        super().__init__()
        self.logdir = logdir
        self._writers: dict[str, _event_writer.EventWriter] = {}

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Writes the epoch's scalars and flushes them."""
        for name, value in (logs or {}).items():
            run, tag = ("validation", name[4:]) if name.startswith("val_") else ("train", name)
            try:
                number = float(value)
            except (TypeError, ValueError):  # not a scalar: Keras's callback skips it too
                continue
            self._writer(run).scalar(f"epoch_{tag}", number, step=epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        """Closes the files."""
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    def _writer(self, run: str) -> _event_writer.EventWriter:
        if run not in self._writers:
            self._writers[run] = _event_writer.EventWriter(os.path.join(self.logdir, run))
        return self._writers[run]
