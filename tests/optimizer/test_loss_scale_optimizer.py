"""kmix.LossScaleOptimizer: exact traces, skipped steps, state, saving, replicas."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops
from test_health import reference_bins

import kmix
from kmix.record import step_record as record

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/

SCRIPTS = os.path.join(TESTS, "scripts")


class GradientFault(keras.layers.Layer):
    """Identity forward; at the chosen (1-based) training calls, its backward pass
    turns the incoming gradient into inf, so every layer *before* it overflows."""

    def __init__(self, bad_steps=(), **kwargs):
        super().__init__(**kwargs)
        self.bad_steps = tuple(bad_steps)

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), dtype="int64", initializer="zeros", trainable=False)

    def call(self, x):
        step = self.calls.assign_add(1)
        bad = ops.any(ops.equal(step, ops.convert_to_tensor(self.bad_steps + (-1,), step.dtype)))

        @ops.custom_gradient
        def fault(x):
            def grad(*args, upstream=None):
                dy = args[0] if upstream is None else upstream  # TensorFlow, JAX
                return ops.where(bad, ops.full_like(dy, np.inf), dy)

            return ops.copy(x), grad

        return fault(x)


def faulty_model(bad_steps=()):
    """Dense(2) -> fault -> Dense(1): a fault overflows only the first Dense's gradients."""
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(2, kernel_initializer="ones", name="first"),
            GradientFault(bad_steps, name="fault"),
            keras.layers.Dense(1, kernel_initializer="ones", name="last", dtype="float32"),
        ],
        name="net",
    )


class Recorder(keras.callbacks.Callback):
    """Records the optimizer state, weights and inner-optimizer state after each batch."""

    def __init__(self):
        super().__init__()
        self.states, self.weights, self.inner = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        opt = self.model.optimizer
        self.states.append(opt.read_state())
        self.weights.append([v.numpy().copy() for v in self.model.trainable_variables])
        self.inner.append([v.numpy().copy() for v in opt.inner_optimizer.variables])


def fit(model, opt, steps, recorder=None, **compile_kwargs):
    model.compile(optimizer=opt, loss="mse", **compile_kwargs)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, (steps, 3)).astype("float32")
    y = rng.uniform(0.0, 1.0, (steps, 1)).astype("float32")
    callbacks = [recorder] if recorder else []
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


# On JAX jit_compile=False runs the step eagerly (slow): the compiled one runs there.
@pytest.mark.parametrize(
    "jit_compile",
    [pytest.param(False, marks=pytest.mark.torch), pytest.param(True, marks=pytest.mark.jax)],
)
@pytest.mark.slow
def test_exact_trace_under_fit(jit_compile):
    keras.mixed_precision.set_global_policy("mixed_float16")
    rec = Recorder()
    opt = kmix.LossScaleOptimizer(
        keras.optimizers.Adam(0.1), initial_scale=8.0, dynamic_growth_steps=2
    )
    fit(faulty_model(bad_steps=(3, 4, 7)), opt, steps=8, recorder=rec, jit_compile=jit_compile)

    trace = [
        (
            s["attempted_steps"],
            s["loss_scale"],
            s["good_steps"],
            s["skipped_steps"],
            s["last_overflow_step"],
            s["consecutive_skips"],
        )
        for s in rec.states
    ]
    assert trace == [
        (1, 8.0, 1, 0, 0, 0),
        (2, 16.0, 0, 0, 0, 0),  # grew after 2 good steps
        (3, 8.0, 0, 1, 3, 1),  # overflow: skip, back off
        (4, 4.0, 0, 2, 4, 2),
        (5, 4.0, 1, 2, 4, 0),
        (6, 8.0, 0, 2, 4, 0),
        (7, 4.0, 0, 3, 7, 1),
        (8, 4.0, 1, 3, 7, 0),
    ]
    assert opt.iterations.numpy() == 5  # the inner optimizer applied only the good steps
    events = opt.scale_events()
    assert [(e.index, e.step, e.kind, e.old_scale, e.new_scale) for e in events] == [
        (1, 2, "growth", 8.0, 16.0),
        (2, 3, "backoff", 16.0, 8.0),
        (3, 4, "backoff", 8.0, 4.0),
        (4, 6, "growth", 4.0, 8.0),
        (5, 7, "backoff", 8.0, 4.0),
    ]
    skipped = [e for e in events if e.kind == "backoff"]
    # Only the layer before the fault overflowed: its kernel and bias.
    assert {(e.variable, e.nonfinite_variables, e.loss_finite) for e in skipped} == {
        ("net/first/kernel", 2, True)
    }
    assert opt.scale_events(since=4) == events[4:]


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_skipped_steps_leave_weights_and_inner_state_bit_for_bit():
    keras.mixed_precision.set_global_policy("mixed_float16")
    rec = Recorder()
    opt = kmix.LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=8.0)
    fit(faulty_model(bad_steps=(2, 3)), opt, steps=4, recorder=rec)
    for before, after in ((0, 1), (1, 2)):  # steps 2 and 3 were skipped
        for a, b in zip(rec.weights[before], rec.weights[after], strict=True):
            assert a.tobytes() == b.tobytes()
        for a, b in zip(rec.inner[before], rec.inner[after], strict=True):
            assert a.tobytes() == b.tobytes()
    # ... and the good step after them moved every weight.
    assert all(
        not np.array_equal(a, b) for a, b in zip(rec.weights[2], rec.weights[3], strict=True)
    )


