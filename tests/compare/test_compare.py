"""kmix compare (issue 23): the rules over hand-made tables, the record, the CLI's errors,
and one small real comparison (slow).

The recommendation is a pure function of the rows and the noise floor, so its cases
("float16 overflows", "all within noise", "float16 pathologically slow", the memory
case) are checked on tables written by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import textwrap

import pytest

from kmix import tags
from kmix.cli import main
from kmix.cli.compare import TargetError, load_target
from kmix.compare import rules
from kmix.compare.memory import importable_name, peak_from_result
from kmix.compare.rounds import round_plan
from kmix.compare.values import (
    MEASURED,
    OUT_OF_MEMORY,
    STOPPED_SLOW,
    CompareError,
    PolicyComparison,
    PolicyRow,
    Recommendation,
    comparison_from_dict,
)

MS = 1e-3


def row(policy: str, ms: float | None, **changes) -> PolicyRow:
    """A measured row of 200 steps at ``ms`` per step, float32 at 10 ms the reference."""
    base = PolicyRow(
        policy=policy,
        status=MEASURED,
        steps=200,
        step_time_s=None if ms is None else ms * MS,
        speedup=None if ms is None else 10.0 / ms,
        final_loss=0.5,
        loss_departure=None if policy == "float32" else 0.0,
        loss_ok=None if policy == "float32" else True,
        min_headroom_bits=6.0 if "float16" in policy else None,
    )
    return dataclasses.replace(base, **changes)


# ------------------------------------------------------------ measured numbers
def test_step_stats_median_and_interquartile_range():
    assert rules.step_stats([]) is None
    assert rules.step_stats([0.5]) == (0.5, 0.0)
    median, iqr = rules.step_stats([1.0, 2.0, 3.0, 4.0, 100.0])
    assert median == 3.0
    assert iqr == pytest.approx(4.0 - 2.0)


def test_noise_floor_is_the_largest_difference_of_float32_against_itself():
    assert rules.noise_floor([]) is None
    assert rules.noise_floor([1.02, 0.97, 1.01]) == pytest.approx(0.03)
    # one turn hit by a neighbour's burst sets it: no speed-up below it is claimed
    assert rules.noise_floor([1.0, 1.8, 1.01, 0.99]) == pytest.approx(0.8)
    # the overall ratio (all steps pooled) counts too
    assert rules.noise_floor([1.01, 0.99], overall=1.05) == pytest.approx(0.05)


def test_a_difference_inside_the_noise_floor_is_no_measurable_difference():
    assert rules.within_noise(10.4 * MS, 10 * MS, 0.05) is True
    assert rules.within_noise(9.6 * MS, 10 * MS, 0.05) is True
    assert rules.within_noise(10.6 * MS, 10 * MS, 0.05) is False
    assert rules.within_noise(8.0 * MS, 10 * MS, 0.05) is False
    assert rules.within_noise(10 * MS, 10 * MS, None) is None


def test_final_loss_is_the_mean_of_the_last_tenth_and_none_when_not_finite():
    curve = [float(v) for v in range(100)]
    assert rules.final_loss(curve) == pytest.approx(sum(range(90, 100)) / 10)
    assert rules.final_loss([3.0, 2.0]) == 2.0
    assert rules.final_loss([]) is None
    assert rules.final_loss([1.0] * 18 + [math.inf] * 2) is None
    assert rules.final_loss([1.0] * 19 + [math.inf]) == 1.0  # one skipped step (test_rules)


def test_round_plan_splits_the_steps_after_the_warm_up():
    assert round_plan(200, 4, 2) == [50, 50, 49, 49]
    assert sum(round_plan(13, 2, 1)) == 12


def test_slow_budget_has_a_floor_and_scales_with_float32():
    assert rules.slow_budget_s(0.1) == rules.SLOW_BUDGET_FLOOR_S
    assert rules.slow_budget_s(100.0) == 100.0 * rules.SLOW_FACTOR


def test_native_compute_by_cpu_flags_and_gpu_capability():
    assert rules.native_compute("float32", (), ())[0] is True
    assert rules.native_compute("mixed_bfloat16", ("avx512_bf16",), ())[0] is True
    native, why = rules.native_compute("mixed_float16", ("avx512f", "avx512_bf16"), ())
    assert native is False and "AVX512_FP16" in why
    assert rules.native_compute("mixed_float16", ("avx512_fp16",), ())[0] is True
    assert rules.native_compute("mixed_float16", (), [(7, 0)])[0] is True
    assert rules.native_compute("mixed_bfloat16", (), [(7, 5)])[0] is False
    assert rules.native_compute("mixed_bfloat16", (), [None])[0] is None


def test_slow_cause_names_onednn_float16_on_a_cpu():
    cause = rules.slow_cause("mixed_float16", ("avx512_fp16",), accelerators=False, onednn=True)
    assert "TF_ENABLE_ONEDNN_OPTS=0" in cause
    assert rules.slow_cause("mixed_float16", (), accelerators=True, onednn=True) is None
    emulated = rules.slow_cause("mixed_bfloat16", ("avx2",), accelerators=False, onednn=True)
    assert "AVX512_BF16" in emulated
    assert rules.slow_cause("float32", (), accelerators=False, onednn=True) is None
    no_onednn = rules.slow_cause("mixed_bfloat16", ("avx512_bf16",), False, onednn=False)
    assert "oneDNN is off (TF_ENABLE_ONEDNN_OPTS=0)" in no_onednn
    assert rules.slow_cause("mixed_bfloat16", ("avx512_bf16",), False, onednn=True) is None


# ------------------------------------------------------------ recommendation
def test_all_within_noise_recommends_float32():
    table = [row("float32", 10), row("mixed_float16", 9.8), row("mixed_bfloat16", 10.1)]
    table = [dataclasses.replace(r, within_noise=r.policy != "float32" or None) for r in table]
    advice = rules.recommend(table, floor=0.05)
    assert advice.policy == "float32"
    assert "no policy is measurably faster" in advice.reasons[0]
    assert "±5.0%" in advice.reasons[0]


def test_fastest_safe_policy_is_recommended():
    table = [row("float32", 10), row("mixed_float16", 5), row("mixed_bfloat16", 8)]
    advice = rules.recommend(table, floor=0.05)
    assert advice.policy == "mixed_float16"
    assert advice.reasons[0].startswith("mixed_float16: ×2.00")


def test_tied_fastest_prefers_bfloat16_which_needs_no_loss_scaling():
    table = [row("float32", 10), row("mixed_float16", 5.0), row("mixed_bfloat16", 5.1)]
    advice = rules.recommend(table, floor=0.05)
    assert advice.policy == "mixed_bfloat16"
    assert "mixed_float16 was faster by less than the noise floor" in advice.reasons[0]


def test_float16_fastest_but_a_layer_overflows_names_the_layer_and_the_fixes():
    table = [
        row("float32", 10),
        row("mixed_float16", 5, overflow_layers=("block_2/ffn_out",), skipped_steps=30),
        row("mixed_bfloat16", 8),
    ]
    advice = rules.recommend(table, floor=0.05)
    assert advice.policy == "mixed_bfloat16"
    second = advice.reasons[1]
    assert second.startswith("mixed_float16 would be faster (×2.00")
    assert "'block_2/ffn_out'" in second
    assert "kmix.callbacks.PrecisionAutopilot" in second
    assert "kmix.policy_scope('float32')" in second


def test_low_activation_headroom_is_unsafe_and_names_the_tightest_layer():
    table = [
        row("float32", 10),
        row("mixed_float16", 5, min_headroom_bits=0.4, tightest_layer="logits"),
    ]
    advice = rules.recommend(table, floor=0.05)
    assert advice.policy == "float32"
    assert any("'logits'" in r and "0.4 bits" in r for r in advice.reasons)


def test_too_many_skipped_steps_are_unsafe():
    table = [row("float32", 10), row("mixed_float16", 5, skipped_steps=40)]
    assert rules.safety_problem(table[1]) == "40 of 200 steps were skipped (safe: at most 5%)"
    assert rules.recommend(table, 0.05).policy == "float32"


def test_float16_pathologically_slow_is_reported_with_its_cause():
    cause = rules.slow_cause("mixed_float16", ("avx512_fp16",), accelerators=False, onednn=True)
    table = [
        row("float32", 24),
        row(
            "mixed_float16",
            10240,
            status=STOPPED_SLOW,
            steps=5,
            note=f"stopped after 48 s (budget 48 s); cause: {cause}",
        ),
        row("mixed_bfloat16", 17),
    ]
    advice = rules.recommend(table, floor=0.05)
    assert advice.policy == "mixed_bfloat16"
    slow = [r for r in advice.reasons if r.startswith("mixed_float16")]
    assert len(slow) == 1 and "pathologically slow" in slow[0]
    assert "TF_ENABLE_ONEDNN_OPTS=0" in slow[0]


def test_float32_out_of_device_memory_but_a_mixed_policy_fits():
    table = [
        row("float32", None, status=OUT_OF_MEMORY, steps=0),
        row("mixed_float16", 7, peak_memory_bytes=30 * 2**30),
        row("mixed_bfloat16", 8, peak_memory_bytes=31 * 2**30),
    ]
    advice = rules.recommend(table, floor=0.05)
    assert advice.policy == "mixed_float16"
    assert "float32 does not fit in device memory, mixed_float16 does" in advice.reasons[0]
    assert "peak 30720 MiB" in advice.reasons[0]


def test_a_loss_that_departs_from_float32_is_left_out_and_says_by_how_much():
    table = [
        row("float32", 10, final_loss=0.30),
        row("mixed_float16", 5, final_loss=0.45, loss_departure=0.15, loss_ok=False),
    ]
    advice = rules.recommend(table, floor=0.05, loss_spread=0.01)
    assert advice.policy == "float32"
    assert "higher by 0.15" in advice.reasons[1] and "spread (0.01)" in advice.reasons[1]


def test_a_loss_that_is_not_finite_is_left_out_and_says_so():
    table = [
        row("float32", 10, final_loss=0.30),
        row("float16", 5, final_loss=None, loss_departure=None, loss_ok=False),
    ]
    advice = rules.recommend(table, floor=0.05)
    assert advice.policy == "float32"
    assert advice.reasons[1] == (
        "float16 is left out: its loss is not finite over the last tenth of the steps "
        "(float32's final loss: 0.3)"
    )


def test_recommend_needs_float32():
    with pytest.raises(ValueError, match="float32 row"):
        rules.recommend([row("mixed_float16", 5)], 0.05)


# ------------------------------------------------------------ values and record
def comparison() -> PolicyComparison:
    rows = (
        row(
            "float32", 10, loss_curve=(1.0, 0.5), memory_note="not measured (measure_memory=False)"
        ),
        row("mixed_float16", 5, loss_curve=(1.0, math.nan), within_noise=False),
    )
    return PolicyComparison(
        rows=rows,
        noise_floor=0.03,
        noise_ratios=(1.01, 0.97),
        loss_spread=0.01,
        recommendation=Recommendation("mixed_float16", ("mixed_float16: ×2.00",)),
        steps=200,
        rounds=2,
        batch_size=32,
        timing="in one process",
        model="tiny",
    )


def test_to_dict_is_json_ready_and_reads_back():
    original = comparison()
    data = original.to_dict()
    text = json.dumps(data, allow_nan=False)  # a NaN loss is written as null
    back = comparison_from_dict(json.loads(text))
    assert back.rows[0] == original.rows[0]
    assert math.isnan(back.rows[1].loss_curve[1])
    assert back.recommendation == original.recommendation
    assert back.noise_floor == 0.03


def test_markdown_shows_the_table_noise_floor_recommendation_and_explains_absences():
    text = comparison().to_markdown()
    assert "| float32 | measured | 10 ms" in text
    assert "×2.00" in text
    assert "Noise floor: ±3.0% (float32 against itself, the largest difference" in text
    assert "per round: 1.010, 0.970)" in text
    assert "The machine was busy" not in text
    busy = dataclasses.replace(comparison(), noise_floor=0.34).to_markdown()
    assert "The machine was busy or uneven" in busy
    assert "**Recommendation: mixed_float16**" in text
    assert "not measured (measure_memory=False)" in text  # the absence, explained once
    assert text.count("measure_memory=False") == 1


def test_comparison_record_round_trips_and_other_text_is_no_record(tmp_path):
    data = comparison().to_dict()
    text = tags.format_comparison(data)
    assert tags.parse_comparison(text) == data
    assert tags.parse_comparison('{"record": "run_end"}') is None
    assert tags.parse_comparison("not json") is None
    assert tags.read_comparison_file(str(tmp_path)) is None
    (tmp_path / tags.COMPARISON_FILE).write_text(text)
    assert tags.read_comparison_file(str(tmp_path)) == data


def test_peak_from_a_memory_process_says_what_was_measured():
    cpu = peak_from_result({"start_rss": 2**29, "peak_rss": 2**30, "rss_from": "reset"})
    assert cpu.bytes == 2**30 and cpu.baseline == 2**29
    assert "CPU: peak resident memory" in cpu.note and "just before the model" in cpu.note
    gpu = peak_from_result({"device": "GPU:0", "device_peak": 5, "start_rss": 1})
    assert gpu.bytes == 5 and "GPU:0" in gpu.note
    assert peak_from_result({"out_of_memory": True}).out_of_memory


def test_only_functions_importable_by_name_get_a_memory_process():
    assert importable_name(rules.recommend) == "kmix.compare.rules:recommend"
    assert importable_name(lambda: None) is None

    def nested():
        return None

    assert importable_name(nested) is None


# ------------------------------------------------------------ CLI errors
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``cmpmodels`` in the current directory, as a user would have it."""
    (tmp_path / "cmpmodels.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def tiny():
                import keras
                model = keras.Sequential(
                    [keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                     keras.layers.Dense(2, dtype="float32")])
                model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
                return model

            def not_a_model():
                return 42

            def data():
                rng = np.random.default_rng(0)
                return (rng.normal(size=(128, 6)).astype("float32"),
                        rng.normal(size=(128, 2)).astype("float32"))

            def wrong_shape():
                return np.zeros((64, 5), "float32"), np.zeros((64, 2), "float32")

            VALUE = 3
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("cmpmodels", None)


def one_line_error(capsys, argv) -> str:
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("cmpmodels", "is not MODULE:FUNCTION"),
        ("no_such_module_xyz:build", "no module named 'no_such_module_xyz'"),
        ("cmpmodels:missing", "module cmpmodels has no 'missing'"),
        ("cmpmodels:VALUE", "VALUE is not a function but int"),
    ],
)
def test_bad_module_function_is_one_line_and_status_2(user_module, capsys, target, expected):
    line = one_line_error(capsys, ["compare", target, "--data", "cmpmodels:data"])
    assert line.startswith("kmix compare: ") and expected in line


