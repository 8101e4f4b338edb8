"""The TensorBoard plugin's HTTP routes, served by TensorBoard's own WSGI app.

Runs are written with ``tf.summary`` in kmix's tag formats and read through
TensorBoard's multiplexer data provider with its default sampling, as
``tensorboard --logdir`` would. A fake provider stands in for a 100,000-step run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from importlib import metadata as importlib_metadata

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_ingester, plugin_event_multiplexer
from tensorboard.backend.event_processing import data_provider as mux_provider
from tensorboard.data import provider as tb_provider
from tensorboard.plugins import base_plugin
from tensorboard.plugins.histogram import metadata as histogram_metadata
from werkzeug import test as werkzeug_test
from werkzeug import wrappers

from kmix import report, tags
from kmix.tbplugin import plugin as kmix_plugin
from kmix.tbplugin import view

EVENTS = [  # (step, kind, old, new, variable, count, loss_finite)
    (3, "backoff", 1024.0, 512.0, "dense/kernel", 1, True),
    (7, "backoff", 512.0, 256.0, "dense/bias", 2, True),
    (9, "forward_overflow", 256.0, 256.0, None, 0, False),
    (16, "growth", 256.0, 512.0, None, 0, True),
]
HISTOGRAM_STEPS = (4, 8, 12)


def _event(step, kind, old, new, variable, count, loss_finite):
    return tags.ScaleEvent(0, step, kind, old, new, variable, count, loss_finite, None)


def _histogram(exponents: dict[int, int], nonfinite: int = 0) -> np.ndarray:
    edges = np.asarray(tags.exponent_bucket_edges(), np.float64)
    counts = np.zeros(tags.NUM_EXPONENT_BINS)
    for exponent, count in exponents.items():
        counts[tags.exponent_bin(exponent)] = count
    counts[-1] = nonfinite
    return np.column_stack([edges, counts])


def write_kmix_run(path: str) -> None:
    """A 20-step run: scale, skips, headroom, four events, histograms, policy."""
    writer = tf.summary.create_file_writer(path)
    with writer.as_default():
        scale, skipped = 1024.0, 0
        by_step = {e[0]: e for e in EVENTS}
        for step in range(1, 21):
            event = by_step.get(step)
            if event is not None:
                scale = event[3]
                skipped += event[1] != "growth"
                tf.summary.text(tags.EVENTS, tags.format_event(_event(*event)), step=step)
            tf.summary.scalar(tags.LOSS_SCALE, scale, step=step)
            tf.summary.scalar(tags.SKIPPED_STEPS, skipped, step=step)
            headroom = -1.0 if step in (3, 7) else 4.0 + step % 3
            tf.summary.scalar(tags.OVERFLOW_HEADROOM_BITS, headroom, step=step)
        for step in HISTOGRAM_STEPS:
            for variable, hist in (
                ("dense/kernel", _histogram({-30: 5, -10: 90, 3: 5}, nonfinite=step == 4)),
                ("dense/bias", _histogram({-12: 10})),
            ):
                tf.summary.write(
                    tags.GRAD_EXPONENT + variable,
                    hist,
                    step=step,
                    metadata=histogram_metadata.create_summary_metadata(variable, ""),
                )
        table = "| layer | compute |\n|---|---|\n| dense | float16 |"
        policy = (
            f"Global dtype policy `mixed_float16`; model `m` policy `mixed_float16`.\n\n{table}"
        )
        tf.summary.text(tags.POLICY, policy, step=0)
    writer.close()


def write_plain_run(path: str) -> None:
    """A run without kmix data."""
    writer = tf.summary.create_file_writer(path)
    with writer.as_default():
        for step in range(3):
            tf.summary.scalar("loss", 1.0 / (step + 1), step=step)
    writer.close()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    write_kmix_run(str(root / "exp" / "train"))
    write_plain_run(str(root / "plain" / "train"))
    return root


def serve(provider) -> werkzeug_test.Client:
    """A client of TensorBoard's WSGI app with only the kmix plugin, over ``provider``."""
    context = base_plugin.TBContext(logdir=None, data_provider=provider)
    app = application.TensorBoardWSGI([kmix_plugin.KmixPlugin(context)], data_provider=provider)
    return werkzeug_test.Client(app, wrappers.Response)


