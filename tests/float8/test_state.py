"""kmix's optimizer on float8 layers: every saturated tensor-step, exact against a NumPy
replay of Keras's variables (tests/float8/replay.py), and the output gradients' float8
state following the loss scale. TensorFlow and JAX."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from replay import Replay, float8_layers

import kmix

as_numpy = keras.ops.convert_to_numpy  # a torch parameter's value too (it requires grad)

# Every test fits or builds float8 models, on each backend.
pytestmark = [pytest.mark.jax, pytest.mark.torch, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def mlp(nested: bool = False) -> keras.Model:
    inputs = keras.Input((8,))
    block = keras.Sequential(
        [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16, activation="relu")],
        name="block",
    )
    x = block(inputs) if nested else keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.quantize("float8")
    return model


def data(spike_batch: int = 9, batches: int = 16, batch_size: int = 16):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batches * batch_size, 8)).astype("float32")
    y = rng.standard_normal((batches * batch_size, 1)).astype("float32")
    x[spike_batch * batch_size : (spike_batch + 1) * batch_size] *= 50  # an injected spike
    return x, y


def unfollowing_optimizer(inner="sgd") -> kmix.LossScaleOptimizer:
    """kmix's optimizer growing every 4 steps from 256, its float8 scales not following."""
    return kmix.LossScaleOptimizer(
        inner, dynamic_growth_steps=4, initial_scale=256.0, float8_follows_loss_scale=False
    )


def growth_saturating_fit(log_dir, update_freq: int, histogram_freq: int):
    """Weights frozen (SGD at 0), one batch repeated 24 times, the loss scale growing every
    4 steps without the float8 scales following: after the warm-up every output-gradient
    saturation comes from a growth. The monitor writes to ``log_dir``.

    Returns:
        ``(model, optimizer)`` after the fit.
    """
    from kmix.callbacks import MixedPrecisionMonitor

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = data(spike_batch=-1)
        x, y = np.tile(x[:16], (24, 1)), np.tile(y[:16], (24, 1))
        keras.utils.set_random_seed(0)
        model = mlp()
        opt = unfollowing_optimizer(keras.optimizers.SGD(0.0))
        model.compile(optimizer=opt, loss="mse")
        monitor = MixedPrecisionMonitor(
            str(log_dir), update_freq=update_freq, histogram_freq=histogram_freq, verbose=0
        )
        model.fit(x, y, batch_size=16, verbose=0, shuffle=False, callbacks=[monitor])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, opt


def growing_inputs_run():
    """An MLP whose inputs grow ×1.25 at every one of 32 batches (so their float8 scale is
    always a step behind): ``(model, optimizer, x, y)``, compiled, not yet fitted."""
    keras.utils.set_random_seed(0)
    model = mlp()
    opt = unfollowing_optimizer()
    model.compile(optimizer=opt, loss="mse")
    x, y = data(spike_batch=-1, batches=32)
    x *= np.repeat(1.25 ** np.arange(32), 16)[:, None].astype("float32")
    return model, opt, x, y


def train(model, follows=True, inner="sgd", xy=None, **kwargs):
    keras.utils.set_random_seed(0)
    opt = kmix.LossScaleOptimizer(
        inner,
        dynamic_growth_steps=kwargs.pop("growth", 4),
        initial_scale=kwargs.pop("initial_scale", 256.0),
        float8_follows_loss_scale=follows,
    )
    model.compile(optimizer=opt, loss="mse", **kwargs)
    replay = Replay()
    replay.rescaled = follows
    x, y = data() if xy is None else xy
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[replay])
    return opt, replay


@pytest.mark.parametrize(
    ("follows", "jit_compile"), [(True, "auto"), (False, "auto"), (True, True)]
)
def test_every_saturated_tensor_step_at_its_step_as_the_replay_says(follows, jit_compile):
    keras.utils.set_random_seed(0)
    opt, replay = train(mlp(), follows, jit_compile=jit_compile)
    got = [(s.step, s.layer, s.tensor) for s in opt.float8_saturations()]
    assert len(got) == len(set(got))
    assert set(got) == replay.saturated() and got  # the spike and the growths saturate
    assert any(s[0] == 10 and s[2] == "inputs" for s in got)  # the spike's batch
    counts = {(h.layer, h.tensor): h.saturated_steps for h in opt.float8_health()}
    for (layer, tensor), n in counts.items():
        assert n == sum(1 for s in got if s[1:] == (layer, tensor))
    events = {e.step for e in opt.scale_events() if e.kind == "growth"}
    assert events  # growths happened (every 4 steps)