@pytest.mark.slow
def test_sgd_lr1_gives_known_weights_with_unscaled_gradients():
    """w <- w - grad with the gradient unscaled exactly (scale 2**10, float32 policy)."""
    w = keras.Variable(np.array([1.0, 2.0], "float32"))
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1024.0)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * x)
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, [w]), [w])

    step(tf.constant([0.5, -0.25]))
    np.testing.assert_array_equal(w.numpy(), [0.5, 2.25])
    step(tf.constant([np.inf, 1.0]))  # non-finite loss: skipped, recorded as such
    np.testing.assert_array_equal(w.numpy(), [0.5, 2.25])
    (event,) = opt.scale_events()
    # A forward overflow: skipped, and the scale is kept (no scale fixes the forward pass).
    assert (event.step, event.kind, event.loss_finite, event.variable) == (
        2,
        "forward_overflow",
        False,
        w.path,
    )
    assert (event.old_scale, event.new_scale, opt.loss_scale) == (1024.0, 1024.0, 1024.0)
    assert opt.read_state()["consecutive_nonfinite_loss"] == 1
    step(tf.constant([1.0, 1.0]))
    np.testing.assert_array_equal(w.numpy(), [-0.5, 1.25])
    assert opt.read_state()["loss_finite"] is True
    assert opt.read_state()["consecutive_nonfinite_loss"] == 0


def one_measured_step(inputs: int, units: int, jit_compile: bool):
    """One fit step of Dense(units) -> Dense(1) with statistics and histograms due (scale 256).

    Under ``mixed_float16``: float16's range statistics describe float16 layers only, and
    kmix knows the model's layers on every fit (a float32 model has no range statistics).

    Returns:
        The optimizer, its state after the step, and the same step's scaled gradients
        recomputed eagerly from the initial weights (float64), the reference.
    """
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((inputs,)), keras.layers.Dense(units), keras.layers.Dense(1)]
    )
    opt = kmix.LossScaleOptimizer("sgd", initial_scale=256.0, health_every=1, histogram_every=1)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, inputs)).astype("float32")
    y = rng.standard_normal((8, 1)).astype("float32")
    initial = model.get_weights()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, epochs=1)  # one step
    state = opt.read_state()
    model.set_weights(initial)  # the reference: the same step's scaled gradients
    ref = [g.astype(np.float64) for g in scaled_gradients(model, x, y, 256.0)]
    return opt, state, ref


def scaled_gradients(model: keras.Model, x: np.ndarray, y: np.ndarray, scale: float) -> list:
    """The gradients of ``mse(y, model(x)) * scale``, computed eagerly (on each backend)."""
    loss = keras.losses.MeanSquaredError()
    if keras.backend.backend() == "torch":
        for v in model.trainable_variables:
            v.value.grad = None
        (loss(y, model(x)) * scale).backward()
        return [v.value.grad.detach().cpu().numpy() for v in model.trainable_variables]
    if keras.backend.backend() == "jax":
        import jax

        def scaled(trainable):
            out, _ = model.stateless_call(
                trainable, [v.value for v in model.non_trainable_variables], x
            )
            return loss(y, out) * scale

        grads = jax.grad(scaled)([v.value for v in model.trainable_variables])
        return [np.asarray(g) for g in grads]
    with tf.GradientTape() as tape:
        scaled = loss(y, model(x)) * scale
    return [g.numpy() for g in tape.gradient(scaled, model.trainable_variables)]


@pytest.mark.parametrize(
    "jit_compile",
    [pytest.param(False, marks=pytest.mark.torch), pytest.param(True, marks=pytest.mark.jax)],
)
@pytest.mark.slow
def test_health_statistics_in_fit_match_numpy(jit_compile):
    """The stored statistics equal a NumPy reference on the same scaled gradients.

    The reference recomputes the step eagerly, so its float16 gradients may round each
    element differently from the compiled step (another kernel, another order of
    accumulation: oneDNN, XLA): at most one float16 unit in the last place, a relative
    2**-10 (10 fraction bits, rounding to nearest either side). A norm, a maximum and a
    ratio of them carry that relative error, so ``rtol=2**-10``; headroom, a log2 of a
    ratio, moves by at most 2**-10 / ln 2 bits. Counts (zeros, values under float16's
    smallest normal, exponent bins) are exact when no element sits within that one ulp of
    a threshold: the test checks that first, so an exact comparison is a fair one.
    """
    opt, state, ref = one_measured_step(4, 3, jit_compile)
    assert state["health_step"] == 1 and state.histogram_step == 1
    flat = np.concatenate([g.ravel() for g in ref])
    ulp = 2.0**-10  # float16 rounding, relative, between two computations of one value
    magnitudes = np.abs(flat[flat != 0])
    to_power_of_two = np.abs(magnitudes / 2.0 ** np.round(np.log2(magnitudes)) - 1.0)
    assert to_power_of_two.min() > ulp, "a value on a bin edge: the counts could differ"
    np.testing.assert_allclose(state["grad_norm"], np.linalg.norm(flat / 256.0), rtol=ulp)
    np.testing.assert_allclose(state["max_abs_scaled"], np.abs(flat).max(), rtol=ulp)
    np.testing.assert_allclose(
        state["headroom_bits"], np.log2(65504.0 / np.abs(flat).max()), atol=ulp / np.log(2)
    )
    n = flat.size  # fractions of n elements: exact counts, float32 division
    np.testing.assert_allclose(
        state["underflow_fraction"], np.mean(np.abs(flat) < 2.0**-14), atol=0.5 / n
    )
    np.testing.assert_allclose(state.health["zero_fraction"], np.mean(flat == 0), atol=0.5 / n)
    tiny = (flat != 0) & (np.abs(flat) < 2.0**-14)
    np.testing.assert_allclose(state.health["subnormal_fraction"], np.mean(tiny), atol=0.5 / n)
    assert state["nonfinite_elements"] == 0.0
    hist = opt.exponent_histograms_by_variable()
    assert list(hist) == opt.variable_paths()
    for counts, grad in zip(hist.values(), ref, strict=True):
        np.testing.assert_array_equal(counts, reference_bins(grad.ravel()))


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_health_statistics_under_jit_on_a_large_kernel():
    """XLA once failed on large kernels (segment ids of unbounded size): 262,144 elements.

    Sums over that many float32 values carry about sqrt(n) * 2**-24 relative error. The
    reference recomputes the step eagerly: its float16 gradients may round an element one
    float16 unit in the last place away from the step's (another kernel's order of
    accumulation: torch's eager matmul), a relative 2**-10 on the maximum.
    """
    opt, state, ref = one_measured_step(64, 4096, jit_compile=True)
    flat = np.concatenate([g.ravel() for g in ref])
    np.testing.assert_allclose(state.health["grad_norm"], np.linalg.norm(flat / 256.0), rtol=1e-4)
    np.testing.assert_allclose(state.health["max_abs_scaled"], np.abs(flat).max(), rtol=2**-10)
    for counts, grad in zip(opt.exponent_histograms_by_variable().values(), ref, strict=True):
        assert counts.sum() == grad.size


