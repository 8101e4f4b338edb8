"""The "Mixed Precision" tab in a real browser: TensorBoard as a subprocess, headless Chromium.

A tiny model trained with kmix.LossScaleOptimizer and MixedPrecisionMonitor overflows
where its data says; ``tensorboard --logdir`` serves the run on a free local port and
Playwright drives Debian's ``chromium`` (``.ci/run`` installs it). The events the tab
shows must be the optimizer's own, a chart must be drawn, and no JavaScript error may
happen. The screenshot is kept in pytest's tmp dir (and copied to
``$KMIX_SCREENSHOT_DIR`` when that is set).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import keras
import pytest
import tensorflow as tf
from spiky import spiky_data, spiky_model
from test_tbplugin import (
    LongRunProvider,
    default_provider,
    serve,
    write_compare_logdir,
    write_mixed_run,
)

import kmix
from kmix.callbacks import MixedPrecisionMonitor

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"{CHROMIUM} is not installed (apt-get install -y chromium; .ci/run does it)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
pytestmark = pytest.mark.slow  # a fit, a TensorBoard subprocess and a browser


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def run_with_overflows(tmp_path_factory):
    """The log dir and the optimizer's own events: (step, kind, variable)."""
    root = tmp_path_factory.mktemp("logs")
    model = spiky_model(
        kmix.LossScaleOptimizer(
            keras.optimizers.SGD(0.0), initial_scale=1024, dynamic_growth_steps=4
        )
    )
    x, y = spiky_data(24, spikes=(3, 4, 12), nan_rows=(18,))
    monitor = MixedPrecisionMonitor(root / "spiky", update_freq=2, histogram_freq=4, verbose=0)
    model.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[monitor])
    events = [(e.step, e.kind, e.variable or "") for e in model.optimizer.scale_events(0)]
    # TensorBoard keeps 10 text points per tag by default: stay within them
    assert 4 <= len(events) <= 10, events
    writer = tf.summary.create_file_writer(str(root / "plain"))
    with writer.as_default():
        tf.summary.scalar("loss", 1.0, step=1)
    writer.close()
    keras.config.set_dtype_policy("float32")
    return root, events


@pytest.fixture(scope="module")
def tensorboard(run_with_overflows):
    """The URL of ``tensorboard --logdir`` on the run, once the kmix plugin lists it."""
    root, _ = run_with_overflows
    port = free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(root)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    log = open(root / "tensorboard.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/data/plugin/kmix/runs", timeout=5) as response:
                    if "spiky/train" in json.load(response)["runs"]:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(
                    f"tensorboard did not serve the run:\n{(root / 'tensorboard.log').read_text()}"
                )
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture
def page():
    """A Chromium page, and the JavaScript errors it reports."""
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1500})
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
        page.on(
            "console",
            lambda message: message.type == "error" and errors.append(f"console: {message.text}"),
        )
        page.errors = errors
        yield page
        browser.close()


def open_tab(page, url: str):
    """Opens TensorBoard's "Mixed Precision" tab and waits until the page is drawn."""
    page.goto(f"{url}/#kmix")
    frame = page.frame_locator("iframe").first
    frame.locator("body[data-state=ready]").wait_for(timeout=60_000)
    return frame


def open_run(page, url: str, root, name: str):
    """Opens the tab on the one run ``root/name/train``, served by the plugin's own code
    (the page's requests are answered with its payload)."""
    payload = serve(default_provider(root)).get(f"/data/plugin/kmix/run?run={name}/train")
    page.route(
        "**/data/plugin/kmix/runs",
        lambda route: route.fulfill(json={"runs": [name], "other_runs": []}),
    )
    page.route(
        f"**/data/plugin/kmix/run?run={name}*",
        lambda route: route.fulfill(body=payload.get_data(), content_type="application/json"),
    )
    return open_tab(page, url)