def test_growths_saturate_the_output_gradients_only_without_following():
    """Weights frozen (lr 0) and one batch repeated: the output gradients change only with
    the loss scale, so every saturation of them comes from a growth."""
    x, y = data(spike_batch=-1)
    x, y = np.tile(x[:16], (24, 1)), np.tile(y[:16], (24, 1))

    def output_grad_saturations(follows):
        keras.utils.set_random_seed(0)
        opt, replay = train(mlp(), follows, keras.optimizers.SGD(0.0), (x, y))
        assert {(s.step, s.layer, s.tensor) for s in opt.float8_saturations()} == replay.saturated()
        growths = [e.step for e in opt.scale_events() if e.kind == "growth"]
        return growths, [  # after the warm-up (the delayed scales set by the first steps)
            s for s in opt.float8_episodes() if s.tensor == "outputs_grad" and s.step > growths[0]
        ]

    growths, off = output_grad_saturations(False)
    assert len(growths) >= 4
    # Stock: each growth doubles the next steps' output gradients past their delayed scale.
    past = {s.step for s in off if s.bits_over == pytest.approx(1.0, abs=1e-3)}
    assert past >= {g + 1 for g in growths[1:-1]}
    # Following the loss scale: the same growths saturate nothing.
    assert output_grad_saturations(True) == (growths, [])


def test_output_gradient_state_is_multiplied_at_growth_and_backoff():
    keras.utils.set_random_seed(0)
    on, replay = train(mlp(), True, initial_scale=2.0**24, growth=3)
    kinds = [e.kind for e in on.scale_events()]
    assert "backoff" in kinds and "growth" in kinds
    for before, after in replay.steps:
        factor = np.float32(after["loss_scale"] / before["loss_scale"])
        skipped = after["iterations"] == before["iterations"]
        for key, value in before.items():
            if not isinstance(key, tuple):
                continue
            if skipped:  # nothing applied: the output gradients' state is only rescaled
                expected = value * factor if key[1] == "outputs_grad" else value
                np.testing.assert_array_equal(after[key], expected)


def test_nested_float8_layers_and_a_lazily_built_model():
    keras.utils.set_random_seed(0)
    opt, replay = train(mlp(nested=True))
    assert {p for p, _ in float8_layers(opt and replay.model)} >= {"block/dense", "block/dense_1"}
    assert {(s.step, s.layer, s.tensor) for s in opt.float8_saturations()} == replay.saturated()

    lazy = keras.Sequential(
        [
            keras.layers.Dense(16, activation="relu", dtype="float8_from_mixed_float16"),
            keras.layers.Dense(1, dtype="float8_from_mixed_float16"),
        ]
    )
    keras.utils.set_random_seed(0)
    opt, replay = train(lazy)
    assert len(opt.float8.tensors) == 6
    assert {(s.step, s.layer, s.tensor) for s in opt.float8_saturations()} == replay.saturated()


def test_keras_file_keeps_float8_state_and_counts(tmp_path):
    keras.utils.set_random_seed(0)
    model = mlp()
    opt, _ = train(model)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    again = loaded.optimizer
    assert isinstance(again, kmix.LossScaleOptimizer) and again.float8.follows_loss_scale
    assert again.float8_saturations() == opt.float8_saturations()
    assert [h.saturated_steps for h in again.float8_health()] == [
        h.saturated_steps for h in opt.float8_health()
    ]
    for (path_a, a), (path_b, b) in zip(float8_layers(model), float8_layers(loaded), strict=True):
        assert path_a == path_b
        np.testing.assert_array_equal(
            as_numpy(a.outputs_grad_amax_history),
            as_numpy(b.outputs_grad_amax_history),
        )