@pytest.mark.slow
def test_float32_layers_do_not_count_against_float16_headroom():
    """A float32 head in a mixed model may hold gradients beyond 65504 harmlessly."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(2, kernel_initializer="ones", name="body"),
            keras.layers.Dense(1, kernel_initializer="zeros", name="head", dtype="float32"),
        ],
        name="net",
    )
    opt = kmix.LossScaleOptimizer(  # lr 0: both steps see the same weights
        keras.optimizers.SGD(0.0), initial_scale=2.0**20, health_every=1
    )
    model.compile(optimizer=opt, loss="mse")
    x, y = np.ones((1, 2), "float32"), np.full((1, 1), 10.0, "float32")
    # Every fit tells kmix the model (callbacks or not): head's float32 gradient, 2 * 2 *
    # (0 - 10) * 2**20 for its kernel, does not count; body's float16 gradients are all
    # zero (head's zero kernel sends none back).
    model.fit(x, y, verbose=0, epochs=1)
    assert opt.float16_mask.tolist() == [1.0, 1.0, 0.0, 0.0]
    with pytest.warns(kmix.KmixDeprecationWarning, match="watch_float16_layers is deprecated"):
        assert opt.watch_float16_layers(model) == ["net/body/kernel", "net/body/bias"]
    model.fit(x, y, verbose=0, epochs=1)
    state = opt.read_state()
    assert state["skipped_steps"] == 0 and state["max_abs_scaled"] == 0.0
    assert state["headroom_bits"] == pytest.approx(kmix.record.health.MAX_HEADROOM_BITS)
    assert state["underflow_fraction"] == 1.0  # body's 6 zeros; head's 3 values not counted
    # Without a model (a bare apply) every variable counts, that gradient included.
    bare = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), health_every=1)
    bare.apply([ops.convert_to_tensor([40.0 * 2.0**20])], [keras.Variable(np.zeros(1, "float32"))])
    assert bare.read_state()["headroom_bits"] == pytest.approx(np.log2(65504 / (40 * 2.0**20)))

    # Told before it is built (as the monitor does when fit builds it lazily):
    fresh = kmix.LossScaleOptimizer("sgd")
    assert fresh.watch(model) == ["net/body/kernel", "net/body/bias"]
    fresh.build(model.trainable_variables)
    assert fresh.float16_mask.tolist() == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.slow
def test_embedding_gradients_train_and_count_rows_once():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(10, 2, embeddings_initializer="ones", name="emb"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, kernel_initializer="ones", use_bias=False, dtype="float32"),
        ]
    )
    opt = kmix.LossScaleOptimizer("sgd", initial_scale=4.0, health_every=1, histogram_every=1)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.array([[1, 1, 1, 3]]), np.zeros((1, 1)), verbose=0)
    hist = opt.exponent_histograms_by_variable()
    # Two rows were looked up (1 three times, 3 once): 2 rows x 2 columns counted.
    assert int(hist[model.get_layer("emb").embeddings.path].sum()) == 4
    assert opt.read_state()["skipped_steps"] == 0


@pytest.mark.slow
def test_custom_gradient_tape_loop_with_fault_on_chosen_layer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = faulty_model(bad_steps=(2,))
    model.build((None, 3))
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0)
    x, y = tf.ones((2, 3)), tf.zeros((2, 1))

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    for _ in range(3):
        train_step()
    assert (opt.attempted_steps, opt.skipped_steps, opt.loss_scale) == (3, 1, 32.0)
    (event,) = opt.scale_events()
    assert (event.step, event.variable, event.loss_finite) == (2, "net/first/kernel", True)


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_gradient_accumulation_in_the_inner_optimizer():
    """SGD(lr=1) accumulating 2 steps: w <- w - mean(grad_1, grad_2), gradients unscaled."""
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")]
    )
    inner = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    opt = kmix.LossScaleOptimizer(inner, initial_scale=4.0)
    model.compile(optimizer=opt, loss="mse")
    rec = Recorder()
    x, y = np.ones((4, 2), "float32"), np.zeros((4, 1), "float32")
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False, callbacks=[rec])
    # pred = 2 -> d(loss)/dw = 2 * 2 = 4; then pred = -6 -> grad -12.
    assert [w[0].ravel().tolist() for w in rec.weights] == [[1, 1], [-3, -3], [-3, -3], [9, 9]]


@pytest.mark.jax
@pytest.mark.torch
def test_state_reads_before_the_optimizer_is_built():
    opt = kmix.LossScaleOptimizer("sgd", initial_scale=64.0, health_every=7)
    assert (opt.loss_scale, opt.skipped_steps, opt.attempted_steps, opt.event_count) == (
        64.0,
        0,
        0,
        0,
    )
    assert (opt.health_every, opt.scale_events(), opt.underflow_by_variable()) == (7, [], {})
    state = opt.read_state()
    assert state["loss_scale"] == 64.0 and state["loss_finite"] is True
    assert state["attempted_steps"] == state["health_step"] == 0
    w = keras.Variable(np.ones(2, "float32"))
    opt.apply([ops.convert_to_tensor([1.0, 1.0])], [w])
    assert dataclasses.asdict(opt.read_state()).keys() == dataclasses.asdict(state).keys()


def test_host_reads_equal_keras_reads():
    """The callbacks' raw variable reads (TensorFlow's host_value) give Keras's values."""
    from kmix.backend.tensorflow import host_value

    w = keras.Variable(np.ones(3, "float16"))
    opt = kmix.LossScaleOptimizer("sgd", initial_scale=8.0)
    opt.apply([tf.constant([1.0, np.inf, 2.0], "float16")], [w])
    opt.apply([tf.constant([1.0, 3.0, 2.0], "float16")], [w])
    for variable in [*opt.variables, w, tf.Variable([1, 2], dtype=tf.int64)]:
        got, want = host_value(variable), np.asarray(keras.ops.convert_to_numpy(variable))
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    state = opt.read_state()
    assert (state.loss_scale, state.attempted_steps, state.skipped_steps) == (4.0, 2, 1)
    counters_only = opt.read_state(counters_only=True)
    assert counters_only.loss_scale is None and counters_only.health == {}
    assert dataclasses.replace(counters_only, loss_scale=4.0, health=state.health) == state


