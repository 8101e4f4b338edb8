"""kmix.optimizer.model_hooks: what the optimizer attaches to its model, checked eagerly."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmix
from kmix.optimizer.model_hooks import ModelHooks


def mixed_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="body"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(1, dtype="float32", name="head"),
        ],
        name="net",
    )


@pytest.mark.jax
@pytest.mark.torch
def test_float16_mask_follows_each_layers_compute_dtype():
    keras.config.set_dtype_policy("mixed_float16")
    model, hooks = mixed_model(), ModelHooks()
    variables = model.trainable_weights
    np.testing.assert_array_equal(hooks.float16_mask(variables), np.ones(len(variables)))
    hooks.protect(model)
    # Under mixed_float16 BatchNormalization's compute dtype is float16 (it computes its
    # statistics in float32 inside, its output is float16); the head is float32.
    assert [v.path for v in variables] == [
        "net/body/kernel",
        "net/body/bias",
        "net/norm/gamma",
        "net/norm/beta",
        "net/head/kernel",
        "net/head/bias",
    ]
    np.testing.assert_array_equal(hooks.float16_mask(variables), [1, 1, 1, 1, 0, 0])


@pytest.mark.jax
@pytest.mark.torch
def test_watching_twice_wraps_the_train_step_and_taps_the_layers_once():
    keras.config.set_dtype_policy("mixed_float16")
    model, hooks = mixed_model(), ModelHooks()
    hooks.protect(model)
    hooks.tap(model)
    wrapper, tap = model.train_step, hooks._tap
    hooks.protect(model)
    hooks.tap(model)
    assert model.train_step is wrapper and hooks._tap is tap
    assert tap.paths == ["net/body", "net/norm"]  # the float16 layers only
    assert hooks.model is model


@pytest.mark.parametrize("watched", [True, False])
def test_a_skipped_step_leaves_the_moving_statistics_only_when_watched(watched):
    """An eager train step on a non-finite batch: the optimizer skips it; its forward pass
    assigned NaN moving statistics, which the watched model gets back."""
    keras.config.set_dtype_policy("mixed_float16")
    model = mixed_model()
    opt = kmix.LossScaleOptimizer("sgd", initial_scale=4.0)
    model.compile(optimizer=opt, loss="mse")
    model.train_step((np.ones((2, 3), "float32"), np.zeros((2, 1), "float32")))
    if watched:
        opt.watch(model)
    norm = model.get_layer("norm")
    before = [v.numpy().copy() for v in (norm.moving_mean, norm.moving_variance)]
    model.train_step((np.full((2, 3), np.inf, "float32"), np.zeros((2, 1), "float32")))
    after = [v.numpy() for v in (norm.moving_mean, norm.moving_variance)]
    assert (opt.attempted_steps, opt.skipped_steps) == (2, 1)
    if watched:
        for got, want in zip(after, before, strict=True):
            np.testing.assert_array_equal(got, want)
    else:  # stock behaviour, the reason the hook exists
        assert not np.isfinite(after[0]).all()