def test_the_tab_shows_the_optimizers_events_and_charts(
    page, tensorboard, run_with_overflows, tmp_path
):
    _, expected = run_with_overflows
    frame = open_tab(page, tensorboard)
    assert page.get_by_text("Mixed Precision").first.is_visible()

    rows = frame.locator("table.events tbody tr")
    shown = rows.evaluate_all(
        "rows => rows.map(r => [Number(r.dataset.step), r.dataset.kind,"
        " r.querySelector('.variable').textContent])"
    )
    assert [tuple(row) for row in shown] == expected

    line = frame.locator("path.loss-scale-line")
    assert line.count() == 1 and line.get_attribute("d").count("V") >= 3
    assert frame.locator(".loss-scale .marker").count() == len(expected)
    variables = frame.locator(".exponent-heatmap text[data-variable]").count()
    assert variables == 4  # a/kernel, a/bias, b/kernel, b/bias
    assert frame.locator(".exponent-heatmap rect.cell").count() >= variables
    assert frame.locator(".findings li").count() >= 1
    assert frame.locator(".policy table").count() == 1

    skip = next(e for e in expected if e[2])
    frame.locator(f".loss-scale .marker[data-step='{skip[0]}']").hover()
    tooltip = frame.locator("#tooltip")
    assert tooltip.is_visible()
    assert f"at step {skip[0]}" in tooltip.text_content() and skip[2] in tooltip.text_content()
    # The server's kmix/events line, its markup drawn: the same words in the marker's title.
    said = tooltip.text_content()
    assert "**" not in said and "`" not in said and "first non-finite gradient" in said
    assert tooltip.locator("code").first.text_content() == skip[2]
    title = frame.locator(f".loss-scale .marker[data-step='{skip[0]}'] title")
    assert title.text_content() == said

    frame.locator(f"table.events tr[data-step='{skip[0]}']").click()
    assert "selected" in frame.locator(f"table.events tr[data-step='{skip[0]}']").get_attribute(
        "class"
    )
    assert frame.locator(".loss-scale line.highlight").get_attribute("visibility") == "visible"
    frame.locator(".exponent-heatmap .row-outline").wait_for()
    outlined = frame.locator(".exponent-heatmap text[data-variable]").evaluate_all(
        "labels => labels.map(l => l.dataset.variable)"
    )
    assert skip[2] in outlined

    shot = tmp_path / "mixed_precision_tab.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("KMIX_SCREENSHOT_DIR"):
        shutil.copy(shot, os.environ["KMIX_SCREENSHOT_DIR"])

    frame.locator("input[data-kind=growth]").uncheck()
    assert rows.count() == sum(e[1] != "growth" for e in expected)

    frame.locator("input[value=plain]").check()
    empty = frame.locator("section[data-run=plain] .run-empty")
    empty.wait_for()
    assert "no kmix data" in empty.text_content()
    assert page.errors == []


def test_a_100000_step_run_draws_every_event(page, tensorboard):
    """The page draws the server's downsampled payload of a 100,000-step run, every event
    marked; the status line says how long drawing took (not asserted: a timing)."""
    payload = serve(LongRunProvider()).get("/data/plugin/kmix/run?run=long").get_data()
    page.route(
        "**/data/plugin/kmix/runs",
        lambda route: route.fulfill(json={"runs": ["long"], "other_runs": []}),
    )
    page.route(
        "**/data/plugin/kmix/run?run=long*",
        lambda route: route.fulfill(body=payload, content_type="application/json"),
    )
    frame = open_tab(page, tensorboard)
    status = frame.locator("#status").text_content()
    assert re.fullmatch(r"Drawn in \d+ ms", status), status  # drawn, not still loading
    events = len(LongRunProvider().events)
    assert frame.locator(".loss-scale .marker").count() == events
    assert page.errors == []


