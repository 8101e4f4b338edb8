"""Activation statistics and the forward tap, against NumPy and eager recomputations."""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kmix
from kmix.optimizer.tap import ActivationTap
from kmix.record import activations

F16_MAX = float(np.finfo(np.float16).max)
F16_TINY = float(np.finfo(np.float16).smallest_normal)


# ------------------------------------------------------------------ statistics
def numpy_stats(structure):
    """Independent reference: float64 NumPy over the float arrays of a structure."""
    leaves = keras.tree.flatten(structure)
    floats = [np.asarray(x) for x in leaves if np.asarray(x).dtype.kind == "f"]
    values = np.concatenate([x.astype(np.float64).ravel() for x in floats] or [np.zeros(0)])
    finite = np.isfinite(values)
    magnitude = np.abs(values)
    max_abs = magnitude[finite].max(initial=0.0)
    n = max(values.size, 1)
    with np.errstate(invalid="ignore"):
        zero = np.sum(values == 0) / n
        below = np.sum(magnitude < F16_TINY) / n
    return {
        "max_abs": max_abs,
        "headroom_bits": math.log2(F16_MAX / max(max_abs, 2.0**-24)),
        "nonfinite_fraction": np.sum(~finite) / n,
        "underflow_fraction": below,
        "zero_fraction": zero,
        "subnormal_fraction": below - zero,
    }


def as_numpy(named_tuple):
    return {k: ops.convert_to_numpy(v) for k, v in named_tuple._asdict().items()}


@pytest.mark.jax
@pytest.mark.torch
def test_statistics_match_numpy_on_nested_outputs():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((6, 7)) * 10.0 ** rng.uniform(-9, 4, (6, 7))).astype("float16")
    a[0, :3] = [np.inf, np.nan, 0.0]
    a[1, :2] = [2.0**-20, -(2.0**-15)]  # float16 subnormals
    b = (rng.standard_normal(11) * 3e5).astype("float32")  # finite, beyond float16
    b[0], b[1] = -np.inf, 1e-30
    outputs = [
        ops.convert_to_tensor(a),
        (ops.convert_to_tensor(b), ops.convert_to_tensor(np.arange(5, dtype="int32"))),
        {"scores": ops.convert_to_tensor(a[:2]), "mask": ops.ones((3,), "bool")},
        [ops.convert_to_tensor(np.arange(4, dtype="int64"))],  # no float tensor at all
    ]
    got = as_numpy(activations.activation_stats(outputs))
    refs = [
        numpy_stats(a),
        numpy_stats(b),
        numpy_stats(a[:2]),
        dict.fromkeys(numpy_stats([]), np.nan),  # no float element: not measured
    ]
    for key, values in got.items():
        assert values.dtype == np.float32 and values.shape == (4,), key
        np.testing.assert_allclose(
            values, [r[key] for r in refs], rtol=1e-6, atol=1e-6, err_msg=key
        )
    assert got["max_abs"][1] == np.abs(b[np.isfinite(b)]).max()  # exact, not close
    assert got["headroom_bits"][1] < 0  # finite float32 values past float16's max


@pytest.mark.jax
@pytest.mark.torch
def test_headroom_is_exact_at_1024():
    x = np.linspace(-1024, 512, 97).astype("float16")
    stats = activations.activation_stats([ops.convert_to_tensor(x)])
    assert float(stats.max_abs[0]) == 1024.0
    # log2(65504 / 1024) = log2(63.96875) = 5.9992954... (not 5.9998: 65504 is 2^16 - 32)
    assert float(stats.headroom_bits[0]) == pytest.approx(math.log2(65504 / 1024), abs=1e-6)
    assert float(stats.headroom_bits[0]) == pytest.approx(5.99930, abs=1e-5)


def test_no_layers_gives_empty_vectors():
    stats = activations.activation_stats([])
    assert all(ops.convert_to_numpy(v).shape == (0,) for v in stats)


# ------------------------------------------------------------------ forward_origin
def origin(inputs, outputs):
    found = activations.forward_origin(inputs, outputs)
    return (
        int(found.layer_index),
        float(found.max_abs_input),
        bool(found.inputs_finite),
    )


def t(values, dtype="float16"):
    return ops.convert_to_tensor(np.asarray(values, dtype))


@pytest.mark.jax
@pytest.mark.torch
def test_forward_origin_names_the_origin_not_the_propagation():
    inputs = [t([1.0, -2.0]), t([3.0, 7.0]), t([np.inf, 1.0]), t([np.nan])]
    outputs = [t([3.0, 7.0]), t([np.inf, 1.0]), t([np.nan]), t([np.nan])]
    assert origin(inputs, outputs) == (1, 7.0, True)


