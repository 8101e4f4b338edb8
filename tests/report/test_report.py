"""kmix.report: read synthetic kmix logs back, with exact expected summaries.

The logs are written here with ``tf.summary`` and the tag constants of
``kmix.tags``, independently of ``kmix.callbacks``, so the reader is checked
against the tag contract rather than against the monitor's code.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.plugins.histogram import metadata as histogram_metadata

from kmix import report, tags
from kmix.report import read as report_read
from kmix.report.summary import _direction
from kmix.tags import ScaleEvent

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

EVENTS = [  # (step, kind, old scale, new scale, variable, non-finite variables, loss finite)
    (1, "backoff", 2.0**16, 2.0**15, "dense_2/kernel", 3, True),
    (2, "backoff", 2.0**15, 2.0**14, "dense_2/kernel", 1, True),
    (3, "backoff", 2.0**14, 2.0**13, "conv/bias", 1, True),
    (53, "growth", 2.0**13, 2.0**14, None, 0, True),
    (80, "backoff", 2.0**14, 2.0**13, "dense_2/kernel", 2, False),
]
LOST_NOTE = "**2 scale events lost** between steps 60 and 70: raise `event_capacity`."
POLICY_TEXT = "Global dtype policy `mixed_float16`.\n\n| layer | compute |\n|---|---|"
READ_STEPS = range(10, 101, 10)


def scale_at(step: int) -> float:
    """The loss scale after ``step`` in the synthetic run."""
    scale = EVENTS[0][2]
    for event_step, _, _, new, *_ in EVENTS:
        if event_step <= step:
            scale = new
    return scale


def exponent_histogram(**counts_by_exponent: int) -> np.ndarray:
    """Counts per kmix exponent bin; keys ``e<n>``/``m<n>`` for exponent n/-n, and ``zero``."""
    counts = np.zeros(tags.NUM_EXPONENT_BINS)
    for key, count in counts_by_exponent.items():
        if key == "zero":
            counts[0] = count
        else:
            exponent = int(key[1:]) * (-1 if key[0] == "m" else 1)
            counts[2 + exponent - tags.EXPONENT_MIN] = count
    return counts


HISTOGRAMS = {  # step -> variable -> counts
    50: {"dense_2/kernel": exponent_histogram(e0=10)},
    100: {
        # 8 zeros, 37 below 2**-14 (30 at 2**-20, 7 at 2**-15), 55 normal
        "dense_2/kernel": exponent_histogram(zero=8, m20=30, m15=7, e0=55),
        "conv/kernel": exponent_histogram(zero=50, e3=50),
    },
}


def write_histogram(tag: str, counts: np.ndarray, step: int) -> None:
    """Writes exact bins as the monitor does: a [k, 3] tensor of left, right, count."""
    edges = np.asarray(tags.exponent_bucket_edges())
    tf.summary.write(
        tag,
        np.column_stack([edges, counts]),
        step=step,
        metadata=histogram_metadata.create_summary_metadata(tag, ""),
    )


def write_run(logdir: str, *, upto: int = 100, writer=None) -> None:
    """Writes the synthetic run's kmix data for steps up to ``upto`` into LOGDIR/train."""
    writer = writer or tf.summary.create_file_writer(os.path.join(logdir, tags.TRAIN_DIR))
    with writer.as_default():
        tf.summary.text(tags.POLICY, POLICY_TEXT, step=0)
        for step, kind, old, new, variable, count, loss_finite in EVENTS:
            if step <= upto:
                event = ScaleEvent(0, step, kind, old, new, variable, count, loss_finite)
                tf.summary.text(tags.EVENTS, tags.format_event(event), step=step)
        if upto >= 70:
            tf.summary.text(tags.EVENTS, LOST_NOTE, step=70)
        for k, step in enumerate(READ_STEPS):
            if step > upto:
                break
            skipped = sum(e[0] <= step and e[1] != "growth" for e in EVENTS)
            tf.summary.scalar(tags.LOSS_SCALE, scale_at(step), step=step)
            tf.summary.scalar(tags.SKIPPED_STEPS, skipped, step=step)
            tf.summary.scalar(tags.SKIP_RATE, 0.25 if step == 10 else 0.0, step=step)
            tf.summary.scalar(tags.OVERFLOW_HEADROOM_BITS, 5.0 - 0.5 * k, step=step)
            tf.summary.scalar(tags.UNDERFLOW_FRACTION, 0.125, step=step)
            tf.summary.scalar(tags.GRAD_NORM, float(k + 1), step=step)
            dense = 0.4375 if step == 100 else 0.25
            tf.summary.scalar(tags.UNDERFLOW_BY_VARIABLE + "dense_2/kernel", dense, step=step)
            tf.summary.scalar(tags.UNDERFLOW_BY_VARIABLE + "conv/kernel", 0.5, step=step)
            tf.summary.scalar(tags.UNDERFLOW_BY_VARIABLE + "conv/bias", 0.0625, step=step)
        for step, by_variable in HISTOGRAMS.items():
            if step <= upto:
                for variable, counts in by_variable.items():
                    write_histogram(tags.GRAD_EXPONENT + variable, counts, step)
    writer.flush()


