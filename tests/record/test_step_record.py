"""The step record's pure update and event ring, against plain-Python references."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from keras import ops
from test_scaling import reference_step

import kmix.backend
from kmix.record import HOST_OPS, scaling
from kmix.record import step_record as record
from kmix.record.scaling import ScaleConfig
from kmix.tags import EventSource

CONFIG = ScaleConfig(growth_steps=3, hysteresis=2, min_scale=1.0, max_scale=2.0**4)
LOSS = {"finite": record.LOSS_FINITE, "nonfinite": record.LOSS_NONFINITE, "unknown": -1}
INT = kmix.backend.int64_dtype()
"""The counters' dtype: int64; int32 on JAX without jax_enable_x64, and on torch."""
TOP = record.int_max(ops.convert_to_numpy(ops.convert_to_tensor(0, INT)).dtype)
"""Where the counters saturate: the end of :data:`INT` as the backend holds it."""


def reference(steps: list[tuple[bool, str]], health_every: int, histogram_every: int) -> list:
    """The counters rule written as plain Python, one dict per step."""
    c = dict.fromkeys(record.Counters._fields, 0) | {"hysteresis_left": CONFIG.hysteresis}
    c["loss_state"] = record.LOSS_FINITE
    scale, trace = np.float32(8.0), []
    for grads_finite, loss in steps:
        forward = loss == "nonfinite"
        step = c["attempted_steps"] + 1
        if forward:  # the scale is kept, the good-step count restarts
            new, event = (scale, 0, c["hysteresis_left"]), scaling.FORWARD_OVERFLOW
        else:
            new, event = reference_step(
                (scale, c["good_steps"], c["hysteresis_left"]), grads_finite, CONFIG
            )
        scale, c["good_steps"], c["hysteresis_left"] = new
        skipped = forward or not grads_finite
        c.update(
            attempted_steps=step,
            skipped_steps=c["skipped_steps"] + skipped,
            consecutive_skips=c["consecutive_skips"] + 1 if skipped else 0,
            last_overflow_step=step if skipped else c["last_overflow_step"],
            loss_state=LOSS[loss],
            consecutive_nonfinite_loss=c["consecutive_nonfinite_loss"] + 1 if forward else 0,
            event_count=c["event_count"] + (event != scaling.NONE),
            health_step=step if step % health_every == 0 else c["health_step"],
            histogram_step=(
                step if histogram_every and step % histogram_every == 0 else c["histogram_step"]
            ),
        )
        trace.append((float(scale), dict(c), event))
    return trace


def initial_record() -> record.StepRecord:
    """An optimizer's record before its first step, scale 8, as tensors."""
    counters = ops.convert_to_tensor(list(record.initial_counters(CONFIG.hysteresis)), INT)
    return record.StepRecord(ops.convert_to_tensor(8.0, "float32"), record.unpack(counters))


def run_graph(steps, health_every, histogram_every) -> list:
    state = initial_record()
    trace = []
    for grads_finite, loss in steps:
        state, outcome = record.advance(
            state,
            ops.convert_to_tensor(grads_finite),
            LOSS[loss],
            CONFIG,
            health_every,
            histogram_every,
        )
        packed = record.unpack(record.pack(state.counters, INT))  # the variable's round trip
        counters = {k: int(ops.convert_to_numpy(v)) for k, v in packed._asdict().items()}
        trace.append((float(ops.convert_to_numpy(state.scale)), counters, int(outcome.event)))
        state = record.StepRecord(state.scale, packed)
    return trace


@pytest.mark.jax
@pytest.mark.torch
def test_exact_trace_with_forward_overflows_and_unknown_losses():
    steps = [(True, "finite")] * 3 + [(False, "finite"), (True, "nonfinite"), (False, "unknown")]
    trace = run_graph(steps, health_every=2, histogram_every=3)
    assert trace == reference(steps, 2, 3)
    scales = [scale for scale, _, _ in trace]
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 8.0]  # growth, absorbed, kept, backoff
    assert [event for _, _, event in trace] == [0, 0, 1, 3, 5, 2]
    assert trace[-1][1]["skipped_steps"] == 3 and trace[-1][1]["loss_state"] == -1


STEP_SEQUENCES = (
    st.lists(st.tuples(st.booleans(), st.sampled_from(list(LOSS))), min_size=1, max_size=12),
    st.integers(1, 4),
    st.integers(0, 3),
)
"""(grads finite, loss) per step, health_every, histogram_every."""