def test_float16_views_of_a_run_with_a_float32_head(page, tensorboard, tmp_path):
    """Float16's limits over float16 rows only, a colour scale, steps labelled across the
    grid, a single reading drawn as a point, reference lines named outside the chart."""
    write_mixed_run(str(tmp_path / "mixed" / "train"))
    frame = open_run(page, tensorboard, tmp_path, "mixed")
    scale = frame.locator(".loss-scale svg").first
    assert scale.locator("rect.lost-events").count() == 1
    line = scale.locator("path.loss-scale-line").get_attribute("d")
    assert line.startswith("M") and "V" in line  # from 1024 at begin down to 1
    heat = frame.locator(".exponent-heatmap")
    head = heat.locator("text[data-variable='head/kernel']")
    assert head.get_attribute("data-dtype") == "float32"
    assert head.evaluate("label => label.firstChild.textContent") == "head/kernel (float32)"
    head_top = float(head.get_attribute("y")) - 11
    limits = heat.locator("line.limit")
    assert limits.count() == 3
    for k in range(3):
        assert float(limits.nth(k).get_attribute("y2")) <= head_top  # above the float32 row
    assert "float16's limits do not apply" in heat.locator(".dtype-note").text_content()
    assert heat.locator(".colour-scale rect").count() >= 10
    assert "100%" in heat.locator(".colour-scale").text_content()

    grid = frame.locator(".headroom-grid").first
    ticks = grid.locator(".step-ticks text").all_text_contents()
    assert len(ticks) > 2 and ticks[0] == "25" and ticks[-1] == "400"
    assert "head/kernel" in grid.locator(".left-out").text_content()
    cells = grid.locator("rect title").all_text_contents()
    assert cells and not any(cell.startswith("head/kernel") for cell in cells)

    chart = frame.locator(".headroom svg").first
    assert chart.locator("circle.point").count() == 1  # the one reading, at step 100
    assert all("65504" not in text for text in chart.locator("text").all_text_contents())
    legend = frame.locator(".headroom .legend").first.text_content()
    assert "float16 max (65504)" in legend and "(1 reading)" in legend
    facts = frame.locator(".summary dl.facts").text_content()
    assert "initial 1024 (2^10)" in facts and "10 scale events lost" in facts

    shot = tmp_path / "mixed_precision_float32_head.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("KMIX_SCREENSHOT_DIR"):
        shutil.copy(shot, os.environ["KMIX_SCREENSHOT_DIR"])
    assert page.errors == []


def test_precision_changes_of_a_healed_run(page, tensorboard, tmp_path):
    """PrecisionAutopilot's moves: a dashed line each on the loss-scale chart, with the
    move's line on hover, and the "Precision changes" table with the plan's code."""
    from test_autopilot import X, Y, make

    model = make("functional")
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    monitor = MixedPrecisionMonitor(str(tmp_path / "healed"), update_freq=2, verbose=0)
    model.fit(X, Y, batch_size=8, verbose=0, shuffle=False, callbacks=[autopilot, monitor])
    frame = open_run(page, tensorboard, tmp_path, "healed")
    marks = frame.locator(".loss-scale g.precision-move")
    assert marks.count() == 2
    assert [marks.nth(i).get_attribute("data-step") for i in range(2)] == ["1", "2"]
    marks.nth(1).hover()
    said = frame.locator("#tooltip").text_content()
    assert said == (
        "moved next (Dense) mixed_float16 → float32 at step 2: forward overflow at step 2: "
        "the cast of its input (max |input| 72000) overflowed"
    )
    rows = frame.locator(".precision-panel tbody tr").evaluate_all(
        "rows => rows.map(r => Array.from(r.cells, c => c.textContent))"
    )
    assert rows == [
        [str(m.step), m.layer, "Dense", "mixed_float16 → float32", m.reason]
        for m in autopilot.moves
    ]
    code = frame.locator(".precision-panel pre.plan-code").text_content()
    assert code.startswith("kmix.apply_plan(model, kmix.PrecisionPlan({'big': 'float32', 'next'")
    assert "Still computed in float16" in frame.locator(".float16-share").text_content()
    shot = tmp_path / "mixed_precision_precision_changes.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("KMIX_SCREENSHOT_DIR"):
        shutil.copy(shot, os.environ["KMIX_SCREENSHOT_DIR"])
    assert page.errors == []