def test_no_float8_layers_no_float8_variables():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    opt = kmix.LossScaleOptimizer("sgd")
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
    assert not opt.float8.active and opt.float8_saturations() == []
    assert not [v for v in opt.variables if "fp8" in v.name]


def test_monitor_writes_float8_tags_and_every_episode_at_its_step(tmp_path):
    from test_monitor import read_back, scalars, texts

    from kmix import tags
    from kmix.callbacks import MixedPrecisionMonitor

    keras.utils.set_random_seed(0)
    model = mlp()
    opt = kmix.LossScaleOptimizer("sgd", dynamic_growth_steps=4, initial_scale=256.0)
    model.compile(optimizer=opt, loss="mse")
    x, y = data()
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=5)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    logged = read_back(tmp_path)
    layer = float8_layers(model)[0][0]
    for prefix in (tags.FP8_SCALE, tags.FP8_HEADROOM_BITS, tags.FP8_SATURATED_STEPS):
        assert scalars(logged, tags.float8_tag(prefix, layer, "inputs"))
    for tensor in ("inputs", "kernel"):
        assert scalars(logged, tags.float8_tag(tags.FP8_UNDERFLOW_FRACTION, layer, tensor))
    final = scalars(logged, tags.float8_tag(tags.FP8_SATURATED_STEPS, layer, "inputs"))
    assert final[max(final)] == sum(
        1 for s in opt.float8_saturations() if (s.layer, s.tensor) == (layer, "inputs")
    )
    records = [tags.parse_saturation_record(text) for _, text in texts(logged, tags.FP8_RECORD)]
    assert sorted((r.step, r.layer, r.tensor) for r in records) == sorted(
        (e.step, e.layer, e.tensor) for e in opt.float8_episodes()
    )


def flushed_share(inputs: np.ndarray, scale: float, ulps: int = 0) -> float:
    """NumPy: the share of non-zero inputs Keras's E4M3 quantization flushes to zero (the
    inputs and the scale cast to float16, divided there, at most 2**-10); with ``ulps``,
    the threshold moved by that many float16 ulps (negative: down)."""
    x = inputs.astype("float16")
    quotient = np.abs(x / np.asarray(scale, "float16"))
    nonzero = np.abs(x) > 0
    threshold = 2.0**-10 * (1 + ulps * 2.0**-10)
    return np.count_nonzero(nonzero & (quotient <= threshold)) / np.count_nonzero(nonzero)


@pytest.mark.parametrize("nested", [False, True])
def test_inputs_underflow_is_each_float8_layers_share_its_scale_flushes(nested, tmp_path):
    """Weights frozen, one batch repeated (its column 0 shrunk ×1e-5, below E4M3's reach at
    the scale the batch sets): at each read the monitor writes every float8 layer's inputs'
    underflow, measured in the step, exact against NumPy on the inputs the layers see."""
    from test_monitor import read_back, scalars

    from kmix import tags
    from kmix.callbacks import MixedPrecisionMonitor

    x, y = data(spike_batch=-1)
    xb, yb = x[:16].copy(), y[:16]
    xb[:, 0] *= 1e-5
    keras.utils.set_random_seed(0)
    model = mlp(nested)
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0))
    model.compile(optimizer=opt, loss="mse")
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=4, verbose=0)
    model.fit(
        np.tile(xb, (8, 1)),
        np.tile(yb, (8, 1)),
        batch_size=16,
        verbose=0,
        shuffle=False,
        callbacks=[monitor],
    )
    seen = {}  # each float8 layer's inputs on the batch, as the fitted model computes them
    for path, layer in float8_layers(model):  # Keras calls a quantized layer's quantized_call
        call = layer.quantized_call

        def capture(inputs, *args, _call=call, _path=path, **kwargs):
            seen[_path] = as_numpy(inputs).astype("float32")
            return _call(inputs, *args, **kwargs)

        layer.quantized_call = capture
    model(xb)
    got = {h.layer: h.underflow_fraction for h in opt.float8_health() if h.tensor == "inputs"}
    layers = float8_layers(model)
    assert sorted(got) == sorted(path for path, _ in layers)
    arrived = xb.astype("float16").astype("float32")  # the batch, as Keras autocasts it
    first = next(path for path, _ in layers if np.array_equal(seen[path], arrived))
    scales = {path: float(as_numpy(layer.inputs_scale)) for path, layer in layers}
    expected = flushed_share(seen[first], scales[first])  # the batch: the same values
    assert got[first] == pytest.approx(expected, abs=1e-7)
    assert 0 < expected < 1  # column 0's tiny values flush, the rest do not
    # Deeper layers' inputs were computed again here, outside the compiled step: a float16
    # matmul summed in another order can differ by an ulp, so a value that close to the
    # threshold may flip; every other value decides the same.
    for path in (path for path, _ in layers if path != first):
        low, high = (flushed_share(seen[path], scales[path], ulps) for ulps in (-4, 4))
        assert low - 1e-7 <= got[path] <= high + 1e-7
    written = scalars(
        read_back(tmp_path), tags.float8_tag(tags.FP8_UNDERFLOW_FRACTION, first, "inputs")
    )
    assert written[8] == pytest.approx(expected, abs=1e-7)