@pytest.fixture
def run_dir(tmp_path) -> str:
    logdir = str(tmp_path / "run")
    write_run(logdir)
    return logdir


def expected_events() -> list[dict]:
    return [
        {
            "kind": kind,
            "step": step,
            "old_scale": old,
            "new_scale": new,
            "variable": variable,
            "nonfinite_variables": count,
            "loss_finite": loss_finite,
        }
        for step, kind, old, new, variable, count, loss_finite in EVENTS
    ]


# ----------------------------------------------------------------- summary
def test_summary_numbers_are_exact(run_dir):
    typed = report.summarize(report.read_log(run_dir))
    summary = typed.to_dict()

    assert summary["logdir"] == os.path.join(run_dir, tags.TRAIN_DIR)
    assert summary["steps_seen"] == 100
    assert summary["loss_scale"] == {
        "initial": 2.0**16,  # from the first event: the scalar starts at step 10
        "final": 2.0**13,
        "min": 2.0**13,
        "max": 2.0**16,
    }
    assert summary["skipped_steps"] == 4
    assert summary["skip_rate"] == 0.04
    assert summary["recent_skip_rate"] == 0.0
    assert summary["events"] == [event | {"origin": None} for event in expected_events()]
    assert typed.events == tuple(
        ScaleEvent(0, step, kind, old, new, variable, count, loss_finite)
        for step, kind, old, new, variable, count, loss_finite in EVENTS
    )
    assert summary["event_counts"] == {"backoff": 4, "growth": 1}
    assert summary["trends"] == {
        "overflow_headroom_bits": {
            "points": 10,
            "nonfinite_points": 0,
            "first_step": 10,
            "last_step": 100,
            "first": 5.0,
            "last": 0.5,
            "min": 0.5,
            "max": 5.0,
            "direction": "falling",
        },
        "underflow_fraction": {
            "points": 10,
            "nonfinite_points": 0,
            "first_step": 10,
            "last_step": 100,
            "first": 0.125,
            "last": 0.125,
            "min": 0.125,
            "max": 0.125,
            "direction": "steady",
        },
        "grad_norm": {
            "points": 10,
            "nonfinite_points": 0,
            "first_step": 10,
            "last_step": 100,
            "first": 1.0,
            "last": 10.0,
            "min": 1.0,
            "max": 10.0,
            "direction": "rising",
        },
    }
    assert list(summary["underflow_by_variable"].items()) == [  # largest first
        ("conv/kernel", 0.5),
        ("dense_2/kernel", 0.4375),
        ("conv/bias", 0.0625),
    ]
    assert summary["gradient_exponents"] == {
        "dense_2/kernel": {
            "step": 100,
            "elements": 100,
            "zero": 0.08,
            "below_normal": 0.37,
            "in_range": 0.55,
            "above_max": 0.0,
            "nonfinite": 0.0,
        },
        "conv/kernel": {
            "step": 100,
            "elements": 100,
            "zero": 0.5,
            "below_normal": 0.0,
            "in_range": 0.5,
            "above_max": 0.0,
            "nonfinite": 0.0,
        },
    }
    assert summary["policy"] == POLICY_TEXT
    assert summary["notes"] == [{"step": 70, "text": LOST_NOTE}]


