"""kmix.LossScaleOptimizer's eager step (kmix/optimizer/torch_step.py), and a nested model's
overflow on every backend.

Marked ``jax`` and ``torch`` too: the test runs in each pass (TensorFlow, JAX, torch), in
process, with the same expected values.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmix


class Block(keras.layers.Layer):
    """``up`` (a Dense whose float16 output overflows) then BatchNormalization."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(4, kernel_initializer="ones", name="up")
        self.norm = keras.layers.BatchNormalization(name="norm")

    def call(self, x, training=False):
        return self.norm(self.up(x), training=training)


class Net(keras.Model):
    def __init__(self):
        super().__init__(name="net")
        self.stem = keras.layers.Dense(4, kernel_initializer="ones", name="stem")
        self.block = Block(name="block")
        self.head = keras.layers.Dense(1, dtype="float32", name="head")

    def call(self, x, training=False):
        return self.head(self.block(self.stem(x), training=training))


def state(model: keras.Model, optimizer: kmix.LossScaleOptimizer) -> list[np.ndarray]:
    return [
        np.array(keras.ops.convert_to_numpy(v))
        for v in [*model.weights, *optimizer.inner_optimizer.variables]
    ]


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_an_overflow_in_a_nested_layer_is_named_skipped_and_leaves_every_state_as_it_was():
    """Inputs 0.5: ``stem`` outputs 4 x 0.5 = 2 (exact in float16); with ``up``'s kernel at
    30000 its outputs are 4 x 2 x 30000 = 240000, past float16's 65504: inf from finite
    inputs. The step is skipped: weights, Adam's state and BatchNormalization's moving
    statistics keep every bit; the scale is kept (a forward overflow)."""
    keras.config.set_dtype_policy("mixed_float16")
    model = Net()
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=1024.0)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.full((8, 4), 0.5, "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=8, verbose=0)  # one good step: Adam's state is not zeros
    model.block.up.kernel.assign(np.full((4, 4), 30000.0, "float32"))
    before = state(model, optimizer)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[kmix.callbacks.LossScaleGuard(verbose=0)])

    after = state(model, optimizer)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    (event,) = optimizer.scale_events()
    assert (event.step, event.kind, event.old_scale, event.new_scale) == (
        2,
        "forward_overflow",
        1024.0,
        1024.0,
    )
    assert event.loss_finite is False
    origin = event.origin
    assert (origin.layer, origin.layer_class, origin.inputs_finite) == (
        "net/block/up",
        "Dense",
        True,
    )
    assert origin.max_abs_input == 2.0
    snapshot = optimizer.read_state()
    assert (snapshot.attempted_steps, snapshot.skipped_steps, snapshot.loss_scale) == (2, 1, 1024.0)


def host_reads(monkeypatch) -> list[str]:
    """The names of torch's host reads (``bool``, ``item``, ``tolist``, ``numpy``) made from
    now on, appended as they happen."""
    import torch

    reads = []
    for name in ("__bool__", "item", "tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def reads_of_a_step(model, opt, x, y, reads: list[str]) -> list[str]:
    """The host reads of one train step of ``model`` compiled with ``opt`` (built first)."""
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=len(x), verbose=0)  # builds the state outside the count
    reads.clear()
    model.train_step((keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)))
    return list(reads)


@pytest.mark.torch
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="counts torch's host reads")
def test_a_quiet_eager_step_reads_one_value_on_the_host(monkeypatch):
    """On torch each read of a device value is a sync: a quiet step of kmix's optimizer
    (monitor's tap installed) reads its decisions at once, one read; stock Keras's reads two
    (its finite check and its growth check), counted the same way."""
    keras.config.set_dtype_policy("mixed_float16")
    model = Net()
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.full((8, 4), 0.5, "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=8, verbose=0)  # built, one step done
    optimizer.watch(model)  # the tap, as the monitor installs it
    stock = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    reads = host_reads(monkeypatch)
    assert len(reads_of_a_step(model, stock, x, y, reads)) == 2
    assert len(reads_of_a_step(model, optimizer, x, y, reads)) == 1


@pytest.mark.torch
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="counts torch's host reads")
def test_a_quiet_float8_step_reads_its_saturation_check_with_its_decisions(monkeypatch):
    """Float8 layers' saturation check is read with the step's flags: still one read."""
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.quantize("float8")
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-9))  # the amaxes hold still
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    y = np.zeros((8, 1), "float32")
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=8, epochs=12, verbose=0)  # the delayed scales settle
    assert optimizer.float8.active
    reads = host_reads(monkeypatch)
    assert len(reads_of_a_step(model, optimizer, x, y, reads)) == 1
    assert optimizer.float8_saturations(since_step=13) == []  # the step counted was quiet