def test_a_target_needs_data_and_exactly_one_of_target_or_demo(user_module, capsys):
    assert "needs --data" in one_line_error(capsys, ["compare", "cmpmodels:tiny"])
    assert "either MODULE:FUNCTION" in one_line_error(capsys, ["compare"])
    assert "either" in one_line_error(capsys, ["compare", "--demo", "cmpmodels:tiny"])
    line = one_line_error(capsys, ["compare", "--demo", "--data", "cmpmodels:data"])
    assert "--data cmpmodels:data is for MODULE:FUNCTION" in line


def test_a_used_logdir_is_refused(user_module, capsys):
    (user_module / "used").mkdir()
    (user_module / "used" / "keep.txt").write_text("mine")
    argv = ["compare", "cmpmodels:tiny", "--data", "cmpmodels:data", "--logdir", "used"]
    assert "is not empty" in one_line_error(capsys, argv)
    assert (user_module / "used" / "keep.txt").read_text() == "mine"


def test_load_target_returns_the_function(user_module):
    assert load_target("cmpmodels:data", "--data")()[0].shape == (128, 6)
    with pytest.raises(TargetError, match="--data 'cmpmodels:nope'"):
        load_target("cmpmodels:nope", "--data")


def test_a_missing_function_is_said_before_its_module_is_imported(user_module):
    """The module may import TensorFlow (seconds): a name its source does not define is
    refused first, and the module is not imported."""
    (user_module / "heavy.py").write_text(
        "raise RuntimeError('imported')\n\ndef model():\n    pass\n"
    )
    with pytest.raises(
        TargetError,
        match=r"module heavy has no 'nosuchfn' \(its source, .*heavy.py, defines none\)",
    ):
        load_target("heavy:nosuchfn", "MODULE:FUNCTION")
    with pytest.raises(TargetError, match="importing heavy raised RuntimeError: imported"):
        load_target("heavy:model", "MODULE:FUNCTION")  # defined: the module is imported


