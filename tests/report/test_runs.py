"""Several kmix runs in one log dir (a script run twice): told apart, the latest reported.

The logs are written here with ``tf.summary`` and the formats of ``kmix.tags``, one
event-file writer per ``fit`` as the monitor opens them, so the reader is checked
against the contract rather than against the monitor's code.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.plugins.histogram import metadata as histogram_metadata

from kmix import report, tags
from kmix.report import runs as report_runs
from kmix.tags import PolicyRecord, RunEnd, ScaleEvent


def write_small_run(
    logdir: str,
    run_id: str | None,
    *,
    scale: float,
    skips: tuple[int, ...] = (),
    steps: int = 6,
    begin: int = 0,
    skipped: int = 0,
    end: bool = True,
    histogram: str | None = None,
) -> None:
    """One ``fit`` as the monitor writes it: policy record first, a read every step.

    Args:
        logdir: the log dir (written under ``train``).
        run_id: the id written in every record (None: a log from before run ids).
        scale: the loss scale at train begin; each skip halves it.
        skips: the steps skipped (gradient overflows, each a backoff event).
        steps: the last step.
        begin: the attempted step at train begin (> 0: a resumed fit).
        skipped: the optimizer's skipped-step counter at train begin.
        end: write the run-end record.
        histogram: a variable to write one exponent histogram of, at the last step.
    """
    writer = tf.summary.create_file_writer(os.path.join(logdir, tags.TRAIN_DIR))
    with writer.as_default():
        record = PolicyRecord(
            "mixed_float16", "m", "mixed_float16", "float16", "float32", "kmix", 1.0, 2.0**24,
            1, 0, loss_scale=scale, run_id=run_id,
        )  # fmt: skip
        tf.summary.text(tags.POLICY_RECORD, tags.format_policy_record(record), step=begin)
        for step in range(begin + 1, steps + 1):
            if step in skips:
                event = ScaleEvent(skipped + 1, step, "backoff", scale, scale / 2, "w", 1, True)
                scale, skipped = scale / 2, skipped + 1
                tf.summary.text(tags.EVENTS, tags.format_event(event), step=step)
                record_text = tags.format_event_record(event, run_id)
                tf.summary.text(tags.EVENT_RECORD, record_text, step=step)
            tf.summary.scalar(tags.LOSS_SCALE, scale, step=step)
            tf.summary.scalar(tags.SKIPPED_STEPS, skipped, step=step)
        if histogram is not None:
            counts = np.zeros(tags.NUM_EXPONENT_BINS)
            counts[tags.exponent_bin(-3)] = 10
            tf.summary.write(
                tags.GRAD_EXPONENT + histogram,
                np.column_stack([np.asarray(tags.exponent_bucket_edges()), counts]),
                step=steps,
                metadata=histogram_metadata.create_summary_metadata(histogram, ""),
            )
        if end:
            text = tags.format_run_end(RunEnd(steps, tags.COMPLETED, "fit returned", run_id))
            tf.summary.text(tags.RUN_END, text, step=steps)
    writer.close()


def write_twice(logdir: str) -> None:
    """The issue's script run twice: scale 4 with a skip at 2, then 1024 with one at 4."""
    write_small_run(logdir, "20250101-100000-aaaaaa", scale=4.0, skips=(2,), histogram="a/kernel")
    write_small_run(
        logdir, "20250101-110000-bbbbbb", scale=1024.0, skips=(4,), histogram="b/kernel"
    )


# ------------------------------------------------------------------- reports
def test_a_log_dir_written_twice_reports_the_latest_run_alone(tmp_path):
    """Was: 'skipped steps 2 of 6', the scale 4..1024 with no event between, both events."""
    write_twice(str(tmp_path))
    log = report.read_log(str(tmp_path))
    summary = report.summarize(log)

    assert (summary.steps_seen, summary.skipped_steps) == (6, 1)
    assert [(e.step, e.old_scale, e.new_scale) for e in summary.events] == [(4, 1024.0, 512.0)]
    scale = summary.loss_scale
    assert (scale.initial, scale.final, scale.min, scale.max) == (1024.0, 512.0, 512.0, 1024.0)
    assert list(summary.gradient_exponents) == ["b/kernel"]
    assert summary.run.index == 2 and summary.run.run_id == "20250101-110000-bbbbbb"
    assert [(r.index, r.first_step, r.last_step, r.train_begins) for r in summary.runs] == [
        (1, 0, 6, 1),
        (2, 0, 6, 1),
    ]
    assert [r.end.reason for r in summary.runs] == ["completed", "completed"]

    (note,) = [f for f in summary.findings if f.rule == "runs"]
    assert note.severity == "warning"
    assert note.message.startswith(
        "this log dir holds 2 kmix runs (a script run twice into one log_dir?): this report "
        "is of the latest (run 2 of 2: id 20250101-110000-bbbbbb, began "
    )
    assert "and its counts are of that run alone" in note.message
    assert "run 1: id 20250101-100000-aaaaaa, began " in note.message
    assert "steps 0..6, completed at step 6" in note.message
    assert "`kmix report LOGDIR --run N`" in note.message and "runs/<name>-<date>" in note.message

    text = report.format_summary(summary)
    train = os.path.join(str(tmp_path), tags.TRAIN_DIR)
    assert text.splitlines()[1] == (
        f"run             2 of 2 in this log dir (the latest); see run 1 with: "
        f"kmix report {train} --run 1"
    )
    assert "skipped steps   1 of 6 (16.67%)" in text
    data = summary.to_dict()
    assert data["run"]["index"] == 2 and [r["run_id"] for r in data["runs"]] == [
        "20250101-100000-aaaaaa",
        "20250101-110000-bbbbbb",
    ]