@pytest.mark.jax
@pytest.mark.torch
def test_forward_origin_nested_inputs_and_int_leaves():
    inputs = [
        (t([1.0]), {"mask": ops.ones((2,), "bool"), "ids": t([9, 10], "int32")}),
        [t([2.0], "float32"), t([-600.0])],
    ]
    outputs = [(t([2.0]), t([1.0])), {"a": t([np.inf]), "b": t([4.0])}]
    assert origin(inputs, outputs) == (1, 600.0, True)


@pytest.mark.jax
@pytest.mark.torch
def test_forward_origin_measures_integer_inputs_and_nothing_else():
    """An Embedding's inputs are integer ids: their magnitude is what was measured; a layer
    with no numeric input has no max (NaN, shown as unknown), never a 0."""
    ids = [t([3, 7, 2], "int32"), t([1.0])]
    assert origin(ids, [t([np.inf]), t([np.inf])]) == (0, 7.0, True)
    found = activations.forward_origin([(ops.ones((2,), "bool"),)], [t([np.nan])])
    assert int(found.layer_index) == 0 and math.isnan(float(found.max_abs_input))


@pytest.mark.jax
@pytest.mark.torch
def test_forward_origin_nan_from_the_data():
    inputs = [t([np.nan, 5.0]), t([np.nan])]
    outputs = [t([np.nan]), t([np.nan])]
    assert origin(inputs, outputs) == (0, 5.0, False)


@pytest.mark.jax
@pytest.mark.torch
def test_forward_origin_all_finite_and_empty():
    assert origin([t([1.0])], [t([65504.0])]) == (-1, 0.0, True)
    assert origin([], []) == (-1, 0.0, True)
    with pytest.raises(ValueError, match="len\\(inputs\\)=1 and len\\(outputs\\)=0"):
        activations.forward_origin([t([1.0])], [])


# ------------------------------------------------------------------ the tap
def take_in_function(model, tap, x, jit_compile=False):
    """Calls the model in a traced function that reduces ``tap.take()`` there: a
    ``tf.function`` (``jit_compile`` as given), on JAX ``jax.jit``."""
    paths = []

    def step(x):
        model(x, training=True)
        records = tap.take()
        paths[:] = [r.path for r in records]
        stats = activations.activation_stats([r.outputs for r in records])
        found = activations.forward_origin(
            [r.inputs for r in records], [r.outputs for r in records]
        )
        return stats, found

    if keras.backend.backend() == "jax":
        import jax

        traced = jax.jit(step)
    elif keras.backend.backend() == "torch":  # eager: the step's scope tells its calls

        def traced(x):
            with kmix.backend.step_scope():
                return step(x)

    else:
        traced = tf.function(step, jit_compile=jit_compile)
    stats, found = traced(x)
    return paths, as_numpy(stats), as_numpy(found)


def max_abs(x):
    return float(np.max(np.abs(ops.convert_to_numpy(x).astype(np.float64))))


@pytest.fixture
def float16_policy():
    keras.config.set_dtype_policy("mixed_float16")


def functional_with_shared_layer():
    inputs = keras.Input((6,))
    shared = keras.layers.Dense(6, name="shared")
    first = shared(inputs)
    second = shared(keras.layers.Activation("tanh", name="squash")(first))
    head = keras.layers.Dense(3, name="head", dtype="float32")(second)
    return keras.Model(inputs, head), shared


@pytest.mark.jax
@pytest.mark.torch
def test_functional_paths_in_order_and_exact_max(float16_policy):
    model, shared = functional_with_shared_layer()
    tap = ActivationTap(model).install()
    assert tap.paths == ["shared", "squash"]  # float32 head and InputLayer are not tapped
    x = np.random.default_rng(1).standard_normal((5, 6)).astype("float32") * 30
    paths, stats, found = take_in_function(model, tap, x)
    assert paths == ["shared", "squash", "shared#2"]
    h1 = shared(x)
    h2 = model.get_layer("squash")(h1)
    h3 = shared(h2)
    np.testing.assert_array_equal(stats["max_abs"], [max_abs(h1), max_abs(h2), max_abs(h3)])
    assert found["layer_index"] == -1
    assert tap.last_taken[2] == activations.LayerCall("shared#2", "Dense")


def test_lazily_built_sequential(float16_policy):
    model = keras.Sequential(
        [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4), keras.layers.Dense(2)]
    )
    model.layers[-1].dtype_policy = "float32"  # one layer left out of float16
    tap = ActivationTap(model).install()  # before any variable exists
    x = np.random.default_rng(2).standard_normal((3, 5)).astype("float32")
    paths, stats, _ = take_in_function(model, tap, x)
    assert paths == [layer.path for layer in model.layers[:2]] == tap.paths
    h1 = model.layers[0](x)
    np.testing.assert_array_equal(stats["max_abs"], [max_abs(h1), max_abs(model.layers[1](h1))])


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(8, activation="relu", name="up")
        self.down = keras.layers.Dense(4, name="down")

    def call(self, x):
        return x + self.down(self.up(x))  # the residual add is the block's own work


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block(name="block")
        self.out = keras.layers.Dense(2, name="out")

    def call(self, x, training=False):
        return self.out(self.block(self.block(x)))  # the block is reused in a loop


