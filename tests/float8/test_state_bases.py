"""kmix's float8 check beyond one step an execution and a float16 base.

``steps_per_execution`` > 1 (TensorFlow and JAX; Keras refuses it on torch): a callback sees
one batch an execution, so the reference is the same seeded run at one step an execution,
replayed step by step (tests/float8/replay.py); both runs must end with the same variables
and the same saturations. A ``mixed_bfloat16`` or float32 base needs no loss scaling:
kmix's optimizer with its scale pinned at 1 still checks every float8 tensor in the step,
and the monitor writes each episode it counted.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from replay import Replay, float8_layers
from test_state import data, mlp

import kmix

as_numpy = keras.ops.convert_to_numpy

pytestmark = pytest.mark.slow

BASES = ("mixed_float16", "mixed_bfloat16", "float32")


@pytest.fixture(params=BASES)
def base(request):
    """The global policy the float8 model is quantized over (reset by conftest after)."""
    keras.mixed_precision.set_global_policy(request.param)
    return request.param


def fit(base, steps_per_execution=1, scaled=True, callbacks=(), **compile_kwargs):
    """A seeded float8 MLP trained on tests/float8's data (a spike at batch 10).

    ``scaled``: the loss scale grows every 4 steps from 256 (kmix's default rule) under
    ``mixed_float16``; otherwise it is pinned at 1, no loss scaling, as a bfloat16 or
    float32 base needs.
    """
    keras.utils.clear_session()  # the same layer names in every run
    keras.mixed_precision.set_global_policy(base)
    keras.utils.set_random_seed(0)
    model = mlp()
    assert {layer.dtype_policy.name for _, layer in float8_layers(model)} == {f"float8_from_{base}"}
    pinned = {} if scaled else {"initial_scale": 1.0, "max_scale": 1.0}
    opt = kmix.LossScaleOptimizer(
        "sgd", **({"dynamic_growth_steps": 4, "initial_scale": 256.0} | pinned)
    )
    model.compile(
        optimizer=opt, loss="mse", steps_per_execution=steps_per_execution, **compile_kwargs
    )
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks))
    return model, opt


def saturations(opt) -> list[tuple[int, str, str]]:
    return [(s.step, s.layer, s.tensor) for s in opt.float8_saturations()]


def float8_values(model) -> dict[tuple[str, str], np.ndarray]:
    return {
        (path, name): as_numpy(getattr(layer, name))
        for path, layer in float8_layers(model)
        for tensor in ("inputs", "kernel", "outputs_grad")
        for name in (f"{tensor}_scale", f"{tensor}_amax_history")
    }


@pytest.mark.jax
@pytest.mark.parametrize("jit_compile", ["auto", True])
def test_steps_per_execution_saturations_are_those_one_step_an_execution_replays(base, jit_compile):
    """Three steps an execution over 16 batches (the last execution is one step): every
    saturated tensor-step at its own step, as the replay of the one-step run says."""
    if jit_compile is True and keras.backend.backend() == "jax":
        pytest.skip("JAX always compiles the step: 'auto' is the same run")
    scaled = base == "mixed_float16"
    replay = Replay()
    one_model, one = fit(base, 1, scaled, [replay], jit_compile=jit_compile)
    expected = replay.saturated()
    assert saturations(one) and set(saturations(one)) == expected
    model, opt = fit(base, 3, scaled, jit_compile=jit_compile)
    got = saturations(opt)
    assert len(got) == len(set(got)) and set(got) == expected
    assert any(step == 10 and tensor == "inputs" for step, _, tensor in got)  # the spike
    assert opt.attempted_steps == one.attempted_steps == 16
    assert opt.scale_events() == one.scale_events()
    if scaled:  # growths inside executions (every 4 steps, executions of 3)
        assert [e.step for e in opt.scale_events() if e.kind == "growth"][:3] == [4, 8, 12]
    assert opt.float8_episodes() == one.float8_episodes()
    assert [h.saturated_steps for h in opt.float8_health()] == [
        h.saturated_steps for h in one.float8_health()
    ]
    ran, reference = float8_values(model), float8_values(one_model)
    for key, value in reference.items():  # the same training, step for step
        np.testing.assert_array_equal(ran[key], value, err_msg=str(key))


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("base", ["mixed_bfloat16", "float32"], indirect=True)
def test_without_loss_scaling_every_saturation_is_counted_and_written(base, tmp_path):
    """A bfloat16 or float32 base, the loss scale pinned at 1: the check still runs in the
    step (exact against the replay) and the monitor writes every episode at its step."""
    from test_monitor import read_back, scalars, texts

    from kmix import tags
    from kmix.callbacks import MixedPrecisionMonitor

    replay = Replay()
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=5, verbose=0)
    _, opt = fit(base, scaled=False, callbacks=[replay, monitor])
    assert opt.loss_scale == 1.0 and opt.scale_events() == []
    got = saturations(opt)
    assert got and len(got) == len(set(got)) and set(got) == replay.saturated()
    assert any(step == 10 and tensor == "inputs" for step, _, tensor in got)  # the spike
    logged = read_back(tmp_path)
    records = [tags.parse_saturation_record(t) for _, t in texts(logged, tags.FP8_RECORD)]
    assert sorted((r.step, r.layer, r.tensor, r.steps) for r in records) == sorted(
        (e.step, e.layer, e.tensor, e.steps) for e in opt.float8_episodes()
    )
    for h in opt.float8_health():
        written = scalars(logged, tags.float8_tag(tags.FP8_SATURATED_STEPS, h.layer, h.tensor))
        assert (
            written[max(written)]
            == h.saturated_steps
            == sum(1 for s in got if s[1:] == (h.layer, h.tensor))
        )


@pytest.mark.jax
@pytest.mark.torch
def test_a_bfloat16_base_with_a_growing_loss_scale_is_exact_too():
    """kmix's default rule over ``mixed_bfloat16`` (what ``kmix compare`` compiles): the
    loss scale grows, the output gradients follow it, and the replay agrees."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    replay = Replay()
    _, opt = fit("mixed_bfloat16", callbacks=[replay])
    assert [e.step for e in opt.scale_events() if e.kind == "growth"][:3] == [4, 8, 12]
    got = saturations(opt)
    assert got and set(got) == replay.saturated()
