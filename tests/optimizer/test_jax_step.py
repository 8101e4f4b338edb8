"""kmix.LossScaleOptimizer on Keras's JAX backend, and the same behaviours on torch.

The slow tests run tests/scripts/backend_fit.py in a subprocess with ``KERAS_BACKEND=jax``
and, for the behaviours every backend shares (``any_run``), ``KERAS_BACKEND=torch`` (this
process has TensorFlow's Keras loaded), and check what it printed against a plain Python
reference of the scale rule written here. They skip when JAX (torch) is not installed.
The fast tests check the pure pieces the JAX step adds, on the test process's backend.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from keras import ops

from kmix import backend as _backend
from kmix.record import health, scaling
from kmix.record import step as step_values
from kmix.record import step_record as record
from kmix.record.activations import ACTIVATION_CAPACITY, ACTIVATION_FIELDS

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/

SCRIPT = os.path.join(TESTS, "scripts", "backend_fit.py")
TIMEOUT = 120
# As in the script (kept in step by test_the_reference_reads_the_scripts_settings).
KINDS = ["ok", "ok", "forward", "ok", *["gradient"] * 4, *["ok"] * 8]
SETTINGS = {"initial_scale": 64.0, "dynamic_growth_steps": 2, "min_scale": 16.0, "max_scale": 128.0}
VARIABLES = [
    "direct/kernel",
    "direct/bias",
    "hidden/kernel",
    "hidden/bias",
    "out/kernel",
    "out/bias",
]
FIRST_NONFINITE = {"forward": "direct/kernel", "gradient": "hidden/kernel"}
"""A NaN loss makes every gradient NaN; a float16 gradient overflow starts in ``hidden``."""

needs_jax = pytest.mark.skipif(
    importlib.util.find_spec("jax") is None,
    reason='JAX is not installed (pip install ".[jax]" from the repository root)',
)


def reference(kinds: list[str], initial: float, growth: int, low: float, high: float) -> dict:
    """The scale rule with hysteresis 1, in plain Python: scales, skips and events by step."""
    scale, good = initial, 0
    scales, skipped, events = [], [], []
    for step, kind in enumerate(kinds, start=1):
        old = scale
        if kind == "ok":
            good += 1
            if good == growth:
                scale, good = min(scale * 2, high), 0
                if scale != old:
                    events.append([step, "growth", old, scale, None, True])
        elif kind == "forward":  # skipped, the scale kept
            good = 0
            skipped.append(step)
            events.append([step, "forward_overflow", old, old, FIRST_NONFINITE[kind], False])
        else:
            good, scale = 0, max(scale / 2, low)
            skipped.append(step)
            kind_name = "backoff" if scale != old else "overflow_at_floor"
            events.append([step, kind_name, old, scale, FIRST_NONFINITE[kind], True])
        scales.append(scale)
    return {"scales": scales, "skipped": skipped, "events": events, "good": good}


def run_script(scenario: str, tmp_path: os.PathLike, devices: int = 1, **environ: str) -> dict:
    """Runs backend_fit.py's ``scenario`` in a fresh process (JAX unless ``environ`` says
    ``KERAS_BACKEND``) and returns what it printed."""
    env = {**os.environ, "KERAS_BACKEND": "jax", "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_ENABLE_X64", None)
    env |= environ
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    done = subprocess.run(
        [sys.executable, SCRIPT, scenario, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("JSON ")]
    assert done.returncode == 0 and lines, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1][len("JSON ") :]) | {"directory": str(tmp_path)}


def as_rows(events: list[dict]) -> list[list]:
    keys = ("step", "kind", "old_scale", "new_scale", "variable", "loss_finite")
    return [[e[k] for k in keys] for e in events]


needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason='torch is not installed (pip install ".[torch]" from the repository root)',
)


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fit scenario on JAX."""
    return run_script("fit", tmp_path_factory.mktemp("jax_fit"))


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fit scenario on torch (what only JAX has is not run there)."""
    return run_script("fit", tmp_path_factory.mktemp("torch_fit"), KERAS_BACKEND="torch")


@pytest.fixture(
    params=[pytest.param("jax", marks=needs_jax), pytest.param("torch", marks=needs_torch)]
)
def any_run(request: pytest.FixtureRequest) -> dict:
    """The fit scenario on each backend whose step is not TensorFlow's: the same promises."""
    return request.getfixturevalue("fit_run" if request.param == "jax" else "torch_run")


