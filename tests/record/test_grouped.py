"""Per-tensor statistics a group of equal tensors at a time (kmix.record.grouped), vs NumPy."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from kmix.record import activations, health
from kmix.record import grouped as _grouped


def sums_and_peaks(rows):
    """[sum, max |x|, n] per row of a [k, n] stack: the ``measure`` under test."""
    total, peak = _grouped.reduce_rows(
        [ops.cast(rows, "float32"), ops.abs(ops.cast(rows, "float32"))], ("sum", "max")
    )
    n = ops.ones_like(total) * ops.cast(ops.shape(rows)[1], "float32")
    return ops.stack([total, peak, n], axis=1)


def interleaved_tensors():
    """Shapes that repeat out of order, two dtypes of one shape, and a None."""
    rng = np.random.default_rng(0)

    def ints(shape, dtype="float32"):
        return rng.integers(-50, 50, shape).astype(dtype)  # exact sums in any order

    return [ints((3, 4)), ints((5,)), None, ints((3, 4)), ints((5,), "float16"), ints((3, 4))]


@pytest.mark.jax
@pytest.mark.torch
def test_rows_come_back_in_the_order_given_with_zeros_for_none():
    tensors = interleaved_tensors()
    got = np.asarray(
        _grouped.rows_per_tensor(
            [None if t is None else ops.convert_to_tensor(t) for t in tensors], sums_and_peaks, 3
        )
    )
    want = [[0.0, 0.0, 0.0] if t is None else [t.sum(), np.abs(t).max(), t.size] for t in tensors]
    np.testing.assert_array_equal(got, np.asarray(want, "float32"))


@pytest.mark.jax
@pytest.mark.torch
def test_large_tensors_are_measured_alone_and_small_ones_of_a_shape_together():
    # Stacking copies what it stacks: a large tensor would cost its size in memory.
    rng = np.random.default_rng(1)
    large = (2, _grouped.STACK_LIMIT // 2)
    tensors = [
        rng.integers(-9, 9, large).astype("float32"),
        rng.integers(-9, 9, (4,)).astype("float32"),
        rng.integers(-9, 9, large).astype("float32"),
        rng.integers(-9, 9, (4,)).astype("float32"),
    ]
    stacks = []

    def measure(rows):
        stacks.append(tuple(rows.shape))
        return sums_and_peaks(rows)

    got = np.asarray(
        _grouped.rows_per_tensor([ops.convert_to_tensor(t) for t in tensors], measure, 3)
    )
    want = [[t.sum(), np.abs(t).max(), t.size] for t in tensors]
    np.testing.assert_array_equal(got, np.asarray(want, "float32"))
    assert sorted(stacks) == sorted([(1, _grouped.STACK_LIMIT)] * 2 + [(2, 4)])


@pytest.mark.jax
@pytest.mark.torch
def test_reduce_rows_keeps_each_columns_dtype_and_kind():
    counts = ops.convert_to_tensor(np.array([[1, 0, 1], [0, 0, 0]], "int32"))
    values = ops.convert_to_tensor(np.array([[0.5, 3.0, 2.0], [0.0, 0.0, 0.0]], "float16"))
    total, peak = _grouped.reduce_rows([counts, values], ("sum", "max"))
    dtypes = [keras.backend.standardize_dtype(x.dtype) for x in (total, peak)]
    assert dtypes == ["int32", "float16"]
    np.testing.assert_array_equal(np.asarray(total), [2, 0])
    np.testing.assert_array_equal(np.asarray(peak, "float32"), [3.0, 0.0])  # max from 0


@pytest.mark.jax
@pytest.mark.torch
def test_health_per_variable_follows_the_variables_when_shapes_repeat():
    kernel = np.array([[1e-6, 1.0], [0.0, 2.0]], "float32")  # 2 of 4 below float16 normal
    bias = np.array([3.0, 0.0, 1e-7], "float32")  # 2 of 3
    other = np.array([[5.0, 6.0], [7.0, 8.0]], "float32")  # 0 of 4
    grads = [kernel, bias, None, other, bias * 0.0]  # (2,2), (3,), None, (2,2), (3,)
    got = health.gradient_health(
        [None if g is None else ops.convert_to_tensor(g) for g in grads], 1.0
    )
    np.testing.assert_allclose(
        np.asarray(got.underflow_per_variable), [0.5, 2 / 3, 0.0, 0.0, 1.0], rtol=1e-6
    )
    assert float(got.max_abs_scaled) == 8.0


@pytest.mark.jax
@pytest.mark.torch
def test_activation_statistics_of_repeated_shapes_and_a_two_tensor_output():
    a = np.array([[1.0, 0.0], [np.inf, 4.0]], "float16")
    b = np.array([[2.0, 2.0], [2.0, 3e-5]], "float16")  # 3e-5: a float16 subnormal
    c = np.array([0.5, -8.0, 0.0], "float32")
    layer_leaves = [[a], [b, c], [b]]  # b twice: measured once, counted for both layers
    tensors = [ops.convert_to_tensor(x) for x in (a, b, c)]
    outputs = [tensors[0], (tensors[1], tensors[2]), tensors[1]]
    got = activations.activation_stats(outputs)
    for index, leaves in enumerate(layer_leaves):
        values = np.concatenate([np.asarray(x, "float64").ravel() for x in leaves])
        finite = values[np.isfinite(values)]
        n = values.size
        assert float(got.max_abs[index]) == np.abs(finite).max()
        assert float(got.nonfinite_fraction[index]) == pytest.approx((n - finite.size) / n)
        assert float(got.zero_fraction[index]) == pytest.approx(np.sum(values == 0) / n)
        below = np.sum(np.abs(values) < float(np.finfo(np.float16).smallest_normal))
        assert float(got.underflow_fraction[index]) == pytest.approx(below / n)


@pytest.mark.jax
@pytest.mark.torch
def test_the_origin_is_the_first_layer_whose_output_breaks_with_finite_inputs():
    x = ops.convert_to_tensor(np.array([[1.0, 2.0]], "float32"))
    h = ops.convert_to_tensor(np.array([[3.0, 9.0]], "float16"))  # same shape as x, other dtype
    bad = ops.convert_to_tensor(np.array([[np.inf, 1.0]], "float16"))
    ids = ops.convert_to_tensor(np.array([[7, 300]], "int32"))
    found = activations.forward_origin([x, (h, ids), bad], [h, bad, bad])
    assert int(found.layer_index) == 1  # layer 2's inputs are finite, its output is not
    assert float(found.max_abs_input) == 300.0  # the integer ids count
    assert bool(found.inputs_finite)
