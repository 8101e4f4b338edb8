"""kmix.float8's pure step functions against plain-Python references."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from keras import ops

from kmix.float8 import (
    Float8Record,
    Float8Tensor,
    StepCheck,
    advance_float8,
    check_step,
    decode_saturations,
    float8_tensors,
    kept_where_zero,
    rescaled,
    tensor_health,
    worst_of_replicas,
)
from kmix.float8.health import kernel_underflows
from kmix.tags import ROUNDING_BITS, Float8Saturation, format_saturation

pytestmark = pytest.mark.jax


def reference(saturated_by_step, amax_by_step, limit_by_step, capacity):
    """Episodes as a plain list: [first, steps, tensor, amax, limit, last_amax, last_limit]."""
    episodes, open_ = [], {}
    for step, row in enumerate(saturated_by_step, start=1):
        for i, sat in enumerate(row):
            if not sat:
                open_.pop(i, None)
                continue
            a, lim = amax_by_step[step - 1][i], limit_by_step[step - 1][i]
            if i in open_ and open_[i][0] + open_[i][1] == step:
                open_[i][1] += 1
                open_[i][5:] = [a, lim]
            else:
                open_[i] = [step, 1, i, a, lim, a, lim]
                episodes.append(open_[i])
    return episodes


def run(saturated_by_step, amax_by_step, limit_by_step, capacity):
    n = len(saturated_by_step[0])
    rec = Float8Record(
        np.zeros((n, 3), "int64"),
        np.zeros((), "int64"),
        np.zeros((capacity, 4), "int64"),
        np.zeros((capacity, 4), "float32"),
    )
    for step, sat in enumerate(saturated_by_step, start=1):
        check = StepCheck(
            np.float32(amax_by_step[step - 1]), np.float32(limit_by_step[step - 1]), np.array(sat)
        )
        if any(sat):
            rec = Float8Record(*(np.asarray(v) for v in advance_float8(rec, check, step)))
    return rec


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_episodes_and_counts_match_a_plain_replay(seed):
    rng = np.random.default_rng(seed)
    n, steps, capacity = 5, 60, 256
    sat = (rng.random((steps, n)) < 0.3).tolist()
    amax = rng.random((steps, n)).astype("float32") + 1
    limit = rng.random((steps, n)).astype("float32")
    rec = run(sat, amax, limit, capacity)
    assert np.asarray(rec.tensors)[:, 0].tolist() == np.sum(sat, axis=0).tolist()
    expected = reference(sat, amax, limit, capacity)
    assert int(rec.episode_count) == len(expected)
    tensors = [Float8Tensor(f"l{i}", "inputs", 0, 0, 448.0) for i in range(n)]
    got = decode_saturations(
        tensors, int(rec.episode_count), rec.episode_ints, rec.episode_floats, per_step=False
    )
    want = sorted(expected, key=lambda e: (e[0], e[2]))
    assert [(g.step, g.steps, g.layer) for g in got] == [(e[0], e[1], f"l{e[2]}") for e in want]
    np.testing.assert_allclose([g.amax for g in got], [e[3] for e in want], rtol=0, atol=0)
    per_step = decode_saturations(
        tensors, int(rec.episode_count), rec.episode_ints, rec.episode_floats
    )
    assert {(s.step, s.layer) for s in per_step} == {
        (step, f"l{i}") for step, row in enumerate(sat, start=1) for i, x in enumerate(row) if x
    }


@pytest.mark.parametrize("capacity", [4, 128])
def test_a_tensor_saturating_every_step_never_floods_the_ring(capacity):
    n, steps = 2, 40
    sat = [[True, step % 3 == 0] for step in range(1, steps + 1)]
    ones = np.ones((steps, n), "float32")
    rec = run(sat, ones * 2, ones, capacity)
    tensors = [Float8Tensor("a", "inputs", 0, 0, 448.0), Float8Tensor("b", "kernel", 0, 0, 448.0)]
    args = (tensors, int(rec.episode_count), rec.episode_ints, rec.episode_floats)
    got = decode_saturations(*args, per_step=False)
    a = [g for g in got if g.layer == "a"]
    b = [g.step for g in got if g.layer == "b"]
    if capacity == 128:  # one row for the whole run, one per single-step episode of b
        assert [(g.step, g.steps) for g in a] == [(1, steps)]
        assert b == list(range(3, steps + 1, 3))
    else:  # the open episode moves to a new row when the ring comes round
        assert len(got) <= capacity and a[-1].step + a[-1].steps - 1 == steps
        assert b == list(range(3, steps + 1, 3))[-len(b) :]
    per_step = decode_saturations(*args, since_step=30 if capacity == 128 else 36)
    first = 31 if capacity == 128 else 37
    assert [(s.step, s.layer) for s in per_step if s.layer == "a"] == [
        (step, "a") for step in range(first, steps + 1)
    ]


def test_check_step_clips_above_scale_times_format_max_only_when_applied():
    tensors = [
        Float8Tensor("d", "inputs", 0, 1, 448.0),
        Float8Tensor("d", "outputs_grad", 2, 3, 57344.0),
    ]
    values = [np.float32(0.5), None, np.float32(2.0), None]
    grads = [None, np.float32([224.1, 0, 0]), None, np.float32([114688.0, 9, 9])]
    check = check_step(tensors, grads, values, np.bool_(True))
    assert np.asarray(check.saturated).tolist() == [True, False]  # 224.1 > 224; 114688 = limit
    np.testing.assert_array_equal(np.asarray(check.limit), np.float32([224.0, 114688.0]))
    assert not np.asarray(check_step(tensors, grads, values, np.bool_(False)).saturated).any()


def test_replicas_agree_on_any_replicas_saturation_with_the_amax_that_clipped_most():
    """Each replica checks against its own scales (Keras keeps one set per replica)."""
    amaxes = np.float32([[1.0, 5.0, 9.0, 2.0], [3.0, 7.0, 4.0, np.nan]])
    limits = np.float32([[2.0, 4.0, 3.0, 2.0], [2.0, 4.0, 1.0, 1.0]])
    check = worst_of_replicas(amaxes, limits, np.bool_(True))
    # plain Python: per column, the clipped replica with the largest amax / limit, else row 0
    expected = []
    for col in range(4):
        ratios = [
            (amaxes[r, col] / limits[r, col], r)
            for r in range(2)
            if amaxes[r, col] > limits[r, col]
        ]
        row = max(ratios)[1] if ratios else 0
        expected.append((amaxes[row, col], limits[row, col], bool(ratios)))
    assert expected == [(3.0, 2.0, True), (7.0, 4.0, True), (4.0, 1.0, True), (2.0, 2.0, False)]
    got = zip(*(np.asarray(v).tolist() for v in check), strict=True)
    assert [tuple(g) for g in got] == expected
    skipped = worst_of_replicas(amaxes, limits, np.bool_(False))
    assert not np.asarray(skipped.saturated).any()


@pytest.mark.parametrize("fmt_max", [448.0, 57344.0])
@pytest.mark.parametrize(("amax", "under"), [(255.0, True), (850.0, True), (3.0, False)])
def test_an_amax_at_the_limit_its_scale_was_set_from_is_clipped_by_rounding_and_said_so(
    amax, under, fmt_max
):
    """Keras's delayed scale, ``1 / (max / amax)`` in float32, times ``max`` falls a rounding
    under some amaxes (255, 850): Keras clips such a tensor (by under 2**-20 bits), the check
    counts it as the issue defines it, and the words say it was float32 rounding."""
    f32 = np.float32
    scale = f32(1) / (f32(fmt_max) / f32(amax))  # Keras's compute_float8_scale, margin 0
    t = [Float8Tensor("d", "inputs", 0, 1, fmt_max)]
    check = check_step(t, [None, np.float32([amax, 0])], [scale, None], np.bool_(True))
    assert np.asarray(check.saturated).tolist() == [under]
    assert (scale * f32(fmt_max) < f32(amax)) == under  # the reference: amax > scale * max
    limit = float(np.asarray(check.limit)[0])
    item = Float8Saturation(7, "d", "inputs", amax, limit)
    if under:
        assert 0 < item.bits_over <= ROUNDING_BITS
        assert format_saturation(item) == (
            f"**float8 saturation** at step 7: `d` inputs amax {amax:.9g} > limit {limit:.9g} "
            "(float32 rounding at the limit: clipped by under a millionth)"
        )
    clear = Float8Saturation(7, "d", "inputs", amax * 1.5, limit)  # 0.58 bits over
    assert format_saturation(clear).endswith(
        f"amax {amax * 1.5:.6g} > limit {limit:.6g} (0.58 bits over)"
    )


def test_rescale_touches_only_the_output_gradients():
    tensors = [
        Float8Tensor("d", t, 2 * i, 2 * i + 1, 448.0)
        for i, t in enumerate(["inputs", "kernel", "outputs_grad"])
    ]
    values = [np.float32(3.0), np.float32([1, 2])] * 3
    out = rescaled(tensors, values, np.float32(0.5))
    assert sorted(out) == [4, 5]
    np.testing.assert_array_equal(np.asarray(out[5]), np.float32([0.5, 1]))


def test_a_zero_new_scale_keeps_that_tensors_scale_and_history_and_nothing_else():
    """JAX hands a scale Keras did not update a 0 (a layer called without training): its
    scale and history keep their values; a computed scale, a None and the rest pass."""
    tensors = [
        Float8Tensor("d", t, 2 * i, 2 * i + 1, 448.0)
        for i, t in enumerate(["inputs", "kernel", "outputs_grad"])
    ]
    values = [np.float32(2.0), np.float32([5, 6]), np.float32(3.0), np.float32([7, 8])]
    values += [np.float32(4.0), np.float32([9, 1])]
    grads = [np.float32(0.0), np.float32([0, 0]), np.float32(0.25), np.float32([3, 7])]
    grads += [None, None]
    out = [None if g is None else np.asarray(g) for g in kept_where_zero(tensors, grads, values)]
    np.testing.assert_array_equal(out[0], np.float32(2.0))  # kept
    np.testing.assert_array_equal(out[1], np.float32([5, 6]))
    np.testing.assert_array_equal(out[2], np.float32(0.25))  # Keras's new values
    np.testing.assert_array_equal(out[3], np.float32([3, 7]))
    assert out[4:] == [None, None]


def test_tensor_health_words_the_newest_amax_against_the_scale():
    t = Float8Tensor("d", "kernel", 0, 1, 448.0)
    amax, peak = np.float32(112.0), np.float32(896.0)  # a history's newest entry, its maximum
    kernel = np.float32([1.0, 2.0**-11, 0.0, -3.0])  # scale 2**-1: 2**-11 / 0.5 = 2**-10 flushes
    share = kernel_underflows([kernel], [np.float32(0.5)], ["float16"])[0]
    assert share == pytest.approx(1 / 3, rel=2**-23)  # 1 of the 3 non-zero values
    h = tensor_health(t, 0.5, amax, peak, 7, share)
    assert h.headroom_bits == pytest.approx(1.0) and h.staleness_bits == pytest.approx(3.0)
    assert h.saturated_steps == 7 and h.underflow_fraction == share
    assert tensor_health(t, 0.5, 0.0, 0.0).headroom_bits is None
    # Not measured (the compute dtype unknown): the kernel's underflow is not given, not guessed.
    assert tensor_health(t, 0.5, amax, peak, 7).underflow_fraction is None
    # No value non-zero: no share to give; each layer's share is its own in one call.
    shares = kernel_underflows(
        [np.zeros(3, "float32"), kernel, kernel], [np.float32(0.5), 0.5, 2.0**-12], ["float16"] * 3
    )
    assert shares[0] is None and shares[1] == share and shares[2] == 0.0
    assert kernel_underflows([], [], []) == []


@pytest.mark.torch
def test_read_health_gives_each_float8_tensor_as_numpy_reads_its_variables():
    """read_health's one compiled read, against NumPy over the same variables: each
    tensor's scale, its history's newest entry, headroom and staleness in bits, and the
    kernel's share flushed in float16 (its compute dtype); read again after they change."""
    from kmix.float8 import read_health

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
        model.quantize("float8")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    variables = model.trainable_variables
    tensors = float8_tensors(variables)
    rng = np.random.default_rng(0)

    def expected(t):
        scale = float(np.float32(ops.convert_to_numpy(variables[t.scale_index])))
        history = ops.convert_to_numpy(variables[t.history_index]).astype("float32")
        amax, peak = float(history[0]), float(np.max(history))
        share = None
        if t.tensor == "kernel":
            kernel = next(v for v in variables if v.path == f"{t.layer}/kernel")
            x = ops.convert_to_numpy(kernel).astype("float16")
            nonzero = np.abs(x) > 0
            flushed = nonzero & (np.abs(x / np.float16(scale)) <= 2.0**-10)
            share = np.count_nonzero(flushed) / np.count_nonzero(nonzero)
        return scale, amax, math.log2(scale * t.format_max / amax), math.log2(peak / amax), share

    for _ in range(2):
        for t in tensors:
            history = rng.uniform(0.5, 4.0, variables[t.history_index].shape)
            variables[t.history_index].assign(history.astype("float32"))
            variables[t.scale_index].assign(np.float32(rng.uniform(2.0**-12, 2.0**-2)))
        for t in tensors:
            kernel = next(v for v in variables if v.path == f"{t.layer}/kernel")
            kernel.assign(rng.standard_normal(kernel.shape).astype("float32") * 2.0**-12)
        got = read_health(variables, [4, 5, 6, 7, 8, 9], model=model)
        assert [(h.layer, h.tensor) for h in got] == [(t.layer, t.tensor) for t in tensors]
        for h, t in zip(got, tensors, strict=True):
            scale, amax, headroom, staleness, share = expected(t)
            assert (h.scale, h.amax) == (scale, amax)
            assert h.headroom_bits == pytest.approx(headroom, rel=1e-12)
            assert h.staleness_bits == pytest.approx(staleness, rel=1e-12)
            if share is None:  # measured for kernels only
                assert h.underflow_fraction is None
            else:  # a count over a count, divided once in float32
                assert h.underflow_fraction == pytest.approx(share, rel=2**-24)
        assert [h.saturated_steps for h in got] == [4, 5, 6, 7, 8, 9]
        assert any(h.underflow_fraction for h in got)  # the shares are not all zero
    unmeasured = read_health(variables)  # no model, no compute dtypes: no kernel shares
    assert [(h.scale, h.amax, h.underflow_fraction) for h in unmeasured] == [
        (h.scale, h.amax, None) for h in got
    ]
    assert read_health([keras.Variable(1.0)]) == []  # no float8 state: nothing read


