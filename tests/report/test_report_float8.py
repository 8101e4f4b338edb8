"""kmix report's Float8 section: exact text and JSON on hand-written logs, and on a real
short fit whose float8 output gradients do not follow the loss scale (tests/float8)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_report import event_line, hand_log

from kmix import report, tags
from kmix.tags import Float8Saturation

LAYERS = ("mlp/dense", "mlp/dense_1")


def float8_log(stale_bits=0.0, episodes=(), events=(), counts=True, steps=(10, 20)):
    """Two float8 layers read at ``steps``; ``mlp/dense``'s inputs ``stale_bits`` stale."""
    scalars = {tags.LOSS_SCALE: (list(steps), [256.0] * len(steps))}
    for layer in LAYERS:
        for tensor in ("inputs", "kernel", "outputs_grad"):
            stale = stale_bits if (layer, tensor) == (LAYERS[0], "inputs") else 0.0
            scalars[tags.float8_tag(tags.FP8_SCALE, layer, tensor)] = (steps, [0.5, 0.25])
            scalars[tags.float8_tag(tags.FP8_HEADROOM_BITS, layer, tensor)] = (
                steps,
                [0.5, 0.25 + stale],
            )
            scalars[tags.float8_tag(tags.FP8_STALENESS_BITS, layer, tensor)] = (steps, [0, stale])
            if counts:
                scalars[tags.float8_tag(tags.FP8_SATURATED_STEPS, layer, tensor)] = (steps, [1, 2])
        scalars[tags.float8_tag(tags.FP8_UNDERFLOW_FRACTION, layer, "kernel")] = (
            steps,
            [0.0, 0.375],
        )
    records = [(e.step, tags.format_saturation_record(e, "run")) for e in episodes]
    return hand_log(scalars=scalars, texts={tags.FP8_RECORD: records, tags.EVENTS: list(events)})


def section(summary) -> list[str]:
    lines = report.format_summary(summary).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("float8 "))
    return lines[start : lines.index("findings")]


def test_a_run_without_float8_layers_has_no_section():
    summary = report.summarize(hand_log(scalars={tags.LOSS_SCALE: ([10], [8.0])}))
    assert summary.float8 is None
    assert summary.to_dict()["float8"] is None
    assert not any(line.startswith("float8") for line in report.format_summary(summary).split("\n"))
    assert [f.rule for f in summary.findings] == ["healthy"]


def test_the_section_lists_episodes_and_each_tensor_as_last_read():
    episodes = [
        Float8Saturation(11, LAYERS[1], "outputs_grad", 2.0, 1.0, 3),
        Float8Saturation(4, LAYERS[0], "kernel", 0.75, 0.5),
    ]
    summary = report.summarize(float8_log(episodes=episodes))
    assert section(summary) == [
        "float8          2 layers, 6 tensors; 2 saturation episodes, 12 saturated tensor-steps",
        "  saturation episodes (first step, length, layer and tensor, amax vs limit)",
        "    step 4      1 step    `mlp/dense` kernel: amax 0.75 > limit 0.5 (0.58 bits over)",
        "    step 11     3 steps   `mlp/dense_1` outputs_grad: amax 2 > limit 1 (1.00 bits over)",
        "  latest read (headroom, its min over reads and staleness in bits; saturated steps "
        "so far; kernel values flushed to zero)",
        "    layer tensor              step  scale  headroom   min  stale  saturated  flushed",
        "    mlp/dense inputs            20   0.25      0.25  0.25   0.00          2",
        "    mlp/dense kernel            20   0.25      0.25  0.25   0.00          2      38%",
        "    mlp/dense outputs_grad      20   0.25      0.25  0.25   0.00          2",
        "    mlp/dense_1 inputs          20   0.25      0.25  0.25   0.00          2",
        "    mlp/dense_1 kernel          20   0.25      0.25  0.25   0.00          2      38%",
        "    mlp/dense_1 outputs_grad    20   0.25      0.25  0.25   0.00          2",
    ]
    data = json.loads(report.to_json(summary))["float8"]
    assert data["layers"] == list(LAYERS)
    assert [(e["step"], e["steps"]) for e in data["episodes"]] == [(4, 1), (11, 3)]
    assert data["tensors"][1] == {
        "layer": "mlp/dense",
        "tensor": "kernel",
        "step": 20,
        "scale": 0.25,
        "headroom_bits": 0.25,
        "min_headroom_bits": 0.25,
        "staleness_bits": 0.0,
        "saturated_steps": 2,
        "underflow_fraction": 0.375,
        "episodes": 1,
    }
    assert [f.message for f in summary.findings if f.rule.startswith("float8")] == [
        "float8: 12 saturated tensor-steps in 2 episodes (a tensor clipped at a step: its amax "
        "beyond its delayed scale x the format's max)"
    ]