def test_a_model_quantized_after_a_fit_has_its_float8_inputs_measured(tmp_path):
    """Fitted in mixed_float16 with the monitor (its layers' ``call`` tapped), then
    quantized: Keras runs ``quantized_call`` from then on, and the next fit taps that."""
    from kmix.callbacks import MixedPrecisionMonitor

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    x, y = data(spike_batch=-1)
    for run in ("before", "after"):
        if run == "after":
            model.quantize("float8")
        opt = kmix.LossScaleOptimizer("sgd")
        model.compile(optimizer=opt, loss="mse")
        monitor = MixedPrecisionMonitor(str(tmp_path / run), update_freq=4, verbose=0)
        model.fit(x, y, batch_size=16, verbose=0, shuffle=False, callbacks=[monitor])
    got = {h.layer: h.underflow_fraction for h in opt.float8_health() if h.tensor == "inputs"}
    assert sorted(got) == sorted(path for path, _ in float8_layers(model))
    assert all(0.0 <= value <= 1.0 for value in got.values())
    assert sorted(opt.activations_by_layer()) == sorted(got)  # the float8 layers' outputs too


class TrainingNotPassed(keras.Model):
    """A subclassed model whose call does not pass ``training`` on to its float8 layers."""

    def __init__(self):
        super().__init__()
        self.block = keras.Sequential([keras.layers.Dense(16, activation="relu")])
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.block(x))