def test_each_call_reads_the_variables_it_is_given():
    """The compiled call is kept per compute dtypes: a second model's kernels of the same
    shapes are read as themselves, not as the first model's (one flushed value of 3, then
    two)."""
    scale = keras.Variable(np.float32(0.5))
    first = keras.Variable(np.float32([1.0, 2.0**-11, 3.0]))
    second = keras.Variable(np.float32([2.0**-11, 2.0**-11, 3.0]))
    assert kernel_underflows([first], [scale], ["float16"])[0] == pytest.approx(1 / 3, rel=2**-23)
    assert kernel_underflows([second], [scale], ["float16"])[0] == pytest.approx(2 / 3, rel=2**-23)
    second.assign(np.float32([1.0, 2.0, 3.0]))  # read as it is now
    assert kernel_underflows([second], [scale], ["float16"]) == [0.0]


@pytest.mark.parametrize(
    ("compute_dtype", "flushed"), [("float16", 1.0), ("bfloat16", 1.0), ("float32", 0.0)]
)
def test_the_kernels_underflow_is_in_the_compute_dtype_as_keras_quantizes(compute_dtype, flushed):
    """Keras divides the autocast kernel by the scale cast to the compute dtype. A scale of
    1 + 2**-10 - 2**-13 is 1 + 2**-10 in float16 (1.0 in bfloat16), so the kernel value
    2**-10 * (1 + 2**-10) divides to exactly 2**-10 there (half of E4M3's smallest
    subnormal: a tie, to 0); in float32 the quotient stays just above it and is kept."""
    kernel = np.float32([2.0**-10 * (1 + 2.0**-10)])
    scale = 1 + 2.0**-10 - 2.0**-13
    assert kernel_underflows([kernel], [np.float32(scale)], [compute_dtype]) == [flushed]
    quantized = keras.quantizers.quantize_and_dequantize(  # Keras itself, as a float8 layer runs it
        keras.ops.cast(kernel, compute_dtype), np.float32(scale), "float8_e4m3fn", compute_dtype
    )
    assert float(np.mean(keras.ops.convert_to_numpy(quantized) == 0)) == flushed


