"""The in-graph scale rule against an independent plain-Python reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from keras import ops

from kmix.record import scaling
from kmix.record.scaling import ScaleConfig, ScaleState

pytestmark = [pytest.mark.jax, pytest.mark.torch]  # the rule in keras.ops, on each backend

KINDS = {
    "none": scaling.NONE,
    "growth": scaling.GROWTH,
    "backoff": scaling.BACKOFF,
    "absorbed": scaling.SKIP_ABSORBED,
    "floor": scaling.OVERFLOW_AT_FLOOR,
}


def reference_step(state: tuple, finite: bool, c: ScaleConfig) -> tuple[tuple, int]:
    """The rule written as plain branches, in float32 like the optimizer's variable."""
    scale, good, left = state
    f32 = np.float32
    if finite:
        good += 1
        if good >= c.growth_steps:
            new = min(f32(scale) * f32(c.growth_factor), f32(c.max_scale))
            kind = KINDS["growth"] if new != scale else KINDS["none"]
            return (f32(new), 0, c.hysteresis), kind
        return (scale, good, left), KINDS["none"]
    left -= 1
    if left <= 0:
        new = max(f32(scale) * f32(c.backoff_factor), f32(c.min_scale))
        kind = KINDS["backoff"] if new != scale else KINDS["floor"]
        return (f32(new), 0, c.hysteresis), kind
    return (scale, 0, left), KINDS["absorbed"]


def graph_step(state: tuple, finite: bool, c: ScaleConfig) -> tuple[tuple, int]:
    scale, good, left = state
    tensors = ScaleState(
        ops.convert_to_tensor(scale, "float32"),
        ops.convert_to_tensor(good, "int64"),
        ops.convert_to_tensor(left, "int64"),
    )
    new, event = scaling.update_scale(tensors, ops.convert_to_tensor(finite), c)
    as_np = ops.convert_to_numpy
    return (
        np.float32(as_np(new.scale)),
        int(as_np(new.good_steps)),
        int(as_np(new.hysteresis_left)),
    ), int(as_np(event))


def run(step_fn, finite_seq, c: ScaleConfig, initial: float):
    state = (np.float32(initial), 0, c.hysteresis)
    trace = []
    for finite in finite_seq:
        state, kind = step_fn(state, finite, c)
        trace.append((float(state[0]), state[1], state[2], kind))
    return trace


def test_exact_trace_with_hysteresis_and_bounds():
    c = ScaleConfig(
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_steps=2,
        hysteresis=2,
        min_scale=1.0,
        max_scale=8.0,
    )
    seq = [True, True, False, False, False, True, True, True, True, False, False, False, False]
    trace = run(graph_step, seq, c, initial=4.0)
    g, b, a, f, n = (KINDS[k] for k in ("growth", "backoff", "absorbed", "floor", "none"))
    assert trace == [
        (4.0, 1, 2, n),
        (8.0, 0, 2, g),  # two good steps: grow to the ceiling
        (8.0, 0, 1, a),  # first overflow absorbed by hysteresis=2
        (4.0, 0, 2, b),  # second overflow backs off, budget refills
        (4.0, 0, 1, a),
        (4.0, 1, 1, n),  # good steps do not refill the budget
        (8.0, 0, 2, g),  # growth does
        (8.0, 1, 2, n),
        (8.0, 0, 2, n),  # growth period ends at max_scale: no change, no event
        (8.0, 0, 1, a),
        (4.0, 0, 2, b),
        (4.0, 0, 1, a),
        (2.0, 0, 2, b),
    ]


def test_scale_stops_at_min_scale_and_reports_the_floor():
    c = ScaleConfig(min_scale=1.0, max_scale=2.0**24)
    trace = run(graph_step, [False] * 4, c, initial=4.0)
    assert [t[0] for t in trace] == [2.0, 1.0, 1.0, 1.0]
    assert [t[3] for t in trace] == [KINDS["backoff"]] * 2 + [KINDS["floor"]] * 2


def test_keras_defaults_match_stock_rule():
    """hysteresis=1, factor 2/0.5: grow after `growth_steps` good steps, halve on overflow."""
    c = ScaleConfig(growth_steps=3)
    trace = run(graph_step, [True, True, True, False, True], c, initial=2.0**15)
    assert [t[0] for t in trace] == [2.0**15, 2.0**15, 2.0**16, 2.0**15, 2.0**15]


configs = st.builds(
    ScaleConfig,
    growth_factor=st.floats(1.01, 8.0),
    backoff_factor=st.floats(0.05, 0.99),
    growth_steps=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    min_scale=st.floats(0.5, 4.0),
    max_scale=st.floats(4.0, 2.0**30),
)


@settings(max_examples=60, deadline=None)
@given(c=configs, seq=st.lists(st.booleans(), min_size=1, max_size=40), data=st.data())
def test_graph_rule_matches_reference(c, seq, data):
    initial = data.draw(st.floats(c.min_scale, c.max_scale), label="initial")
    assert run(graph_step, seq, c, initial) == run(reference_step, seq, c, initial)


@pytest.mark.parametrize("finite", [True, False])
def test_scale_never_leaves_bounds(finite):
    c = ScaleConfig(growth_steps=1, min_scale=2.0, max_scale=16.0)
    trace = run(graph_step, [finite] * 10, c, initial=4.0)
    assert all(2.0 <= t[0] <= 16.0 for t in trace)
    assert trace[-1][0] == (16.0 if finite else 2.0)