def open_logdir(page, url: str, root):
    """Opens the tab with every request of the plugin answered by its own code over the
    log dir ``root`` (TensorBoard's subprocess serves the page around the tab)."""
    client = serve(default_provider(root))

    def answer(route):
        parts = urllib.parse.urlsplit(route.request.url)
        path = parts.path[parts.path.index("/data/plugin/kmix/") :]
        response = client.get(f"{path}?{parts.query}" if parts.query else path)
        route.fulfill(
            status=response.status_code,
            body=response.get_data(),
            content_type=response.headers["Content-Type"],
        )

    page.route(re.compile(r".*/data/plugin/kmix/.*"), answer)
    return open_tab(page, url)


@pytest.fixture(scope="module")
def compare_logdir(tmp_path_factory):
    """``kmix compare``'s three runs and its record, beside seven runs of other
    experiments: ten runs with kmix data."""
    root = tmp_path_factory.mktemp("compare")
    write_compare_logdir(root, extra_runs=7)
    return root


def ticked(frame) -> list[str]:
    return frame.locator("#run-picker input:checked").evaluate_all("b => b.map(x => x.value)")


def tick(frame, run: str, checked: bool = True):
    """Ticks or unticks a run and waits until every ticked run is drawn again."""
    box = frame.locator(f"#run-picker input[value='{run}']")
    box.check() if checked else box.uncheck()
    for name in ticked(frame):
        frame.locator(f"section[data-run='{name}'][data-state]").wait_for()


OVERLAPS = """svg => {
  const width = svg.viewBox.baseVal.width;
  const boxes = Array.from(svg.querySelectorAll('text')).map((t) => {
    const b = t.getBBox();
    return {text: t.textContent, x0: b.x, x1: b.x + b.width, y0: b.y, y1: b.y + b.height};
  }).filter((b) => b.x1 > b.x0);
  const clipped = boxes.filter((b) => b.x0 < 0 || b.x1 > width).map((b) => b.text);
  const overlapping = [];
  boxes.forEach((a, i) => boxes.slice(i + 1).forEach((b) => {
    const x = Math.min(a.x1, b.x1) - Math.max(a.x0, b.x0);
    const y = Math.min(a.y1, b.y1) - Math.max(a.y0, b.y0);
    if (x > 0.5 && y > 0.5) overlapping.push([a.text, b.text]);
  }));
  return {clipped, overlapping, texts: boxes.map((b) => b.text)};
}"""


def keep(shot):
    """A screenshot written in pytest's tmp dir, copied to ``$KMIX_SCREENSHOT_DIR`` if set."""
    if os.environ.get("KMIX_SCREENSHOT_DIR"):
        shutil.copy(shot, os.environ["KMIX_SCREENSHOT_DIR"])


