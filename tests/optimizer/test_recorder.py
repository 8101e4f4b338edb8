"""kmix.optimizer.recorder: the record written inside a traced step and read back (no fit)."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix


@pytest.mark.jax
@pytest.mark.torch
def test_a_traced_step_records_every_field_exactly():
    """Four steps of a tf.function around apply, against the rule worked by hand:
    scale 4, growth after 2 good steps, SGD with lr 1 on the unscaled gradients.

    step 1: [inf, 0]  skipped, backoff 4 -> 2             w = [1, 1]
    step 2: [4, 8]/2  = [2, 4]                            w = [-1, -3]
    step 3: [4, 8]/2  = [2, 4], 2nd good step: growth 2 -> 4   w = [-3, -7]
    step 4: [8, 4]/4  = [2, 1]                            w = [-5, -8]
    """
    w = keras.Variable(np.ones(2, "float32"), name="w")
    opt = kmix.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=4.0, dynamic_growth_steps=2, health_every=1
    )

    def step(grad):
        opt.apply([grad], [w])

    if keras.backend.backend() == "tensorflow":  # elsewhere a custom loop's apply runs its
        step = tf.function(step)  # own step (JAX) or runs eagerly (torch)
    for grad in ([np.inf, 0.0], [4.0, 8.0], [4.0, 8.0], [8.0, 4.0]):
        step(keras.ops.convert_to_tensor(grad, "float32"))
    np.testing.assert_array_equal(w.numpy(), [-5.0, -8.0])
    state = opt.read_state()
    assert (state.loss_scale, state.attempted_steps, state.skipped_steps) == (4.0, 4, 1)
    assert (state.good_steps, state.last_overflow_step, state.event_count) == (1, 1, 2)
    assert (state.health_step, state.loss_finite) == (4, None)  # no scale_loss in the graph
    assert state.health["grad_norm"] == pytest.approx(math.sqrt(5.0), rel=1e-6)
    assert state.health["max_abs_scaled"] == 8.0
    events = [(e.step, e.kind, e.old_scale, e.new_scale, e.variable) for e in opt.scale_events()]
    assert events == [(1, "backoff", 4.0, 2.0, w.path), (3, "growth", 2.0, 4.0, None)]
    assert opt.underflow_by_variable() == {w.path: 0.0}
    assert opt.activations_by_layer() == {}  # no tapped forward pass


@pytest.mark.jax
@pytest.mark.torch
def test_reads_before_build_give_the_initial_record():
    opt = kmix.LossScaleOptimizer("sgd", initial_scale=64.0, hysteresis=3)
    state = opt.recorder.read_state()
    assert (state.loss_scale, state.attempted_steps, state.event_count) == (64.0, 0, 0)
    assert opt.recorder.by_variable("underflow_per_variable") == {}
    assert opt.recorder.recorded_events() == []
    with pytest.raises(ValueError, match="since=-1"):
        opt.recorder.recorded_events(-1)