def test_float8_scales_keras_does_not_update_are_named_and_kept_not_a_crash(tmp_path):
    """Called without ``training``, Keras's float8 layers compute no new inputs or kernel
    scale. TensorFlow and torch give None (kmix's compiled step crashed on it once), JAX
    gives 0, which stock Keras assigns, so the next step divides by 0 and every loss is
    NaN. With kmix the fit trains on each backend, those scales stay as they are, kmix
    names the tensors it cannot check (at the trace, or at the monitor's read on JAX), and
    the output gradients are still checked."""
    from kmix.callbacks import MixedPrecisionMonitor

    keras.utils.set_random_seed(0)
    x, y = data(spike_batch=-1)
    model = TrainingNotPassed()
    model(x[:2])
    model.quantize("float8")
    opt = kmix.LossScaleOptimizer("sgd")
    model.compile(optimizer=opt, loss="mse")
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=4, verbose=0)
    with pytest.warns(kmix.KmixWarning, match="float8 scale") as caught:
        history = model.fit(x, y, batch_size=16, verbose=0, shuffle=False, callbacks=[monitor])
    said = next(str(w.message) for w in caught if "float8 scale" in str(w.message))
    for path, layer in float8_layers(model):
        assert f"`{path}` inputs" in said and f"`{path}` kernel" in said
        assert f"`{path}` outputs_grad" not in said
        for tensor in ("inputs", "kernel"):  # as they were built
            assert float(as_numpy(getattr(layer, f"{tensor}_scale"))) == 1.0
            assert not as_numpy(getattr(layer, f"{tensor}_amax_history")).any()
        assert float(as_numpy(layer.outputs_grad_scale)) != 1.0  # followed its gradients
    assert np.isfinite(history.history["loss"]).all()
    state = opt.read_state()
    assert (state.attempted_steps, state.skipped_steps) == (len(x) // 16, 0)


def test_monitor_reads_float8_health_without_a_loss_scale(tmp_path):
    """A float32 base and a plain optimizer: no loss scale, so the variables alone are read
    at each read (scale, headroom, staleness, kernel flush; no counts, no episodes)."""
    from test_monitor import read_back, scalars

    from kmix import tags
    from kmix.callbacks import MixedPrecisionMonitor

    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x, y = data()
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=4, verbose=0)
    with pytest.warns(kmix.KmixWarning) as caught:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    said = [str(w.message) for w in caught]
    assert any("No loss-scale optimizer" in text for text in said)
    # The inputs' underflow is measured in the step by kmix's optimizer: absent, and said.
    names = ", ".join(f"`{path}`" for path, _ in float8_layers(model))
    assert f"kmix/fp8_underflow_fraction/<layer>/inputs is not written for {names}" in "".join(said)
    logged = read_back(tmp_path)
    for path, layer in float8_layers(model):
        for tensor in ("inputs", "kernel", "outputs_grad"):
            scale = scalars(logged, tags.float8_tag(tags.FP8_SCALE, path, tensor))
            assert sorted(scale) == [4, 8, 12, 16]  # every read, and none at run end again
            history = as_numpy(getattr(layer, f"{tensor}_amax_history")).astype("float32")
            expected_scale = float(as_numpy(getattr(layer, f"{tensor}_scale")))
            assert scale[16] == pytest.approx(expected_scale, rel=1e-6)
            headroom = scalars(logged, tags.float8_tag(tags.FP8_HEADROOM_BITS, path, tensor))
            limit = expected_scale * {"outputs_grad": 57344.0}.get(tensor, 448.0)
            assert headroom[16] == pytest.approx(np.log2(limit / history[0]), abs=1e-5)
            assert not scalars(logged, tags.float8_tag(tags.FP8_SATURATED_STEPS, path, tensor))
        flushed = tags.float8_tag(tags.FP8_UNDERFLOW_FRACTION, path, "kernel")
        assert 0.0 <= scalars(logged, flushed)[16] <= 1.0
        assert not scalars(logged, tags.float8_tag(tags.FP8_UNDERFLOW_FRACTION, path, "inputs"))


def test_gradient_health_counts_real_gradients_only():
    """Keras hands a float8 layer's scales and amax histories their new value as the
    "gradient": health, per-variable underflow and histograms leave them out (SGD with
    lr 1 and one step: the real gradients are the weights' change)."""
    keras.utils.set_random_seed(0)
    model = mlp()
    scale = 256.0
    opt = kmix.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=scale, health_every=1, histogram_every=1
    )
    model.compile(optimizer=opt, loss="mse")
    x, y = data(spike_batch=-1)
    model(x[:16])  # built before the weights are read
    real = [v for v in model.trainable_variables if not v.overwrite_with_gradient]
    float8 = [v for v in model.trainable_variables if v.overwrite_with_gradient]
    assert float8
    before = [as_numpy(v).astype("float64") for v in real]
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0, shuffle=False)
    grads = [b - as_numpy(v).astype("float64") for b, v in zip(before, real, strict=True)]
    values = np.concatenate([g.ravel() for g in grads])
    scaled = np.abs(values * scale)
    health = opt.read_state().health
    assert health["float16_elements"] == values.size
    assert health["grad_norm"] == pytest.approx(np.sqrt(np.sum(values**2)), rel=1e-3)
    assert health["max_abs_scaled"] == pytest.approx(scaled.max(), rel=1e-3)
    tiny = np.mean(scaled < 2.0**-14)
    assert health["underflow_fraction"] == pytest.approx(tiny, abs=2 / values.size)
    paths = {str(v.path) for v in float8}
    assert not paths & set(opt.underflow_by_variable())
    assert not paths & set(opt.exponent_histograms_by_variable())
    assert {str(v.path) for v in real} == set(opt.underflow_by_variable())


