"""PrecisionAutopilot in fit: layers move out of float16 at their exact steps and training goes on.

The model: ``Dense "big"`` with every kernel entry ``C`` on inputs of ones(8), so its
outputs are exactly ``8 * C``; ``C = 9000`` gives 72000, past float16's max 65504, at
step 1, so "big" overflows itself; once it computes in float32, the cast of its 72000s
into "next" (float16) overflows at step 2; "next" in float32 feeds a LayerNormalization,
which brings the values back into range. So: two moves, two skipped steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util.tensor_util import make_ndarray

import kmix
from kmix import tags

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/

pytestmark = pytest.mark.slow  # every test fits a model

X = np.ones((48, 8), "float32")
Y = np.zeros((48, 1), "float32")
CAST = "the cast of its input (max |input| 72000) overflowed"


def layers_of(c: float):
    return [
        keras.layers.Dense(16, kernel_initializer=keras.initializers.Constant(c), name="big"),
        keras.layers.Dense(16, name="next"),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ]


class Block(keras.layers.Layer):
    def __init__(self, c: float, **kwargs):
        super().__init__(**kwargs)
        self.big, self.next = layers_of(c)[:2]

    def call(self, x):
        return self.next(self.big(x))


class Net(keras.Model):
    def __init__(self, c: float):
        super().__init__(name="net")
        self.block = Block(c, name="block")
        self.norm, self.head = layers_of(c)[2:]

    def call(self, x):
        return self.head(self.norm(self.block(x)))


def make(shape: str, c: float = 9000.0, **compile_kwargs) -> keras.Model:
    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_float16")  # after clear_session, which resets it
    keras.utils.set_random_seed(1)  # "next"'s kernel: the same gradients every run
    if shape == "functional":
        inputs = keras.Input((8,))
        x = inputs
        for layer in layers_of(c):
            x = layer(x)
        model = keras.Model(inputs, x)
    elif shape == "lazy_sequential":
        model = keras.Sequential(layers_of(c))
    else:
        model = Net(c)
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-4)), "mse", **compile_kwargs)
    return model


def paths(model: keras.Model) -> tuple[str, str]:
    """The paths the tap names "big" and "next" by (Keras's ``layer.path``)."""
    found = {
        layer.name: layer.path for layer in model._flatten_layers() if layer.name in ("big", "next")
    }
    return found["big"], found["next"]


def fit(model, callbacks, **kwargs):
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=callbacks, **kwargs)
    return model.optimizer.read_state(counters_only=True)


@pytest.mark.parametrize(
    "shape,jit",
    [
        ("functional", False),
        ("functional", True),
        ("lazy_sequential", False),
        ("subclassed", False),
    ],
)
def test_reactive_moves_at_the_exact_steps_and_training_goes_on(shape, jit):
    model = make(shape, jit_compile=jit)
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    state = fit(model, [autopilot])
    big, after = paths(model)
    assert autopilot.moves == [
        kmix.PrecisionMove(
            1, big, "Dense", "forward overflow at step 1", "mixed_float16", "float32"
        ),
        kmix.PrecisionMove(
            2, after, "Dense", f"forward overflow at step 2: {CAST}", "mixed_float16", "float32"
        ),
    ]
    assert (state.attempted_steps, state.skipped_steps) == (6, 2)
    assert np.isfinite(model.evaluate(X, Y, verbose=0))
    assert autopilot.plan.policies == {big: "float32", after: "float32"}
    share = autopilot.float16_share
    if shape == "subclassed":  # no layer.output: every layer weighed by its parameters
        assert share.by_parameters == (big, after, "net/norm", "net/head")
        assert share.share == pytest.approx(32 / (144 + 272 + 32 + 17))
    else:  # multiply-adds; norm (32 parameters) is what stays in float16
        assert share.by_parameters == (("norm",) if shape == "functional" else ("sequential/norm",))
        assert share.share == pytest.approx(32 / (128 + 256 + 32 + 16))


def scalars_and_texts(log_dir: str):
    acc = event_accumulator.EventAccumulator(
        os.path.join(log_dir, "train"), size_guidance={"tensors": 0}
    ).Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        out[tag] = [(e.step, e.tensor_proto) for e in acc.Tensors(tag)]
    return out