def test_findings_in_plain_words(run_dir):
    summary = report.summarize(report.read_log(run_dir)).to_dict()
    found = summary["findings"]

    assert [(f["severity"], f["rule"]) for f in found] == [
        ("warning", "nonfinite_loss"),
        ("warning", "headroom"),
        ("info", "zero_gradients"),
        ("warning", "underflow"),
        ("info", "culprit"),
        ("info", "overflow_episode"),
        ("info", "note"),
    ]
    messages = [f["message"] for f in found]
    assert messages[0].startswith("the loss itself was non-finite at step 80:")
    assert "0.50 bits below float16's maximum" in messages[1]
    assert messages[2].startswith("50% of gradient elements in conv/kernel are exactly zero")
    assert messages[3].startswith(
        "37% of gradient elements in dense_2/kernel sit below float16's smallest normal "
        "(2^-14) after scaling: the scale is too low for this layer"
    )
    assert "only 0.5 bits of headroom" in messages[3]  # a higher scale would overflow
    assert messages[4] == (
        "dense_2/kernel had the first non-finite gradient in 3 of the 4 skipped steps "
        "that named one"
    )
    assert messages[5] == (
        "steps 1-3: 3 skipped step(s) in a row backed the scale off from 65536 (2^16) to "
        "8192 (2^13); training resumed at step 4: recovered. Afterwards 1 more skipped "
        "step(s) and 1 growth(s) kept the scale near the largest that fits; it ended at "
        "8192 (2^13)"
    )
    assert messages[6] == f"note at step 70: {LOST_NOTE}"


def hand_log(scalars=None, texts=None, histograms=None) -> report.KmixLog:
    """A KmixLog built by hand (steps, values) per scalar tag, for edge cases."""
    return report.KmixLog(
        path="hand",
        scalars={
            tag: report.Series(np.asarray(s, np.int64), np.asarray(v, np.float64))
            for tag, (s, v) in (scalars or {}).items()
        },
        histograms=histograms or {},
        texts=texts or {},
    )


def event_line(step, kind, old, new, variable=None, loss_finite=True):
    event = ScaleEvent(0, step, kind, old, new, variable, int(variable is not None), loss_finite)
    return (step, tags.format_event(event))


def test_skips_after_the_last_counter_point_are_counted():
    log = hand_log(
        scalars={tags.SKIPPED_STEPS: ([10], [3]), tags.LOSS_SCALE: ([10], [8.0])},
        texts={tags.EVENTS: [event_line(20, "backoff", 8.0, 4.0, "w")]},
    )
    summary = report.summarize(log).to_dict()
    assert summary["skipped_steps"] == 4
    assert summary["steps_seen"] == 20
    assert summary["loss_scale"] == {"initial": 8.0, "final": 4.0, "min": 4.0, "max": 8.0}


def test_healthy_run_says_so():
    log = hand_log(scalars={tags.LOSS_SCALE: ([10, 20], [2.0**15, 2.0**15])})
    typed = report.summarize(log)
    summary = typed.to_dict()
    assert summary["findings"] == [
        {"severity": "info", "rule": "healthy", "message": "no problems found"}
    ]
    assert summary["trends"]["grad_norm"] is None
    assert "gradient norm              not logged" in report.format_summary(typed)


def test_notes_without_warnings_are_introduced_as_notes():
    log = hand_log(
        scalars={tags.LOSS_SCALE: ([1, 100], [8.0, 4.0]), tags.SKIPPED_STEPS: ([100], [1])},
        texts={tags.EVENTS: [event_line(3, "backoff", 8.0, 4.0, "w")]},
    )
    found = report.summarize(log).to_dict()["findings"]
    assert [f["severity"] for f in found] == ["info"] * len(found) and len(found) > 1
    assert (
        found[0]["message"] == f"no problems found; {len(found) - 1} notes for information follow"
    )


def test_skip_rate_and_floor_warnings():
    lines = [event_line(s, "overflow_at_floor", 1.0, 1.0, "w") for s in range(1, 11)]
    log = hand_log(
        scalars={tags.SKIPPED_STEPS: ([10], [10]), tags.SKIP_RATE: ([10], [1.0])},
        texts={tags.EVENTS: lines},
    )
    found = report.summarize(log).to_dict()["findings"]
    rules = [(f["severity"], f["rule"]) for f in found]
    assert rules[:3] == [
        ("warning", "overflow_at_floor"),
        ("warning", "skip_rate"),
        ("warning", "skip_rate"),
    ]
    assert "at step 1, 2, 3, 4, 5 and 5 more" in found[0]["message"]
    assert found[1]["message"].startswith("100% of steps were skipped (10 of 10)")
    assert found[2]["message"].startswith("100% of the most recent steps were skipped")


def test_underflow_without_histograms_says_zeros_are_included():
    log = hand_log(scalars={tags.UNDERFLOW_BY_VARIABLE + "d/kernel": ([10], [0.5])})
    (finding,) = report.summarize(log).to_dict()["findings"]
    assert finding["rule"] == "underflow"
    assert finding["message"].startswith("50% of gradient elements in d/kernel sit at zero or")
    assert "zeros included" in finding["message"]