# ------------------------------------------------------------------ slow: the subprocess
@pytest.mark.slow
def test_fit_follows_the_rule_at_every_step(any_run):
    expected = reference(KINDS, *SETTINGS.values())
    assert any_run["variables"] == VARIABLES
    # read during fit, after each batch: the optimizer's reads sync the JAX state first
    assert any_run["scales"] == expected["scales"]
    assert any_run["attempted"] == list(range(1, len(KINDS) + 1))
    assert min(expected["scales"]) == SETTINGS["min_scale"]  # the floor is reached...
    assert max(expected["scales"]) == SETTINGS["max_scale"]  # ...and the ceiling
    assert as_rows(any_run["events"]) == expected["events"]
    assert {e[1] for e in expected["events"]} >= {"overflow_at_floor", "forward_overflow"}
    state = any_run["state"]
    assert state["attempted_steps"] == len(KINDS)
    assert state["skipped_steps"] == len(expected["skipped"])
    assert state["last_overflow_step"] == expected["skipped"][-1]
    assert state["good_steps"] == expected["good"]
    assert state["consecutive_skips"] == 0 and state["loss_finite"] is True
    assert state["event_count"] == len(expected["events"])
    assert state["loss_scale"] == expected["scales"][-1]
    assert state["health"] == {} and state["health_step"] == 0  # not measured yet
    assert any_run["counter_dtype"] == "int32"  # int64 on JAX with jax_enable_x64
    assert any_run["tensorflow_imported"] is False  # kmix's core path


@pytest.mark.slow
@needs_jax
def test_with_jax_enable_x64_the_counters_are_int64_and_the_rule_the_same(tmp_path):
    run = run_script("fit", tmp_path, JAX_ENABLE_X64="1")
    expected = reference(KINDS, *SETTINGS.values())
    assert run["counter_dtype"] == "int64"
    assert run["scales"] == expected["scales"]
    assert as_rows(run["events"]) == expected["events"]
    assert run["skips"]["gradient"]["unchanged"] and run["skips"]["forward"]["unchanged"]
    assert run["loaded"]["state"] == run["saved"]["state"]


@pytest.mark.slow
@needs_jax
def test_fit_on_jax_reads_the_facts_the_design_relies_on(fit_run):
    # Keras 3.15 purges the variables during a JAX fit and drops their initializers:
    # reading one raises instead of giving its initial value.
    assert set(fit_run["raw_scale_reads"]) == {"TypeError"}
    assert fit_run["tensorflow_imported"] is False  # kmix's core path on JAX


@pytest.mark.slow
def test_a_skipped_step_keeps_weights_and_inner_state_bit_for_bit(any_run):
    skips = any_run["skips"]
    assert skips["gradient"]["unchanged"] and skips["forward"]["unchanged"]
    scale = any_run["state"]["loss_scale"]
    assert skips["gradient"]["scale_before"] == scale
    assert skips["gradient"]["scale_after"] == max(scale / 2, SETTINGS["min_scale"])
    assert skips["forward"]["scale_after"] == skips["forward"]["scale_before"]  # kept
    assert skips["ok_changes_weights"]  # the comparison can see a change


@pytest.mark.slow
def test_save_and_load_keep_the_scale_counters_and_events(any_run):
    saved, loaded = any_run["saved"], any_run["loaded"]
    assert loaded["type"] == "LossScaleOptimizer"
    assert loaded["state"] == saved["state"]
    assert loaded["events"] == saved["events"]
    assert saved["state"]["attempted_steps"] == len(KINDS) + 3  # the three single-batch fits
    assert saved["state"]["skipped_steps"] == any_run["state"]["skipped_steps"] + 2
    assert [e["kind"] for e in saved["events"][-2:]] == ["backoff", "forward_overflow"]


@pytest.mark.slow
def test_apply_in_a_custom_loop_skips_and_applies(any_run):
    loop = any_run["custom_loop"]
    assert loop["skip_unchanged"] and loop["applied_changes_weights"]
    scale = SETTINGS["initial_scale"]
    assert loop["skipped"]["skipped_steps"] == 1 and loop["skipped"]["loss_scale"] == scale / 2
    assert loop["skipped"]["loss_finite"] is None  # no scale_loss in this loop: unknown
    assert loop["applied"]["attempted_steps"] == 2 and loop["applied"]["good_steps"] == 1
    assert as_rows(loop["events"]) == [[1, "backoff", scale, scale / 2, VARIABLES[0], None]]