def test_read_in_step_takes_the_read_the_traced_step_made_before_it_assigns():
    """TensorFlow's read_in_step gives back the step's own earlier read of a variable (the
    value before the step's assignment after it, and no new ReadVariableOp); a variable the
    step never read, a distributed one and an eager call read anew."""
    from kmix.backend.tensorflow import read_in_step

    scale, other = keras.Variable(2.0), keras.Variable(5.0)
    seen = {}

    @tf.function
    def step():
        used = tf.convert_to_tensor(scale.value) * 1.0  # the forward pass's read
        found, fresh = read_in_step(scale), read_in_step(other) * 1.0
        scale.assign(used * 4.0)  # the step assigns after it
        seen["reads"] = [op for op in found.graph.get_operations() if op.type == "ReadVariableOp"]
        return found, fresh

    found, fresh = step()
    assert (float(found), float(fresh), float(scale.numpy())) == (2.0, 5.0, 8.0)
    assert len(seen["reads"]) == 2  # the forward's of ``scale``, the new one of ``other``
    assert float(read_in_step(scale)) == 8.0  # eager: the value now
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        mirrored = keras.Variable(3.0)
    got = strategy.run(
        tf.function(lambda: read_in_step(mirrored) + tf.convert_to_tensor(mirrored.value))
    )
    assert float(got) == 6.0


@pytest.mark.jax
@pytest.mark.torch
def test_compiled_reads_a_trainable_variable_without_recording_gradients():
    """kmix.backend.compiled (a host read) gives the values; on torch, where it runs op
    by op, it records no autograd graph of the trainable parameter it reads."""
    from kmix import backend

    weight = keras.Variable(np.float32([1.0, -2.0]))
    out = backend.compiled(lambda values: ops.abs(values[0]) * 2.0)([weight.value])
    np.testing.assert_array_equal(ops.convert_to_numpy(out), np.float32([2.0, 4.0]))
    assert not getattr(out, "requires_grad", False)
    if keras.backend.backend() == "torch":
        assert weight.value.requires_grad  # it is trainable: the read alone records nothing


def test_compiled_calls_trace_once_per_signature_and_read_what_they_are_handed():
    """TensorFlow's compiled: one trace for new values of the same dtypes and shapes
    (Python numbers and NumPy arrays as tensors, not baked in), one per new signature (a
    new structure or shape, one variable handed twice, a non-trainable one); each call
    reads the variables handed to it, as they are now, in their places; a mirrored
    variable is read (one replica here: tests/float8/test_mirrored.py has two)."""
    from kmix.backend.tensorflow import compiled

    traces = []

    def body(values, scale):  # each value weighed by its place: a swap shows
        traces.append(None)
        return tf.add_n([tf.reduce_sum(v) * (i + 1) for i, v in enumerate(values)]) * scale

    call = compiled(body)
    first, second = tf.Variable([1.0, 2.0]), tf.Variable([3.0, 4.0])
    assert float(call([second, second], 1.0)) == 21.0 and len(traces) == 1  # one variable
    assert float(call([first, second], 1.0)) == 17.0 and len(traces) == 2  # two: traced anew
    assert float(call([second, first], 2.0)) == 26.0 and len(traces) == 2
    assert float(call([first, first], np.float32(0.5))) == 4.5 and len(traces) == 2
    second.assign([5.0, 6.0])
    assert float(call([first, second], 1.0)) == 25.0 and len(traces) == 2  # read as it is now
    assert float(call([first], 2.0)) == 6.0 and len(traces) == 3  # a new structure
    frozen = tf.Variable([1.0, 1.0], trainable=False)
    assert float(call([frozen], 1.0)) == 2.0 and len(traces) == 4
    assert float(call([tf.constant([1.0, 2.0, 3.0])], 1.0)) == 6.0 and len(traces) == 5
    assert float(call([tf.constant([1.0, 2.0, 4.0])], 1.0)) == 7.0 and len(traces) == 5
    assert float(call([np.float32([1.0, 2.0, 5.0])], 1.0)) == 8.0 and len(traces) == 5
    keyed = compiled(lambda named: named["x"] * 2.0 + named["y"])  # dicts too
    assert float(keyed({"y": tf.constant(1.0), "x": first[0]})) == 3.0
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        mirrored = tf.Variable([7.0, 8.0])
    assert float(call([mirrored], 1.0)) == 15.0