def test_a_compare_logdir_side_by_side(page, tensorboard, compare_logdir, tmp_path):
    """The tab opens on the float16 run (float32/train sorts first); the sticky header
    stays one line with ten runs; the comparison shows while one of its runs is ticked;
    a float32 run beside it says what does not apply to it; no axis label overlaps."""
    page.set_viewport_size({"width": 1200, "height": 1400})
    frame = open_logdir(page, tensorboard, compare_logdir)
    assert ticked(frame) == ["cmp/mixed_float16/train"]
    labels = frame.locator("#run-picker label")
    assert labels.count() == 11  # ten runs with kmix data, and the comparison's record
    tops = labels.evaluate_all("ls => ls.map(l => Math.round(l.getBoundingClientRect().top))")
    assert len(set(tops)) == 1, tops  # one line
    bar = frame.locator("header.bar").evaluate("b => b.getBoundingClientRect().height")
    assert bar < 50, bar
    wide, shown = frame.locator("#run-picker").evaluate("p => [p.scrollWidth, p.clientWidth]")
    assert wide > shown  # the rest of the runs scroll into view, and are counted
    assert frame.locator("#run-count").text_content() == "1 of 11 runs:"
    assert frame.locator("#comparison").is_visible()

    tick(frame, "cmp/float32/train")
    assert ticked(frame) == ["cmp/float32/train", "cmp/mixed_float16/train"]
    single = frame.locator("section[data-run='cmp/float32/train']")
    assert single.locator("path.loss-scale-line").count() == 0  # no flat line
    said = single.locator(".loss-scale").text_content()
    assert said.startswith("The loss scale is not used: this run computes in float32")
    assert "histogram_freq" not in single.text_content()
    assert single.locator(".step-pick").is_hidden()  # no empty step list
    for panel in (".exponents", ".headroom", ".whatif"):
        words = single.locator(panel).text_content()
        assert "float16's statistics do not apply to a float32 run" in words, (panel, words)

    mixed = frame.locator("section[data-run='cmp/mixed_float16/train']")
    assert mixed.locator("path.loss-scale-line").count() == 1
    heat = mixed.locator("svg.exponent-heatmap")
    found = heat.evaluate(OVERLAPS)
    assert found["clipped"] == [] and found["overlapping"] == [], found
    assert {"zero", "inf/NaN", "0"} <= set(found["texts"])
    for grid in mixed.locator("svg.headroom-grid").all():
        found = grid.evaluate(OVERLAPS)
        assert found["clipped"] == [] and found["overlapping"] == [], found
    for name, shot in ((None, "compare_side_by_side.png"),
                       (".exponents", "compare_side_by_side_exponents.png")):  # fmt: skip
        path = tmp_path / shot
        (mixed.locator(name) if name else page).screenshot(path=str(path))
        keep(path)

    tick(frame, "cmp/float32/train", False)
    tick(frame, "cmp/mixed_float16/train", False)
    tick(frame, "other_experiment_0/train")
    assert ticked(frame) == ["other_experiment_0/train"]
    assert frame.locator("#comparison").is_hidden()  # none of its runs is ticked
    assert page.errors == []


CELL_FILLS = """svg => Array.from(svg.querySelectorAll('rect.cell')).map((r) =>
  [r.dataset.row, r.dataset.bits, getComputedStyle(r).fill])"""
LEGEND_FILLS = """legend => Array.from(legend.querySelectorAll('[data-bits]')).map((r) =>
  [r.dataset.bits, getComputedStyle(r).fill])"""


def rgb(fill: str) -> tuple[int, int, int] | None:
    match = re.fullmatch(r"rgb\((\d+), (\d+), (\d+)\)", fill)
    return None if match is None else tuple(int(v) for v in match.groups())


def lightness(color: tuple[int, int, int]) -> float:
    return (max(color) + min(color)) / 2


def test_headroom_colours_grow_calmer_with_headroom(page, tensorboard, compare_logdir, tmp_path):
    """Red and orange below 1 and 4 bits, then one ramp that gets lighter as headroom
    grows, clamped at the top (40 bits as 24); all-zero and unmeasured cells blank, and
    the legend drawn with the cells' own colours."""
    frame = open_logdir(page, tensorboard, compare_logdir)
    tick(frame, "cmp/mixed_float16/train")
    section = frame.locator("section[data-run='cmp/mixed_float16/train']")
    grids = section.locator("svg.headroom-grid")
    assert grids.count() == 2
    colours: dict[str, set] = {}
    for k in range(2):
        for _row, bits, fill in grids.nth(k).evaluate(CELL_FILLS):
            colours.setdefault(bits, set()).add(fill)
    assert all(len(fills) == 1 for fills in colours.values()), colours
    colour = {bits: fills.pop() for bits, fills in colours.items()}
    assert colour["zero"] == "none" and colour["none"] == "none"  # blank
    assert colour["nonfinite"] == "rgb(127, 0, 0)"  # an all-NaN output is no all-zero one
    warm = [rgb(colour[b]) for b in ("-1", "0.5", "1", "2", "3")]
    assert all(r > g and r > b for r, g, b in warm), warm
    assert colour["-1"] != colour["0.5"] != colour["1"] and colour["1"] == colour["3"]
    ramp = [rgb(colour[b]) for b in ("4.5", "12", "24", "40")]
    assert all(g > r for r, g, b in ramp), ramp
    lights = [lightness(c) for c in ramp]
    assert lights[0] < lights[1] < lights[2] == lights[3], lights  # calmer, then clamped
    assert colour["40"] != colour["3"]
    legend = section.locator(".headroom-legend").first
    keyed = dict(legend.evaluate(LEGEND_FILLS))
    assert keyed["nonfinite"] == "rgb(127, 0, 0)"
    for bits in ("-1", "0.5", "2", "12", "24"):  # a class's swatch, the ramp's stops
        assert keyed[bits] == colour[bits], (bits, keyed)
    assert keyed["zero"] in ("none", "rgb(255, 255, 255)")
    words = legend.text_content()
    assert "all zero" in words and "not measured" in words and "24+" in words
    shot = tmp_path / "headroom_colours.png"
    section.locator("div.headroom-grid").locator("xpath=..").screenshot(path=str(shot))  # the panel
    keep(shot)
    assert page.errors == []