@pytest.mark.slow
def test_a_skipped_step_gives_back_batch_normalizations_statistics(any_run):
    state = any_run["forward_state"]
    assert state["paths"] == [
        "sequential/batch_normalization/moving_mean",
        "sequential/batch_normalization/moving_variance",
        "sequential/count_calls/calls",
    ]
    assert state["skipped_steps"] == 1
    assert state["skip_keeps_float_state"] and state["ok_changes_float_state"]
    assert state["integer_calls"] == [1, 2, 3]  # as on TensorFlow: named, not given back
    assert state["warnings"] == [
        "kmix: a skipped step gives back the float variables the forward pass assigned "
        "(BatchNormalization's statistics); these integer variables keep the skipped "
        "step's update: sequential/count_calls/calls."
    ]


@pytest.mark.slow
def test_the_callbacks_name_each_cast_overflow_and_the_autopilot_moves_it(any_run):
    run = any_run["watched"]
    # Epoch 1, step 3: wide's input cast overflows; epoch 2 (step 11): norm's, at 4 * 90000.
    assert run["moves"] == [
        [3, "wide", "mixed_float16", "float32"],
        [11, "norm", "mixed_float16", "float32"],
    ]
    origins = [(e["step"], e["kind"], e["origin"]) for e in run["events"]]
    assert origins == [
        (3, "forward_overflow", {**ORIGIN, "layer": "wide", "layer_class": "Dense"}),
        (11, "forward_overflow", {**ORIGIN, "layer": "norm", "max_abs_input": 360000.0}),
    ]
    assert run["layers"] == ["norm", "wide"]  # the tap's activation statistics
    assert run["health_step"] == 16 and run["histogram_step"] == 16
    assert not run["tensorflow_imported"]
    assert [name.startswith("events.out.tfevents.") for name in run["files"]] == [True]
    summary = run["summary"]
    assert [m["layer"] for m in summary["precision_moves"]] == ["wide", "norm"]
    assert summary["precision_plan"] == {"wide": "float32", "norm": "float32"}
    assert [e["step"] for e in summary["events"]] == [3, 11]
    assert summary["skipped_steps"] == 2 and summary["run_end"]["reason"] == "completed"


@pytest.mark.slow
@needs_jax
def test_a_changed_statistics_setting_reaches_the_jit_step_and_a_repeated_one_reuses_it(
    fit_run,
):
    run = fit_run["retraces"]
    # Every 3 steps: 6 in steps 1-8, 15 in 9-16; then every 1000 until step 19, every 5
    # from there: 20 is the last health step (the settings are constants of the step).
    assert run["health_steps"] == [6, 15, 20]
    # One trace per settings: the second fit asks for what the first did.
    assert run["traces"][0] == run["traces"][1] and run["traces"][2] > run["traces"][1]


@pytest.mark.slow
def test_a_sequential_without_input_names_the_cast_of_its_data_on_entry(any_run):
    (event,) = any_run["lazy_origin"]  # rows 4-5 are the third batch
    assert (event["step"], event["kind"]) == (3, "forward_overflow")
    assert event["origin"] == {
        "layer": "sequential/d",
        "layer_class": "Dense",
        "inputs_finite": True,
        "max_abs_input": 90000.0,
    }


@pytest.mark.slow
def test_activation_statistics_describe_the_steps_own_forward_pass_dropout_included(any_run):
    # Statistics every step: each step measures its own pass; a pass with another
    # dropout mask (another seed state) would not show what the layer saw.
    rows = any_run["measured_again"]
    assert len(rows) == 5
    for row in rows:
        assert row["drop"] is not None, rows
        assert row["drop"]["max_abs"] == row["seen"] > 0
        assert 0.2 < row["drop"]["zero_fraction"] < 0.8  # dropout dropped about half
    assert len({row["seen"] for row in rows}) == 5  # a new mask and batch at each step


@pytest.mark.slow
@needs_jax
def test_a_step_that_does_not_measure_its_pass_names_the_origin_its_own_pass_had(fit_run):
    # Steps 3 and 6 measure their own pass (statistics every 3 steps); the others run it
    # again from the step's values when the loss is non-finite. The origin's largest
    # input is the largest unit the step's dropout mask kept: the pass's own, each step.
    run = fit_run["origin_again"]
    assert run["measured"] == [0, 0, 1, 1, 1, 2]
    assert [e["step"] for e in run["events"]] == [1, 2, 3, 4, 5, 6]
    for event, seen in zip(run["events"], run["seen"], strict=True):
        assert event["kind"] == "forward_overflow" and not event["loss_finite"]
        assert event["origin"] == {
            "layer": "post",
            "layer_class": "Dense",
            "inputs_finite": True,
            "max_abs_input": float(seen),
        }
    assert len(set(run["seen"])) > 2  # the masks differ from step to step