def test_an_unknown_loss_is_named_not_blamed_on_the_data(user_module, capsys):
    argv = ["compare", "cmpmodels:tiny", "--data", "cmpmodels:data", "--loss", "nosuchloss"]
    line = one_line_error(capsys, argv)
    assert "--loss 'nosuchloss' is not a Keras loss" in line and "data" not in line


def test_bad_arguments_of_compare_policies(tmp_path):
    from kmix.compare.comparison import compare_policies

    (tmp_path / "mine.txt").write_text("mine")
    with pytest.raises(CompareError, match="logdir .* is not empty: give a new or empty"):
        compare_policies(lambda: None, None, logdir=str(tmp_path))

    with pytest.raises(CompareError, match="include 'float32'"):
        compare_policies(lambda: None, None, policies=("mixed_float16",))
    with pytest.raises(CompareError, match="each once"):
        compare_policies(lambda: None, None, policies=("float32", "float32"))
    with pytest.raises(CompareError, match=r"steps=4: use an integer >= 2 \* rounds \+ 1 = 9"):
        compare_policies(lambda: None, None, steps=4)


def test_a_function_that_returns_no_model_is_one_line_and_status_2(user_module, capsys):
    argv = ["compare", "cmpmodels:not_a_model", "--data", "cmpmodels:data", "--no-memory"]
    line = one_line_error(capsys, argv)
    assert "returned int (42), not a keras.Model" in line