@pytest.mark.parametrize("which", [1, "1", "20250101-100000-aaaaaa"])
def test_an_earlier_run_is_reported_by_its_number_or_id(tmp_path, which):
    write_twice(str(tmp_path))
    summary = report.summarize(report.read_log(str(tmp_path), run=which))
    assert summary.run.index == 1 and (summary.steps_seen, summary.skipped_steps) == (6, 1)
    assert [(e.step, e.old_scale) for e in summary.events] == [(2, 4.0)]
    assert (summary.loss_scale.initial, summary.loss_scale.max) == (4.0, 4.0)
    assert list(summary.gradient_exponents) == ["a/kernel"]
    assert "this report is of run 1 (run 1 of 2" in summary.findings[0].message


def test_a_run_the_log_dir_does_not_hold_is_an_error_listing_those_it_holds(tmp_path):
    write_twice(str(tmp_path))
    with pytest.raises(report.ReportError) as error:
        report.read_log(str(tmp_path), run=3)
    assert str(error.value) == (
        f"no run 3 in {tmp_path}: it holds 2 kmix runs (1: id 20250101-100000-aaaaaa; "
        "2: id 20250101-110000-bbbbbb); pass a number from 1 to 2 or one of those ids"
    )


def test_a_resumed_run_is_one_run(tmp_path):
    """BackupAndRestore, or a second fit: the same id again, from a later step."""
    logdir = str(tmp_path)
    write_small_run(logdir, "20250101-100000-aaaaaa", scale=1024.0, skips=(2,), steps=4)
    write_small_run(
        logdir, "20250101-100000-aaaaaa", scale=512.0, skips=(6,), steps=8, begin=4, skipped=1
    )
    summary = report.summarize(report.read_log(logdir))
    (run,) = summary.runs
    assert (run.first_step, run.last_step, run.train_begins) == (0, 8, 2)
    assert [e.step for e in summary.events] == [2, 6]
    assert (summary.steps_seen, summary.skipped_steps) == (8, 2)
    assert not [f for f in summary.findings if f.rule == "runs"]
    assert "\nrun             " not in report.format_summary(summary)


def test_logs_without_run_ids_read_as_one_run_as_before(tmp_path):
    """Logs of kmix 0.1.0 and earlier versions: every point is one run, as it was read."""
    logdir = str(tmp_path)
    write_small_run(logdir, None, scale=4.0, skips=(2,))
    write_small_run(logdir, None, scale=1024.0, skips=(4,))
    (log,) = report.read_runs(logdir)
    summary = report.summarize(log)
    assert [(e.step, e.old_scale) for e in summary.events] == [(2, 4.0), (4, 1024.0)]
    (run,) = summary.runs
    assert (run.run_id, run.train_begins, run.first_step, run.last_step) == (None, 2, 0, 6)
    assert not [f for f in summary.findings if f.rule == "runs"]


def test_a_run_with_an_id_after_one_without_is_a_second_run(tmp_path):
    logdir = str(tmp_path)
    write_small_run(logdir, None, scale=4.0, skips=(2,))
    write_small_run(logdir, "20250101-110000-bbbbbb", scale=1024.0, skips=(4,))
    logs = report.read_runs(logdir)
    assert [log.run.run_id for log in logs] == [None, "20250101-110000-bbbbbb"]
    assert [e.step for e in report.summarize(logs[-1]).events] == [4]
    assert "run 1: no run id, began " in report.summarize(logs[-1]).findings[0].message