ORIGIN = {
    "layer": "norm",
    "layer_class": "BatchNormalization",
    "inputs_finite": True,
    "max_abs_input": 90000.0,
}


@pytest.mark.slow
@needs_jax
def test_data_parallel_over_two_devices_skips_a_step_one_shard_spoils(tmp_path):
    run = run_script("data_parallel", tmp_path, devices=2)
    assert run["devices"] == 2 and run["variables"] == VARIABLES
    for kind in ("forward", "gradient"):  # the bad row is on the second device only
        step = run["steps"][kind]
        assert step["unchanged"] and step["replicas_identical"] and step["finite"], kind
        assert step["replicas"] == 2
    assert not run["steps"]["ok"]["unchanged"] and run["steps"]["ok"]["replicas_identical"]
    scale = SETTINGS["initial_scale"]
    assert as_rows(run["events"]) == [
        [2, "forward_overflow", scale, scale, "direct/kernel", False],
        [3, "backoff", scale, scale / 2, "hidden/kernel", True],
    ]
    assert run["state"]["skipped_steps"] == 2 and run["state"]["attempted_steps"] == 4
    # The NaN row came with the data: hidden (the float16 layer) is named, its inputs not
    # finite; the monitor on the global program wrote both events; statistics at step 4 only
    # (update_freq=4): steps 2 and 3 ran the quiet step, its origin from the pass run again.
    origin = {"layer": "hidden", "layer_class": "Dense", "inputs_finite": False}
    assert {k: run["events"][0]["origin"][k] for k in origin} == origin
    assert run["events"][1]["origin"] is None
    # one process: the shard (the second device's) is named, no process
    assert [e["source"] for e in run["events"]] == [{"process": None, "replica": 1}] * 2
    assert run["layers"] == ["hidden"] and run["state"]["health_step"] == 4
    assert run["report_events"] == [2, 3]


# ------------------------------------------------------------------ fast: the pure pieces
def test_the_reference_reads_the_scripts_settings():
    source = open(SCRIPT).read()
    assert 'KINDS = ["ok", "ok", "forward", "ok", *["gradient"] * 4, *["ok"] * 8]' in source
    for name, value in SETTINGS.items():
        assert f'"{name}": {value},' in source


@pytest.mark.parametrize(("dtype", "top"), [("int64", 2**63 - 1), ("int32", 2**31 - 1)])
def test_counters_saturate_at_their_dtypes_end(dtype, top):
    assert record.int_max(dtype) == top
    counter = ops.convert_to_tensor(np.asarray([top - 2, top - 1, top], dtype))
    after = ops.convert_to_numpy(record.saturating_add(counter, True))
    assert after.dtype == np.dtype(dtype)
    assert after.tolist() == [top - 1, top, top]


def test_int_max_refuses_a_float_dtype():
    with pytest.raises(ValueError, match="dtype='float32' is not an integer dtype"):
        record.int_max("float32")


def int32_record(attempted: int) -> tuple:
    counters = record.initial_counters(1)._replace(attempted_steps=attempted)
    packed = ops.convert_to_tensor(np.asarray(list(counters), "int32"))
    ring = record.EventRing(
        ops.convert_to_tensor(np.zeros((2, len(record.EVENT_INT_FIELDS)), "int32")),
        ops.convert_to_tensor(np.zeros((2, len(record.EVENT_FLOAT_FIELDS)), "float32")),
    )
    return packed, ring


def int32_values(attempted: int, n: int = 2) -> step_values.RecordValues:
    packed, ring = int32_record(attempted)
    return step_values.RecordValues(
        scale=ops.convert_to_tensor(4.0),
        counters=packed,
        health=ops.convert_to_tensor(np.full(len(record.HEALTH_FIELDS), np.nan, "float32")),
        underflow_per_variable=ops.zeros((n,)),
        subnormal_per_variable=ops.zeros((n,)),
        exponent_histograms=ops.zeros((n, health.NUM_EXPONENT_BINS), "int32"),
        activation_stats=ops.convert_to_tensor(
            np.full((ACTIVATION_CAPACITY, len(ACTIVATION_FIELDS)), np.nan, "float32")
        ),
        event_ints=ring.ints,
        event_floats=ring.floats,
    )