def written_episodes(log_dir) -> list:
    from test_monitor import read_back, texts

    from kmix import tags

    logged = read_back(log_dir)
    return [tags.parse_saturation_record(text) for _, text in texts(logged, tags.FP8_RECORD)]


def test_one_monitor_over_two_fits_writes_each_episode_at_its_full_length(tmp_path):
    """The inputs grow at every step, across both fits: their episode, open when the first
    fit ends, is written again when the second has made it longer; episodes of the second
    fit are written once they end, not truncated at its first read."""
    from kmix.callbacks import MixedPrecisionMonitor

    model, opt, x, y = growing_inputs_run()
    y *= 0
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=1, verbose=0)
    for part in (slice(0, 7 * 16), slice(7 * 16, 512)):  # 7 steps, then 25
        model.fit(x[part], y[part], batch_size=16, verbose=0, shuffle=False, callbacks=[monitor])
    episodes = {(e.step, e.layer, e.tensor): e.steps for e in opt.float8_episodes()}
    assert any(step <= 7 < step + steps - 1 for (step, _, _), steps in episodes.items())
    assert any(step > 7 and steps > 1 for (step, _, _), steps in episodes.items())
    longest: dict = {}
    for r in written_episodes(tmp_path):
        key = (r.step, r.layer, r.tensor)
        longest[key] = max(longest.get(key, 0), r.steps)
        if r.step > 7:  # the second fit's: written once, ended
            assert r.steps == episodes[key], r
    assert longest == episodes


def test_held_answers_every_question_from_one_read_of_the_record(monkeypatch):
    """Inside ``held`` the record is read once (its two variables) and every answer
    (counts, episodes, their number, the open ones) is what that read held, the same as
    outside; a step run inside is seen only after it."""
    from kmix import backend
    from kmix.float8 import state as float8_state

    model, opt, x, y = growing_inputs_run()
    model.fit(x[:160], y[:160] * 0, batch_size=16, verbose=0, shuffle=False)
    state = opt.float8

    def answers():
        return (
            state.saturated_steps(),
            opt.float8_episodes(),
            state.episode_count(),
            state.open_episodes(10),
        )

    outside = answers()
    assert outside[2] > 0 and outside[3]  # episodes, some open at the last step
    reads = []
    monkeypatch.setattr(
        float8_state, "host_value", lambda v: reads.append(v) or backend.host_value(v)
    )
    with state.held():
        inside = answers()
        assert [id(v) for v in reads] == [id(v) for v in state.record]
        model.fit(x[160:176], y[160:176] * 0, batch_size=16, verbose=0, shuffle=False)
        assert answers() == outside  # still what the read held
        with state.held():  # nested: the outer read holds, inside and after
            assert answers() == outside
        assert answers() == outside and len(reads) == len(state.record)  # none read anew
    assert inside == outside
    assert state.saturated_steps() != outside[0]  # read anew: the inputs saturated again


def test_episodes_the_ring_overwrote_between_reads_are_counted_lost(tmp_path, monkeypatch):
    """A ring of 6 rows and a read every 8 steps: every episode is written or counted lost."""
    from test_monitor import read_back, texts

    from kmix import report, tags
    from kmix.callbacks import MixedPrecisionMonitor

    monkeypatch.setattr("kmix.float8.state.MIN_CAPACITY", 6)
    model, opt, x, y = growing_inputs_run()
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=8, verbose=0)
    model.fit(x, y * 0, batch_size=16, verbose=0, shuffle=False, callbacks=[monitor])
    assert opt.float8.capacity == 6
    logged = read_back(tmp_path)
    records = [text for _, text in texts(logged, tags.FP8_RECORD)]
    lost = [r for r in map(tags.parse_lost_record, records) if r is not None]
    written = {(r.step, r.layer, r.tensor) for r in map(tags.parse_saturation_record, records) if r}
    assert lost and sum(r.episodes for r in lost) + len(written) == opt.float8.episode_count()
    assert all(r.step % 8 == 0 for r in lost)
    assert any("episodes lost" in text for _, text in texts(logged, tags.FP8_EVENTS))
    section = report.summarize(report.read_log(str(tmp_path))).float8
    assert section.lost_episodes == sum(r.episodes for r in lost)