def test_moves_are_written_kept_by_keras_files_and_the_plan_heals_the_next_run(tmp_path):
    model = make("functional")
    assert not np.isfinite(model.evaluate(X, Y, verbose=0))  # float16: "big" overflows
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    monitor = kmix.callbacks.MixedPrecisionMonitor(str(tmp_path / "logs"), update_freq=3, verbose=0)
    fit(model, [autopilot, monitor], validation_data=(X, Y))
    assert np.isfinite(model.history.history["val_loss"][-1])  # evaluation moved too
    assert np.isfinite(model.evaluate(X, Y, verbose=0))
    assert np.isfinite(model.predict(X, verbose=0)).all()
    data = scalars_and_texts(str(tmp_path / "logs"))
    records = [
        tags.parse_precision_move_record(proto.string_val[0].decode())
        for _, proto in data[tags.PRECISION_MOVE_RECORD]
    ]
    assert [r.move for r in records] == autopilot.moves
    assert {r.run_id for r in records} == {monitor.run_id}
    lines = [(step, proto.string_val[0].decode()) for step, proto in data[tags.PRECISION_MOVES]]
    assert lines == [(m.step, tags.format_precision_move(m)) for m in autopilot.moves]
    shares = [(step, float(make_ndarray(proto))) for step, proto in data[tags.FLOAT16_SHARE]]
    total = 128 + 256 + 32 + 16
    assert shares == [
        (0, pytest.approx((128 + 256 + 32) / total)),
        (1, pytest.approx((256 + 32) / total)),
        (2, pytest.approx(32 / total)),
    ]
    # A .keras file keeps the moved layers' policies.
    path = str(tmp_path / "healed.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert {layer.name: layer.dtype_policy.name for layer in loaded.layers[1:]} == {
        "big": "float32",
        "next": "float32",
        "norm": "mixed_float16",
        "head": "float32",
    }
    # The plan, through JSON, makes a fresh model start healed: no skipped step.
    plan = kmix.PrecisionPlan.from_json(autopilot.plan.to_json())
    fresh = make("functional")
    assert kmix.apply_plan(fresh, plan) == ["big", "next"]
    assert fit(fresh, []).skipped_steps == 0


def test_proactive_moves_before_the_overflow_without_a_skipped_step():
    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8,))
    big, norm, head = (layers_of(6000.0)[i] for i in (0, 2, 3))  # 48000: 0.449 bits left
    model = keras.Model(inputs, head(norm(big(inputs))))
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-4)), "mse")
    autopilot = kmix.callbacks.PrecisionAutopilot(update_freq=2)
    state = fit(model, [autopilot])
    assert state.skipped_steps == 0
    low = f"headroom {np.log2(65504 / 48000):.3g} bits, below the margin of 1 bit"
    # The first health step moves "big". Its output, float32 now, has no float16 headroom,
    # and "norm" (LayerNormalization: autocast off, it computes in float32) does not cast
    # it to float16: nothing else moves.
    assert [(m.step, m.layer, m.reason) for m in autopilot.moves] == [(2, "big", low)]


def test_steps_per_execution_moves_at_the_next_execution_and_says_so():
    model = make("functional", steps_per_execution=3)
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    with pytest.warns(UserWarning, match="steps_per_execution=3 a move takes effect at the next"):
        state = fit(model, [autopilot])
    big, after = paths(model)
    assert [(m.step, m.layer, m.reason) for m in autopilot.moves] == [
        (3, big, "forward overflow at step 1"),
        (6, after, f"forward overflow at step 4: {CAST}"),
    ]
    assert state.skipped_steps == 6  # every step of the two executions before a move took effect


def test_the_guard_lets_the_autopilot_act_first_and_stops_when_moving_cannot_help():
    model = make("functional")
    guard = kmix.callbacks.LossScaleGuard(patience=1, verbose=0)
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    fit(model, [guard, autopilot])  # the guard is called first at each step
    assert guard.diagnosis is None and len(autopilot.moves) == 2
    model = make("functional")
    guard = kmix.callbacks.LossScaleGuard(patience=1, verbose=0)
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    fit(model, [autopilot, guard])  # the autopilot first: the guard sees it moved
    assert guard.diagnosis is None and len(autopilot.moves) == 2
    model = make("functional")
    guard = kmix.callbacks.LossScaleGuard(patience=2, verbose=0)
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False, max_layers=1)
    with pytest.warns(UserWarning, match="max_layers=1 layers moved in this fit, so it stops"):
        fit(model, [autopilot, guard])
    big, _ = paths(model)
    assert guard.reason == "nonfinite_loss" and guard.step == 2  # steps 1 and 2 overflowed
    assert guard.diagnosis.endswith(
        f"PrecisionAutopilot moved 1 layer out of float16 before this (`{big}` (Dense) to "
        "float32 at step 1, forward overflow at step 1); it reached max_layers=1."
    )