@pytest.mark.jax
@pytest.mark.torch
def test_counters_saturate_instead_of_overflowing():
    w = keras.Variable(np.ones(2, "float32"))
    opt = kmix.LossScaleOptimizer("sgd")
    opt.build([w])
    counters = opt.recorder.counters.numpy()
    top = record.int_max(counters.dtype)  # int64; int32 on JAX without x64, and on torch
    assert top == record.int_max(kmix.backend.int64_dtype())
    for name in ("skipped_steps", "attempted_steps"):
        counters[record.Counters._fields.index(name)] = top - 1
    opt.recorder.counters.assign(counters)
    for _ in range(2):
        opt.apply([ops.convert_to_tensor([np.nan, 0.0])], [w])
    assert opt.skipped_steps == opt.attempted_steps == top


def test_event_ring_keeps_the_most_recent_events():
    w = keras.Variable(np.ones(1, "float32"))
    opt = kmix.LossScaleOptimizer("sgd", event_capacity=3, initial_scale=2.0**10)
    for _ in range(5):
        opt.apply([ops.convert_to_tensor([np.inf])], [w])
    assert opt.event_count == 5
    assert [e.index for e in opt.scale_events()] == [3, 4, 5]
    assert [e.new_scale for e in opt.scale_events(since=3)] == [2.0**6, 2.0**5]


@pytest.mark.parametrize("growth_steps", [1, 3])
def test_defaults_follow_stock_keras_scale_trace(growth_steps):
    """hysteresis=1 and factors 2 / 0.5 reproduce Keras's own rule, step for step."""
    pattern = [True, True, True, False, True, False, False, True, True, True, True]
    traces = []
    for make in (kmix.LossScaleOptimizer, keras.mixed_precision.LossScaleOptimizer):
        w = keras.Variable(np.ones(2, "float32"))
        opt = make(keras.optimizers.SGD(0.0), dynamic_growth_steps=growth_steps)
        trace = []
        for finite in pattern:
            opt.apply([tf.constant([1.0 if finite else np.inf, 0.0])], [w])
            trace.append(float(opt.dynamic_scale.numpy()))
        traces.append(trace)
    assert traces[0] == traces[1]
    assert len(set(traces[0])) > 2  # the pattern made the scale move both ways


@pytest.mark.slow
def test_watching_changes_nothing_in_the_training_without_xla(tmp_path):
    """Monitor (statistics every 2 steps, histograms every 4) and guard: the same weights,
    bit for bit, as stock Keras's optimizer on a healthy run (jit_compile=False)."""
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 8)).astype("float32"), rng.integers(0, 4, 96)
    weights = {}
    for kind in ("stock", "kmix"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.LayerNormalization(),
                keras.layers.Dense(4, dtype="float32"),
            ]
        )
        adam = keras.optimizers.Adam()
        if kind == "stock":
            opt, callbacks = keras.mixed_precision.LossScaleOptimizer(adam), []
        else:
            opt = kmix.LossScaleOptimizer(adam)
            callbacks = [
                kmix.callbacks.MixedPrecisionMonitor(
                    tmp_path, update_freq=2, histogram_freq=4, verbose=0
                ),
                kmix.callbacks.LossScaleGuard(verbose=0),
            ]
        model.compile(opt, "sparse_categorical_crossentropy", jit_compile=False)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        weights[kind] = [w.numpy() for w in model.trainable_weights]
    assert int(opt.read_state().health_step) == 12  # statistics were taken
    for stock, watched in zip(weights["stock"], weights["kmix"], strict=True):
        np.testing.assert_array_equal(watched, stock)


def test_compile_does_not_wrap_it_again():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = kmix.LossScaleOptimizer("adam")
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt
    assert isinstance(opt, keras.mixed_precision.LossScaleOptimizer)
    assert isinstance(opt.inner_optimizer, keras.optimizers.Adam)


@pytest.mark.jax
@pytest.mark.torch
def test_config_round_trip():
    opt = kmix.LossScaleOptimizer(
        keras.optimizers.SGD(0.5),
        initial_scale=64.0,
        dynamic_growth_steps=7,
        growth_factor=3.0,
        backoff_factor=0.25,
        hysteresis=2,
        min_scale=2.0,
        max_scale=1024.0,
        health_every=5,
        histogram_every=10,
        event_capacity=9,
    )
    config = opt.get_config()
    clone = kmix.LossScaleOptimizer.from_config(json.loads(json.dumps(config)))
    assert clone.get_config() == config
    assert config["inner_optimizer"]["class_name"] == "SGD"
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is kmix.LossScaleOptimizer