@pytest.mark.torch
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch's finite screen")
def test_the_finite_screen_proves_finite_or_suspects_never_misses():
    """One norm per tensor: finite proves finite; inf, NaN (anywhere) and a finite tensor
    whose squares overflow float32 are suspected; None and empty tensors are finite."""
    import torch

    from kmix.backend.torch import screened_nonfinite_flags

    nan_last = torch.ones(1000)
    nan_last[-1] = float("nan")
    values = [
        None,
        torch.zeros(0),
        torch.ones(3, 3),
        nan_last,
        torch.tensor([1.0, -float("inf")]),
        torch.tensor([1e20, 1.0]),  # finite; 1e40 overflows float32
        torch.tensor([300.0], dtype=torch.float16),  # 9e4 overflows float16, not float32
        np.float32([np.nan, 1.0]),  # optimizer.apply() takes arrays too
        np.ones(2),  # float64 arrays as well
        torch.tensor([1e200, 1.0], dtype=torch.float64),  # finite; its square overflows
        torch.tensor([3.0, 1e150], dtype=torch.float64),  # accumulated in float64: finite
        torch.tensor([1, 2]),  # integers are finite
    ]
    flags = screened_nonfinite_flags(values)
    assert flags.dtype == torch.float32
    assert flags.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert screened_nonfinite_flags([]).tolist() == []


@pytest.mark.torch
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch's finite screen")
def test_a_finite_gradient_the_screen_suspects_is_applied_and_a_nonfinite_one_skipped():
    """A gradient of 1e20 (finite: its square overflows the screen's norm) is settled by
    the exact check: the step applies, nothing is skipped. A NaN gradient is skipped and
    named."""
    keras.config.set_dtype_policy("float32")
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1.0)
    kernel = keras.Variable(np.zeros((2,), "float32"), name="kernel")
    bias = keras.Variable(np.zeros((2,), "float32"), name="bias")
    optimizer.build([kernel, bias])
    optimizer.apply([keras.ops.convert_to_tensor([1e20, 0.0]), keras.ops.ones((2,))])
    assert keras.ops.convert_to_numpy(kernel).tolist() == [float(np.float32(-1e20)), 0.0]
    assert optimizer.read_state().skipped_steps == 0

    optimizer.apply([keras.ops.ones((2,)), keras.ops.convert_to_tensor([np.nan, 0.0])])
    state = optimizer.read_state()
    assert (state.attempted_steps, state.skipped_steps) == (2, 1)
    assert keras.ops.convert_to_numpy(bias).tolist() == [-1.0, -1.0]
    (event,) = optimizer.scale_events()
    assert (event.step, event.variable, event.nonfinite_variables) == (2, "bias", 1)

    optimizer.apply([np.ones(2), np.full(2, 2.0)])  # float64 NumPy gradients: applied
    assert keras.ops.convert_to_numpy(bias).tolist() == [-3.0, -3.0]
    assert optimizer.read_state().attempted_steps == 3


@pytest.mark.torch
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch's one-call unscale")
def test_the_one_call_unscale_is_keras_divide_bit_for_bit_in_every_dtype():
    """float32 tensors go through one torch._foreach_div, the rest through keras.ops.divide:
    each result equals keras.ops.divide's, dtype and bits (subnormals and the top included).
    On a CPU torch's foreach runs the per-tensor op; its fused CUDA kernel is not run here."""
    import torch

    from kmix.backend.torch import divided

    scale = keras.Variable(np.float32(1000.0)).value  # not a power of two: no reciprocal
    values = [
        torch.tensor([3.0, -7.5, 1e-40, 3e38]),
        torch.tensor([3.0, 60000.0], dtype=torch.float16),
        torch.tensor([3.0], dtype=torch.float64),
        np.float32([1.0, 2.0]),
    ]
    for got, value in zip(divided(values, scale), values, strict=True):
        want = keras.ops.divide(value, scale)
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert divided([], scale) == []