def test_subclassed_model_with_nested_block(float16_policy):
    model = Net()
    model(np.zeros((1, 4), "float32"))
    tap = ActivationTap(model).install()
    x = np.random.default_rng(3).standard_normal((6, 4)).astype("float32")
    paths, stats, _ = take_in_function(model, tap, x)
    assert tap.paths == ["net/block", "net/block/up", "net/block/down", "net/out"]
    # A record is appended when its call returns: a block's inner layers come first.
    first = "net/block/up net/block/down net/block"
    expected_paths = first.split() + [p + "#2" for p in first.split()] + ["net/out"]
    assert paths == expected_paths
    b = model.block
    u1 = b.up(x)
    d1 = b.down(u1)
    y1 = b(x)
    u2 = b.up(y1)
    d2 = b.down(u2)
    y2 = b(y1)
    expected = [max_abs(v) for v in (u1, d1, y1, u2, d2, y2, model.out(y2))]
    np.testing.assert_array_equal(stats["max_abs"], expected)


@pytest.mark.jax
@pytest.mark.torch
def test_float16_overflow_is_named_with_inputs_finite(float16_policy):
    inputs = keras.Input((4,))
    ones = keras.initializers.Constant(1.0)
    hidden = keras.layers.Dense(4, name="hidden", kernel_initializer=ones)(inputs)
    blow = keras.layers.Dense(4, name="blow", kernel_initializer=keras.initializers.Constant(300.0))
    outputs = keras.layers.Dense(1, name="after")(blow(hidden))
    model = keras.Model(inputs, outputs)
    tap = ActivationTap(model).install()
    x = np.full((2, 4), 60.0, "float32")
    paths, stats, found = take_in_function(model, tap, x)
    h = model.get_layer("hidden")(x)
    assert paths == ["hidden", "blow", "after"]
    assert found["layer_index"] == 1 and bool(found["inputs_finite"])
    assert float(found["max_abs_input"]) == max_abs(h)
    assert stats["nonfinite_fraction"][1] == 1.0 and stats["nonfinite_fraction"][0] == 0.0


# On JAX take_in_function always compiles: one of the two runs there.
@pytest.mark.parametrize(
    "jit_compile",
    [pytest.param(False, marks=pytest.mark.torch), pytest.param(True, marks=pytest.mark.jax)],
)
def test_a_cast_overflow_names_the_layer_it_enters_with_the_finite_value(
    float16_policy, jit_compile
):
    """A float32 block's finite 90000 becomes inf only in Keras's cast into the next
    float16 layer: that layer is the origin, its input finite at 90000 (as it arrived),
    not "non-finite inputs, max 0" (issue 21, item 1). The same for data past 65504."""
    inputs = keras.Input((2,))
    big = keras.initializers.Constant(300.0)
    with kmix.policy_scope("float32"):
        wide = keras.layers.Dense(2, name="wide", kernel_initializer=big, use_bias=False)
    after = keras.layers.Dense(1, name="after", kernel_initializer="ones")
    model = keras.Model(inputs, after(wide(inputs)))
    tap = ActivationTap(model).install()
    assert tap.paths == ["after"]
    x = np.full((1, 2), 150.0, "float32")  # wide: 2 * 150 * 300 = 90000 in float32
    paths, stats, found = take_in_function(model, tap, x, jit_compile=jit_compile)
    assert paths == ["after"] and stats["nonfinite_fraction"][0] == 1.0
    assert found["layer_index"] == 0 and bool(found["inputs_finite"])
    assert float(found["max_abs_input"]) == 90000.0

    data_model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="first")])
    tap = ActivationTap(data_model).install()
    _, _, found = take_in_function(data_model, tap, np.array([[1.0, 70000.0]], "float32"))
    assert found["layer_index"] == 0 and bool(found["inputs_finite"])
    assert float(found["max_abs_input"]) == 70000.0


def test_jit_compile(float16_policy):
    model, shared = functional_with_shared_layer()
    tap = ActivationTap(model).install()
    x = np.random.default_rng(4).standard_normal((5, 6)).astype("float32")
    paths, stats, _ = take_in_function(model, tap, x, jit_compile=True)
    assert paths == ["shared", "squash", "shared#2"]
    assert stats["max_abs"][0] == max_abs(shared(x))