def default_provider(logdir) -> mux_provider.MultiplexerDataProvider:
    """TensorBoard's Python data provider with its default sampling."""
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        size_guidance=data_ingester.DEFAULT_SIZE_GUIDANCE,
        tensor_size_guidance=data_ingester.DEFAULT_TENSOR_SIZE_GUIDANCE,
    )
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    return mux_provider.MultiplexerDataProvider(multiplexer, str(logdir))


@pytest.fixture(scope="module")
def client(logdir):
    return serve(default_provider(logdir))


def get_json(client, url, status=200):
    response = client.get(url)
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.headers["Content-Type"].startswith("application/json")
    return json.loads(response.get_data(as_text=True))


URL = "/data/plugin/kmix"


# ----------------------------------------------------------------- routes
def test_runs_route_splits_runs_with_and_without_kmix_data(client):
    assert get_json(client, f"{URL}/runs") == {
        "runs": ["exp/train"],
        "other_runs": ["plain/train"],
        "default_run": "exp/train",  # no policy record: the first run
        "compute_dtypes": {},
        "ended": {},  # runs whose end is recorded and not "completed"
    }


def test_run_route_shape_events_series_and_heatmap(client):
    data = get_json(client, f"{URL}/run?run=exp/train")
    assert data["run"] == "exp/train" and data["empty"] is False
    summary = data["summary"]
    events = [
        (e["step"], e["kind"], e["old_scale"], e["new_scale"], e["variable"])
        for e in summary["events"]
    ]
    assert events == [(s, k, o, n, v) for s, k, o, n, v, _, _ in EVENTS]
    assert [e["loss_finite"] for e in summary["events"]] == [True, True, False, True]
    assert data["events_check"] == {
        "complete": True,
        "shown": 3,
        "skipped_steps": 3,
        "message": None,
    }
    scale = data["series"]["loss_scale"]
    # a step line only needs the points where the scale changes (and the ends)
    assert scale["steps"] == [1, 3, 7, 16, 20] and scale["points"] == 20
    assert scale["values"] == [1024.0, 512.0, 256.0, 512.0, 512.0]
    assert data["series"]["overflow_headroom_bits"]["steps"] == list(range(1, 21))
    assert data["series"]["min_activation_headroom_bits"] is None
    exponents = data["exponents"]
    assert exponents["steps"] == list(HISTOGRAM_STEPS)
    heat = exponents["heatmap"]
    assert heat["step"] == 12 and heat["variables"] == ["dense/bias", "dense/kernel"]
    kernel = heat["shares"][1]
    assert len(kernel) == tags.NUM_EXPONENT_BINS
    assert kernel[tags.exponent_bin(-10)] == pytest.approx(0.9)
    assert sum(kernel) == pytest.approx(1.0)
    grid = data["headroom_by_variable"]
    assert grid["steps"] == list(HISTOGRAM_STEPS)
    assert grid["names"] == ["dense/bias", "dense/kernel"]
    assert grid["bits"][1] == ["nonfinite", 12.0, 12.0]  # 15 - 3: the top exponent is 3
    assert grid["bits"][0] == [27.0, 27.0, 27.0]
    assert data["float16"]["min_normal_exponent"] == -14
    assert "| layer | compute |" in summary["policy"]


def test_run_summary_is_kmix_reports(client, logdir):
    """One source of truth: the tab's summary is ``kmix report --json``'s, but the path."""
    data = get_json(client, f"{URL}/run?run=exp/train")
    expected = json.loads(report.to_json(report.summarize(report.read_log(str(logdir / "exp")))))
    got = dict(data["summary"])
    assert got.pop("logdir") == "exp/train"
    expected.pop("logdir")
    assert got == expected
    assert got["precision_whatif"]["gradients"]["step"] == 12