def _advance(*args: object) -> step_values.RecordValues:
    return step_values.advance_record(*args)[0]


def test_the_record_as_values_keeps_int32_and_writes_an_event_only_when_one_happens():
    rule = scaling.ScaleConfig(growth_steps=10, min_scale=1.0, max_scale=8.0)
    never = step_values.Statistics(10**6, 0, np.ones(2, "float32"))
    grads = [np.ones(3, "float32"), np.ones(2, "float32")]
    finite = np.float32([0, 0, 0, 0])
    new = _advance(int32_values(2**31 - 2), grads, finite, never, None, rule)
    counters = record.Counters(*ops.convert_to_numpy(new.counters).tolist())
    assert ops.convert_to_numpy(new.counters).dtype == np.int32
    assert counters.attempted_steps == 2**31 - 1 and counters.event_count == 0
    assert float(new.scale) == 4.0 and not ops.convert_to_numpy(new.event_ints).any()
    overflow = np.float32([0, 1, 0, 0])  # the second gradient, at the saturated end
    spoilt = [grads[0], grads[1] * np.inf]
    new = _advance(new, spoilt, overflow, never, None, rule)
    counters = record.Counters(*ops.convert_to_numpy(new.counters).tolist())
    assert counters.attempted_steps == 2**31 - 1 and counters.skipped_steps == 1
    assert counters.event_count == 1 and float(new.scale) == 2.0
    (event,) = record.decode_events(
        ops.convert_to_numpy(new.event_ints),
        ops.convert_to_numpy(new.event_floats),
        1,
        0,
        ["a", "b"],
    )
    assert (event.event.step, event.event.kind, event.event.variable) == (2**31 - 1, "backoff", "b")
    assert (event.event.old_scale, event.event.new_scale) == (4.0, 2.0)
    # A skip is measured at its step: the two inf elements, the finite norm sqrt(3) / 4.
    assert event.health["nonfinite_elements"] == 2.0 and event.health["float16_elements"] == 5.0
    assert event.health["grad_norm"] == pytest.approx(3**0.5 / 4)


def test_the_record_as_values_measures_health_when_due_and_keeps_it_otherwise():
    rule = scaling.ScaleConfig(growth_steps=10, min_scale=1.0, max_scale=8.0)
    every_2 = step_values.Statistics(2, 2, np.float32([1, 0]))
    grads = [np.float32([0.0, 2.0**-20, 3.0]), np.float32([5.0, 6.0])]
    finite = np.float32([0, 0, 0, 0])
    old = int32_values(0)
    first = _advance(old, grads, finite, every_2, None, rule)  # step 1
    assert np.isnan(ops.convert_to_numpy(first.health)).all()
    assert not ops.convert_to_numpy(first.exponent_histograms).any()
    second = _advance(first, grads, finite, every_2, None, rule)  # step 2
    values = ops.convert_to_numpy(second.health).tolist()
    measured = dict(zip(record.HEALTH_FIELDS, values, strict=True))
    # Only the first variable is float16: 3 scaled elements, one exact zero, one below
    # float16's smallest normal (2**-20 < 2**-14), the largest 3; the norm is unscaled
    # by 4 over both (reference: plain Python).
    assert measured["float16_elements"] == 3.0
    assert measured["max_abs_scaled"] == 3.0
    assert measured["grad_norm"] == pytest.approx((2.0**-40 + 9 + 25 + 36) ** 0.5 / 4)
    assert measured["zero_fraction"] == pytest.approx(1 / 3)
    assert measured["subnormal_fraction"] == pytest.approx(1 / 3)
    assert ops.convert_to_numpy(second.underflow_per_variable).tolist() == pytest.approx([2 / 3, 0])
    histograms = ops.convert_to_numpy(second.exponent_histograms)
    assert histograms.sum(axis=1).tolist() == [3, 2]
    assert histograms[0, 0] == 1  # the zero has its own bin


def test_a_backend_kmix_does_not_run_on_is_refused_in_one_line(monkeypatch):
    import kmix

    monkeypatch.setattr(_backend, "NAME", "openvino")  # as if Keras ran on OpenVINO
    with pytest.raises(ValueError) as error:
        kmix.LossScaleOptimizer("sgd")
    message = str(error.value)
    assert "\n" not in message
    assert "kmix.LossScaleOptimizer does not support the Keras backend 'openvino'" in message
    assert "it runs on 'tensorflow', 'jax' and 'torch'" in message