def test_a_growth_that_saturated_output_gradients_is_said_in_plain_words():
    episodes = [Float8Saturation(16, layer, "outputs_grad", 2.0, 1.0) for layer in LAYERS]
    growth = event_line(15, "growth", 256.0, 512.0)
    summary = report.summarize(float8_log(episodes=episodes, events=[growth]))
    assert summary.float8.growth_saturations == (report.values.GrowthSaturation(15, LAYERS),)
    (finding,) = [f for f in summary.findings if f.rule == "float8_growth"]
    assert (finding.severity, finding.message) == (
        "warning",
        "the loss-scale growth at step 15 saturated the output gradients of 2 float8 layers "
        "(at step 16); their float8 scales did not follow the loss scale: "
        "kmix.LossScaleOptimizer with float8_follows_loss_scale=True (its default) "
        "multiplies them by each change of the scale in the same step",
    )
    # An episode that starts at the growth's own step is not the growth's.
    early = [Float8Saturation(15, LAYERS[0], "outputs_grad", 2.0, 1.0)]
    assert not report.summarize(
        float8_log(episodes=early, events=[growth])
    ).float8.growth_saturations


def test_several_growths_are_one_finding():
    steps = (100, 200, 300)
    episodes = [Float8Saturation(s + 1, LAYERS[0], "outputs_grad", 2.0, 1.0) for s in steps]
    episodes += [Float8Saturation(201, LAYERS[1], "outputs_grad", 2.0, 1.0)]
    events = [event_line(s, "growth", 2.0**k, 2.0 ** (k + 1)) for k, s in enumerate(steps, 8)]
    summary = report.summarize(float8_log(episodes=episodes, events=events, steps=(100, 300)))
    (finding,) = [f for f in summary.findings if f.rule == "float8_growth"]
    assert finding.message.startswith(
        "3 loss-scale growths (at steps 100, 200, 300) each saturated the output gradients "
        "of 1 to 2 float8 layers at the next step; "
    )


def test_a_stale_spike_names_its_step_and_what_flushes():
    spike = Float8Saturation(310, LAYERS[0], "inputs", 64.0, 1.0)
    summary = report.summarize(float8_log(stale_bits=6.0, episodes=[spike], steps=(300, 400)))
    (finding,) = [f for f in summary.findings if f.rule == "float8_stale"]
    assert finding.message == (
        "a spike at step 310 keeps `mlp/dense`'s inputs' scale 6.0 bits too coarse at step "
        "400: values below 2^-12.8 of its latest amax flush to zero (2^-18.8 with a fresh "
        "scale); the scale stays until the spike leaves the amax history (Keras keeps "
        "amax_history_length steps, 1024 by default). To recover now, reset `mlp/dense`'s "
        "inputs_amax_history between steps (e.g. from a callback: "
        "layer.inputs_amax_history.assign(keras.ops.zeros_like(layer.inputs_amax_history)); "
        "on JAX call model.jax_state_sync() first, or fit's own copy overwrites it): "
        "two steps later its scale comes from fresh amaxes. For spikes to leave sooner, build "
        "the layer with a shorter history (dtype=keras.dtype_policies."
        'QuantizedFloat8DTypePolicy("float8", its source policy, amax_history_length=...)), '
        "or keep the spike out of the data"
    )
    # Without kmix's optimizer nothing recorded the spike's step; 3 bits are not stale.
    assert (
        report.summarize(float8_log(stale_bits=6.0, counts=False))
        .findings[0]
        .message.startswith("a spike keeps `mlp/dense`'s inputs' scale 6.0 bits too coarse")
    )
    assert not [f for f in report.summarize(float8_log(3.0)).findings if f.rule == "float8_stale"]


