"""The epoch scalars of ``kmix demo``: Keras's TensorBoard callback, or kmix's writer.

``keras.callbacks.TensorBoard`` writes with ``tf.summary``, importing TensorFlow whatever
the backend. Where TensorFlow is not the backend (:data:`kmix.backend.USES_TENSORFLOW`),
the demo writes the epoch scalars Keras's callback would (``epoch_loss``,
``epoch_accuracy`` under ``train`` and ``validation``) with kmix's own event writer
(:class:`EpochScalars`); it seeds with :func:`kmix.backend.set_random_seed`, which does
not import TensorFlow there either.
"""

from __future__ import annotations

import os

import keras

from kmix import backend, tags


def tensorboard_callback(logdir: str) -> keras.callbacks.Callback:
    """The callback that writes the epoch scalars Keras's TensorBoard callback writes.

    Args:
        logdir: the TensorBoard log dir.

    Returns:
        ``keras.callbacks.TensorBoard(logdir)`` where TensorFlow is the backend, else
        :class:`EpochScalars` (no TensorFlow).
    """
    if backend.USES_TENSORFLOW:
        return keras.callbacks.TensorBoard(logdir)
    return EpochScalars(logdir)


class EpochScalars(keras.callbacks.Callback):
    """Writes each epoch's logs as TensorBoard scalars, as Keras's TensorBoard callback does.

    ``loss`` and the metrics go to ``LOGDIR/train`` as ``epoch_loss``, ``epoch_accuracy``;
    the ``val_`` ones to ``LOGDIR/validation`` under the same names; the step is the epoch
    (from 0). Files are written with :class:`kmix.tags.event_file.EventWriter`: no TensorFlow.

    Args:
        logdir: the TensorBoard log dir.
    """

    def __init__(self, logdir: str) -> None:
        super().__init__()
        self.logdir = logdir
        self._writers: dict[str, tags.EventWriter] = {}

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

    def _writer(self, run: str) -> tags.EventWriter:
        if run not in self._writers:
            self._writers[run] = tags.EventWriter(os.path.join(self.logdir, run))
        return self._writers[run]