@pytest.mark.jax
@pytest.mark.torch
@settings(max_examples=25, deadline=None)
@given(*STEP_SEQUENCES)
@pytest.mark.slow
def test_graph_update_matches_reference(steps, health_every, histogram_every):
    assert run_graph(steps, health_every, histogram_every) == reference(
        steps, health_every, histogram_every
    )


@pytest.mark.jax
@pytest.mark.torch
def test_event_ring_round_trip_and_overwrite():
    capacity = 2
    ring = record.EventRing(
        ops.zeros((capacity, len(record.EVENT_INT_FIELDS)), INT),
        ops.zeros((capacity, len(record.EVENT_FLOAT_FIELDS)), "float32"),
    )
    health = np.full(len(record.HEALTH_FIELDS), np.nan, "float32")
    health[:2] = [3.0, 4096.0]  # grad_norm, max_abs_scaled; float16_elements unmeasured
    health[record.HEALTH_FIELDS.index("float16_elements")] = 6.0
    rows = [
        (5, scaling.BACKOFF, [False, True, True], record.LOSS_FINITE, record.NO_ORIGIN),
        (
            6,
            scaling.FORWARD_OVERFLOW,
            [False, False, False],
            record.LOSS_NONFINITE,
            record.EventOrigin(1, 1, 812.0),
        ),
        (9, scaling.GROWTH, [False, False, False], record.LOSS_UNKNOWN, record.NO_ORIGIN),
    ]
    for index, (step, kind, bad, loss, origin) in enumerate(rows, start=1):
        ints, floats = record.encode_event(
            step, kind, (8.0, 4.0), ops.convert_to_tensor(bad), loss, health, origin
        )
        ring = record.write_event(ring, index, ints, floats)
    decoded = record.decode_events(
        ops.convert_to_numpy(ring.ints),
        ops.convert_to_numpy(ring.floats),
        event_count=3,
        since=0,
        variables=["a/kernel", "b/kernel", "b/bias"],
        layers=[("in", "InputLayer"), ("block/ffn", "Dense")],
    )
    assert [r.event.index for r in decoded] == [2, 3]  # the first was overwritten
    forward, growth = (r.event for r in decoded)
    assert (forward.step, forward.kind, forward.variable, forward.loss_finite) == (
        6,
        "forward_overflow",
        None,
        False,
    )
    assert dataclasses.asdict(forward.origin) == {
        "layer": "block/ffn",
        "layer_class": "Dense",
        "inputs_finite": True,
        "max_abs_input": 812.0,
    }
    assert (growth.kind, growth.loss_finite, growth.origin) == ("growth", None, None)
    assert forward.source is growth.source is None  # one replica: no source column known
    assert (
        decoded[0].health["max_abs_scaled"] == 4096.0 and "headroom_bits" not in decoded[0].health
    )
    assert (
        record.decode_events(
            ops.convert_to_numpy(ring.ints), ops.convert_to_numpy(ring.floats), 3, 3, []
        )
        == []
    )


@pytest.mark.jax
@pytest.mark.torch
def test_no_headroom_is_claimed_when_every_nonzero_value_was_nonfinite():
    values = dict.fromkeys(record.HEALTH_FIELDS, 0.0) | {
        "headroom_bits": 40.0,  # what the capped formula gives for max 0
        "nonfinite_elements": 3.0,
        "float16_elements": 6.0,
    }
    health = record.measured_health(list(values.values()))
    assert "headroom_bits" not in health and health["nonfinite_elements"] == 3.0
    assert (
        record.measured_health(list((values | {"nonfinite_elements": 0.0}).values()))[
            "headroom_bits"
        ]
        == 40.0
    )


@settings(max_examples=40, deadline=None)
@given(*STEP_SEQUENCES)
@pytest.mark.slow
def test_a_quiet_step_is_exactly_the_constant_delta(steps, health_every, histogram_every):
    """Where the optimizer adds QUIET_DELTA instead of running the rule, the rule agrees."""
    state = initial_record()
    for grads_finite, loss in steps:
        packed = record.pack(state.counters, INT)
        health_due, histogram_due = ops.convert_to_numpy(
            record.due_now(packed, np.asarray([health_every, histogram_every], INT))
        )
        quiet = record.is_quiet(
            packed, flags(grads_finite, loss), np.asarray([health_due, histogram_due]), CONFIG
        )
        new, outcome = record.advance(
            state,
            ops.convert_to_tensor(grads_finite),
            LOSS[loss],
            CONFIG,
            health_every,
            histogram_every,
        )
        assert bool(health_due) == bool(outcome.health_due)
        assert bool(histogram_due) == bool(outcome.histogram_due)
        if bool(quiet):
            before = ops.convert_to_numpy(packed)
            after = ops.convert_to_numpy(record.pack(new.counters, INT))
            np.testing.assert_array_equal(after - before, list(record.QUIET_DELTA))
            assert float(new.scale) == float(state.scale) and int(outcome.event) == scaling.NONE
        state = new