def test_tensors_clipped_at_many_steps_are_a_warning():
    summary = report.summarize(float8_log(steps=(5, 10)))
    (finding,) = [f for f in summary.findings if f.rule == "float8_saturated"]
    assert finding.severity == "warning"
    assert finding.message == (
        "float8: 12 saturated tensor-steps in 0 episodes (a tensor clipped at a step: its amax "
        "beyond its delayed scale x the format's max); clipped at more than 10% of the steps: "
        "`mlp/dense` inputs (2 of 10, 20%), `mlp/dense` kernel (2 of 10, 20%), `mlp/dense` "
        "outputs_grad (2 of 10, 20%) and 3 more. Delayed scaling clips any amax above every "
        "amax still in the history: values that keep growing are clipped step after step. "
        "Where this clipping costs accuracy, train the next run with `mlp/dense`, "
        '`mlp/dense_1` out of float8: model.quantize("float8", filters=...) quantizes only '
        "the layers the filter selects (Keras cannot take a quantized layer back out of float8)"
    )


def test_often_clipped_tensors_say_what_to_do_by_how_far_they_clip():
    """Episodes all within float32 rounding of the limit: nothing to do; past it: the next
    run without those layers in float8 (the worst episode named)."""
    limit = np.float32(3.0)
    rounding = [  # one ulp over 3 (2^-22): about 2^-24 bits, under ROUNDING_BITS
        Float8Saturation(s, LAYERS[0], "kernel", float(np.nextafter(limit, 4.0)), float(limit))
        for s in (2, 4, 6)
    ]
    only_kernel = float8_log(steps=(5, 10))
    for tag in list(only_kernel.scalars):  # one tensor clipped at many steps
        parsed = tags.parse_float8_tag(tag)
        if parsed and parsed[0] == tags.FP8_SATURATED_STEPS and parsed[1:] != (LAYERS[0], "kernel"):
            only_kernel.scalars[tag] = report.Series(np.asarray([5, 10]), np.asarray([0.0, 0.0]))
    only_kernel.texts[tags.FP8_RECORD] = [
        (e.step, tags.format_saturation_record(e, "run")) for e in rounding
    ]
    (finding,) = [f for f in report.summarize(only_kernel).findings if f.rule == "float8_saturated"]
    over = np.log2(float(np.nextafter(limit, 4.0)) / 3.0)
    assert over <= report.float8.ROUNDING_BITS
    assert finding.message.endswith(
        f"clipped step after step. Their episodes clip by at most {over:.2g} bits: float32 "
        "rounding at a steady amax (Keras's margin of 0 puts it at the limit), nothing to do"
    )
    real = rounding + [Float8Saturation(8, LAYERS[0], "kernel", 6.0, 3.0)]
    only_kernel.texts[tags.FP8_RECORD] = [
        (e.step, tags.format_saturation_record(e, "run")) for e in real
    ]
    (finding,) = [f for f in report.summarize(only_kernel).findings if f.rule == "float8_saturated"]
    assert finding.message.endswith(
        "clipped step after step. Where this clipping (up to 1.00 bits over: clipped values "
        "lose at most 50%) costs accuracy, "
        'train the next run with `mlp/dense` out of float8: model.quantize("float8", '
        "filters=...) quantizes only the layers the filter selects (Keras cannot take a "
        "quantized layer back out of float8)"
    )


@pytest.mark.slow
def test_a_real_fit_without_following_reports_its_growth_saturations(tmp_path):
    """Weights frozen, one batch repeated (tests/float8/test_state.py): every output-gradient
    saturation after the warm-up comes from a growth; the report says so at those steps."""
    from test_state import growth_saturating_fit

    model, opt = growth_saturating_fit(tmp_path, update_freq=5, histogram_freq=5)
    log = report.read_log(str(tmp_path))
    summary = report.summarize(log)
    # The what-if places each float8 layer's variables at its output gradients' real scale.
    gradients = summary.precision_whatif["gradients"]
    weights = {str(v.path) for v in model.trainable_variables if not v.overwrite_with_gradient}
    assert set(gradients.by_variable) == weights == set(gradients.float8_headroom_bits)
    for variable, bits in gradients.float8_headroom_bits.items():
        tag = tags.float8_tag(tags.FP8_HEADROOM_BITS, variable.rpartition("/")[0], "outputs_grad")
        series = log.scalars[tag]
        assert bits == series.values[series.steps <= gradients.step][-1]
    f8 = summary.float8
    assert f8.episodes == tuple(opt.float8_episodes())
    assert f8.saturated_tensor_steps == len(opt.float8_saturations())
    assert len(f8.layers) == 2 and len(f8.tensors) == 6
    growths = {e.step for e in opt.scale_events() if e.kind == "growth"}
    expected = {
        e.step - 1
        for e in opt.float8_episodes()
        if e.tensor == "outputs_grad" and e.step - 1 in growths
    }
    assert {g.step for g in f8.growth_saturations} == expected and len(expected) >= 3
    assert any(f.rule == "float8_growth" for f in summary.findings)
    text = report.format_summary(summary)
    assert f"float8          2 layers, 6 tensors; {len(f8.episodes)} saturation episode" in text


