"""ArrayBatches (kmix/compare/batches.py): the comparison's input from arrays off TensorFlow.

The reference is tf.data's own pipeline, as make_dataset builds it on TensorFlow: the same
batches, in the same order, the remainder dropped, repeated without end.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from kmix.compare.batches import ArrayBatches


def reference(x: np.ndarray, y: np.ndarray, batch_size: int, steps: int) -> list:
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size, drop_remainder=True)
    return [(a.numpy(), b.numpy()) for a, b in data.repeat().take(steps)]


def test_the_batches_are_tf_datas_in_order_repeated_and_skipped():
    x = np.arange(22 * 3, dtype="float32").reshape(22, 3)  # 22 = 5 batches of 4, 2 left over
    y = np.arange(22, dtype="int32")
    batches = ArrayBatches(x, y, 4)
    assert batches.count == 5
    got = list(batches.take(12))  # past the end: batch 5 is batch 0 again
    for (gx, gy), (rx, ry) in zip(got, reference(x, y, 4, 12), strict=True):
        np.testing.assert_array_equal(gx, rx)
        np.testing.assert_array_equal(gy, ry)
    assert [int(b[1][0]) for b in batches.skip(3).take(4)] == [12, 16, 0, 4]
    assert [int(b[1][0]) for b in batches.skip(3).skip(4).take(1)] == [8]
    assert list(batches.take(2))[0][1].tolist() == [0, 1, 2, 3]  # take does not consume


def test_nested_inputs_are_cut_alike_and_too_few_examples_are_refused():
    x = {"a": np.zeros((6, 2), "float32"), "b": np.arange(6)}
    (first, y), (second, _) = ArrayBatches(x, np.arange(6), 3).take(2)
    assert first["b"].tolist() == [0, 1, 2] and second["b"].tolist() == [3, 4, 5]
    assert first["a"].shape == (3, 2) and y.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="5 examples make no batch of batch_size=8"):
        ArrayBatches(np.zeros((5, 1)), np.zeros(5), 8)
    with pytest.raises(ValueError, match=r"x and y differ in length: \[5, 6\] rows"):
        ArrayBatches(np.zeros((6, 1)), np.zeros(5), 2)


def test_make_dataset_refuses_arrays_of_different_lengths_in_one_line():
    from kmix.compare.rounds import make_dataset
    from kmix.compare.values import CompareError

    with pytest.raises(CompareError, match=r"differ in length \(5, 6 rows\): give x and y"):
        make_dataset((np.zeros((6, 2)), np.zeros(5)), 2)