def flags(grads_finite: bool, loss: str) -> np.ndarray:
    """The optimizer's flags for one variable: [gradient non-finite, loss non-finite, unknown]."""
    return np.float32([not grads_finite, loss == "nonfinite", loss == "unknown"])


@pytest.mark.jax
@pytest.mark.torch
def test_which_steps_are_quiet():
    counters = initial_record().counters

    def quiet(grads_finite=True, loss="finite", health_every=4, histogram_every=0, **changes):
        """Decided in the step (keras.ops) and on the host (HOST_OPS, NumPy): the same."""
        c = counters._replace(**{k: ops.convert_to_tensor(v, INT) for k, v in changes.items()})
        packed, every = record.pack(c, INT), np.asarray([health_every, histogram_every], INT)
        due = record.due_now(packed, every)
        in_step = bool(record.is_quiet(packed, flags(grads_finite, loss), due, CONFIG))
        host_packed = ops.convert_to_numpy(packed)
        host_due = record.due_now(host_packed, every, HOST_OPS)
        assert host_due.tolist() == ops.convert_to_numpy(due).tolist()
        host = record.is_quiet(host_packed, flags(grads_finite, loss), host_due, CONFIG, HOST_OPS)
        assert bool(host) == in_step
        return in_step

    assert quiet()
    assert not quiet(grads_finite=False)  # a skip
    assert not quiet(loss="nonfinite")  # a forward overflow
    assert not quiet(loss="unknown")  # the loss state changes
    assert not quiet(health_every=1)  # statistics are due
    assert not quiet(histogram_every=1)
    assert not quiet(good_steps=CONFIG.growth_steps - 1)  # the scale grows
    assert not quiet(consecutive_skips=1)  # a streak ends
    assert not quiet(consecutive_nonfinite_loss=2)
    assert not quiet(loss_state=record.LOSS_UNKNOWN)
    assert quiet(good_steps=CONFIG.growth_steps - 2)  # the last step before growth
    assert quiet(attempted_steps=TOP - 2, health_every=1000, histogram_every=0)
    assert not quiet(attempted_steps=TOP - 1)  # the counter saturates next


@pytest.mark.jax
@pytest.mark.torch
def test_due_now_is_what_advance_finds_due():
    every = np.asarray([3, 4], INT)
    for attempted in (0, 2, 3, 11, TOP - 1, TOP):
        c = initial_record().counters._replace(
            attempted_steps=ops.convert_to_tensor(attempted, INT)
        )
        step = min(attempted + 1, TOP)
        expected = [step % 3 == 0, step % 4 == 0]
        packed = record.pack(c, INT)
        assert ops.convert_to_numpy(record.due_now(packed, every)).tolist() == expected
        host = ops.convert_to_numpy(packed)  # an eager step decides on the host
        assert record.due_now(host, every, HOST_OPS).tolist() == expected


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize(
    ("source", "want"),
    [
        (record.NonfiniteSource(-1, 1), EventSource(None, 1)),
        (record.NonfiniteSource(1, 3), EventSource(1, 3)),
        (record.NO_SOURCE, None),
    ],
)
def test_the_source_columns_decode_where_known_and_older_rings_read_as_unknown(source, want):
    health = np.full(len(record.HEALTH_FIELDS), np.nan, "float32")
    ints, floats = record.encode_event(
        4, scaling.BACKOFF, (8.0, 4.0), ops.convert_to_tensor([True]), 1, health, source=source
    )
    ints, floats = ops.convert_to_numpy(ints)[None], ops.convert_to_numpy(floats)[None]
    (got,) = record.decode_events(ints, floats, 1, 0, ["w"])
    assert got.event.source == want
    # a ring saved before the source columns (7 of them) decodes with none
    (old,) = record.decode_events(ints[:, :7], floats, 1, 0, ["w"])
    assert old.event.source is None and old.event.variable == "w"
    assert record.EVENT_INT_FIELDS[7:] == ("source_process", "source_replica")