def test_float8_tensors_found_by_name_and_flag():
    class V:
        def __init__(self, path, flag=True):
            self.path, self.overwrite_with_gradient = path, flag

    names = [
        "kernel",
        "inputs_scale",
        "inputs_amax_history",
        "outputs_grad_scale",
        "outputs_grad_amax_history",
    ]
    variables = [V(f"m/block/d/{n}", n != "kernel") for n in names] + [
        V("m/other/inputs_scale", False)
    ]
    found = float8_tensors(variables)
    assert [(t.layer, t.tensor, t.scale_index, t.history_index) for t in found] == [
        ("m/block/d", "inputs", 1, 2),
        ("m/block/d", "outputs_grad", 3, 4),
    ]
    assert math.isclose(found[1].format_max, 57344.0)


def test_advance_runs_on_ops_values():
    rec = Float8Record(
        *(
            ops.convert_to_tensor(v)
            for v in (
                np.zeros((1, 3), "int32"),
                np.int32(0),
                np.zeros((2, 4), "int32"),
                np.zeros((2, 4), "float32"),
            )
        )
    )
    new = advance_float8(rec, StepCheck(np.float32([2]), np.float32([1]), np.array([True])), 5)
    assert np.asarray(new.episode_ints)[0].tolist() == [5, 1, 0, 1]