class Twice(keras.Model):
    """A subclassed model calling one layer twice: no Keras graph says it is shared."""

    def __init__(self, shared, norm, head):
        super().__init__(name="twice")
        self.shared, self.norm, self.head = shared, norm, head

    def call(self, x):
        return self.head(self.norm(self.shared(x) + self.shared(x)))


@pytest.mark.parametrize("shape", ["functional", "subclassed"])
def test_a_shared_layer_moves_every_call_and_says_so(shape):
    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_float16")
    shared = keras.layers.Dense(
        8, kernel_initializer=keras.initializers.Constant(9000.0), name="shared"
    )
    norm = keras.layers.LayerNormalization(name="norm")
    head = keras.layers.Dense(1, dtype="float32", name="head")
    if shape == "functional":
        inputs = keras.Input((8,))
        model = keras.Model(inputs, head(norm(shared(inputs) + shared(inputs))))
    else:
        model = Twice(shared, norm, head)
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-4)), "mse")
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    state = fit(model, [autopilot])
    assert [(m.step, m.layer, m.reason) for m in autopilot.moves] == [
        (1, shared.path, "forward overflow at step 1 (a shared layer: every call of it moves)")
    ]
    assert state.skipped_steps == 1 and np.isfinite(model.evaluate(X, Y, verbose=0))


def test_nothing_to_do_in_float32_and_kmix_optimizer_required():
    keras.utils.clear_session()
    keras.config.set_dtype_policy("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-4)), "mse")
    autopilot = kmix.callbacks.PrecisionAutopilot()
    with pytest.warns(UserWarning, match="computes in float32 and no layer computes in float16"):
        fit(model, [autopilot])
    assert autopilot.moves == []
    model = make("functional")
    model.compile(keras.optimizers.SGD(1e-4), "mse")  # float16, without loss scaling
    with pytest.raises(
        ValueError, match="needs kmix's optimizer.*compiled with the stock `keras.mixed_precision"
    ):
        fit(model, [kmix.callbacks.PrecisionAutopilot()])


def test_loop_driver_retraces_the_users_step_after_a_move():
    import tensorflow as tf

    model = make("functional")
    optimizer = model.optimizer
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.mean_squared_error(y, model(x, training=True)))
            loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    with kmix.callbacks.LoopDriver(model, [autopilot]) as driver:
        step = driver.function(train_step)
        for i in range(6):
            step(X[8 * i : 8 * i + 8], Y[8 * i : 8 * i + 8])
            driver.step_end()
    assert [m.step for m in autopilot.moves] == [1, 2]
    events = optimizer.scale_events()
    assert [(e.step, e.kind) for e in events] == [(1, "forward_overflow"), (2, "forward_overflow")]
    assert optimizer.read_state(counters_only=True).skipped_steps == 2


MIRRORED = textwrap.dedent(
    """
    import json, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, numpy as np, kmix
    sys.path[:0] = [{here!r}, {tests!r}]  # this module, and the helpers it imports
    from test_autopilot import X, Y, layers_of
    keras.config.set_dtype_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        inputs = keras.Input((8,))
        x = inputs
        for layer in layers_of(9000.0):
            x = layer(x)
        model = keras.Model(inputs, x)
        model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-4)), "mse")
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    model.fit(X, Y, batch_size=8, verbose=0, shuffle=False, callbacks=[autopilot])
    state = model.optimizer.read_state(counters_only=True)
    print(json.dumps({{"moves": [[m.step, m.layer, m.reason] for m in autopilot.moves],
                      "skipped": state.skipped_steps,
                      "loss": float(model.evaluate(X, Y, verbose=0))}}))
    """
)


def test_mirrored_strategy_every_replica_moves_the_same_layers():
    import json

    script = MIRRORED.format(here=os.path.dirname(os.path.abspath(__file__)), tests=TESTS)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["moves"] == [
        [1, "big", "forward overflow at step 1"],
        [2, "next", f"forward overflow at step 2: {CAST}"],
    ]
    assert result["skipped"] == 2 and np.isfinite(result["loss"])