def test_an_episode_written_again_longer_keeps_its_longest_record():
    """An episode open when a fit ended is written then, and again once the next fit has
    made it longer: the report keeps the longest."""
    short = Float8Saturation(5, LAYERS[0], "inputs", 2.0, 1.0, 2)
    summary = report.summarize(
        float8_log(episodes=[short, short.__class__(**{**vars(short), "steps": 6})])
    )
    assert [(e.step, e.steps) for e in summary.float8.episodes] == [(5, 6)]
    again = report.summarize(
        float8_log(episodes=[Float8Saturation(5, LAYERS[0], "inputs", 2.0, 1.0, 6), short])
    )
    assert [(e.step, e.steps) for e in again.float8.episodes] == [(5, 6)]


def test_lost_episodes_are_counted_in_the_section_and_the_tab():
    from kmix.tbplugin.float8 import float8_payload

    log = float8_log(episodes=[Float8Saturation(4, LAYERS[0], "kernel", 0.75, 0.5)])
    lost = [tags.format_lost_record(tags.Float8Lost(s, n), "run") for s, n in ((10, 3), (20, 2))]
    log.texts[tags.FP8_RECORD] += [(10, lost[0]), (20, lost[1]), (20, lost[1])]  # one twice
    summary = report.summarize(log)
    assert summary.float8.lost_episodes == 5
    assert section(summary)[1] == (
        "  5 more episodes lost: overwritten in the optimizer's ring before a read (a lower "
        "update_freq reads them all)"
    )
    assert float8_payload(log, summary, limit=200)["lost_episodes"] == 5
    assert tags.parse_lost_record(lost[0]) == tags.Float8Lost(10, 3)
    assert tags.parse_saturation_record(lost[0]) is None  # older readers skip it


def test_the_growth_finding_names_the_flag_only_where_the_run_recorded_it_false():
    import dataclasses

    from test_finding_rules import RECORD

    episodes = [Float8Saturation(16, layer, "outputs_grad", 2.0, 1.0) for layer in LAYERS]
    growth = event_line(15, "growth", 256.0, 512.0)

    def message(**fields) -> str:
        log = float8_log(episodes=episodes, events=[growth])
        record = dataclasses.replace(RECORD, loss_scaling="kmix", **fields)
        log.texts[tags.POLICY_RECORD] = [(0, tags.format_policy_record(record))]
        (finding,) = [f for f in report.summarize(log).findings if f.rule == "float8_growth"]
        return finding.message

    off = message(float8_follows_loss_scale=False)
    assert "(float8_follows_loss_scale=False in this run)" in off
    for follows in (True, None):  # following, or a log from before the field: not the flag
        said = message(float8_follows_loss_scale=follows)
        assert "float8_follows_loss_scale" not in said
        assert said.endswith(
            "(at step 16); the growth doubled them past their delayed float8 scales, which "
            "catch up only from the next steps' amax"
        )
    text = tags.format_policy_record(dataclasses.replace(RECORD, float8_follows_loss_scale=False))
    assert tags.parse_policy_record(text).float8_follows_loss_scale is False
    old = json.loads(text)
    del old["float8_follows_loss_scale"]
    assert tags.parse_policy_record(json.dumps(old)).float8_follows_loss_scale is None


def test_the_float8_formats_are_stated_once_in_the_contract():
    import math

    from kmix.report.float8 import FLUSH_FRESH_BITS

    assert tags.FLOAT8_FORMAT_MAX == {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
    assert FLUSH_FRESH_BITS == {
        "inputs": math.log2(2.0**-9 / 2 / 448.0),
        "kernel": math.log2(2.0**-9 / 2 / 448.0),
        "outputs_grad": math.log2(2.0**-16 / 2 / 57344.0),
    }