def write_float8_run(path) -> tuple:
    """A float8 MLP trained by kmix's optimizer without following the loss scale: its
    growths saturate the output gradients. Returns the optimizer's episodes."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "float8"))
    from test_state import growth_saturating_fit

    _, opt = growth_saturating_fit(path, update_freq=2, histogram_freq=12)
    return tuple(opt.float8_episodes())


def test_the_float8_section_draws_headroom_grid_and_episodes(page, tensorboard, tmp_path):
    episodes = write_float8_run(tmp_path / "float8")
    frame = open_run(page, tensorboard, tmp_path, "float8")
    panel = frame.locator(".float8-panel")
    assert panel.is_visible()
    grid = panel.locator("svg.headroom-grid")
    names = grid.locator("text title").all_text_contents()
    assert len(names) == 6 and names[0].endswith(" inputs") and names[2].endswith(" outputs_grad")
    assert grid.locator("rect.cell").count() == 6 * 12  # a read every 2 of 24 steps
    # float8's own colours: red only where an episode clipped the tensor, not by bits
    red = grid.locator('rect.cell[fill="#c62828"]').count()
    clipped = {(e.layer, e.tensor, (e.step + 1) // 2 * 2) for e in episodes}
    assert 0 < red and red <= sum(e.steps for e in episodes) + len(clipped)
    assert panel.locator(".float8-legend").is_visible()
    assert not panel.locator(".headroom-legend").count()
    rows = panel.locator(".float8-episodes tbody tr")
    assert rows.count() == len(episodes) > 0
    assert [int(s) for s in rows.evaluate_all("rs => rs.map(r => r.dataset.step)")] == [
        e.step for e in episodes
    ]
    assert panel.locator(".float8-tensors tbody tr").count() == 6
    flushed = {  # the last column: the inputs' share measured in the step, the kernels' read
        tensor: cell
        for tensor, cell in panel.locator(".float8-tensors tbody tr").evaluate_all(
            "rs => rs.map(r => [r.cells[1].textContent, r.cells[r.cells.length - 1].textContent])"
        )
    }
    assert flushed["inputs"].endswith("%") and flushed["kernel"].endswith("%")
    assert flushed["outputs_grad"] == ""
    assert "float8" in frame.locator(".findings").text_content()
    # The what-if's float8 rows: E5M2 as if at each layer's real output-gradient headroom.
    whatif = frame.locator(".whatif")
    marked = [t for t in whatif.locator("td").all_text_contents() if t.endswith(" *")]
    assert sorted(marked) == sorted(
        f"{layer}/{name} *" for layer in {e.layer for e in episodes} for name in ("kernel", "bias")
    )
    assert "real output-gradient headroom" in whatif.locator(".float8-whatif").text_content()
    shot = tmp_path / "mixed_precision_float8.png"
    panel.screenshot(path=str(shot))
    keep(shot)
    assert page.errors == []