def test_exponents_route_gives_the_heatmap_at_a_histogram_step(client):
    heat = get_json(client, f"{URL}/exponents?run=exp/train&step=4")
    assert heat["step"] == 4 and heat["variables"] == ["dense/bias", "dense/kernel"]
    assert heat["elements"] == [10, 101]
    assert heat["shares"][1][-1] == pytest.approx(1 / 101)  # the inf/NaN bin
    assert get_json(client, f"{URL}/exponents?run=exp/train")["step"] == 12


def test_run_without_kmix_data_gives_the_empty_state(client):
    data = get_json(client, f"{URL}/run?run=plain/train")
    assert data["empty"] is True
    assert "no kmix data" in data["message"] and "MixedPrecisionMonitor" in data["message"]


def test_events_sampled_away_by_tensorboard_are_told(tmp_path):
    """TensorBoard keeps 10 text points per tag by default; the skip counter knows more."""
    writer = tf.summary.create_file_writer(str(tmp_path / "many"))
    with writer.as_default():
        for step in range(1, 16):
            event = _event(step, "backoff", 2.0 ** (30 - step), 2.0 ** (29 - step), "w", 1, True)
            tf.summary.text(tags.EVENTS, tags.format_event(event), step=step)
            tf.summary.scalar(tags.SKIPPED_STEPS, step, step=step)
    writer.close()
    data = get_json(serve(default_provider(tmp_path)), f"{URL}/run?run=many")
    check = data["events_check"]
    assert check["complete"] is False and check["shown"] == 10 and check["skipped_steps"] == 15
    assert "--samples_per_plugin=text=0" in check["message"]


def test_a_directory_written_by_two_runs_shows_the_latest_and_says_so(tmp_path):
    """A script run twice into one log dir: the tab draws the latest run, as kmix report."""
    from test_runs import write_twice

    write_twice(str(tmp_path / "twice"))
    client = serve(default_provider(tmp_path))
    data = get_json(client, f"{URL}/run?run=twice/train")
    summary = data["summary"]
    assert (summary["steps_seen"], summary["skipped_steps"]) == (6, 1)
    assert [(e["step"], e["old_scale"]) for e in summary["events"]] == [(4, 1024.0)]
    assert summary["run"]["index"] == 2 and len(summary["runs"]) == 2
    loss_scale = data["series"]["loss_scale"]
    assert (loss_scale["steps"], loss_scale["values"]) == ([1, 4, 6], [1024.0, 512.0, 512.0])
    assert data["runs_note"].startswith("this log dir holds 2 kmix runs")
    assert data["runs_note"] == summary["findings"][0]["message"]
    expected = json.loads(
        report.to_json(report.summarize(report.read_log(str(tmp_path / "twice"))))
    )
    assert {k: v for k, v in summary.items() if k != "logdir"} == {
        k: v for k, v in expected.items() if k != "logdir"
    }
    heat = get_json(client, f"{URL}/exponents?run=twice/train")
    assert heat["variables"] == ["b/kernel"]  # the earlier run's histogram is not drawn


def test_no_run_with_kmix_data(tmp_path):
    write_plain_run(str(tmp_path / "plain"))
    provider = default_provider(tmp_path)
    client = serve(provider)
    assert get_json(client, f"{URL}/runs") == {
        "runs": [],
        "other_runs": ["plain"],
        "default_run": None,
        "compute_dtypes": {},
        "ended": {},
    }
    context = base_plugin.TBContext(logdir=None, data_provider=provider)
    assert kmix_plugin.KmixPlugin(context).is_active() is False


def test_plugin_is_active_and_registered(logdir):
    context = base_plugin.TBContext(logdir=None, data_provider=default_provider(logdir))
    plugin = kmix_plugin.KmixPlugin(context)
    assert plugin.is_active() is True
    meta = plugin.frontend_metadata()
    assert meta.es_module_path == "/static/index.js" and meta.tab_name == "Mixed Precision"
    points = importlib_metadata.entry_points(group="tensorboard_plugins")
    assert {p.name: p.value for p in points}["kmix"] == "kmix.tbplugin.plugin:KmixPlugin"