def _reloaded(opt: kmix.LossScaleOptimizer, store: dict) -> kmix.LossScaleOptimizer:
    """A fresh optimizer on a fresh model, loaded from ``store`` (Keras must not skip it)."""
    import warnings

    fresh = mlp()
    again = kmix.LossScaleOptimizer("sgd", dynamic_growth_steps=4, initial_scale=256.0)
    fresh.compile(optimizer=again, loss="mse")
    again.build(fresh.trainable_variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Keras warns when it skips the optimizer's state
        again.load_own_variables(store)
    assert again.loss_scale == opt.loss_scale and again.attempted_steps == opt.attempted_steps
    assert again.scale_events() == opt.scale_events()
    return again


def test_state_saved_before_the_float8_record_existed_loads_with_the_record_at_zero():
    """A ``.keras`` file of a float8 model saved before kmix kept float8 state lacks the
    record's variables: the rest loads (Keras would skip everything on the count)."""
    from kmix.float8 import FIELDS

    keras.utils.set_random_seed(0)
    opt, _ = train(mlp())
    old_store = {}
    for v in opt.variables:
        if v.name not in FIELDS:
            old_store[str(len(old_store))] = as_numpy(v)
    assert len(old_store) == len(opt.variables) - 2
    again = _reloaded(opt, old_store)
    assert again.float8.episode_count() == 0 and again.float8_saturations() == []
    for old, new in zip(opt.variables, again.variables, strict=True):
        if old.name not in FIELDS:
            np.testing.assert_array_equal(as_numpy(old), as_numpy(new))


def test_a_store_of_another_layout_is_left_to_keras_not_joined():
    """Two more entries than the optimizer has, but not the four-variable record where the
    record is: handed on unchanged (Keras then warns that it skips the optimizer's state)."""
    keras.utils.set_random_seed(0)
    opt, _ = train(mlp())
    store = {str(i): as_numpy(v) for i, v in enumerate(opt.variables)}
    store |= {str(len(store)): np.zeros(3), str(len(store) + 1): np.zeros(3)}
    assert opt.float8.completed(store, opt.variables) is store


def test_state_saved_with_the_record_as_four_variables_loads_with_its_counts_and_episodes():
    """kmix 0.1.0 kept the float8 record in four variables (counts, episode count, the
    ring's integers and floats, in that order where the record's variables are now): a
    ``.keras`` file saved then loads into the two, every saturation kept."""
    from kmix.float8 import StoredRecord, unstored

    keras.utils.set_random_seed(0)
    opt, _ = train(mlp())
    assert opt.float8_saturations()  # the spike and the growths saturate
    now = StoredRecord(*(as_numpy(v) for v in opt.float8.record))
    split = unstored(now, len(opt.float8.tensors))
    old_store, first = {}, None
    for v in opt.variables:
        if v is opt.float8.record.floats:
            continue
        if v is opt.float8.record.ints:
            first = len(old_store)
            for value in split:
                old_store[str(len(old_store))] = np.asarray(value)
        else:
            old_store[str(len(old_store))] = as_numpy(v)
    n, capacity = len(opt.float8.tensors), opt.float8.capacity
    assert len(old_store) == len(opt.variables) + 2
    assert [np.shape(old_store[str(first + i)]) for i in range(4)] == [
        (n, 3),  # per tensor: saturated steps, last saturated step, episode
        (),  # episodes started
        (capacity, 4),  # the ring: step, steps, tensor, episode
        (capacity, 4),  # the ring: amax, limit, last amax, last limit
    ]
    again = _reloaded(opt, old_store)
    for old, new in zip(opt.variables, again.variables, strict=True):
        np.testing.assert_array_equal(as_numpy(old), as_numpy(new), err_msg=old.name)
    assert again.float8.episode_count() == opt.float8.episode_count() > 0
    assert again.float8.saturated_steps() == opt.float8.saturated_steps()
    unnamed = [(s.step, s.tensor, s.amax, s.limit, s.steps) for s in opt.float8_saturations()]
    assert [  # the fresh model's layers have other names
        (s.step, s.tensor, s.amax, s.limit, s.steps) for s in again.float8_saturations()
    ] == unnamed
