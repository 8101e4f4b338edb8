"""Gradient health statistics against NumPy references computed in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
from keras import ops

from kmix import tags
from kmix.record import health

F16_MAX = float(np.finfo(np.float16).max)
F16_TINY = float(np.finfo(np.float16).smallest_normal)


@pytest.mark.jax
@pytest.mark.torch
def test_float16_constants_match_numpy():
    assert health.FLOAT16_MAX == F16_MAX
    assert health.FLOAT16_SMALLEST_NORMAL == F16_TINY
    assert health.FLOAT16_SMALLEST_SUBNORMAL == float(np.finfo(np.float16).smallest_subnormal)


def numpy_health(grads, scale):
    """Independent reference: float64 NumPy, one concatenated array."""
    flat = [np.asarray(g, np.float64).ravel() for g in grads if g is not None]
    values = np.concatenate(flat)
    finite = np.isfinite(values)
    magnitude = np.abs(values[finite])
    max_abs = magnitude.max(initial=0.0)
    per_var = [
        0.0 if g is None else float(np.mean(np.abs(np.asarray(g, np.float64)) < F16_TINY))
        for g in grads
    ]
    return {
        "grad_norm": math.sqrt(np.sum((magnitude / scale) ** 2)),
        "max_abs_scaled": max_abs,
        "headroom_bits": math.log2(F16_MAX / max(max_abs, 2.0**-24)),
        "underflow_fraction": np.mean(np.abs(values) < F16_TINY),
        "nonfinite_elements": float(np.sum(~finite)),
        "underflow_per_variable": per_var,
    }


def computed(grads, scale):
    stats = health.gradient_health(
        [None if g is None else ops.convert_to_tensor(g) for g in grads], scale
    )
    return {k: ops.convert_to_numpy(v) for k, v in stats._asdict().items()}


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_statistics_match_numpy_on_random_gradients(seed):
    rng = np.random.default_rng(seed)
    grads = [
        (rng.standard_normal((7, 5)) * 10.0 ** rng.uniform(-9, 3, (7, 5))).astype("float32"),
        None,
        np.zeros(4, "float32"),
        (rng.standard_normal(9) * 3000).astype("float32"),
    ]
    grads[0][0, 0] = np.inf
    grads[3][2] = np.nan
    scale = 1024.0
    got, want = computed(grads, scale), numpy_health(grads, scale)
    for key in ("grad_norm", "max_abs_scaled", "headroom_bits", "underflow_fraction"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=0, err_msg=key)
    assert got["nonfinite_elements"] == want["nonfinite_elements"] == 2.0
    np.testing.assert_allclose(
        got["underflow_per_variable"], want["underflow_per_variable"], rtol=1e-6
    )


@pytest.mark.jax
@pytest.mark.torch
def test_exact_values_on_a_hand_made_gradient():
    grads = [np.array([3.0, -4.0, 0.0, 2.0**-15, 65504.0 * 2], "float32")]
    got = computed(grads, scale=2.0)
    # norm of the unscaled finite values: sqrt(1.5^2 + 2^2 + 0 + 2^-32 + 65504^2)
    np.testing.assert_allclose(
        got["grad_norm"], math.sqrt(1.5**2 + 4 + 2.0**-32 + 65504.0**2), rtol=1e-6
    )
    assert got["max_abs_scaled"] == 131008.0
    np.testing.assert_allclose(got["headroom_bits"], -1.0, atol=1e-6)  # twice float16's max
    assert got["underflow_fraction"] == pytest.approx(2 / 5)  # the zero and 2**-15
    assert got["nonfinite_elements"] == 0.0


@pytest.mark.jax
@pytest.mark.torch
def test_float16_mask_limits_range_statistics_to_float16_variables():
    grads = [np.array([1.0, 0.0], "float32"), np.array([1e6, 1e-9], "float32")]
    mask = ops.convert_to_tensor([1.0, 0.0])  # the second variable computes in float32
    got = {
        k: ops.convert_to_numpy(v)
        for k, v in health.gradient_health(grads, 1.0, mask)._asdict().items()
    }
    assert got["max_abs_scaled"] == 1.0  # 1e6 would overflow float16, but never was float16
    assert got["headroom_bits"] == pytest.approx(math.log2(65504.0))
    assert got["underflow_fraction"] == 0.5  # the zero of the first variable only
    np.testing.assert_allclose(got["grad_norm"], math.sqrt(1.0 + 1e12), rtol=1e-6)  # all count
    assert got["underflow_per_variable"].tolist() == [0.5, 0.5]


def test_sparse_slices_are_summed_per_row_like_the_update():
    """An embedding looked up 3 times at row 1: statistics see the summed row."""
    import tensorflow as tf

    values = np.array([[1.0, -2.0], [1.0, -2.0], [1.0, -2.0], [0.5, 2.0**-20]], "float32")
    sparse = tf.IndexedSlices(values, tf.constant([1, 1, 1, 3]), tf.constant([5, 2]))
    dense = tf.convert_to_tensor(sparse).numpy()  # TensorFlow's own densification
    got = computed([sparse], scale=2.0)
    rows = dense[[1, 3]]  # the rows the update touches
    np.testing.assert_allclose(got["grad_norm"], np.linalg.norm(rows / 2.0), rtol=1e-6)
    assert got["max_abs_scaled"] == 6.0  # 3 * |-2|
    assert got["underflow_fraction"] == 0.25  # 2**-20 in one of the 4 row elements
    hist = ops.convert_to_numpy(health.exponent_histogram(sparse))
    np.testing.assert_array_equal(hist, reference_bins(rows.ravel()))


@pytest.mark.jax
@pytest.mark.torch
def test_headroom_is_capped_when_all_gradients_are_zero():
    got = computed([np.zeros(3, "float32")], scale=1.0)
    assert got["headroom_bits"] == pytest.approx(health.MAX_HEADROOM_BITS)
    assert health.MAX_HEADROOM_BITS == pytest.approx(math.log2(65504) + 24)
    assert got["underflow_fraction"] == 1.0


@pytest.mark.jax
@pytest.mark.torch
def test_nonfinite_flags_mark_each_variable():
    grads = [np.ones(2, "float32"), None, np.array([1.0, np.nan], "float32"), np.array([-np.inf])]
    flags = ops.convert_to_numpy(health.nonfinite_flags(grads))
    assert flags.tolist() == [0.0, 0.0, 1.0, 1.0]


def reference_bins(values):
    """Bin index of each value, per the layout documented in kmix.tags."""
    out = []
    for v in np.asarray(values, np.float64):
        if not np.isfinite(v):
            out.append(tags.NUM_EXPONENT_BINS - 1)
        elif v == 0:
            out.append(0)
        else:
            e = math.floor(math.log2(abs(v)))
            out.append(min(max(e - tags.EXPONENT_MIN + 2, 1), tags.NUM_EXPONENT_BINS - 2))
    return np.bincount(out, minlength=tags.NUM_EXPONENT_BINS)


@pytest.mark.jax
@pytest.mark.torch
def test_exponent_histogram_matches_reference():
    rng = np.random.default_rng(3)
    values = np.concatenate(
        [
            rng.standard_normal(500) * 2.0 ** rng.integers(-60, 40, 500),
            [0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-40, 2.0**-41, 2.0**17, 2.0**18, 65504.0],
            [2.0**k for k in range(-45, 25)],  # exact powers of two sit on bin edges
        ]
    ).astype("float32")
    got = ops.convert_to_numpy(health.exponent_histogram(values.reshape(-1, 5)))
    np.testing.assert_array_equal(got, reference_bins(values))
    assert got.sum() == values.size


@pytest.mark.jax
@pytest.mark.torch
def test_exponent_histogram_bins_cover_float16_range():
    edges = tags.exponent_bucket_edges()
    assert len(edges) == tags.NUM_EXPONENT_BINS
    lefts = [left for left, _ in edges]
    # Every float16 exponent (-24 .. 15) and the margins [-40, 17] have their own bin.
    for e in range(tags.EXPONENT_MIN, tags.EXPONENT_MAX + 1):
        assert float(e) in lefts
    counts = ops.convert_to_numpy(health.exponent_histogram(np.array([1.0], "float32")))
    assert edges[int(np.argmax(counts))] == (0.0, 1.0)
