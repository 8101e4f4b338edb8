"""Scale events as data: each written as a ``kmix/event_record`` beside its ``kmix/events`` line.

Logs are written here with ``tf.summary`` in the monitor's formats (the line and the
record of each event at its step, and of each lost-event note at the step of the
first event after it), read back through TensorBoard's reader (``kmix report``) and
its data provider (the tab). The fallback to the lines is checked with logs written
as kmix 0.1.0 and the versions before the records wrote them: lines only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf
from test_report import hand_log
from test_tbplugin import URL, default_provider, get_json, serve

from kmix import report, tags
from kmix.report.read import scale_events_of
from kmix.tags import EventsLost, ForwardOrigin, ScaleEvent

FLOAT32_TENTH = float(np.float32(0.1))  # 0.100000001490116...: not a power of two
EVENTS = (
    ScaleEvent(1, 3, "backoff", 1024.0, 512.0, "dense/kernel", 2, True),
    ScaleEvent(2, 5, "skip_absorbed", 512.0, 512.0, "dense/bias", 1, None),
    ScaleEvent(
        3,
        8,
        "forward_overflow",
        512.0,
        512.0,
        None,
        0,
        False,
        ForwardOrigin("ffn", "Dense", True, 812.25),
    ),
    ScaleEvent(
        6,
        12,
        "overflow_at_floor",
        1.0,
        1.0,
        "w",
        3,
        False,
        ForwardOrigin("x", "Conv2D", False, None),
    ),
    ScaleEvent(7, 13, "backoff", math.inf, 2.0**24, "w", 1, True),
    ScaleEvent(8, 40, "growth", FLOAT32_TENTH, 2 * FLOAT32_TENTH, None, 0, True),
)
LOST = EventsLost(2, 10, 15, 4)  # events 4 and 5 fell out of the ring before step 15's read
LOST_AT = 12  # written at the step of the first event the read still found


def write_monitor_log(logdir: str, *, records: bool = True) -> None:
    """Writes EVENTS and LOST as the monitor does; ``records=False``: lines only (older logs)."""
    writer = tf.summary.create_file_writer(os.path.join(logdir, tags.TRAIN_DIR))
    with writer.as_default():
        for event in EVENTS:
            if event.step == LOST_AT:
                tf.summary.text(tags.EVENTS, tags.format_events_lost(LOST), step=LOST_AT)
                if records:
                    tf.summary.text(tags.EVENT_RECORD, tags.format_event_record(LOST), step=LOST_AT)
            tf.summary.text(tags.EVENTS, tags.format_event(event), step=event.step)
            if records:
                tf.summary.text(tags.EVENT_RECORD, tags.format_event_record(event), step=event.step)
            skipped = sum(e.kind in tags.SKIP_KINDS and e.step <= event.step for e in EVENTS)
            tf.summary.scalar(tags.SKIPPED_STEPS, skipped + LOST.count * (event.step >= LOST_AT),
                              step=event.step)  # fmt: skip
    writer.close()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    root = tmp_path_factory.mktemp("events")
    write_monitor_log(str(root / "records"))
    write_monitor_log(str(root / "lines"), records=False)
    return root


def test_every_field_round_trips_through_the_event_files(logs):
    read = scale_events_of(report.read_log(str(logs / "records")))
    assert read.from_records
    assert read.events == EVENTS  # index, float32 scales, inf, origins: exactly
    assert [e.index for e in read.events] == [1, 2, 3, 6, 7, 8]
    assert read.notes == ((LOST_AT, tags.format_events_lost(LOST)),)
    assert read.lost == LOST.count
    summary = report.summarize(report.read_log(str(logs / "records")))
    assert summary.events == EVENTS
    assert summary.events_lost == LOST.count
    assert [(n.step, n.text) for n in summary.notes] == list(read.notes)


def test_logs_without_records_read_their_lines(logs):
    """Logs of kmix 0.1.0 and of the versions before the records: the lines are parsed.

    A line holds no index, and its scales only to 9 significant digits (exact as
    float32, not as the float the record keeps).
    """
    read = scale_events_of(report.read_log(str(logs / "lines")))
    assert not read.from_records
    assert read.events[:-1] == tuple(dataclasses.replace(e, index=0) for e in EVENTS[:-1])
    growth = read.events[-1]
    assert growth.index == 0 and growth.old_scale != FLOAT32_TENTH
    assert np.float32(growth.old_scale) == np.float32(FLOAT32_TENTH)
    assert read.notes == ((LOST_AT, tags.format_events_lost(LOST)),)
    assert read.lost == LOST.count
    with_records = report.summarize(report.read_log(str(logs / "records")))
    without = report.summarize(report.read_log(str(logs / "lines")))
    for field in ("steps_seen", "skipped_steps", "event_counts", "events_lost", "notes"):
        assert getattr(with_records, field) == getattr(without, field), field


def test_the_records_are_read_not_the_prose():
    """With records present, a line in a wording no parser knows changes nothing."""
    event = EVENTS[2]
    log = hand_log(
        texts={
            tags.EVENTS: [(event.step, "**forward_overflow**, worded by a later version")],
            tags.EVENT_RECORD: [(event.step, tags.format_event_record(event))],
        }
    )
    read = scale_events_of(log)
    assert read.from_records and read.events == (event,) and read.notes == ()


def test_a_record_with_fields_added_later_still_reads():
    event = EVENTS[2]
    data = json.loads(tags.format_event_record(event))
    data["replica"] = 1  # a field of a later version
    data["origin"]["dtype"] = "float16"
    later_kind = {"type": "precision_move", "step": 9, "layer": "ffn"}  # a record type of later
    log = hand_log(
        texts={
            tags.EVENT_RECORD: [
                (event.step, json.dumps(data)),
                (9, json.dumps(later_kind)),
                (10, tags.format_event_record(LOST)),
            ]
        }
    )
    read = scale_events_of(log)
    assert read.events == (event,)
    assert read.lost == LOST.count and read.notes == ((10, tags.format_events_lost(LOST)),)


def test_resumed_runs_keep_each_event_once():
    """A run resumed with BackupAndRestore writes the events before the resume again."""
    twice = [(e.step, tags.format_event_record(e)) for e in EVENTS[:2]] * 2
    log = hand_log(texts={tags.EVENT_RECORD: sorted(twice, key=lambda point: point[0])})
    assert scale_events_of(log).events == EVENTS[:2]


def test_the_tab_shows_each_event_in_the_line_of_its_kmix_events_text(logs):
    """One wording: the tab's lines are the kmix/events lines; its events are the report's."""
    data = get_json(serve(default_provider(logs)), f"{URL}/run?run=records/train")
    log = report.read_log(str(logs / "records"))
    lines = [text for _, text in log.texts[tags.EVENTS] if text != tags.format_events_lost(LOST)]
    assert data["event_lines"] == lines == [tags.format_event(e) for e in EVENTS]
    assert "whether the loss was finite is unknown" in data["event_lines"][1]
    assert "forward overflow starts in `ffn` (Dense)" in data["event_lines"][2]
    assert data["summary"]["events"] == report.summarize(log).to_dict()["events"]
    assert data["events_check"]["complete"] is True


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.slow
def test_the_monitor_writes_a_record_beside_every_line(tmp_path):
    """Through model.fit: five skips, an event ring of 2, one read at the end."""
    import keras
    from spiky import spiky_data, spiky_model

    import kmix
    from kmix.callbacks import MixedPrecisionMonitor

    optimizer = kmix.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=1024, event_capacity=2
    )
    model = spiky_model(optimizer)
    x, y = spiky_data(10, spikes=(1, 2, 4, 6, 9))
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=1000, verbose=0)
    model.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[monitor])

    log = report.read_log(str(tmp_path))
    lines, records = log.texts[tags.EVENTS], log.texts[tags.EVENT_RECORD]
    assert [step for step, _ in records] == [step for step, _ in lines] == [6, 6, 9]
    for (_, line), (_, text) in zip(lines, records, strict=True):
        record = tags.parse_event_record(text)
        if isinstance(record, EventsLost):
            assert line == tags.format_events_lost(record)
        else:
            assert line == tags.format_event(record)
    read = scale_events_of(log)
    assert read.from_records and read.lost == 3
    assert [(e.index, e.step, e.kind, e.variable) for e in read.events] == [
        (4, 6, "backoff", "b/kernel"),
        (5, 9, "backoff", "b/kernel"),
    ]
    assert read.notes[0][1].startswith("**3 scale events lost** between steps 0 and 10")