def test_nonfinite_values_become_null_and_json_is_strict():
    log = hand_log(
        scalars={tags.OVERFLOW_HEADROOM_BITS: ([10, 20, 30], [math.inf, 2.0, math.nan])},
    )
    typed = report.summarize(log)
    summary = typed.to_dict()
    trend = summary["trends"]["overflow_headroom_bits"]
    assert trend["nonfinite_points"] == 2
    assert (trend["first"], trend["last"], trend["direction"]) == (2.0, 2.0, "steady")
    assert json.loads(report.to_json(typed)) == summary


@pytest.mark.parametrize(
    ("values", "direction"),
    [([1.0], "steady"), ([1.0, 1.01], "steady"), ([1.0, 2.0], "rising"), ([2, 1, 0], "falling")],
)
def test_direction(values, direction):
    assert _direction(np.asarray(values, np.float64)) == direction


@pytest.mark.parametrize(
    ("scale", "text"),
    [(32768.0, "32768 (2^15)"), (1.0, "1 (2^0)"), (0.5, "0.5 (2^-1)"), (3.0, "3"), (None, "n/a")],
)
def test_format_scale(scale, text):
    assert report.format_scale(scale) == text


def test_exponent_shares_cover_every_range():
    counts = exponent_histogram(zero=1, m41=1, m15=1, m14=1, e15=1, e16=1, e18=1)
    counts[-1] = 3  # inf/NaN
    assert dataclasses.asdict(report.exponent_shares(7, counts)) == {
        "step": 7,
        "elements": 10,
        "zero": 0.1,
        "below_normal": 0.2,  # below 2**-40, and 2**-15
        "in_range": 0.2,  # 2**-14 and 2**15
        "above_max": 0.2,  # 2**16 and 2**18 or more
        "nonfinite": 0.3,
    }


# ------------------------------------------------------------------- reading
def test_reads_the_train_dir_itself_and_legacy_scalars(tmp_path):
    train = str(tmp_path / "run" / tags.TRAIN_DIR)
    writer = tf.summary.create_file_writer(train)
    with writer.as_default():
        tf.summary.scalar(tags.LOSS_SCALE, 4.0, step=5)
        legacy = tf.compat.v1.Summary(
            value=[tf.compat.v1.Summary.Value(tag=tags.SKIPPED_STEPS, simple_value=2.0)]
        )
        tf.summary.experimental.write_raw_pb(legacy.SerializeToString(), step=6)
        tf.summary.scalar("epoch_loss", 1.0, step=7)  # not kmix: ignored
    writer.flush()
    log = report.read_log(train)
    assert log.path == train
    assert sorted(log.scalars) == [tags.LOSS_SCALE, tags.SKIPPED_STEPS]
    assert report.summarize(log).skipped_steps == 2


def test_reads_a_log_dir_that_is_still_being_written(tmp_path):
    logdir = str(tmp_path / "live")
    writer = tf.summary.create_file_writer(os.path.join(logdir, tags.TRAIN_DIR))
    write_run(logdir, upto=50, writer=writer)
    assert report.summarize(report.read_log(logdir)).steps_seen == 50

    # A half-written record at the end of the file is left for later.
    (event_file,) = glob.glob(os.path.join(logdir, tags.TRAIN_DIR, "events.out.tfevents.*"))
    with open(event_file, "ab") as file:
        file.write(b"\x10\x00\x00")
    summary = report.summarize(report.read_log(logdir))
    assert summary.steps_seen == 50
    assert summary.skipped_steps == 3


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text("x"), "is not a directory"),
        (lambda p: p.mkdir(), "is empty"),
        (lambda p: (p / tags.TRAIN_DIR).mkdir(parents=True), "no kmix data in"),
    ],
)
def test_bad_log_dirs_name_the_path_and_what_was_expected(tmp_path, make, says):
    path = tmp_path / "logs"
    make(path)
    with pytest.raises(report.ReportError) as caught:
        report.read_log(str(path))
    message = str(caught.value)
    assert says in message
    assert str(path) in message
    assert "kmix/ tags under " + os.path.join(str(path), tags.TRAIN_DIR) in message


def test_event_files_without_kmix_tags_are_no_kmix_data(tmp_path):
    logdir = str(tmp_path / "keras_only")
    writer = tf.summary.create_file_writer(os.path.join(logdir, tags.TRAIN_DIR))
    with writer.as_default():
        tf.summary.scalar("epoch_loss", 1.0, step=1)
    writer.flush()
    with pytest.raises(report.ReportError, match="no kmix data in"):
        report.read_log(logdir)