def test_runs_written_at_the_same_time_are_said_to_be_mixed(tmp_path):
    """Two writers at once: the wall times interleave, and the records show it."""
    train = os.path.join(str(tmp_path), tags.TRAIN_DIR)
    first, second = (tf.summary.create_file_writer(train) for _ in range(2))
    for writer, run_id in ((first, "a"), (second, "b")):
        with writer.as_default():
            record = PolicyRecord(
                "p", "m", "p", "float16", "float32", "kmix", 1.0, 8.0, 1, 0, run_id=run_id
            )
            tf.summary.text(tags.POLICY_RECORD, tags.format_policy_record(record), step=0)
            writer.flush()
    with first.as_default():  # run a goes on after run b began
        text = tags.format_run_end(RunEnd(3, tags.COMPLETED, "", "a"))
        tf.summary.text(tags.RUN_END, text, step=3)
    for writer in (first, second):
        writer.close()
    summary = report.summarize(report.read_log(str(tmp_path)))
    assert [r.overlaps for r in summary.runs] == [True, True]
    assert "runs written into one directory at the same time cannot be told apart" in (
        summary.findings[0].message
    )


# --------------------------------------------------------------- split rule
def test_split_runs_gives_each_point_to_the_latest_train_begin_before_it():
    def begin(run_id: str, step: int, wall: float):
        record = PolicyRecord("p", "m", "p", "float16", "float32", "kmix", 1.0, 8.0, 1, 0)
        text = tags.format_policy_record(record.__class__(**{**vars(record), "run_id": run_id}))
        return (step, np.array(text.encode()), wall)

    scalars = {
        tags.LOSS_SCALE: [(1, 8.0, 0.5), (1, 4.0, 2.5), (2, 2.0, 4.5), (5, 1.0, 6.5)],
        "other/tag": [(1, 1.0, 2.5)],  # not kmix's: left out
    }
    tensors = {tags.POLICY_RECORD: ("text", [begin("a", 0, 1.0), begin("b", 0, 2.0)])}
    tensors[tags.POLICY_RECORD][1].append(begin("a", 4, 6.0))  # a resumed after b
    split = report_runs.split_runs(scalars, tensors)
    assert [(info.index, info.run_id, info.train_begins) for info, _, _ in split] == [
        (1, "a", 2),
        (2, "b", 1),
    ]
    (a_info, a_scalars, _), (b_info, b_scalars, _) = split
    assert a_scalars == {tags.LOSS_SCALE: [(1, 8.0), (5, 1.0)]}  # before the first begin: a's
    assert b_scalars == {tags.LOSS_SCALE: [(1, 4.0), (2, 2.0)]}
    assert (a_info.began, a_info.first_step, a_info.last_step) == (1.0, 0, 5)
    assert (b_info.began, b_info.first_step, b_info.last_step, b_info.end) == (2.0, 0, 2, None)
    assert report_runs.split_runs({"other/tag": [(1, 1.0, 0.0)]}, {}) == []


def test_run_words():
    info = report_runs.RunInfo(2, None, None, 4, 9, 3, None)
    assert report_runs.run_words(info) == (
        "no run id, steps 4..9, resumed 2x, end not recorded (still running, or its process "
        "was killed)"
    )
    ended = report_runs.RunInfo(1, "x", None, 0, 9, 1, RunEnd(9, tags.STOPPED_BY_GUARD, "m"))
    assert report_runs.run_words(ended) == "id x, steps 0..9, stopped by LossScaleGuard at step 9"


def test_a_run_stopped_by_kmix_compare_says_so_and_why_wherever_it_is_listed(tmp_path):
    """kmix compare stops a policy too slow to finish: its run end says so, with the reason
    (the listing, the run-end line and the findings), instead of "completed"."""
    message = "too slow (×0.019 of float32's speed): 12 steps took 31.0 s in fit"
    end = RunEnd(12, tags.STOPPED_BY_COMPARE, message, "x")
    assert tags.parse_run_end(tags.format_run_end(end)) == end
    assert tags.STOPPED_BY_COMPARE in tags.RUN_END_REASONS
    info = report_runs.RunInfo(1, "x", None, 0, 12, 1, end)
    assert report_runs.run_words(info) == (
        f"id x, steps 0..12, stopped by kmix compare at step 12: {message}"
    )
    logdir = str(tmp_path / "mixed_float16")
    write_small_run(logdir, "x", scale=8.0, steps=12, end=False)
    writer = tf.summary.create_file_writer(os.path.join(logdir, tags.TRAIN_DIR))
    with writer.as_default():
        tf.summary.text(tags.RUN_END, tags.format_run_end(end), step=12)
    writer.close()
    summary = report.summarize(report.read_log(logdir))
    assert [(f.severity, f.rule, f.message) for f in report.findings(summary)] == [
        ("warning", "run_end", f"the run did not complete: stopped by kmix compare at step 12: "
         f"{message}")
    ]  # fmt: skip
    assert f"run ended       stopped by kmix compare at step 12: {message}" in (
        report.format_summary(summary)
    )
