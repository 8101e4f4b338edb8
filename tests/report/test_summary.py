"""kmix.report on what kmix writes beyond 0.1.0: records, run end, forward overflow,
the underflow split, activations, forecasts, the what-if, and absent statistics."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from test_report import event_line, exponent_histogram, hand_log, write_histogram, write_run

from kmix import report, tags
from kmix.tags import ForwardOrigin, PolicyRecord, RunEnd, ScaleEvent

RECORD = PolicyRecord(
    "mixed_float16", "m", "mixed_float16", "float16", "float32", "kmix", 1.0, 2.0**24, 10, 0
)


def text(tag, value, step=0):
    return {tag: [(step, value)]}


def rules(summary):
    return [(f.severity, f.rule) for f in summary.findings]


def test_a_run_that_did_not_complete_is_never_healthy():
    end = RunEnd(7, "stopped_by_guard", "the loss was non-finite for 3 steps")
    log = hand_log(
        scalars={tags.LOSS_SCALE: ([5], [8.0])}, texts=text(tags.RUN_END, tags.format_run_end(end))
    )
    summary = report.summarize(log)
    assert summary.run_end == end
    assert rules(summary) == [("warning", "run_end")]
    assert summary.findings[0].message == (
        "the run did not complete: stopped by LossScaleGuard at step 7: the loss was "
        "non-finite for 3 steps"
    )
    assert "no problems found" not in report.format_summary(summary)
    assert "run ended       stopped by LossScaleGuard at step 7" in report.format_summary(summary)
    done = hand_log(
        scalars={tags.LOSS_SCALE: ([5], [8.0])},
        texts=text(tags.RUN_END, tags.format_run_end(RunEnd(5, "completed", ""))),
    )
    assert rules(report.summarize(done)) == [("info", "healthy")]


def test_a_forward_overflow_before_a_layer_is_not_blamed_on_it():
    """A layer whose inputs were already non-finite did not make the overflow: an op before
    it did (``stem + res``), or the data."""
    origin = ForwardOrigin("ln", "LayerNormalization", False, None)
    event = ScaleEvent(0, 4, "forward_overflow", 8.0, 8.0, None, 0, False, origin)
    log = hand_log(texts={tags.EVENTS: [(4, tags.format_event(event))]})
    message = report.summarize(log).findings[0].message
    assert message.endswith(
        "it started in an op before `ln` (LayerNormalization), whose inputs were already "
        "non-finite (an op between layers that feed it, such as a sum, or the data) at step 4"
    )
    assert "compute it in float32" not in message


def test_forward_overflow_names_its_origin_everywhere():
    origin = ForwardOrigin("block_3/ffn_out", "Dense", True, 812.0)
    event = ScaleEvent(0, 4, "forward_overflow", 8.0, 8.0, None, 0, False, origin)
    log = hand_log(
        scalars={tags.SKIPPED_STEPS: ([2], [0])},
        texts={tags.EVENTS: [(4, tags.format_event(event))]},
    )
    summary = report.summarize(log)
    assert summary.events == (event,)
    assert summary.skipped_steps == 1
    message = summary.findings[0].message
    assert summary.findings[0].rule == "nonfinite_loss"
    assert message.startswith("the loss itself was non-finite at step 4:")
    assert "it started in `block_3/ffn_out` (Dense; finite inputs, max |input| 812) at step 4" in (
        message
    )
    assert "1 skipped step(s) in a row kept the scale at 8 (2^3)" in summary.findings[-1].message
    assert "forward overflow starts in block_3/ffn_out (Dense): inputs finite" in (
        report.format_summary(summary)
    )
    assert summary.to_dict()["events"][0]["origin"] == {
        "layer": "block_3/ffn_out",
        "layer_class": "Dense",
        "inputs_finite": True,
        "max_abs_input": 812.0,
    }


def test_events_written_twice_by_a_resumed_run_are_listed_once():
    lines = [event_line(3, "backoff", 8.0, 4.0, "w"), event_line(5, "growth", 4.0, 8.0)]
    log = hand_log(texts={tags.EVENTS: lines + lines + [event_line(9, "backoff", 8.0, 4.0, "w")]})
    summary = report.summarize(log)
    assert [(e.step, e.kind) for e in summary.events] == [
        (3, "backoff"),
        (5, "growth"),
        (9, "backoff"),
    ]
    assert summary.skipped_steps == 2


def test_events_lost_are_counted_notes():
    lost = tags.format_events_lost(tags.EventsLost(1, 10, 20, 4))
    log = hand_log(texts={tags.EVENTS: [(12, lost), event_line(15, "backoff", 8.0, 4.0, "w")]})
    summary = report.summarize(log)
    assert summary.events_lost == 1 and len(summary.events) == 1
    assert [(n.step, n.text) for n in summary.notes] == [(12, lost)]
    text_ = report.format_summary(summary)
    assert "events lost     1 (see the notes)" in text_
    assert "(1 variable)" in text_ and "(1 variables)" not in text_


def test_policy_record_gives_the_dtype_and_the_histogram_hint():
    prose = "Global dtype policy `a`; model `m` policy `mixed_float16`."
    bf16 = PolicyRecord(
        "mixed_bfloat16", "m", "mixed_bfloat16", "bfloat16", "float32", "none", None, None, 10, 0
    )
    log = hand_log(
        texts=text(tags.POLICY, prose) | text(tags.POLICY_RECORD, tags.format_policy_record(bf16))
    )
    assert report.summarize(log).compute_dtype == "bfloat16"  # the record, not the prose
    stock = PolicyRecord(
        "mixed_float16", "m", "mixed_float16", "float16", "float32", "keras", None, None, 10, 5
    )
    log = hand_log(
        scalars={tags.LOSS_SCALE: ([10], [8.0])},
        texts=text(tags.POLICY_RECORD, tags.format_policy_record(stock)),
    )
    printed = report.format_summary(report.summarize(log))
    assert "set histogram_freq" not in printed
    assert "histograms need kmix.LossScaleOptimizer" in printed
    assert "policy          model `m` policy `mixed_float16`; loss scaling: keras" in printed


def split_log(zero, subnormal, variable=True):
    scalars = {
        tags.UNDERFLOW_FRACTION: ([10], [zero + subnormal]),
        tags.ZERO_FRACTION: ([10], [zero]),
        tags.SUBNORMAL_FRACTION: ([10], [subnormal]),
    }
    if variable:
        scalars[tags.UNDERFLOW_BY_VARIABLE + "d/kernel"] = ([10], [zero + subnormal])
        scalars[tags.SUBNORMAL_BY_VARIABLE + "d/kernel"] = ([10], [subnormal])
    return hand_log(scalars=scalars)


@pytest.mark.parametrize("variable", [True, False])
def test_exact_zeros_are_information_never_an_underflow_warning(variable):
    summary = report.summarize(split_log(0.5, 0.125, variable))
    assert rules(summary) == [("info", "healthy"), ("info", "zero_gradients")]
    assert "50% of gradient elements in " in summary.findings[1].message
    assert "only 12% are tiny non-zero values" in summary.findings[1].message


@pytest.mark.parametrize("variable", [True, False])
def test_subnormals_warn(variable):
    summary = report.summarize(split_log(0.0, 0.375, variable))
    assert rules(summary) == [("warning", "underflow")]
    assert summary.findings[0].message.startswith("38% of ")
    assert "zeros included" not in summary.findings[0].message
    printed = report.format_summary(summary)
    assert "    of which subnormal       37.50% -> 37.50%" in printed


def test_activation_headroom_and_forecasts():
    steps = np.arange(10, 110, 10)
    falling = 7.0 - 0.05 * steps  # 6.5 at step 10 ... 2.0 at 100: reaches 0 at step 140
    log = hand_log(
        scalars={
            tags.ACTIVATION_HEADROOM_BITS + "ffn": (steps, falling),
            # Falls as fast but reaches 0 at step 200: further ahead (100 steps) than the
            # fitted readings span (50..100), so not told.
            tags.ACTIVATION_HEADROOM_BITS + "mlp": (steps, falling + 3.0),
            tags.ACTIVATION_HEADROOM_BITS + "attn": (steps, np.full(10, 0.5)),
            tags.OVERFLOW_HEADROOM_BITS: (steps, np.full(10, 6.0)),
        },
        texts=text(tags.POLICY_RECORD, tags.format_policy_record(RECORD)),
    )
    summary = report.summarize(log)
    assert list(summary.activation_headroom) == ["attn", "ffn", "mlp"]  # tightest first
    assert summary.activation_headroom["ffn"].last == 2.0
    (forecast,) = summary.forecasts
    assert (forecast.series, forecast.zero_step, forecast.last_step) == (
        "activations of ffn",
        140,
        100,
    )
    assert forecast.bits_per_step == pytest.approx(-0.05, rel=1e-12)
    assert rules(summary) == [("warning", "activation_headroom"), ("info", "forecast")]
    assert summary.findings[0].message.startswith(
        "the outputs of layer attn came within 0.50 bits of float16's maximum (65504) at step 100"
    )
    assert "at about step 140" in summary.findings[1].message


def test_forecast_against_numpy():
    rng = np.random.default_rng(1)
    steps = np.arange(1, 41) * 25
    values = 12.0 - 0.01 * steps + rng.normal(0, 0.05, steps.size)
    zero, slope, points = report.forecast_zero_crossing(steps, values)
    assert points == 20  # the latest half
    fit_slope, fit_intercept = np.polyfit(steps[-20:], values[-20:], 1)
    np.testing.assert_allclose(slope, fit_slope, rtol=1e-9)
    np.testing.assert_allclose(zero, -fit_intercept / fit_slope, rtol=1e-9)
    assert report.forecast_zero_crossing(steps[:5], values[:5]) is None  # too few points
    # Reaches 0 at step 2000: 1000 steps after the last, beyond the 475 the fit spans.
    assert report.forecast_zero_crossing(steps, values + 8.0) is None
    assert report.forecast_zero_crossing(steps, values[::-1]) is None  # rising
    assert report.forecast_zero_crossing(steps, rng.normal(5, 1, steps.size)) is None  # noise
    assert report.forecast_zero_crossing([1, 2, 3, 4], [3.0, 2.0, 1.0, 0.0]) is None  # at 0


def test_absent_statistics_are_absent_with_the_note():
    note = "No loss-scale optimizer, so there is no gradient health to log."
    log = hand_log(scalars={tags.LOSS_SCALE: ([10], [1.0])}, texts=text(tags.NOTES, note, 1))
    summary = report.summarize(log)
    assert all(trend is None for trend in summary.trends.values())
    assert summary.to_dict()["trends"] == dict.fromkeys(summary.trends)
    printed = report.format_summary(summary)
    assert "overflow headroom (bits)   not logged" in printed
    assert f"  not logged because: {note}" in printed
    assert "40" not in printed.split("findings")[0].split("gradient health")[1]


def test_build_log_converts_like_the_reader():
    edges = np.asarray(tags.exponent_bucket_edges())
    counts = exponent_histogram(zero=3, e0=1)
    log = report.build_log(
        "run-a",
        {tags.LOSS_SCALE: [(2, 4.0), (1, 8.0), (2, 2.0)], "epoch_loss": [(1, 1.0)]},
        {
            tags.SKIPPED_STEPS: ("scalars", [(2, np.float32(1.0))]),
            tags.EVENTS: ("text", [(3, np.array([b"a", b"b"]))]),
            tags.GRAD_EXPONENT + "w": ("histograms", [(4, np.column_stack([edges, counts]))]),
            "other/x": ("scalars", [(1, np.float32(1.0))]),
        },
    )
    assert log.path == "run-a"
    assert log.scalars[tags.LOSS_SCALE].steps.tolist() == [1, 2]
    assert log.scalars[tags.LOSS_SCALE].values.tolist() == [8.0, 2.0]  # last write per step
    assert sorted(log.scalars) == [tags.LOSS_SCALE, tags.SKIPPED_STEPS]
    assert log.texts == {tags.EVENTS: [(3, "a\nb")]}
    assert log.histograms["w"][0][0] == 4
    np.testing.assert_array_equal(log.histograms["w"][0][1], counts)


def test_new_tags_read_back_through_tensorboard(tmp_path):
    logdir = str(tmp_path / "run")
    write_run(logdir)
    writer = tf.summary.create_file_writer(os.path.join(logdir, tags.TRAIN_DIR))
    with writer.as_default():
        tf.summary.text(tags.POLICY_RECORD, tags.format_policy_record(RECORD), step=0)
        tf.summary.scalar(tags.SUBNORMAL_FRACTION, 0.0625, step=100)
        tf.summary.scalar(tags.ZERO_FRACTION, 0.0625, step=100)
        tf.summary.scalar(tags.ACTIVATION_HEADROOM_BITS + "dense", 3.0, step=100)
        write_histogram(tags.GRAD_EXPONENT + "late", exponent_histogram(m20=4), 120)
        tf.summary.text(tags.RUN_END, tags.format_run_end(RunEnd(120, "completed", "")), step=120)
    writer.flush()
    summary = report.summarize(report.read_log(logdir))
    assert summary.policy_record == RECORD
    assert summary.run_end == RunEnd(120, "completed", "")
    assert summary.underflow_split["subnormal_fraction"].last == 0.0625
    assert summary.activation_headroom["dense"].last == 3.0
    data = json.loads(report.to_json(summary))
    gradients = data["precision_whatif"]["gradients"]
    assert gradients["step"] == 120 and list(gradients["by_variable"]) == ["late"]
    assert gradients["overall"]["float16"] == {"underflow": 0.0, "subnormal": 1.0, "overflow": 0.0}
    assert set(gradients["overall"]) == {"float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"}
    assert "precision what-if (gradients at step 120" in report.format_summary(summary)


def test_summary_keeps_the_mapping_access_of_0_1_0():
    summary = report.summarize(report.build_log("run", {tags.LOSS_SCALE: [(1, 8.0), (2, 8.0)]}, {}))
    assert summary["steps_seen"] == summary.steps_seen == 2
    assert summary["loss_scale"] == summary.to_dict()["loss_scale"]


# ------------------------------------------------ the scale when events were lost
def test_the_scale_at_train_begin_survives_a_ring_that_lost_the_first_events(tmp_path):
    """The monitor writes the scale at train begin; the report starts from it (issue 21.9).

    Twelve overflows from step 1 with an event ring of 2 and one read at the end: the
    ten oldest events are lost, and the two kept both say 1 -> 1.
    """
    from fake_optimizer import FakeModel, FakeRecorder, fake_fit, scripted

    from kmix.callbacks import MixedPrecisionMonitor

    model = FakeModel(FakeRecorder(initial_scale=1024, min_scale=1, event_capacity=2))
    monitor = MixedPrecisionMonitor(tmp_path, update_freq=1000, verbose=0)
    fake_fit(model, [monitor], scripted(16, skip=range(1, 13)))

    summary = report.summarize(report.read_log(str(tmp_path)))
    assert summary.events_lost == 10
    assert summary.policy_record.loss_scale == 1024.0
    assert summary.loss_scale == report.LossScale(1024.0, 1.0, 1.0, 1024.0)
    printed = report.format_summary(summary)
    assert "loss scale      initial 1024 (2^10), final 1 (2^0), min 1 (2^0), max 1024" in printed
    assert "(min and max of the scales the log holds: 10 scale events lost)" in printed


def test_a_log_that_lost_its_beginning_says_the_scale_is_unknown():
    """No scale at begin (logs before the record held it), events lost from step 0."""
    lost = tags.format_events_lost(tags.EventsLost(10, 0, 16, 2))
    lines = [(11, lost), event_line(11, "overflow_at_floor", 1.0, 1.0, "w")]
    lines.append(event_line(12, "overflow_at_floor", 1.0, 1.0, "w"))
    log = hand_log(
        scalars={tags.LOSS_SCALE: ([11, 12, 16], [1.0, 1.0, 1.0])}, texts={tags.EVENTS: lines}
    )
    summary = report.summarize(log)
    assert summary.loss_scale == report.LossScale(None, 1.0, None, None)
    printed = report.format_summary(summary)
    assert "initial n/a, final 1 (2^0), min n/a, max n/a (initial, min and max unknown: " in printed
    assert "10 scale events lost before the first scale the log holds)" in printed
    # The same log with the scale written at begin knows them.
    begin = dataclasses.replace(RECORD, loss_scale=1024.0)
    log.texts[tags.POLICY_RECORD] = [(0, tags.format_policy_record(begin))]
    assert report.summarize(log).loss_scale == report.LossScale(1024.0, 1.0, 1.0, 1024.0)


# ------------------------------------------- float16 statistics of float16 layers
def test_variables_of_float32_layers_are_left_out_of_float16_statistics():
    """A float32 head's gradients pass 65504 in float32: no float16 statistic of them."""
    dtypes = {"dense/kernel": "float16", "head/kernel": "float32", "head/bias": "float32"}
    record = dataclasses.replace(RECORD, variable_dtypes=dtypes)
    histograms = {
        "dense/kernel": [(25, exponent_histogram(m20=30, e0=70))],
        "head/bias": [(25, exponent_histogram(e17=10))],
    }
    log = hand_log(
        scalars={
            tags.UNDERFLOW_BY_VARIABLE + "dense/kernel": ([25], [0.3]),
            tags.SUBNORMAL_BY_VARIABLE + "dense/kernel": ([25], [0.3]),
            tags.UNDERFLOW_BY_VARIABLE + "head/bias": ([25], [0.9]),
            tags.SUBNORMAL_BY_VARIABLE + "head/bias": ([25], [0.9]),
        },
        histograms=histograms,
        texts=text(tags.POLICY_RECORD, tags.format_policy_record(record)),
    )
    summary = report.summarize(log)
    assert list(summary.gradient_exponents) == ["dense/kernel"]
    assert (
        list(summary.underflow_by_variable)
        == list(summary.subnormal_by_variable)
        == ["dense/kernel"]
    )
    assert summary.variables_not_float16 == {"head/bias": "float32"}  # head/kernel: no data
    assert set(summary.precision_whatif["gradients"].by_variable) == set(histograms)
    underflow = [f for f in summary.findings if f.rule == "underflow"]
    assert len(underflow) == 1 and "dense/kernel" in underflow[0].message
    (other,) = [f for f in summary.findings if f.rule == "not_float16_variables"]
    assert other.severity == "info" and "head/bias" in other.message and "float32" in other.message
    printed = report.format_summary(summary)
    assert "not float16 (left out of the float16 statistics by variable): head/bias (float32)" in (
        printed
    )
    assert "head/bias  step 25" not in printed