# --------------------------------------------------------------------- text
def test_format_summary_lists_every_event_and_finding(run_dir):
    summary = report.summarize(report.read_log(run_dir))
    text = report.format_summary(summary)
    assert "steps seen      100" in text
    assert (
        "loss scale      initial 65536 (2^16), final 8192 (2^13), min 8192 (2^13), max 65536 (2^16)"
    ) in text
    assert "skipped steps   4 of 100 (4.00%); latest window 0.00%" in text
    assert (
        "  backoff at step 1: loss scale 65536 → 32768; "
        "first non-finite gradient dense_2/kernel (3 variables)"
    ) in text
    assert "  growth at step 53: loss scale 8192 → 16384\n" in text
    event_lines = [line for line in text.splitlines() if re.match(r"  [a-z_]+ at step \d+: ", line)]
    assert len(event_lines) == len(EVENTS)
    assert event_lines[-1].endswith("; the loss itself was non-finite")
    assert "  overflow headroom (bits)   5 -> 0.5, 0.5..5, falling (10 points)" in text
    assert "policy          Global dtype policy `mixed_float16`." in text
    for finding in summary.findings:
        assert finding.message in text


# -------------------------------------------------------------------- plots
def assert_png(path: str) -> None:
    with open(path, "rb") as file:
        head = file.read(8)
    assert head == PNG_SIGNATURE
    assert os.path.getsize(path) > 1000


def test_writes_the_three_plots(run_dir, tmp_path):
    log = report.read_log(run_dir)
    out = str(tmp_path / "plots")
    written = report.write_plots(log, report.summarize(log), out)
    # No activation statistics in this run: no activations.png.
    assert written == [os.path.join(out, name) for name in report.PLOT_FILES[:3]]
    for path in written:
        assert_png(path)


def test_activation_plot_draws_the_tightest_layers(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path / tags.TRAIN_DIR))
    with writer.as_default():
        for step in (10, 20, 30):
            for layer, headroom in (("attn/logits", 4.0 - step / 10), ("ffn", 9.0)):
                tf.summary.scalar(tags.ACTIVATION_HEADROOM_BITS + layer, headroom, step=step)
    writer.flush()
    log = report.read_log(str(tmp_path))
    out = str(tmp_path / "plots")
    written = report.write_plots(log, report.summarize(log), out)
    assert written == [os.path.join(out, "activations.png")]
    assert_png(written[0])


def test_no_histograms_no_heatmap(tmp_path):
    log = hand_log(
        scalars={
            tags.LOSS_SCALE: ([10, 20], [4.0, 8.0]),
            tags.OVERFLOW_HEADROOM_BITS: ([10, 20], [3.0, 2.0]),
        },
        texts={tags.EVENTS: [event_line(15, "growth", 4.0, 8.0)]},
    )
    written = report.write_plots(log, report.summarize(log), str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["loss_scale.png", "health.png"]
    for path in written:
        assert_png(path)


def test_headroom_below_zero_says_gradients_overflow():
    log = hand_log(scalars={tags.OVERFLOW_HEADROOM_BITS: ([10], [-2.0])})
    (finding,) = report.summarize(log).to_dict()["findings"]
    assert finding["message"].startswith(
        "the largest scaled gradient exceeded float16's maximum (65504) by 2.00 bits"
    )


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        ("Global dtype policy `float32`; model `m` policy `mixed_float16`; ...", "float16"),
        ("Global dtype policy `x`; model `cnn` policy `mixed_bfloat16`; ...", "bfloat16"),
        ("model `m` policy `float32`.", "float32"),
        ("a policy text in another format", None),
    ],
)
def test_compute_dtype_from_the_policy_text(text, dtype):
    assert report.compute_dtype(text) == dtype


def test_float16_limits_do_not_apply_to_bfloat16():
    log = hand_log(
        scalars={
            tags.OVERFLOW_HEADROOM_BITS: ([10], [-8.0]),
            tags.UNDERFLOW_BY_VARIABLE + "d/kernel": ([10], [0.5]),
        },
        texts={tags.POLICY: [(0, "Global dtype policy `a`; model `m` policy `mixed_bfloat16`.")]},
    )
    summary = report.summarize(log).to_dict()
    assert summary["compute_dtype"] == "bfloat16"
    assert [(f["severity"], f["rule"]) for f in summary["findings"]] == [
        ("info", "healthy"),
        ("info", "not_float16"),
    ]


def test_unreadable_log_dir(tmp_path, monkeypatch):
    def denied(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(report_read.os, "listdir", denied)
    with pytest.raises(report.ReportError, match=r"cannot be read \(Permission denied\)"):
        report.read_log(str(tmp_path))