def test_data_of_the_wrong_shape_is_one_line_and_status_2(user_module, capsys):
    argv = ["compare", "cmpmodels:tiny", "--data", "cmpmodels:wrong_shape", "--no-memory"]
    line = one_line_error(capsys, argv)
    assert "have shape (32, 5)" in line and "expects (None, 6)" in line


# ------------------------------------------------------------ a real comparison
@pytest.mark.slow  # three small models trained side by side, then two memory processes
def test_cli_compares_a_tiny_model_and_report_prints_the_comparison(user_module, capsys):
    argv = ["compare", "cmpmodels:tiny", "--data", "cmpmodels:data", "--steps", "13"]
    argv += ["--rounds", "2", "--policies", "float32,mixed_float16", "--logdir", "cmp", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert "round 2/2, mixed_float16, step 5/5" in err  # progress: policy, round, step
    got = comparison_from_dict(data)
    float32, float16 = got.row("float32"), got.row("mixed_float16")
    for r in got.rows:
        assert r.steps == 13 and len(r.loss_curve) == 13
        assert r.step_time_s > 0 and r.step_time_iqr_s >= 0
        assert r.examples_per_s == pytest.approx(32 / r.step_time_s)
        assert r.speedup == pytest.approx(float32.step_time_s / r.step_time_s)
        assert r.final_loss == pytest.approx(sum(r.loss_curve[-1:]))
        assert r.weights_bytes == (6 * 8 + 8 + 8 * 2 + 2) * 4
        assert (r.peak_memory_bytes is None) == ("not measured" in r.memory_note)
        assert r.memory_note
    assert float32.activation_bytes == 32 * (8 + 2) * 4
    assert float16.activation_bytes == 32 * (8 * 2 + 2 * 4)  # float16 hidden, float32 head
    assert float16.min_headroom_bits is not None and float16.tightest_layer
    assert float32.min_headroom_bits is None
    assert got.noise_floor is not None and len(got.noise_ratios) == 2
    assert got.recommendation.policy in ("float32", "mixed_float16")
    assert os.path.isdir(user_module / "cmp" / "mixed_float16" / "train")
    assert os.path.isdir(user_module / "cmp" / tags.COMPARISON_RUN)
    assert main(["report", "cmp"]) == 0
    report = capsys.readouterr().out
    assert "**Recommendation: " in report and "Noise floor: ±" in report


# ------------------------------------------------------------ the TensorBoard tab
def test_the_tab_serves_a_recorded_comparison_and_lists_no_run_for_it(tmp_path):
    from tensorboard.backend import application
    from tensorboard.backend.event_processing import data_ingester, plugin_event_multiplexer
    from tensorboard.backend.event_processing import data_provider as mux_provider
    from tensorboard.plugins import base_plugin
    from werkzeug import test as werkzeug_test
    from werkzeug import wrappers

    from kmix.compare.comparison import write_comparison
    from kmix.tbplugin import plugin

    write_comparison(str(tmp_path), comparison())
    assert tags.read_comparison_file(str(tmp_path)) == comparison().to_dict()
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance=data_ingester.DEFAULT_TENSOR_SIZE_GUIDANCE
    )
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    provider = mux_provider.MultiplexerDataProvider(multiplexer, str(tmp_path))
    context = base_plugin.TBContext(logdir=None, data_provider=provider)
    app = application.TensorBoardWSGI([plugin.KmixPlugin(context)], data_provider=provider)
    client = werkzeug_test.Client(app, wrappers.Response)
    shown = json.loads(client.get("/data/plugin/kmix/comparison").get_data(as_text=True))
    (only,) = shown["comparisons"]
    assert only["run"] == tags.COMPARISON_RUN
    assert only["markdown"] == comparison().to_markdown()
    runs = json.loads(client.get("/data/plugin/kmix/runs").get_data(as_text=True))
    assert runs["runs"] == []  # the record alone is no training run