def test_the_gradients_headroom_is_never_forecast():
    """Under dynamic loss scaling the gradients' headroom falls toward 0 on every run (the
    scale grows until it nears float16's max, then backs off): no forecast, no warning."""
    from kmix.callbacks._forecast import HeadroomForecast, headroom_series

    steps = np.arange(10, 110, 10)
    falling = 7.0 - 0.05 * steps  # would reach 0 at step 140
    log = hand_log(scalars={tags.OVERFLOW_HEADROOM_BITS: (steps, falling)})
    assert report.summarize(log).forecasts == ()
    assert headroom_series({"headroom_bits": 2.0}, {}) == {}
    forecast = HeadroomForecast()
    told = [
        forecast.add(int(s), headroom_series({"headroom_bits": b}, {}))
        for s, b in zip(steps, falling, strict=True)
    ]
    assert told == [[]] * len(steps)


def test_a_run_across_processes_says_how_many_and_whose_log_it_is():
    def lines(record):
        texts = text(tags.POLICY_RECORD, tags.format_policy_record(record))
        summary = report.summarize(hand_log(scalars={tags.LOSS_SCALE: ([5], [8.0])}, texts=texts))
        return [x for x in report.format_summary(summary).splitlines() if "process" in x]

    assert lines(dataclasses.replace(RECORD, processes=2, devices=4)) == [
        "processes       2 processes, 4 devices in all (keras.distribution); this log is "
        "process 0's, counters and events are global"
    ]
    assert lines(dataclasses.replace(RECORD, processes=1, devices=2)) == [
        "processes       1 process, 2 devices in all (keras.distribution); this log is "
        "process 0's, counters and events are global"
    ]
    assert lines(dataclasses.replace(RECORD, processes=1, devices=1)) == []
    assert lines(RECORD) == []  # TensorFlow, and logs written before the fields