def test_two_towers_with_one_layer_name_move_the_tower_that_overflows():
    """Two towers made by one helper: Keras gives both "proj" layers the path "proj". The
    overflowing one is named by its tower (net/tower_b/proj), and it is the one moved."""
    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(1)

    def tower(name: str, c: float) -> keras.Model:
        x = keras.Input((8,))
        proj = keras.layers.Dense(
            16, kernel_initializer=keras.initializers.Constant(c), name="proj"
        )
        return keras.Model(x, proj(x), name=name)

    inputs = keras.Input((8,))
    a, b = tower("tower_a", 0.01), tower("tower_b", 9000.0)  # 8 * 9000 = 72000 > 65504
    x = keras.layers.Add(name="sum")([a(inputs), b(inputs)])
    x = keras.layers.LayerNormalization(name="norm")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="head")(x), name="net")
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-4)), "mse")
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    state = fit(model, [autopilot])
    assert [(m.step, m.layer) for m in autopilot.moves] == [(1, "net/tower_b/proj"), (2, "sum")]
    assert b.layers[1].compute_dtype == "float32"
    assert a.layers[1].compute_dtype == "float16"  # the other tower's proj stays
    assert (state.attempted_steps, state.skipped_steps) == (6, 2)
    assert autopilot.plan.policies == {"net/tower_b/proj": "float32", "sum": "float32"}


class Float32Block(keras.layers.Layer):
    """A block whose layers compute in float32 (built in ``kmix.policy_scope("float32")``,
    the README's fix for a sensitive block); the block itself keeps the global policy."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with kmix.policy_scope("float32"):
            self.wide = keras.layers.Dense(
                16, kernel_initializer=keras.initializers.Constant(12000.0), name="wide"
            )

    def call(self, x):
        return self.wide(x)  # 8 * 12000 = 96000, beyond float16's range, in float32


def test_a_float32_block_is_not_judged_by_float16_range(tmp_path):
    """Healthy run: the block's float32 output (96000) has no float16 headroom, and the
    LayerNormalization after it does not cast it to float16: nothing moves, nothing
    skips, and the monitor writes no headroom for the block."""
    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8,))
    block = Float32Block(name="block")
    x = keras.layers.LayerNormalization(name="norm")(block(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="head")(x))
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-4)), "mse")
    assert block.compute_dtype == "float16" and block.wide.compute_dtype == "float32"
    autopilot = kmix.callbacks.PrecisionAutopilot(update_freq=2)
    monitor = kmix.callbacks.MixedPrecisionMonitor(str(tmp_path), update_freq=2, verbose=0)
    state = fit(model, [monitor, autopilot])
    assert autopilot.moves == []
    assert state.skipped_steps == 0
    layers = model.optimizer.activations_by_layer()
    assert "headroom_bits" not in layers["block"]
    assert layers["block"]["max_abs"] == 96000.0
    written = scalars_and_texts(str(tmp_path))
    assert tags.ACTIVATION_HEADROOM_BITS + "block" not in written
    assert tags.ACTIVATION_MAX_ABS + "block" in written


def test_an_overflow_in_an_op_between_layers_moves_the_float16_layers_feeding_it():
    """``stem + res`` is an op, not a layer: its float16 sum (40000 + 40000) overflows and
    LayerNormalization "ln" gets inf. "ln" is not the origin; the layers feeding the op
    move, so the sum is computed in float32: one skipped step, then training goes on."""
    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    ones = keras.initializers.Constant(5000.0)  # 8 * 5000 = 40000 each, within float16
    stem = keras.layers.Dense(16, kernel_initializer=ones, name="stem")(inputs)
    res = keras.layers.Dense(16, kernel_initializer=ones, name="res")(inputs)
    x = keras.layers.LayerNormalization(name="ln")(stem + res)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="head")(x))
    model.compile(kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-4)), "mse")
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    state = fit(model, [autopilot])
    reason = "forward overflow at step 1: before `ln`, whose inputs were already non-finite"
    assert [(m.step, m.layer, m.reason) for m in autopilot.moves] == [
        (1, "stem", f"{reason}; it feeds `ln`"),
        (1, "res", f"{reason}; it feeds `ln`"),
    ]
    assert (state.attempted_steps, state.skipped_steps) == (6, 1)
    assert model.get_layer("ln").compute_dtype == "float16"  # not moved: not the origin
