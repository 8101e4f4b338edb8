"""The comparison's input from arrays where Keras's backend is not TensorFlow: no ``tf.data``.

:func:`kmix.compare.rounds.make_dataset` batches ``(x, y)`` arrays with ``tf.data`` on
TensorFlow (Keras's fastest input there). On JAX and torch that would import TensorFlow
only for the input: :class:`ArrayBatches` gives the same batches, in the same order, with
the two operations the comparison uses of a repeated dataset, ``take`` and ``skip``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["ArrayBatches"]


class ArrayBatches:
    """``(x, y)`` arrays cut into batches of ``batch_size``, repeated without end.

    The remainder is dropped, so every step has ``batch_size`` examples (as
    ``tf.data``'s ``batch(..., drop_remainder=True)``); batch ``k`` of the endless sequence
    is batch ``k % count`` of the arrays.

    Args:
        x: an array, or a nested structure of arrays with one leading dimension.
        y: the same for the targets.
        batch_size: examples per batch, at most the number of examples.
        start: the index of the first batch (what :meth:`skip` moves).

    Raises:
        ValueError: the arrays differ in length, or hold fewer examples than one batch
            (:func:`kmix.compare.rounds.make_dataset` says both to the user first).
    """

    def __init__(self, x: Any, y: Any, batch_size: int, start: int = 0) -> None:
        import keras

        self._x, self._y = keras.tree.map_structure(np.asarray, (x, y))
        lengths = {len(a) for a in keras.tree.flatten((self._x, self._y))}
        if len(lengths) > 1:
            raise ValueError(f"x and y differ in length: {sorted(lengths)} rows")
        examples = lengths.pop()
        self.count = examples // batch_size
        if self.count < 1:
            raise ValueError(f"{examples} examples make no batch of batch_size={batch_size}")
        self.batch_size = batch_size
        self.start = start

    def batch(self, index: int) -> tuple[Any, Any]:
        """Batch ``index`` of the endless sequence, as NumPy arrays."""
        import keras

        first = (index % self.count) * self.batch_size
        rows = slice(first, first + self.batch_size)
        return keras.tree.map_structure(lambda a: a[rows], (self._x, self._y))

    def take(self, steps: int) -> Iterator[tuple[Any, Any]]:
        """The next ``steps`` batches from :attr:`start`, as a generator (what ``fit`` reads)."""
        return (self.batch(self.start + k) for k in range(steps))

    def skip(self, steps: int) -> ArrayBatches:
        """The same sequence, ``steps`` batches further on."""
        skipped = object.__new__(ArrayBatches)
        skipped.__dict__.update(self.__dict__, start=self.start + steps)
        return skipped