def test_eager_records_only_when_asked_and_foreign_graphs_give_nothing(float16_policy):
    model, _ = functional_with_shared_layer()
    tap = ActivationTap(model).install()
    x = np.ones((2, 6), "float32")
    model(x)
    assert tap.take() == []
    with tap.recording():
        model(x)
    assert [r.path for r in tap.take()] == ["shared", "squash", "shared#2"]

    @tf.function
    def forward(x):
        return model(x)

    forward(x)  # records in forward's graph, never taken there
    assert tap.take() == []  # eager: another graph's tensors are not returned

    @tf.function
    def other():
        return len(tap.take())

    forward.get_concrete_function(tf.TensorSpec((2, 6)))
    assert other() == 0


def test_remove_restores_call_exactly(float16_policy):
    model, shared = functional_with_shared_layer()
    x = np.random.default_rng(5).standard_normal((2, 6)).astype("float32")
    before = ops.convert_to_numpy(model(x))
    signature = inspect.signature(shared.call)
    tap = ActivationTap(model)
    tap.install().install()  # idempotent
    assert inspect.signature(shared.call) == signature
    assert "call" in vars(shared) and shared.call.__wrapped__ == type(shared).call.__get__(shared)
    tap.remove()
    tap.remove()
    assert "call" not in vars(shared) and not tap.installed
    assert shared.call.__func__ is type(shared).call
    np.testing.assert_array_equal(ops.convert_to_numpy(model(x)), before)
    with tap.recording():
        model(x)
    assert tap.take() == []


class TapLossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """Takes the tap's records first thing in ``apply``, as kmix's optimizer does."""

    tap = None

    def build(self, variables):
        super().build(variables)
        self.seen_max_abs = self.add_variable((2,), name="seen_max_abs", initializer="zeros")

    def apply(self, grads, trainable_variables=None):
        records = self.tap.take()
        stats = activations.activation_stats([r.outputs for r in records])
        super().apply(grads, trainable_variables)  # builds on the first call
        self.seen_max_abs.assign(stats.max_abs)


@pytest.mark.parametrize("jit_compile, steps_per_execution", [(False, 3), (True, 2)])
@pytest.mark.slow
def test_fit_takes_per_traced_step(float16_policy, jit_compile, steps_per_execution):
    model = keras.Sequential(
        [
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(4),
            keras.layers.Dense(2, dtype="float32"),
        ]
    )
    optimizer = TapLossScaleOptimizer(keras.optimizers.SGD(0.0))
    model.compile(
        optimizer, "mse", jit_compile=jit_compile, steps_per_execution=steps_per_execution
    )
    optimizer.tap = ActivationTap(model).install()
    x = np.random.default_rng(6).standard_normal((24, 5)).astype("float32")
    model.fit(x, np.zeros((24, 2)), batch_size=4, verbose=0, shuffle=False)
    last = x[-4:]
    h1 = model.layers[0](last)
    expected = [max_abs(h1), max_abs(model.layers[1](h1))]
    np.testing.assert_array_equal(ops.convert_to_numpy(optimizer.seen_max_abs), expected)


MIRRORED_SCRIPT = textwrap.dedent(
    """
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, numpy as np
    from kmix.optimizer.tap import ActivationTap
    from kmix.record import activations
    keras.config.set_dtype_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, name="d")])
    tap = ActivationTap(model).install()

    @tf.function
    def step(x):
        def replica(x):
            model(x)
            records = tap.take()
            return activations.activation_stats([r.outputs for r in records]).max_abs
        return strategy.experimental_local_results(strategy.run(replica, (x,)))

    x = np.arange(12, dtype="float32").reshape(4, 3) ** 2
    halves = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(x[2 * ctx.replica_id_in_sync_group :][:2])
    )
    got = [float(v[0]) for v in step(halves)]
    want = [float(np.abs(model.layers[0](x[2 * i : 2 * i + 2])).max()) for i in range(2)]
    print(got, want)
    assert got == want, (got, want)
    print("OK")
    """
)


@pytest.mark.slow
def test_mirrored_strategy_replicas_record_their_own_calls():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", MIRRORED_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr[-3000:]


def test_layers_returning_tuples_are_reduced_over_all_their_tensors(float16_policy):
    inputs = keras.Input((3, 4))
    attention = keras.layers.MultiHeadAttention(2, 2, name="mha")
    mixed, scores = attention(inputs, inputs, return_attention_scores=True)
    model = keras.Model(inputs, keras.layers.Flatten(name="flat")(mixed))
    tap = ActivationTap(model).install()
    x = np.random.default_rng(7).standard_normal((2, 3, 4)).astype("float32") * 50
    paths, stats, _ = take_in_function(model, tap, x)
    assert "mha" in paths and paths.index("mha") > paths.index("mha/softmax")
    mixed, scores = attention(x, x, return_attention_scores=True)
    assert stats["max_abs"][paths.index("mha")] == max(max_abs(mixed), max_abs(scores))