@pytest.mark.slow  # three small models trained side by side
def test_a_pathologically_slow_policy_is_stopped_and_reported(user_module, monkeypatch):
    """With a budget of 0 s every policy but float32 (and its repeat) stops after a step."""
    import cmpmodels
    import keras

    from kmix.compare.comparison import compare_policies

    keras.config.set_dtype_policy("mixed_float16")  # the user's, kept
    monkeypatch.setattr(rules, "slow_budget_s", lambda float32_s: 0.0)
    monkeypatch.setattr(rules, "slow_cause", lambda *args: "a cause kmix names")
    got = compare_policies(
        cmpmodels.tiny,
        cmpmodels.data(),
        policies=("float32", "mixed_bfloat16"),
        steps=9,
        rounds=2,
        measure_memory=False,
    )
    assert keras.config.dtype_policy().name == "mixed_float16"
    keras.config.set_dtype_policy("float32")
    float32, stopped = got.row("float32"), got.row("mixed_bfloat16")
    assert float32.status == MEASURED and float32.steps == 9
    # the per-step loss, recovered from Keras's running mean, against an independent one:
    # the first step's loss is the seeded model's loss on the first batch
    keras.utils.clear_session()
    keras.utils.set_random_seed(0)
    x, y = cmpmodels.data()
    model = cmpmodels.tiny()
    first = float(model.evaluate(x[:32], y[:32], batch_size=32, verbose=0))
    assert float32.loss_curve[0] == pytest.approx(first, rel=1e-5)
    # the second: after one SGD step on the first batch (a power-of-two loss scale is exact)
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, shuffle=False, verbose=0)
    second = float(model.evaluate(x[32:64], y[32:64], batch_size=32, verbose=0))
    assert float32.loss_curve[1] == pytest.approx(second, rel=1e-4)
    assert stopped.status == STOPPED_SLOW and stopped.steps == 1  # its first warm-up step
    assert stopped.note.startswith("stopped after ") and "cause: a cause kmix names" in stopped.note
    assert stopped.step_time_s is None and stopped.speedup is None
    assert got.noise_floor is not None  # float32_repeat is never stopped
    assert got.recommendation.policy == "float32"
    assert any("pathologically slow" in r for r in got.recommendation.reasons)
    assert stopped.memory_note == "not measured (measure_memory=False)"
    assert "stopped: too slow" in got.to_markdown()