def test_the_plugin_does_not_import_tensorflow():
    code = (
        "import sys, kmix.tbplugin.plugin as p; "
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------ bad requests
BAD_RUN_QUERIES = [
    ("run=nope", "unknown run 'nope'"),
    ("run=../../etc/passwd", "unknown run"),
    ("run=/etc/passwd", "unknown run"),
    ("run=exp%2F..%2F..%2Fsetup.cfg", "unknown run"),
    ("", "missing query parameter 'run'"),
    ("run=exp/train&run=plain/train", "given 2 times"),
    ("run=" + "x" * 5000, "at most 1000"),
    ("run=exp/train&points=abc", "not a non-negative integer"),
    ("run=exp/train&points=-5", "not a non-negative integer"),
    ("run=exp/train&points=1e3", "not a non-negative integer"),
    ("run=exp/train&points=" + "9" * 40, "not a non-negative integer"),
    ("run=exp/train&points=100000000", "out of range"),
    ("run=exp/train&points=2", "out of range"),
]
BAD_EXPONENT_QUERIES = [
    ("run=exp/train&step=5", "no gradient exponent histogram at step 5"),
    ("run=exp/train&step=x", "not a non-negative integer"),
    ("run=exp/train&step=99999999999999", "not a non-negative integer"),
    ("run=plain/train", "has no gradient exponent histograms"),
    ("run=nope&step=4", "unknown run"),
]


def test_bad_requests_answer_400_with_a_message(client):
    """Query values are only names to look up or bounded integers, never paths."""
    for route, queries in (("run", BAD_RUN_QUERIES), ("exponents", BAD_EXPONENT_QUERIES)):
        for query, words in queries:
            data = get_json(client, f"{URL}/{route}?{query}", status=400)
            assert words in data["error"], (route, query, data)


def test_static_files_come_from_a_fixed_list(client):
    for name, kind in (
        ("index.js", "text/javascript"),
        ("float8.js", "text/javascript"),
        ("style.css", "text/css"),
        ("index.html", "text/html"),
    ):
        response = client.get(f"{URL}/static/{name}")
        assert response.status_code == 200 and response.headers["Content-Type"].startswith(kind)
    assert "export async function render" in client.get(f"{URL}/static/index.js").get_data(
        as_text=True
    )
    for path in (
        "plugin.py",
        "../plugin.py",
        "..%2fplugin.py",
        "%2e%2e%2f%2e%2e%2fsetup.cfg",
        "../../../../setup.cfg",
        "/etc/passwd",
        "%2Fetc%2Fpasswd",
        "static/index.js/..",
        "index.js%00.py",
        "INDEX.JS",
        "",
    ):
        response = client.get(f"{URL}/static/{path}")
        assert response.status_code == 404, path


def test_no_request_writes_anything(logdir):
    package = os.path.dirname(kmix_plugin.__file__)

    def snapshot():
        found = {}
        for root in (str(logdir), package):
            for folder, _, files in os.walk(root):
                for name in files:
                    if "__pycache__" not in folder:
                        stat = os.stat(os.path.join(folder, name))
                        found[os.path.join(folder, name)] = (stat.st_size, stat.st_mtime_ns)
        return found

    before = snapshot()
    client = serve(default_provider(logdir))
    for url in (
        "/runs",
        "/run?run=exp/train",
        "/run?run=plain/train",
        "/run?run=../x",
        "/exponents?run=exp/train&step=8",
        "/static/index.js",
        "/static/../../x",
    ):
        client.get(URL + url)
    assert snapshot() == before


# --------------------------------------------------- long runs, downsampled
def test_downsample_keeps_ends_and_every_spike():
    steps = np.arange(1, 100_001)
    values = np.full(steps.size, 5.0)
    values[[12_345, 77_777]] = [-3.0, 40.0]
    values[50_000] = np.nan
    index = view.downsample(steps, values, 300)
    assert index.size <= 303 and index[0] == 0 and index[-1] == steps.size - 1
    assert {12_345, 77_777, 50_000} <= set(index.tolist())
    assert view.downsample(steps[:10], values[:10], 300).tolist() == list(range(10))


def test_step_changes_keep_a_step_line_exact():
    values = np.array([4.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0])
    assert view.step_changes(values).tolist() == [0, 2, 5, 6]


class LongRunProvider(tb_provider.DataProvider):
    """A 100,000-step run held in memory: one point per step, a scale event every 500."""

    STEPS = 100_000

    SERIES = dict(
        max_step=STEPS, max_wall_time=0.0, plugin_content=b"", description="", display_name=""
    )

    def __init__(self):
        steps = np.arange(1, self.STEPS + 1)
        self.scale = 2.0 ** (10 + (steps // 500) % 6)
        self.headroom = 3.0 + np.sin(steps / 50.0)
        self.headroom[54_321] = -2.0
        self.events = [
            (int(s), self.scale[s - 2], self.scale[s - 1])
            for s in steps[1:]
            if self.scale[s - 1] != self.scale[s - 2]
        ]

    def experiment_metadata(self, ctx=None, *, experiment_id):
        return tb_provider.ExperimentMetadata()

    def list_plugins(self, ctx=None, *, experiment_id):
        return ["scalars", "text"]

    def list_runs(self, ctx=None, *, experiment_id):
        return [tb_provider.Run(run_id="long", run_name="long", start_time=0.0)]

    def list_scalars(self, ctx=None, *, experiment_id, plugin_name, run_tag_filter=None):
        series = tb_provider.ScalarTimeSeries(**self.SERIES)
        return {"long": {tags.LOSS_SCALE: series, tags.OVERFLOW_HEADROOM_BITS: series}}

    def read_scalars(
        self, ctx=None, *, experiment_id, plugin_name, downsample=None, run_tag_filter=None
    ):
        def points(values):
            return [tb_provider.ScalarDatum(i + 1, 0.0, v) for i, v in enumerate(values.tolist())]

        return {
            "long": {
                tags.LOSS_SCALE: points(self.scale),
                tags.OVERFLOW_HEADROOM_BITS: points(self.headroom),
            }
        }

    def read_last_scalars(self, ctx=None, *, experiment_id, plugin_name, run_tag_filter=None):
        return {}

    def list_tensors(self, ctx=None, *, experiment_id, plugin_name, run_tag_filter=None):
        if plugin_name != "text":
            return {}
        return {"long": {tags.EVENTS: tb_provider.TensorTimeSeries(**self.SERIES)}}

    def read_tensors(
        self, ctx=None, *, experiment_id, plugin_name, downsample=None, run_tag_filter=None
    ):
        if plugin_name != "text":
            return {}
        data = []
        for step, old, new in self.events:
            kind = "growth" if new > old else "backoff"
            variable = None if kind == "growth" else "w"
            line = tags.format_event(
                _event(step, kind, old, new, variable, int(bool(variable)), True)
            )
            data.append(tb_provider.TensorDatum(step, 0.0, np.array(line.encode())))
        return {"long": {tags.EVENTS: data}}

    def list_blob_sequences(self, ctx=None, *, experiment_id, plugin_name, run_tag_filter=None):
        return {}

    def read_blob_sequences(
        self, ctx=None, *, experiment_id, plugin_name, downsample=None, run_tag_filter=None
    ):
        return {}

    def read_blob(self, ctx=None, *, blob_key):
        raise KeyError(blob_key)


def test_a_100000_step_run_is_served_downsampled():
    """Its time is measured in bench/bench_tab.py (tests assert no timings)."""
    provider = LongRunProvider()
    client = serve(provider)
    response = client.get(f"{URL}/run?run=long")
    assert response.status_code == 200
    data = json.loads(response.get_data(as_text=True))
    assert len(response.get_data()) < 200_000
    scale = data["series"]["loss_scale"]
    assert (
        scale["points"] == LongRunProvider.STEPS and len(scale["steps"]) <= view.DEFAULT_POINTS + 3
    )
    headroom = data["series"]["overflow_headroom_bits"]
    assert len(headroom["steps"]) <= view.DEFAULT_POINTS + 3
    assert min(headroom["values"]) == -2.0  # the one overflow survives downsampling
    assert len(data["summary"]["events"]) == len(provider.events)  # events are never sampled


# ------------------------------------------ float16 views of float16 layers only
MIXED_HISTOGRAM_STEPS = range(25, 401, 25)


def write_mixed_run(path: str) -> None:
    """A float16 layer and a float32 head whose scaled gradients pass 65504 (in float32),
    one health reading, and a ring that lost the first events of a scale begun at 1024."""
    record = tags.PolicyRecord(
        "mixed_float16", "m", "mixed_float16", "float16", "float32", "kmix", 1.0, 2.0**24,
        100, 25, loss_scale=1024.0,
        variable_dtypes={"dense/kernel": "float16", "head/kernel": "float32"},
    )  # fmt: skip
    lost = tags.EventsLost(10, 0, 400, 2)
    writer = tf.summary.create_file_writer(path)
    with writer.as_default():
        tf.summary.text(tags.POLICY_RECORD, tags.format_policy_record(record), step=0)
        tf.summary.text(tags.EVENTS, tags.format_events_lost(lost), step=11)
        tf.summary.scalar(tags.LOSS_SCALE, 1.0, step=10)
        tf.summary.scalar(tags.LOSS_SCALE, 1.0, step=400)
        tf.summary.scalar(tags.OVERFLOW_HEADROOM_BITS, 1.12, step=100)
        for step in MIXED_HISTOGRAM_STEPS:
            for variable, hist in (
                ("dense/kernel", _histogram({3: 10})),
                ("head/kernel", _histogram({17: 10})),
            ):
                tf.summary.write(
                    tags.GRAD_EXPONENT + variable,
                    hist,
                    step=step,
                    metadata=histogram_metadata.create_summary_metadata(variable, ""),
                )
    writer.close()


def test_float32_layers_are_left_out_of_the_float16_headroom_grid(tmp_path):
    write_mixed_run(str(tmp_path / "mixed" / "train"))
    data = get_json(serve(default_provider(tmp_path)), f"{URL}/run?run=mixed/train")
    grid = data["headroom_by_variable"]
    assert grid["names"] == ["dense/kernel"]  # head/kernel: -2 bits were drawn red
    assert grid["bits"] == [[12.0] * len(MIXED_HISTOGRAM_STEPS)]
    assert grid["left_out"] == {"head/kernel": "float32"}
    assert data["summary"]["variables_not_float16"] == {"head/kernel": "float32"}
    heat = data["exponents"]["heatmap"]  # the page draws head/kernel apart, without limits
    assert heat["variables"] == ["dense/kernel", "head/kernel"]
    assert data["summary"]["loss_scale"]["initial"] == 1024.0
    assert (
        data["scale_caveat"] == " (min and max of the scales the log holds: 10 scale events lost)"
    )
    assert data["series"]["overflow_headroom_bits"]["points"] == 1
    assert data["loss_scale_begin"] == {"step": 0, "value": 1024.0}
    assert data["events_lost_between"] == [[0, 10]]  # before the note's step, 11


# ------------------------------------ a kmix compare log dir: one run per policy
COMPARE_RUNS = {"float32": "float32", "float32_repeat": "float32", "mixed_float16": "float16"}
HEADROOM_STEPS = (5, 10, 15, 20)
GRADIENT_TOPS = {  # variable -> top exponent of its scaled gradients (headroom 15 - top)
    "a/overflow": 16,  # -1 bit
    "b/tight": 14,  # 1 bit
    "c/close": 12,  # 3 bits
    "d/fine": 3,  # 12 bits
    "e/far": -9,  # 24 bits
    "f/farther": -25,  # 40 bits
    "g/zeros": None,  # every element zero
}
ACTIVATION_BITS = {  # layer -> recorded activation headroom
    "l1_low": 0.5,
    "l2_tight": 2.0,
    "l3_ok": 4.5,
    "l4_fine": 12.0,
    "l5_far": 24.0,
    "l6_zeros": math.log2(65504 / 2.0**-24),  # the cap: an all-zero output
    "l7_nan": math.log2(65504 / 2.0**-24),  # no finite value: all NaN at step 15
}


def write_policy_run(path: str, compute: str, steps: int = 20) -> None:
    """A run of ``kmix compare``'s kind: a policy record, a loss scale that stays at
    32768 (its optimizer is a LossScaleOptimizer whatever the policy); a float16 run
    also has gradient histograms and activation headroom."""
    policy = "float32" if compute == "float32" else f"mixed_{compute}"
    variables = {name + "/kernel": compute for name in ("dense", "head")}
    record = tags.PolicyRecord(
        policy, "m", policy, compute, "float32", "kmix", 1.0, 2.0**24, 10,
        5 if compute == "float16" else 0, loss_scale=32768.0, variable_dtypes=variables,
    )  # fmt: skip
    writer = tf.summary.create_file_writer(path)
    with writer.as_default():
        tf.summary.text(tags.POLICY_RECORD, tags.format_policy_record(record), step=0)
        for step in range(1, steps + 1):
            tf.summary.scalar(tags.LOSS_SCALE, 32768.0, step=step)
            tf.summary.scalar(tags.SKIPPED_STEPS, 0.0, step=step)
            tf.summary.scalar(tags.GRAD_NORM, 1.0 / step, step=step)
        if compute == "float16":
            for step in HEADROOM_STEPS:
                tf.summary.scalar(tags.OVERFLOW_HEADROOM_BITS, 3.0, step=step)
                for layer, bits in ACTIVATION_BITS.items():
                    if layer == "l4_fine" and step == 10:
                        continue  # not measured at step 10
                    tf.summary.scalar(tags.ACTIVATION_HEADROOM_BITS + layer, bits, step=step)
                    nonfinite = float(layer == "l7_nan" and step == 15)
                    tf.summary.scalar(
                        tags.ACTIVATION_NONFINITE_FRACTION + layer, nonfinite, step=step
                    )
                for variable, top in GRADIENT_TOPS.items():
                    if variable == "d/fine" and step == 10:
                        continue  # no histogram at step 10
                    counts = _histogram({} if top is None else {top: 4, top - 3: 6})
                    if top is None:
                        counts[0, -1] = 10  # the exactly-zero bin
                    tf.summary.write(
                        tags.GRAD_EXPONENT + variable,
                        counts,
                        step=step,
                        metadata=histogram_metadata.create_summary_metadata(variable, ""),
                    )
    writer.close()


def write_compare_logdir(root, extra_runs: int = 0) -> None:
    """``root/cmp``: what ``kmix compare --logdir root/cmp`` writes (a run per policy and
    the comparison's record), beside ``extra_runs`` runs of another experiment."""
    from test_compare import comparison

    from kmix.compare.comparison import write_comparison

    for name, compute in COMPARE_RUNS.items():
        write_policy_run(str(root / "cmp" / name / "train"), compute)
    write_comparison(str(root / "cmp"), comparison())
    for k in range(extra_runs):
        writer = tf.summary.create_file_writer(str(root / f"other_experiment_{k}" / "train"))
        with writer.as_default():
            tf.summary.scalar(tags.LOSS_SCALE, 1024.0, step=1)
        writer.close()


@pytest.fixture(scope="module")
def compare_client(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    write_compare_logdir(root)
    return serve(default_provider(root))


def test_the_default_run_of_a_compare_logdir_is_its_float16_run(compare_client):
    """float32/train sorts first, but its float16 panels would be empty: the page ticks
    a run whose policy record says it computes in float16."""
    listing = get_json(compare_client, f"{URL}/runs")
    assert listing["runs"] == ["cmp/float32/train", "cmp/float32_repeat/train",
                               "cmp/mixed_float16/train"]  # fmt: skip
    assert listing["default_run"] == "cmp/mixed_float16/train"
    assert listing["compute_dtypes"] == {
        "cmp/float32/train": "float32",
        "cmp/float32_repeat/train": "float32",
        "cmp/mixed_float16/train": "float16",
    }


def test_a_comparison_names_its_runs(compare_client):
    (shown,) = get_json(compare_client, f"{URL}/comparison")["comparisons"]
    assert shown["run"] == "cmp/comparison"
    assert shown["runs"] == ["cmp/float32/train", "cmp/float32_repeat/train",
                             "cmp/mixed_float16/train"]  # fmt: skip


def test_a_float32_run_says_float16_and_the_loss_scale_do_not_apply(compare_client):
    data = get_json(compare_client, f"{URL}/run?run=cmp/float32/train")
    assert data["float16_note"] == (
        "float16's statistics do not apply to a float32 run: it computes in float32 (its "
        "policy record says so), so float16's range, headroom and exponent bands say "
        "nothing about it"
    )
    assert data["loss_scale_note"] == (
        "The loss scale is not used: this run computes in float32, which needs no loss "
        "scaling (the optimizer's scale stayed at 32768 (2^15) and no step was skipped)"
    )
    mixed = get_json(compare_client, f"{URL}/run?run=cmp/mixed_float16/train")
    assert mixed["float16_note"] is None and mixed["loss_scale_note"] is None


def test_all_zero_and_unmeasured_headroom_cells_are_marked_apart(compare_client):
    data = get_json(compare_client, f"{URL}/run?run=cmp/mixed_float16/train")
    grid = data["headroom_by_variable"]
    assert grid["steps"] == list(HEADROOM_STEPS)
    bits = dict(zip(grid["names"], grid["bits"], strict=True))
    assert bits["f/farther"] == [40.0] * 4 and bits["a/overflow"] == [-1.0] * 4
    assert bits["g/zeros"] == ["zero"] * 4  # all zero: no headroom to speak of
    assert bits["d/fine"] == [12.0, None, 12.0, 12.0]  # no histogram at step 10
    layers = data["activation_headroom"]
    by_layer = dict(zip(layers["names"], layers["bits"], strict=True))
    assert by_layer["l6_zeros"] == ["zero"] * 4  # at the cap: nothing above 2^-24
    # the cap, but inf/NaN at step 15: the headroom of no finite value is no all-zero
    assert by_layer["l7_nan"] == ["zero", "zero", "nonfinite", "zero"]
    assert by_layer["l4_fine"] == [12.0, None, 12.0, 12.0]
    assert by_layer["l5_far"] == [24.0] * 4


def test_the_run_list_says_which_runs_did_not_complete(tmp_path):
    """Issue 32: a policy kmix compare stopped as too slow is not shown like a completed
    run: /runs gives how it ended (the page puts it beside the run's name)."""
    words = "too slow (×0.019 of float32's speed): 12 steps took 31.0 s in fit"
    for name, compute, end in (
        ("float32", "float32", tags.RunEnd(20, tags.COMPLETED, "fit returned")),
        ("mixed_float16", "float16", tags.RunEnd(20, tags.STOPPED_BY_COMPARE, words)),
    ):
        path = str(tmp_path / "cmp" / name / "train")
        write_policy_run(path, compute)
        writer = tf.summary.create_file_writer(path)
        with writer.as_default():
            tf.summary.text(tags.RUN_END, tags.format_run_end(end), step=end.step)
        writer.close()
    listing = get_json(serve(default_provider(tmp_path)), f"{URL}/runs")
    assert listing["ended"] == {
        "cmp/mixed_float16/train": f"stopped by kmix compare at step 20: {words}"
    }


def test_a_run_across_processes_says_so_as_kmix_report_does(tmp_path):
    record = tags.PolicyRecord(
        "mixed_float16", "m", "mixed_float16", "float16", "float32", "kmix", 1.0, 2.0**24,
        10, 0, processes=2, devices=4,
    )  # fmt: skip
    for name, written in (("across", record), ("one", dataclasses.replace(record, processes=1))):
        writer = tf.summary.create_file_writer(str(tmp_path / name / "train"))
        with writer.as_default():
            tf.summary.text(tags.POLICY_RECORD, tags.format_policy_record(written), step=0)
            tf.summary.scalar(tags.LOSS_SCALE, 8.0, step=5)
        writer.close()
    client = serve(default_provider(tmp_path))
    assert get_json(client, f"{URL}/run?run=across/train")["processes"] == (
        "2 processes, 4 devices in all (keras.distribution); this log is process 0's, "
        "counters and events are global"
    )
    assert get_json(client, f"{URL}/run?run=one/train")["processes"] == (
        "1 process, 4 devices in all (keras.distribution); this log is process 0's, "
        "counters and events are global"
    )