@pytest.mark.slow
def test_a_process_other_than_the_first_requests_the_statistics_but_writes_nothing(
    tmp_path, monkeypatch
):
    import keras

    import kmix

    monkeypatch.setattr(_backend, "is_first_process", lambda: False)
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = kmix.LossScaleOptimizer("sgd", health_every=1000)
    model.compile(optimizer=optimizer, loss="mse")
    seen = []

    class During(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            seen.append(optimizer.health_every)

    monitor = kmix.callbacks.MixedPrecisionMonitor(str(tmp_path / "logs"), update_freq=3)
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[monitor, During()])
    # The same program on every process: the monitor's steps are in force here too.
    assert seen == [3] * 4 and optimizer.read_state().health_step == 3
    assert optimizer.health_every == 1000  # released at the end
    assert not (tmp_path / "logs").exists()  # process 0 writes


def test_int32_counters_are_quiet_up_to_their_own_end():
    """JAX without x64 keeps the counters in int32: the quiet step stops before int32's end."""
    top = 2**31 - 1
    rule = scaling.ScaleConfig(growth_steps=10)

    def quiet(attempted: int) -> bool:
        packed, _ = int32_record(attempted)
        clean = np.float32([0, 0, 0])
        return bool(record.is_quiet(packed, clean, np.asarray([False, False]), rule))

    low, high = record.quiet_bounds(rule, "int32")
    assert low.dtype == high.dtype == np.int32
    assert quiet(top - 2) and not quiet(top - 1)  # one more step would reach the end


def printed_json(backend: str, *args: str) -> str:
    """Runs ``python *args`` on ``backend``; returns what its first ``JSON `` line says."""
    env = {**os.environ, "KERAS_BACKEND": backend, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=TIMEOUT
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("JSON ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return lines[0][len("JSON ") :]


LOAD = (
    "import dataclasses, json, sys, keras, kmix\n"
    "opt = keras.models.load_model(sys.argv[1]).optimizer\n"
    "events = [dataclasses.asdict(e) for e in opt.scale_events()]\n"
    "print('JSON', json.dumps({'state': dataclasses.asdict(opt.read_state()),\n"
    "    'kinds': [e['kind'] for e in events], 'steps': [e['step'] for e in events]}))\n"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_on", "loaded_on"),
    [
        pytest.param("torch", "tensorflow", marks=needs_torch),
        pytest.param("torch", "jax", marks=[needs_torch, needs_jax]),
        pytest.param("jax", "torch", marks=[needs_torch, needs_jax]),
    ],
)
def test_a_model_saved_on_one_backend_loads_on_another_with_its_state(saved_on, loaded_on, request):
    """The fit scenario's ``.keras`` file (saved after 19 steps) read on another backend:
    the scale, the counters and the events come back (int32 counters load as int64)."""
    run = request.getfixturevalue("fit_run" if saved_on == "jax" else "torch_run")
    line = printed_json(loaded_on, "-c", LOAD, os.path.join(run["directory"], "model.keras"))
    loaded, saved = json.loads(line), run["saved"]
    assert loaded["state"] == saved["state"]
    assert loaded["kinds"] == [e["kind"] for e in saved["events"]]
    assert loaded["steps"] == [e["step"] for e in saved["events"]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend",
    ["tensorflow", pytest.param("jax", marks=needs_jax), pytest.param("torch", marks=needs_torch)],
)
def test_a_saved_kmix_model_loads_after_a_plain_import_kmix_on_either_backend(backend):
    """The fixture was saved on TensorFlow (int64 counters); JAX without x64, and torch,
    hold int32."""
    data = os.path.join(TESTS, "data", "optimizer_643f46e.keras")
    code = (
        "import keras, kmix\n"
        f"opt = keras.models.load_model({data!r}).optimizer\n"
        "state = opt.read_state()\n"
        "print('JSON', type(opt).__name__, state.attempted_steps, state.event_count,"
        " len(opt.scale_events()), opt.recorder.counters.dtype)\n"
    )
    line = printed_json(backend, "-W", "error::UserWarning", "-c", code)
    dtype = "int64" if backend == "tensorflow" else "int32"
    # 11 events happened, the ring of 8 keeps the last 8 (tests/data/optimizer_643f46e.json).
    assert line.split() == ["LossScaleOptimizer", "15", "11", "8", dtype]