def train_small(model, opt, epochs=1, callbacks=()):
    model.compile(optimizer=opt, loss="mse")
    x = np.linspace(0, 1, 24, dtype="float32").reshape(8, 3)
    y = np.arange(8, dtype="float32").reshape(8, 1)
    model.fit(
        x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks)
    )


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_keras_file_restores_scale_and_counters(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = faulty_model(bad_steps=(2,))
    opt = kmix.LossScaleOptimizer("adam", initial_scale=32.0, dynamic_growth_steps=2)
    train_small(model, opt)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"GradientFault": GradientFault})
    assert type(loaded.optimizer) is kmix.LossScaleOptimizer
    assert loaded.optimizer.read_state() == opt.read_state()
    # Keras names the reloaded variables without the model's prefix; the rest is equal.
    got, want = loaded.optimizer.scale_events(), opt.scale_events()
    assert [e.kind for e in want] == ["backoff", "growth"]
    assert [dataclasses.replace(e, variable=None) for e in got] == [
        dataclasses.replace(e, variable=None) for e in want
    ]
    assert got[0].variable == loaded.get_layer("first").kernel.path
    for a, b in zip(loaded.optimizer.variables, opt.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.jax
@pytest.mark.torch
def test_a_keras_file_saved_before_the_step_recorder_loads_unchanged():
    """tests/data/optimizer_643f46e.keras was saved by main at 643f46e (before the record
    moved into kmix.optimizer.recorder): same variable names, order and values, same state.
    Its event ring predates the source columns: they load as -1 (unknown), no source; its
    per-layer rows predate the float8 inputs' column: it loads as NaN (not measured)."""
    data = os.path.join(TESTS, "data")
    with open(os.path.join(data, "optimizer_643f46e.json")) as f:
        expected = json.load(f)
    keras.mixed_precision.set_global_policy("mixed_float16")
    opt = keras.models.load_model(os.path.join(data, "optimizer_643f46e.keras")).optimizer
    assert type(opt) is kmix.LossScaleOptimizer
    assert [v.path for v in opt.variables] == [v["path"] for v in expected["variables"]]
    for variable, want in zip(opt.variables, expected["variables"], strict=True):
        value = variable.numpy()
        if want["path"].endswith("event_ints"):  # the columns added since, at the end
            saved = len(want["value"][0])
            np.testing.assert_array_equal(value[:, saved:], -1)
            value = value[:, :saved]
        if want["path"].endswith("activation_stats"):  # float8 inputs' column: unmeasured
            saved = len(want["value"][0])
            assert value.shape[1] == saved + 1 and np.isnan(value[:, saved:]).all()
            value = value[:, :saved]
        np.testing.assert_array_equal(value, np.asarray(want["value"], variable.dtype))
    state = dataclasses.asdict(opt.read_state())
    assert {k: state[k] for k in expected["state"]} == expected["state"]
    events = [(e.step, e.kind, e.old_scale, e.new_scale) for e in opt.scale_events()]
    assert events == [
        (e["step"], e["kind"], e["old_scale"], e["new_scale"]) for e in expected["events"]
    ]
    assert opt.event_count == 11 and len(events) == 8  # the ring of 8 lost the first 3
    assert {e.source for e in opt.scale_events()} == {None}


class StopAfterEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt("simulated interruption")


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_resume_with_backup_and_restore_continues_with_identical_state(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")

    def make():
        keras.utils.set_random_seed(0)
        return faulty_model(bad_steps=(3, 6)), kmix.LossScaleOptimizer(
            "adam", initial_scale=32.0, dynamic_growth_steps=3
        )

    model, opt = make()
    train_small(model, opt, epochs=3)
    expected = opt.read_state(), [v.numpy() for v in model.weights]

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model, opt = make()
    with pytest.raises(KeyboardInterrupt):
        train_small(model, opt, epochs=3, callbacks=[backup, StopAfterEpoch(1)])
    model, opt = make()
    train_small(model, opt, epochs=3, callbacks=[backup])
    # The fault layer counts its own calls, so resumed faults land on the same steps.
    assert opt.read_state() == expected[0]
    for got, want in zip([v.numpy() for v in model.weights], expected[1], strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_run_settings_are_not_saved_and_config_keeps_the_arguments(tmp_path):
    """A monitor's settings (health_every...) must not leak through a saved file."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = kmix.LossScaleOptimizer("sgd", health_every=7, histogram_every=0)
    train_small(model, opt)
    opt.health_every, opt.histogram_every = 1, 5  # as a monitor sets them during fit
    assert (opt.health_every, opt.histogram_every) == (1, 5)
    assert (opt.get_config()["health_every"], opt.get_config()["histogram_every"]) == (7, 0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path).optimizer
    assert (loaded.health_every, loaded.histogram_every) == (7, 0)
    assert len(loaded.variables) == len(opt.variables)


@pytest.mark.slow
def test_model_saved_with_stock_optimizer_loads_and_migrates(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, dtype="float32")])
    stock = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=512.0)
    train_small(model, stock)
    path = str(tmp_path / "stock.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is keras.mixed_precision.LossScaleOptimizer
    migrated = kmix.LossScaleOptimizer.from_keras(loaded.optimizer, hysteresis=2)
    assert migrated.initial_scale == 512.0
    assert migrated.inner_optimizer is loaded.optimizer.inner_optimizer
    loaded.compile(optimizer=migrated, loss="mse")
    train_small(loaded, migrated)
    assert migrated.attempted_steps == 4
    with pytest.raises(ValueError, match="`optimizer`"):
        kmix.LossScaleOptimizer.from_keras(keras.optimizers.Adam())


def test_from_keras_rescues_a_scale_stock_keras_drove_to_zero():
    stock = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
    stock.build([keras.Variable(np.ones(2, "float32"))])
    stock.dynamic_scale.assign(0.0)  # DESIGN fact 1: persistent NaN halves it to 0.0
    with pytest.warns(UserWarning, match="loss scale 0 is outside") as caught:
        migrated = kmix.LossScaleOptimizer.from_keras(stock, min_scale=2.0)
    assert migrated.loss_scale == 2.0
    (ours,) = [w for w in caught if "is outside kmix's" in str(w.message)]
    assert ours.filename == __file__


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": float("inf")}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": -0.5}, "backoff_factor"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": 1e-50, "initial_scale": 1e-44}, "min_scale"),  # would round to 0.0
        ({"max_scale": 1e300, "initial_scale": 1e38}, "max_scale"),  # would round to inf
        ({"min_scale": 8.0, "max_scale": 4.0, "initial_scale": 4.0}, "max_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"initial_scale": float("nan")}, "initial_scale"),
        ({"initial_scale": 2.0**30}, "initial_scale"),
        ({"dynamic_growth_steps": 0}, "dynamic_growth_steps"),
        ({"dynamic_growth_steps": 2.5}, "dynamic_growth_steps"),
        ({"dynamic_growth_steps": True}, "dynamic_growth_steps"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"health_every": 0}, "health_every"),
        ({"histogram_every": -1}, "histogram_every"),
        ({"event_capacity": 0}, "event_capacity"),
    ],
)
def test_invalid_arguments_name_argument_value_and_range(kwargs, name):
    with pytest.raises(ValueError) as info:
        kmix.LossScaleOptimizer("sgd", **kwargs)
    message = str(info.value)
    assert f"`{name}`" in message and f"{name}={kwargs[name]!r}" in message
    assert "must be" in message


@pytest.mark.parametrize(
    "inner", ["adamm", 3, keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())]
)
def test_invalid_inner_optimizer(inner):
    with pytest.raises(ValueError, match="`inner_optimizer`"):
        kmix.LossScaleOptimizer(inner)


def run_script(*args):
    result = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "mirrored_overflow.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_mirrored_strategy_overflow_on_one_replica_skips_on_all():
    got = run_script("kmix")
    assert got["finite"] and got["replicas_equal"]
    assert got["skipped"] == 1 and got["scale"] == 2.0**14
    assert got["events"] == [[3, "backoff", 2.0**15, 2.0**14]]
    assert got["iterations"] == 3  # 4 steps, the overflowing one skipped
    # the replica whose own gradients overflowed is named (the flags are all-reduced)
    assert got["lines"] == [
        "**backoff** at step 3: loss scale 32768 → 16384; first non-finite gradient "
        "`sequential/dense/kernel` (1 variable); first non-finite in replica 1"
    ]


@pytest.mark.slow
def test_stock_keras_corrupts_weights_in_the_same_case():
    """The fact kmix exists to fix: stock Keras reads replica 0 only and applies NaN."""
    got = run_script("keras")
    assert not got["finite"]


@pytest.mark.jax
@pytest.mark.torch
# ----------------------------------------------- truthful under every model, input, ending
@pytest.mark.slow
def test_a_lazily_built_model_gets_its_float16_mask_when_its_variables_exist(tmp_path):
    """No Input: variables appear at the first step; headroom must still be measured."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.layers.Dense(1, kernel_initializer="ones", name="d")])
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=2.0**10)
    model.compile(optimizer=opt, loss="mse")
    monitor = kmix.callbacks.MixedPrecisionMonitor(tmp_path, update_freq=1, verbose=0)
    x, y = np.full((1, 2), 8.0, "float32"), np.zeros((1, 1), "float32")
    model.fit(x, y, batch_size=1, verbose=0, callbacks=[monitor])
    # d/kernel's scaled gradient: 2 * (16 - 0) * 8 * 1024 = 2**18: past float16's max.
    np.testing.assert_array_equal(opt.float16_mask, [1.0, 1.0])
    assert opt.scale_events()[0].variable == "sequential/d/kernel" or opt.skipped_steps == 1
    state = opt.read_state()
    assert state.skipped_steps == 1 and opt.scale_events()[0].kind == "backoff"


@pytest.mark.slow
def test_an_input_of_unknown_length_counts_only_the_steps_that_ran():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = kmix.LossScaleOptimizer("sgd")
    model.compile(optimizer=opt, loss="mse")
    data = tf.data.Dataset.range(30).filter(lambda i: i % 4 != 0)  # cardinality unknown
    data = data.map(lambda i: (tf.fill([2], tf.cast(i, "float32") / 30), [0.0])).batch(3)
    model.fit(data, epochs=3, verbose=0)
    # 22 rows per epoch in batches of 3: 8 batches, 24 over three epochs. The first steps'
    # scaled gradients may overflow float16 (the scale starts at 2**15, the kernel is
    # random): the steps applied are the attempted ones less the skipped.
    assert opt.attempted_steps == 24
    assert int(opt.iterations.numpy()) == 24 - opt.skipped_steps


@pytest.mark.slow
def test_two_monitors_compose_their_requests_and_restore_the_setting(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = kmix.LossScaleOptimizer("sgd", health_every=100)

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.seen = (opt.health_every, opt.histogram_every)

    probe = Probe()
    monitors = [
        kmix.callbacks.MixedPrecisionMonitor(tmp_path / "a", update_freq=1, verbose=0),
        kmix.callbacks.MixedPrecisionMonitor(tmp_path / "b", update_freq=4, histogram_freq=6),
    ]
    train_small(model, opt, callbacks=[*monitors, probe])
    assert probe.seen == (1, 6)  # each monitor gets its steps
    assert (opt.health_every, opt.histogram_every) == (100, 0)


@pytest.mark.slow
def test_loss_flag_belongs_to_its_step():
    w = keras.Variable(np.ones(2, "float32"))
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=8.0)

    @tf.function
    def step(x):  # two losses, the first NaN: the step's loss is non-finite
        with tf.GradientTape() as tape:
            opt.scale_loss(tf.reduce_sum(w * x) * np.nan)
            second = opt.scale_loss(tf.reduce_sum(w * x))
        opt.apply(tape.gradient(second, [w]), [w])

    step(tf.constant([1.0, 1.0]))
    assert opt.read_state().loss_finite is False and opt.skipped_steps == 1
    np.testing.assert_array_equal(w.numpy(), [1.0, 1.0])

    scaled = tf.function(lambda: opt.scale_loss(tf.reduce_sum(w)))()  # graph, then eager apply
    opt.apply([tf.constant([np.inf, 0.0])], [w])
    assert float(scaled) == 16.0  # sum(w) * 8
    (event,) = opt.scale_events(since=1)
    assert (event.kind, event.loss_finite, event.variable) == ("backoff", None, w.path)


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_reusing_the_optimizer_after_unfreezing_gives_keras_clear_error():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="h1"), keras.layers.Dense(1)]
    )
    model.layers[0].trainable = False
    opt = kmix.LossScaleOptimizer("sgd")
    train_small(model, opt)
    model.layers[0].trainable = True
    clear = (  # Keras's words on TensorFlow and torch; kmix's on JAX, where its step sees it first
        "(?s)Unknown variable.*recreate a new optimizer"
        if keras.backend.backend() != "jax"
        else "built for 2 trainable variables and now gets 4 gradients.*create a new optimizer"
    )
    with pytest.raises(ValueError, match=clear):
        train_small(model, opt)


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("watched", [True, False])
def test_a_skipped_step_leaves_batch_normalization_statistics_as_they_were(watched):
    """With kmix's callbacks (watch) and with none at all: plain compile and fit is safe
    too, since kmix's fit wrapper protects the model first (issue 21, item 5)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(1)]
    )
    opt = kmix.LossScaleOptimizer("sgd", initial_scale=1.0)
    model.compile(optimizer=opt, loss="mse")
    if watched:
        opt.watch(model)  # what kmix's callbacks do at train begin
    x = np.array([[1.0, 2.0], [3.0, 4.0], [np.inf, 1.0], [5.0, 6.0]], "float32")
    y = np.zeros((4, 1), "float32")
    model.fit(x[:2], y[:2], batch_size=2, verbose=0, shuffle=False)
    moving = [v.numpy().copy() for v in model.get_layer("bn").non_trainable_variables]
    model.fit(x[2:], y[2:], batch_size=2, verbose=0, shuffle=False)  # inf in the batch
    assert opt.skipped_steps == 1 and opt.scale_events()[-1].kind == "forward_overflow"
    for variable, before in zip(model.get_layer("bn").non_trainable_variables, moving, strict=True):
        np.testing.assert_array_equal(variable.numpy(), before)


class StepCounter(keras.layers.Layer):
    """Identity that counts its calls in an integer variable (a step counter)."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), dtype="int64", initializer="zeros", trainable=False)

    def call(self, x):
        self.calls.assign_add(1)
        return x