def test_the_record_is_stored_in_two_variables_and_read_back_unchanged():
    """Row 0 the episode count, then each tensor's counters (a zero column), then the
    ring's integers; the ring's floats apart: every value where :func:`unstored` reads it."""
    from kmix.float8.saturation import StoredRecord, stored, stored_shapes, unstored

    rng = np.random.default_rng(0)
    n, capacity = 3, 5
    rec = Float8Record(
        rng.integers(0, 2**20, (n, 3)).astype("int32"),
        np.int32(17),
        rng.integers(0, 2**20, (capacity, 4)).astype("int32"),
        rng.standard_normal((capacity, 4)).astype("float32"),
    )
    kept = StoredRecord(*(np.asarray(ops.convert_to_numpy(v)) for v in stored(rec)))
    on_host = stored(rec, np)
    assert [v.shape for v in kept] == list(stored_shapes(n, capacity))
    for got, want in zip(on_host, kept, strict=True):
        np.testing.assert_array_equal(got, want)
    expected_ints = np.zeros((1 + n + capacity, 4), "int32")
    expected_ints[0, 0] = 17
    expected_ints[1 : 1 + n, :3] = rec.tensors
    expected_ints[1 + n :] = rec.episode_ints
    np.testing.assert_array_equal(kept.ints, expected_ints)
    np.testing.assert_array_equal(kept.floats, rec.episode_floats)
    back = unstored(kept, n)
    for got, want in zip(back, rec, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_formats_are_the_contracts():
    from kmix import float8, tags

    assert float8.FORMAT_MAX is tags.FLOAT8_FORMAT_MAX
    assert float8.FORMAT_TINY is tags.FLOAT8_FORMAT_TINY
    assert float8.FORMATS is tags.FLOAT8_FORMATS


def test_nothing_saturated_leaves_the_record_as_it_was_and_a_factor_of_1_changes_nothing():
    """What lets TensorFlow's and torch's step take one rare branch for both writes: the
    record's update is the identity on a step with nothing saturated (whatever the ring
    holds, open episodes, inf amaxes included), and the rescale by 1 is exact (subnormals
    too: TensorFlow's and XLA's CPU kernels would flush them in a multiplication by 1)."""
    rng = np.random.default_rng(0)
    n, steps, capacity = 4, 30, 8
    sat = (rng.random((steps, n)) < 0.4).tolist()
    amax = rng.random((steps, n)).astype("float32") * 1e3
    amax[3, 1] = np.inf
    rec = run(sat, amax, np.ones((steps, n), "float32"), capacity)  # the ring has come round
    quiet = StepCheck(np.float32(amax[0]), np.float32(amax[0] * 2), np.zeros(n, bool))
    for step in (steps, steps + 1, steps + 5):  # open episodes would continue at steps + 1
        again = advance_float8(rec, quiet, step)
        for old, new in zip(rec, again, strict=True):
            assert np.asarray(new).dtype == np.asarray(old).dtype
            np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    tensors = [Float8Tensor("d", "outputs_grad", 0, 1, 57344.0)]
    values = [
        np.float32(rng.random() * 2.0**-20),
        np.float32([np.inf, 0.0, 2.0**-149, 3.4e38, np.float32(rng.random())]),
    ]
    out = rescaled(tensors, values, np.float32(1.0))
    for index in (0, 1):
        assert np.asarray(out[index]).tobytes() == np.asarray(values[index]).tobytes()
