"""Precision moves and plans, the float16 share, and the autopilot's rules (no fit)."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import kmix
from kmix import tags
from kmix._layers import walk_layers
from kmix.callbacks import _autopilot_rules as rules
from kmix.callbacks._diagnosis import moves_text
from kmix.precision_plan import (
    MULTIPLY_ADDS,
    PARAMETERS,
    LayerCost,
    float16_share,
    layer_costs,
)
from kmix.tags import ForwardOrigin, ScaleEvent

MOVE = kmix.PrecisionMove(
    12, "block/ffn", "Dense", "forward overflow at step 12", "mixed_float16", "float32"
)


def event(step: int, origin: ForwardOrigin | None, loss_finite: bool | None = False) -> ScaleEvent:
    return ScaleEvent(
        step, step, "forward_overflow", 1024.0, 1024.0, "d/kernel", 1, loss_finite, origin
    )


def test_plan_json_round_trip_and_later_moves_win():
    later = kmix.PrecisionMove(30, "block/ffn", "Dense", "r", "float32", "mixed_bfloat16")
    plan = kmix.PrecisionPlan.from_moves([MOVE, later])
    assert plan.policies == {"block/ffn": "mixed_bfloat16"}
    text = plan.to_json()
    assert json.loads(text) == {
        "format": "kmix.precision_plan",
        "version": 1,
        "policies": {"block/ffn": "mixed_bfloat16"},
    }
    assert kmix.PrecisionPlan.from_json(text) == plan
    assert kmix.PrecisionPlan.from_json('{"a": "float32"}').policies == {"a": "float32"}


@pytest.mark.parametrize("text", ["not json", "[1]", '{"policies": {"a": 3}}', '{"a": null}'])
def test_plan_from_bad_json_says_what_it_expected(text):
    with pytest.raises(ValueError, match="PrecisionPlan.from_json"):
        kmix.PrecisionPlan.from_json(text)


def test_move_record_round_trip_and_line():
    text = tags.format_precision_move_record(MOVE, "run-1", 0.25)
    assert tags.parse_precision_move_record(text) == tags.MoveRecord(MOVE, "run-1", 0.25)
    assert tags.parse_precision_move_record('{"type": "scale_event"}') is None
    assert tags.parse_precision_move_record("**moved**") is None
    assert tags.format_precision_move(MOVE) == (
        "**moved** `block/ffn` (Dense) `mixed_float16` → `float32` at step 12: "
        "forward overflow at step 12"
    )


def test_float16_share_is_exact_and_names_the_layers_weighed_by_parameters():
    costs = [
        LayerCost("a", "float16", 300.0, MULTIPLY_ADDS),
        LayerCost("b", "float32", 100.0, MULTIPLY_ADDS),
        LayerCost("norm", "float16", 100.0, PARAMETERS),
    ]
    share = float16_share(costs)
    assert share.share == 400.0 / 500.0
    assert share.by_parameters == ("norm",)
    assert share.words() == (
        "80% of the estimated multiply-adds (weighed by parameters, multiply-adds unknown: `norm`)"
    )
    assert float16_share([]).share is None


def test_layer_costs_count_dense_and_conv_multiply_adds(float16_policy):
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, name="conv")(inputs)  # 4x4 positions, kernel 3*3*2*4
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(5, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    costs = {c.path: c for c in layer_costs(model)}
    assert costs["conv"] == LayerCost("conv", "float16", 3 * 3 * 2 * 4 * 16.0, MULTIPLY_ADDS)
    assert costs["norm"] == LayerCost("norm", "float16", 8.0, PARAMETERS)
    assert costs["head"] == LayerCost("head", "float32", 64.0 * 5, MULTIPLY_ADDS)
    assert set(costs) == {"conv", "norm", "head"}


@pytest.fixture
def float16_policy():
    keras.config.set_dtype_policy("mixed_float16")


def test_apply_plan_sets_policies_and_refuses_unknown_layers(float16_policy):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")]
    )
    plan = kmix.PrecisionPlan({"a": "float32"})
    assert kmix.apply_plan(model, plan) == ["a"]
    assert [layer.dtype_policy.name for layer in model.layers] == ["float32", "mixed_float16"]
    assert kmix.apply_plan(model, plan) == []  # already so
    with pytest.raises(
        ValueError,
        match=r"names \['nope'\], not layers of model 'sequential' "
        r"\(its layers: sequential/a, sequential/b\)",
    ):
        kmix.apply_plan(model, kmix.PrecisionPlan({"b": "float32", "nope": "float32"}))
    with pytest.raises(ValueError, match="policy 'float17' for layer 'b'"):
        kmix.apply_plan(model, kmix.PrecisionPlan({"b": "float17"}))
    assert model.layers[1].dtype_policy.name == "mixed_float16"  # nothing changed
    with pytest.raises(TypeError, match="pass a kmix.PrecisionPlan"):
        kmix.apply_plan(model, {"a": "float32"})
    x = np.ones((2, 3), "float32")
    assert model(x).dtype == "float16"


def test_overflow_candidates_take_each_origin_once_with_its_reason():
    own = ForwardOrigin("block/ffn#2", "Dense", True, 3.5)
    cast = ForwardOrigin("head_in", "Dense", True, 70000.0)
    found = rules.overflow_candidates(
        [
            event(5, own),
            event(6, own),
            event(7, None),
            event(8, cast),
            event(9, ForwardOrigin("x", "Dense", True, 1.0), loss_finite=True),
        ]
    )
    assert found == [
        rules.Candidate("block/ffn", 5, "forward overflow at step 5", overflow=True),
        rules.Candidate(
            "head_in",
            8,
            "forward overflow at step 8: the cast of its input (max |input| 70000) overflowed",
            overflow=True,
        ),
    ]
    assert [e.step for e in rules.unhealable_overflows([event(7, None), event(5, own)])] == [7]


def test_headroom_candidates_below_margin_and_forecast():
    history = rules.HeadroomHistory()
    for step in range(10, 90, 10):  # "fall" loses 1 bit per 10 steps; "flat" keeps 8
        history.add(step, {"fall": 10.0 - 0.1 * step, "flat": 8.0, "low#2": 0.5, "low": 3.0})
    # at step 80: fall has 2 bits left, 0 forecast at step 100
    assert rules.headroom_candidates(history, 80, 1.0, 10) == [
        rules.Candidate("low", 80, "headroom 0.5 bits, below the margin of 1 bit"),
    ]
    assert rules.headroom_candidates(history, 80, 1.0, 20) == [
        rules.Candidate(
            "fall",
            80,
            "headroom 2 bits, falling 10 bits per 100 steps: 0 bits forecast at step 100",
        ),
        rules.Candidate("low", 80, "headroom 0.5 bits, below the margin of 1 bit"),
    ]
    assert rules.headroom_candidates(history, 90, 1.0, 20) == []  # no reading at step 90


def test_moves_text_names_each_move_and_why_the_guard_still_stopped():
    assert moves_text([], 8) == ""
    assert moves_text([MOVE], 8) == (
        "PrecisionAutopilot moved 1 layer out of float16 before this (`block/ffn` (Dense) to "
        "float32 at step 12, forward overflow at step 12); the rule still held after them."
    )
    assert moves_text([MOVE], 1).endswith("; it reached max_layers=1.")


def test_autopilot_arguments_are_checked(monkeypatch):
    from kmix.callbacks import autopilot

    for kwargs, match in [
        ({"update_freq": 0}, "update_freq"),
        ({"margin_bits": -1}, "margin_bits"),
        ({"fallback": "float16"}, "fallback"),
        ({"max_layers": 0}, "max_layers"),
        ({"proactive": 1}, "proactive"),
    ]:
        with pytest.raises(ValueError, match=match):
            kmix.callbacks.PrecisionAutopilot(**kwargs)
    monkeypatch.setattr(autopilot, "_bfloat16_hardware_reason", lambda: "no AVX512-BF16")
    with pytest.raises(ValueError, match=r"fallback='bfloat16'.*\(no AVX512-BF16\)"):
        kmix.callbacks.PrecisionAutopilot(fallback="bfloat16")
    monkeypatch.setattr(autopilot, "_bfloat16_hardware_reason", lambda: None)
    assert kmix.callbacks.PrecisionAutopilot(fallback="bfloat16").to_policy == "mixed_bfloat16"


def test_report_lists_the_moves_the_share_and_the_plan():
    from test_report import hand_log

    from kmix import report

    moved = ScaleEvent(
        1,
        12,
        "forward_overflow",
        8.0,
        8.0,
        None,
        0,
        False,
        ForwardOrigin("block/ffn#2", "Dense", True, 3.0),
    )
    log = hand_log(
        scalars={tags.LOSS_SCALE: ([12], [8.0]), tags.FLOAT16_SHARE: ([0, 12], [0.9, 0.6])},
        texts={
            tags.PRECISION_MOVE_RECORD: [(12, tags.format_precision_move_record(MOVE, "r", 0.6))],
            tags.EVENT_RECORD: [(12, tags.format_event_record(moved, "r"))],
        },
    )
    summary = report.summarize(log)
    assert summary.precision_moves == (MOVE,)
    printed = report.format_summary(summary)
    assert (
        "precision moves 1 (PrecisionAutopilot)\n"
        "  moved block/ffn (Dense) mixed_float16 → float32 at step 12: "
        "forward overflow at step 12\n"
        "  float16 share (estimated multiply-adds; parameters where unknown, see the notes): "
        "90% at train begin, 60% at the end\n"
        "  to start the next run healed, before compile:\n"
        "    kmix.apply_plan(model, kmix.PrecisionPlan({'block/ffn': 'float32'}))"
    ) in printed
    assert "PrecisionAutopilot moved each of them out of float16" in printed
    data = json.loads(report.to_json(summary))
    assert data["precision_plan"] == {"block/ffn": "float32"}
    assert data["precision_moves"] == [MOVE.to_dict()]
    assert data["float16_share"]["last"] == 0.6


def test_skip_rate_diagnosis_names_forward_overflows_instead_of_the_gradients():
    from kmix.callbacks._diagnosis import skip_rate_text
    from kmix.callbacks._trip import SkipRate

    trip = SkipRate(step=352, end=352, steps=200, skipped=120)
    origin = ForwardOrigin("energy", "Dense", True, 700.0)
    overflows = [event(s, origin) for s in (352, 350, 349)]
    backoff = ScaleEvent(9, 348, "backoff", 8.0, 4.0, "d/kernel", 1, True)
    text = skip_rate_text(trip, 0.5, [*overflows, backoff])
    assert text.startswith(
        "kmix.LossScaleGuard stopped training at step 352: 120 of the last 200 steps (60%) "
        "were skipped, more than max_skip_rate=0.5, so the model barely trains. 3 of the "
        "latest 4 skipped steps were forward overflows: the loss itself was non-finite, "
        "which no loss scale fixes. Forward overflow in `energy` (Dense)"
    )
    assert text.endswith("Or let kmix.callbacks.PrecisionAutopilot move it during training.")
    gradients = skip_rate_text(trip, 0.5, [backoff])
    assert "were skipped for non-finite gradients" in gradients and "energy" not in gradients
    assert skip_rate_text(trip, 0.5) == gradients


def test_apply_plan_reaches_an_unbuilt_instance_and_the_layers_nested_in_a_move(float16_policy):
    def build():
        return keras.Sequential([keras.layers.Dense(4, name="big"), keras.layers.Dense(2)])

    first, fresh = build(), build()  # "sequential", then "sequential_1"; neither built
    assert fresh.name != first.name
    plan = kmix.PrecisionPlan({f"{first.name}/big": "float32"})
    assert kmix.apply_plan(fresh, plan) == [f"{first.name}/big"]
    assert [layer.dtype_policy.name for layer in fresh.layers] == ["float32", "mixed_float16"]
    with pytest.raises(ValueError, match="not layers of model"):  # another model's name
        kmix.apply_plan(fresh, kmix.PrecisionPlan({"functional/big": "float32"}))

    inputs = keras.Input((3, 4))  # a composite layer moves with the layers nested in it
    mha = keras.layers.MultiHeadAttention(2, 2, name="mha")
    model = keras.Model(inputs, mha(inputs, inputs))
    nested = [layer for _, layer in walk_layers(mha)]
    assert nested and {layer.compute_dtype for layer in nested} == {"float16"}
    assert kmix.apply_plan(model, kmix.PrecisionPlan({"mha": "float32"})) == ["mha"]
    assert {layer.compute_dtype for layer in [mha, *nested]} == {"float32"}
    assert model(np.ones((1, 3, 4), "float32")).dtype == "float32"


def test_no_float16_advice_for_a_layer_moved_at_its_reading():
    """A layer PrecisionAutopilot moved to float32 at step 12 gets no "compute this layer
    in float32" for its step-12 reading; a layer still in float16 does."""
    from test_report import hand_log

    from kmix import report

    steps = np.array([4, 8, 12])
    log = hand_log(
        scalars={
            tags.ACTIVATION_HEADROOM_BITS + "block/ffn": (steps, np.array([3.0, 2.0, 0.5])),
            tags.ACTIVATION_HEADROOM_BITS + "block/out": (steps, np.array([3.0, 2.0, 0.5])),
        },
        texts={
            tags.PRECISION_MOVE_RECORD: [(12, tags.format_precision_move_record(MOVE, "r", 0.6))]
        },
    )
    advice = [f.message for f in report.summarize(log).findings if f.rule == "activation_headroom"]
    assert [message.split(" came within")[0] for message in advice] == [
        "the outputs of layer block/out"
    ]


def test_the_audit_reads_a_moved_layer_s_output_as_what_it_computes_now():
    """The graph's symbolic tensors keep the dtypes of the policy it was built with."""
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="wide")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(x))
    assert kmix.apply_plan(model, kmix.PrecisionPlan({"wide": "float32"})) == ["wide"]
    rows = {row.path: row for row in kmix.audit(model).rows}
    assert (rows["wide"].compute_dtype, rows["wide"].output_dtype) == ("float32", "float32")
    assert rows["head"].output_dtype == "float16"