@pytest.mark.slow
def test_an_integer_variable_the_forward_pass_assigns_is_named_as_not_restored():
    """Only float state is given back on a skipped step: the integer counter advances, and
    kmix says so by name once, when fit begins (issue 21, item 6)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((2,)), StepCounter(name="counter"), keras.layers.Dense(1)]
    )
    opt = kmix.LossScaleOptimizer("sgd", initial_scale=1.0)
    model.compile(optimizer=opt, loss="mse")
    x = np.array([[1.0, 2.0], [np.inf, 1.0]], "float32")
    with pytest.warns(UserWarning, match=r"integer variables keep the skipped step's update: "):
        model.fit(x, np.zeros((2, 1), "float32"), batch_size=1, verbose=0, shuffle=False)
    assert opt.skipped_steps == 1 and int(model.get_layer("counter").calls.numpy()) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per model
        model.fit(x[:1], np.zeros((1, 1), "float32"), verbose=0)


def test_input_handling_errors_name_the_argument():
    opt = kmix.LossScaleOptimizer("sgd")
    with pytest.raises(ValueError, match="already a kmix.LossScaleOptimizer"):
        kmix.LossScaleOptimizer.from_keras(opt)
    with pytest.raises(ValueError, match="initial_scale=1000000"):
        kmix.LossScaleOptimizer("sgd", initial_scale=10**400)
    with pytest.raises(ValueError, match="since=-5.*integer >= 0"):
        opt.scale_events(since=-5)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    with pytest.raises(TypeError, match="`callbacks`.*callbacks=None"):
        kmix.callbacks.LoopDriver(model, None)


def test_stateless_apply_on_tensorflow_says_what_to_call_instead():
    """fit on TensorFlow never calls it, and Keras's optimizers refuse it there: one line."""
    w = keras.Variable(np.ones(2, "float32"))
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0)
    opt.build([w])
    values = [v.value for v in opt.variables]
    with pytest.raises(ValueError, match=r"not supported on the TensorFlow backend.*apply\("):
        opt.stateless_apply(values, [np.float32([4.0, 8.0])], [w.value])


def test_the_0_1_0_names_of_the_optimizer_module_warn():
    import kmix.optimizer

    with pytest.warns(kmix.KmixDeprecationWarning, match=r"use kmix.record.INT64_MAX"):
        assert kmix.optimizer.INT64_MAX == record.INT64_MAX
