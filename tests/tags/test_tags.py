"""kmix.tags: every format written to TensorBoard reads back, also lines of kmix 0.1.0."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from kmix import tags
from kmix.tags import EventsLost, EventSource, ForwardOrigin, PolicyRecord, RunEnd, ScaleEvent

ORIGIN = ForwardOrigin("block_3/ffn_out", "Dense", True, 812.0)


EVENTS = [
    ScaleEvent(0, 1, "backoff", 2.0**16, 2.0**15, "dense_2/kernel", 3, True),
    ScaleEvent(0, 2, "skip_absorbed", 8.0, 8.0, "w", 1, False),
    ScaleEvent(0, 3, "growth", 0.5, 1.0, None, 0, True),
    ScaleEvent(0, 4, "backoff", 4.0, 2.0, "a/b", 2, None),
    ScaleEvent(0, 5, "forward_overflow", 8.0, 8.0, None, 0, False, ORIGIN),
    ScaleEvent(0, 6, "forward_overflow", 8.0, 8.0, "v", 1, None, ORIGIN),
    ScaleEvent(
        0,
        7,
        "forward_overflow",
        8.0,
        8.0,
        None,
        0,
        False,
        ForwardOrigin("x", "Conv2D", False, None),
    ),
    ScaleEvent(
        0, 8, "overflow_at_floor", 1.0, 1.0, "w", 1, True, ForwardOrigin("l", "L", True, 1.5e-3)
    ),
    ScaleEvent(0, 9, "backoff", math.inf, 2.0**24, "w", 1, True),
    ScaleEvent(0, 10, "backoff", 4.0, 2.0, "w", 1, True, None, EventSource(None, 1)),
    ScaleEvent(0, 11, "forward_overflow", 8.0, 8.0, None, 0, False, ORIGIN, EventSource(1, 3)),
    ScaleEvent(
        0,
        12,
        "forward_overflow",
        8.0,
        8.0,
        None,
        0,
        False,
        ForwardOrigin("l", "L", True, 90000.0),
        EventSource(1, None),
    ),
]


@pytest.mark.parametrize("event", EVENTS)
def test_event_lines_round_trip(event):
    line = tags.format_event(event)
    assert tags.parse_event(line) == event
    assert tags.parse_events_lost(line) is None


def test_event_line_wording():
    event = ScaleEvent(9, 5, "forward_overflow", 8.0, 8.0, "w", 1, None, ORIGIN)
    assert tags.format_event(event) == (
        "**forward_overflow** at step 5: loss scale 8 → 8; first non-finite gradient `w` "
        "(1 variable); whether the loss was finite is unknown; forward overflow starts in "
        "`block_3/ffn_out` (Dense): inputs finite, max |input| 812"
    )


def test_lines_written_by_kmix_0_1_0_read_back():
    lines = {  # exactly as kmix 0.1.0 wrote them
        "**backoff** at step 12: loss scale 32768 → 16384; first non-finite gradient "
        "`conv/kernel` (2 variables)": ScaleEvent(
            0, 12, "backoff", 32768.0, 16384.0, "conv/kernel", 2, True
        ),
        "**skip_absorbed** at step 3: loss scale 8 → 8; first non-finite gradient `w` "
        "(1 variable); the loss itself was non-finite": ScaleEvent(
            0, 3, "skip_absorbed", 8.0, 8.0, "w", 1, False
        ),
        "**growth** at step 50: loss scale 1 → 2": ScaleEvent(
            0, 50, "growth", 1.0, 2.0, None, 0, True
        ),
    }
    for line, event in lines.items():
        assert tags.parse_event(line) == event


def test_the_0_1_0_lost_note_is_a_note_not_an_event():
    line = (  # the monitor's prose of kmix 0.1.0
        "**3 scale events lost** between steps 100 and 200: more happened between two reads "
        "than the optimizer's event ring holds (event_capacity=64). Lower `update_freq` or "
        "raise `event_capacity` of kmix.LossScaleOptimizer."
    )
    assert tags.parse_event(line) is None
    assert tags.parse_events_lost(line) == EventsLost(3, 100, 200, 64)
    assert tags.format_events_lost(EventsLost(3, 100, 200, 64)) == line


@pytest.mark.parametrize("lost", [EventsLost(1, 0, 5), EventsLost(7, 10, 20, 16)])
def test_events_lost_round_trip(lost):
    line = tags.format_events_lost(lost)
    assert tags.parse_events_lost(line) == lost
    assert tags.parse_event(line) is None
    assert ("1 scale event lost" in line) == (lost.count == 1)
    assert tags.parse_event_record(tags.format_event_record(lost)) == lost


@pytest.mark.parametrize("event", EVENTS)
def test_event_records_round_trip_every_field(event):
    event = dataclasses.replace(event, index=event.step + 40)  # the record holds the index
    text = tags.format_event_record(event)
    assert "\n" not in text
    fields = dataclasses.asdict(event)
    if event.source is None:  # written only where known: records stay as they were
        del fields["source"]
    assert json.loads(text) == fields | {"type": tags.SCALE_EVENT_RECORD}
    assert tags.parse_event_record(text) == event
    assert tags.parse_event(text) is None and tags.parse_events_lost(text) is None


def test_event_record_json():
    text = tags.format_event_record(
        ScaleEvent(9, 5, "forward_overflow", 8.0, 8.0, "w", 1, None, ORIGIN)
    )
    assert json.loads(text) == {
        "type": "scale_event",
        "index": 9,
        "step": 5,
        "kind": "forward_overflow",
        "old_scale": 8.0,
        "new_scale": 8.0,
        "variable": "w",
        "nonfinite_variables": 1,
        "loss_finite": None,
        "origin": {
            "layer": "block_3/ffn_out",
            "layer_class": "Dense",
            "inputs_finite": True,
            "max_abs_input": 812.0,
        },
    }
    assert json.loads(tags.format_event_record(EventsLost(3, 100, 200, 64))) == {
        "type": "events_lost",
        "count": 3,
        "after_step": 100,
        "upto_step": 200,
        "capacity": 64,
    }
    with pytest.raises(TypeError, match="expected a kmix.tags.ScaleEvent or kmix.tags.EventsLost"):
        tags.format_event_record(RunEnd(1, "completed", ""))


def test_the_source_of_an_event_is_worded_only_where_known():
    event = ScaleEvent(3, 5, "backoff", 8.0, 4.0, "w", 1, True)
    plain = "**backoff** at step 5: loss scale 8 → 4; first non-finite gradient `w` (1 variable)"
    assert tags.format_event(event) == plain
    for source, words in (
        (EventSource(None, 1), "; first non-finite in replica 1"),
        (EventSource(1, 3), "; first non-finite in process 1, replica 3"),
        (EventSource(1, None), "; first non-finite in process 1"),
    ):
        sourced = dataclasses.replace(event, source=source)
        assert tags.format_event(sourced) == plain + words
        assert json.loads(tags.format_event_record(sourced))["source"] == dataclasses.asdict(source)
    assert "source" not in json.loads(tags.format_event_record(event))


def test_event_records_tolerate_fields_added_later():
    event = ScaleEvent(4, 5, "forward_overflow", 8.0, 8.0, None, 0, False, ORIGIN)
    data = json.loads(tags.format_event_record(event))
    data["replica"], data["origin"]["dtype"] = 1, "float16"
    assert tags.parse_event_record(json.dumps(data)) == event
    del data["origin"]  # a field with a default may be left out
    assert tags.parse_event_record(json.dumps(data)) == dataclasses.replace(event, origin=None)
    assert tags.parse_event_record('{"type": "events_lost", "count": 1, "after_step": 0, '
                                   '"upto_step": 5}') == EventsLost(1, 0, 5)  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        {"type": "precision_move"},  # a record of another kind
        {"type": None},
        {"type": ["scale_event"]},
        {"step": "5"},
        {"step": 5.0},
        {"index": True},
        {"old_scale": "8"},
        {"loss_finite": 0},
        {"variable": 3},
        {"origin": "ffn"},
        {"origin": {"layer": "ffn"}},
        {"origin": {"layer": 1, "layer_class": "D", "inputs_finite": True, "max_abs_input": None}},
    ],
)
def test_event_records_that_are_not_records_parse_to_none(change):
    data = json.loads(tags.format_event_record(ScaleEvent(1, 5, "backoff", 8.0, 4.0, "w", 1, True)))
    assert tags.parse_event_record(json.dumps(data | change)) is None
    del data["step"]
    assert tags.parse_event_record(json.dumps(data)) is None


def test_policy_record_round_trip_and_json():
    record = PolicyRecord(
        "mixed_float16", "cnn", "mixed_float16", "float16", "float32", "kmix", 1.0, 2.0**24, 100, 25
    )
    text = tags.format_policy_record(record)
    assert json.loads(text) == dataclasses.asdict(record)
    assert tags.parse_policy_record(text) == record
    stock = dataclasses.replace(record, loss_scaling="keras", min_scale=None, max_scale=None)
    assert tags.parse_policy_record(tags.format_policy_record(stock)) == stock


def test_run_end_round_trip():
    for reason in tags.RUN_END_REASONS:
        end = RunEnd(41, reason, "" if reason == "completed" else f"why: {reason}")
        assert tags.parse_run_end(tags.format_run_end(end)) == end


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"step": 1}', "Global dtype policy"])
def test_records_that_are_not_records_parse_to_none(text):
    assert tags.parse_run_end(text) is None
    assert tags.parse_policy_record(text) is None
    assert tags.parse_event_record(text) is None


def test_forward_overflow_is_code_5_and_a_skip():
    assert tags.EVENT_KINDS[:4] == ("growth", "backoff", "skip_absorbed", "overflow_at_floor")
    assert tags.EVENT_KINDS.index("forward_overflow") + 1 == 5
    assert tags.SKIP_KINDS == {"backoff", "skip_absorbed", "overflow_at_floor", "forward_overflow"}


def test_exponent_bin_against_numpy():
    rng = np.random.default_rng(0)
    values = np.ldexp(rng.uniform(1, 2, 2000), rng.integers(-60, 40, 2000))
    reference = np.clip(
        np.floor(np.log2(values)).astype(int) - tags.EXPONENT_MIN + 2, 1, tags.NUM_EXPONENT_BINS - 2
    )
    exponents = np.frexp(values)[1] - 1  # exact floor(log2(v))
    assert [tags.exponent_bin(int(e)) for e in exponents] == reference.tolist()
    assert tags.exponent_bin(tags.EXPONENT_MIN) == 2
    assert tags.exponent_bin(tags.EXPONENT_MAX) == tags.NUM_EXPONENT_BINS - 3
    for index in range(2, tags.NUM_EXPONENT_BINS - 2):
        assert tags.exponent_bin(tags.bin_exponent(index)) == index
    assert tags.bin_exponent(0) is None and tags.bin_exponent(tags.NUM_EXPONENT_BINS - 1) is None
    left = tags.exponent_bucket_edges()[tags.exponent_bin(-24)][0]
    assert left == -24.0


def test_a_cast_overflow_is_named_as_what_it_is_in_every_wording():
    """A finite input past 65504 entering a float16 layer: the event line, the guard's
    diagnosis and the report say that the cast into float16 overflowed (issue 21, item 1)."""
    from kmix.callbacks import _diagnosis

    cast = ForwardOrigin("after", "Dense", inputs_finite=True, max_abs_input=90000.0)
    event = ScaleEvent(1, 4, "forward_overflow", 8.0, 8.0, None, 0, False, cast)
    line = tags.format_event(event)
    assert line.endswith(
        "forward overflow starts in `after` (Dense): inputs finite, max |input| 90000, "
        "past float16's max 65504: the cast to float16 as they enter overflows"
    )
    assert tags.parse_event(line).origin == cast
    assert "max |input| 90000, past float16's max 65504: the cast to float16" in (
        _diagnosis.forward_origin([event])
    )
    inside = dataclasses.replace(cast, max_abs_input=812.0)
    assert tags.inputs_words(inside) == "inputs finite, max |input| 812"
    no_max = dataclasses.replace(cast, max_abs_input=None)
    assert tags.inputs_words(no_max) == "inputs finite"


def test_policy_record_holds_the_begin_scale_dtypes_and_audit():
    audit = (
        tags.AuditFinding("warning", "head", "softmax in float16", "dtype='float32'"),
        tags.AuditFinding("info", "", "not compiled", "compile it"),
    )
    record = PolicyRecord(
        "mixed_float16", "m", "mixed_float16", "float16", "float32", "kmix", 1.0, 2.0**24, 10, 0,
        loss_scale=1024.0,
        variable_dtypes={"dense/kernel": "float16", "head/bias": "float32"},
        audit_findings=audit,
    )  # fmt: skip
    assert tags.parse_policy_record(tags.format_policy_record(record)) == record
    data = json.loads(tags.format_policy_record(record))
    assert data["loss_scale"] == 1024.0 and data["audit_findings"][0]["layer"] == "head"
    older = {k: v for k, v in data.items() if k not in ("loss_scale", "variable_dtypes")}
    del older["audit_findings"]
    parsed = tags.parse_policy_record(json.dumps(older))
    assert (parsed.loss_scale, parsed.variable_dtypes, parsed.audit_findings) == (None, None, None)
    for bad in (
        {"loss_scale": "1024"},
        {"variable_dtypes": ["dense/kernel"]},
        {"variable_dtypes": {"dense/kernel": 16}},
        {"audit_findings": {"severity": "warning"}},
        {"audit_findings": [{"severity": "warning", "layer": "x"}]},
    ):
        parsed = tags.parse_policy_record(json.dumps(data | bad))
        assert parsed is not None and getattr(parsed, next(iter(bad))) is None, bad


def test_policy_record_says_how_many_processes_and_devices():
    record = PolicyRecord(
        "mixed_float16", "m", "mixed_float16", "float16", "float32", "kmix", 1.0, 2.0**24, 10, 0,
        processes=2,
        devices=4,
    )  # fmt: skip
    text = tags.format_policy_record(record)
    assert (json.loads(text)["processes"], json.loads(text)["devices"]) == (2, 4)
    assert tags.parse_policy_record(text) == record
    older = {k: v for k, v in json.loads(text).items() if k not in ("processes", "devices")}
    parsed = tags.parse_policy_record(json.dumps(older))
    assert (parsed.processes, parsed.devices) == (None, None)
    for bad in ({"processes": "2"}, {"processes": 0}, {"devices": True}, {"devices": 2.5}):
        parsed = tags.parse_policy_record(json.dumps(json.loads(text) | bad))
        assert parsed is not None and getattr(parsed, next(iter(bad))) is None, bad