@pytest.mark.slow  # three small models trained side by side
def test_a_compare_log_dir_reports_each_run_as_it_ended(user_module, monkeypatch, capsys):
    """Issue 32: in a compare's log dir, a policy stopped as too slow is not "completed"
    and has a finding saying why; the float32 reference, trained in five fits (a warm-up
    and four rounds), states each of its notes once; the record is listed as no run."""
    import re

    import cmpmodels

    from kmix.compare.comparison import compare_policies

    monkeypatch.setattr(rules, "slow_budget_s", lambda float32_s: 0.0)
    compare_policies(
        cmpmodels.tiny,
        cmpmodels.data(),
        policies=("float32", "mixed_float16"),
        steps=9,
        rounds=4,
        logdir=os.path.join("runs", "cmp"),
        measure_memory=False,
    )
    stop = (
        r"stopped by kmix compare at step 1: too slow \(×[0-9.e+-]+ of float32's speed\): "
        r"1 step took \d+\.\d s in fit, float32 \d+\.\d s for as many; its budget was 0 s"
    )
    assert main(["report", "runs"]) == 0  # the listing of a parent directory
    listing = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listing[1:4]] == [
        os.path.join("runs", "cmp", name) for name in ("float32", "float32_repeat", "mixed_float16")
    ]
    assert listing[1].endswith("steps 0..9, resumed 4x, completed at step 9")
    assert re.fullmatch(r".*, steps 0\.\.1, " + stop, listing[3])
    assert main(["report", os.path.join("runs", "cmp", "mixed_float16"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    findings = out[out.index("\nfindings\n") :].splitlines()[2:]
    assert "no problems found" not in out
    assert re.fullmatch(r"  ! the run did not complete: " + stop, findings[0])
    assert main(["report", os.path.join("runs", "cmp", "float32"), "--json"]) == 0
    said = [f["message"] for f in json.loads(capsys.readouterr().out)["findings"]]
    assert len(said) == len(set(said)) == 3  # no problem, computes in float32, the note
    assert said[-1].startswith("note at step 0, 1, 3, 5, 7: ")
    assert main(["report", os.path.join("runs", "cmp", "float32")]) == 0
    out = capsys.readouterr().out  # its scale, compiled in but never used, is not charted
    assert "\nloss scale      not used: this run computes in float32, which needs no " in out
    assert "loss_scale.png" not in out


def test_compare_is_a_kmix_command_with_its_own_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kmix compare")
    for option in ("--demo", "--data", "--steps", "--policies", "--logdir", "--json"):
        assert option in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "compare" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # argparse's usage and error, as every command
        main(["compare", "--demo", "--steps", "0"])
    assert exit_.value.code == 2
    assert "argument --steps: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_data_that_is_neither_arrays_nor_a_dataset_is_refused_with_what_to_give():
    import numpy as np
    import tensorflow as tf

    from kmix.compare.rounds import make_dataset

    with pytest.raises(CompareError, match=r"\(x, y\) of arrays; got str"):
        make_dataset("digits.npz", 32)
    with pytest.raises(CompareError, match="got tuple of length 3"):
        make_dataset((1, 2, 3), 32)
    x, y = np.zeros((10, 4), "float32"), np.zeros((10,), "int32")
    with pytest.raises(CompareError, match="10 examples, fewer than one batch of batch_size=32"):
        make_dataset((x, y), 32)
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    dataset, examples = make_dataset(batched, 32)
    assert examples == 4  # a dataset's own batches
    assert len(list(dataset.take(5))) == 5  # repeated
    with pytest.raises(CompareError, match="empty tf.data.Dataset"):
        make_dataset(batched.take(0), 32)


def test_a_directory_holding_a_comparison_lists_its_runs_not_the_record(tmp_path, capsys):
    """`kmix report runs` over a compare's log dir: the record (runs/compare/comparison) is
    not a training run "whose end was not recorded"; the listing points at the table."""
    from test_runs import write_small_run

    from kmix.cli import main
    from kmix.compare.comparison import write_comparison

    parent = tmp_path / "runs"
    compared = parent / "compare"
    write_comparison(str(compared), comparison())
    write_small_run(
        str(compared / "float32"), "20250101-090000-cccccc", scale=8.0, skips=(), steps=5
    )
    assert main(["report", str(parent)]) == 0
    out = capsys.readouterr().out
    assert "comparison" not in out.replace("kmix compare", "")
    assert f"  {compared / 'float32'}  id 20250101-090000-cccccc" in out
    assert out.splitlines()[-1] == (
        f"{compared} holds a kmix compare: kmix report {compared} shows its table"
    )


def test_a_function_defined_under_try_or_if_is_not_refused(user_module):
    (user_module / "guarded.py").write_text(
        "try:\n    import nothing_here\nexcept ImportError:\n    def model():\n        return 1\n"
    )
    assert load_target("guarded:model", "MODULE:FUNCTION")() == 1


def test_a_batch_of_one_array_is_told_from_a_dict_whatever_the_backend():
    import tensorflow as tf

    from kmix.compare.memory import _one_array

    assert _one_array(tf.constant([1.0])) and not _one_array({"x": tf.constant([1.0])})
    assert not _one_array((tf.constant([1.0]),))
