"""The "Mixed Precision" TensorBoard tab: routes over TensorBoard's data provider.

Registered through the ``tensorboard_plugins`` entry point, so ``pip install kmix``
then ``tensorboard --logdir runs`` shows the tab whenever a run has ``kmix/`` tags.

Routes, under ``/data/plugin/kmix``:

* ``/runs``: ``{"runs": [runs with kmix data], "other_runs": [runs without],
  "default_run": the run to open on (:func:`kmix.tbplugin.view.default_run`),
  "compute_dtypes": {run: compute dtype its policy record names}, "ended": {run: how
  it ended, for the runs whose latest end was not "completed"}}``;
* ``/run?run=NAME[&points=N]``: one run's data (:func:`kmix.tbplugin.view.run_payload`);
* ``/exponents?run=NAME[&step=S]``: the gradient exponent heatmap at one histogram step;
* ``/comparison``: ``{"comparisons": [{"run", "markdown", "runs"}]}``, the ``kmix
  compare`` tables recorded in the experiment
  (:func:`kmix.tbplugin.reader.read_comparisons`), each with the runs it trained
  (``LOGDIR/<name>/train`` beside its record's run ``LOGDIR/comparison``);
* ``/static/NAME``: the page's files, from a fixed list.

Query values are only ever compared with names the data provider listed or parsed
as bounded integers; none becomes a file path, and no request writes anything.
Bad values answer 400 with ``{"error": message}``. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from kmix import report, tags
from kmix._json import json_ready
from kmix.tbplugin import reader, view

PLUGIN_NAME = "kmix"
TAB_NAME = "Mixed Precision"

MAX_RUN_NAME = 1000
"""Longest run name accepted in a query (characters)."""

STATIC_FILES = {
    "index.js": "text/javascript",
    "float8.js": "text/javascript",
    "index.html": "text/html",
    "style.css": "text/css",
}
"""The only files ``/static/`` serves, with their content types."""

_STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_INTEGER = re.compile(r"[0-9]{1,12}")


class BadRequest(ValueError):
    """A query parameter that is missing, malformed or out of range; says which and why."""


def _json(request: Any, content: Any, code: int = 200) -> Any:
    text = json.dumps(content, allow_nan=False, separators=(",", ":"))
    return http_util.Respond(request, text, "application/json", code=code)


def _one(request: Any, name: str, required: bool = True) -> str | None:
    """The single value of query parameter ``name``.

    Raises:
        BadRequest: it is missing (when required), repeated, or too long.
    """
    values = request.args.getlist(name)
    if not values:
        if required:
            raise BadRequest(f"missing query parameter {name!r}")
        return None
    if len(values) > 1:
        raise BadRequest(f"query parameter {name!r} given {len(values)} times; give it once")
    if len(values[0]) > MAX_RUN_NAME:
        raise BadRequest(
            f"query parameter {name!r} is {len(values[0])} characters long; "
            f"at most {MAX_RUN_NAME} are accepted"
        )
    return values[0]


def _integer(request: Any, name: str, low: int, high: int, default: int | None) -> int | None:
    """Optional query parameter ``name`` as an integer in ``[low, high]``, else ``default``.

    Raises:
        BadRequest: it is repeated, not a plain decimal integer, or out of range.
    """
    text = _one(request, name, required=False)
    if text is None:
        return default
    if not _INTEGER.fullmatch(text):
        raise BadRequest(f"query parameter {name}={text[:40]!r} is not a non-negative integer")
    value = int(text)
    if not low <= value <= high:
        raise BadRequest(f"query parameter {name}={value} is out of range [{low}, {high}]")
    return value


def _trained(record_run: str, runs: list[str]) -> list[str]:
    """The runs a ``kmix compare`` record's comparison trained, among ``runs``.

    ``kmix compare --logdir DIR`` writes its record to the run ``DIR/comparison`` and
    each model's to ``DIR/<name>/train`` (a policy, or float32's repeat); DIR was empty.

    Args:
        record_run: the run holding the record.
        runs: the runs with kmix data.

    Returns:
        The runs ``DIR/<name>/train`` beside the record, in the order of ``runs``;
        none when the record's run is not named ``DIR/comparison``.
    """
    folder, _, name = record_run.rpartition("/")
    if name != tags.COMPARISON_RUN:
        return []
    folder = f"{folder}/" if folder else ""
    return [
        run
        for run in runs
        if run.startswith(folder) and re.fullmatch(r"[^/]+/train", run[len(folder) :])
    ]


class KmixPlugin(base_plugin.TBPlugin):
    """TensorBoard plugin ``kmix``: loss scale, events, float16 range and findings per run.

    Args:
        context: TensorBoard's ``TBContext``; only its ``data_provider`` is used.
    """

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._provider = context.data_provider

    def get_plugin_apps(self) -> dict[str, Any]:
        """The plugin's WSGI routes (see the module docstring).

        Returns:
            Route -> WSGI application.
        """
        return {
            "/runs": self._serve_runs,
            "/run": self._serve_run,
            "/exponents": self._serve_exponents,
            "/comparison": self._serve_comparison,
            "/static/*": self._serve_static,
        }

    def is_active(self) -> bool:
        """Whether some run of the default experiment has ``kmix/`` tags.

        Returns:
            True to show the tab.
        """
        if self._provider is None:
            return False
        from tensorboard import context as tb_context

        runs, _ = reader.list_runs(self._provider, tb_context.RequestContext(), "")
        return bool(runs)

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        """The tab: an ES module served by this plugin, titled "Mixed Precision".

        Returns:
            TensorBoard's frontend metadata.
        """
        return base_plugin.FrontendMetadata(es_module_path="/static/index.js", tab_name=TAB_NAME)

    # ---------------------------------------------------------------- routes
    def _where(self, request: Any) -> tuple[Any, str]:
        return plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)

    @wrappers.Request.application
    def _serve_runs(self, request: Any) -> Any:
        ctx, experiment = self._where(request)
        runs, others = reader.list_runs(self._provider, ctx, experiment)
        records = reader.read_policy_records(self._provider, ctx, experiment)
        ends = reader.read_run_ends(self._provider, ctx, experiment)
        listing = {
            "runs": runs,
            "other_runs": others,
            "default_run": view.default_run(runs, records),
            "compute_dtypes": {run: records[run].compute_dtype for run in runs if run in records},
            "ended": {
                run: report.end_words(end)
                for run, end in ends.items()
                if run in runs and end.reason != tags.COMPLETED
            },
        }
        return _json(request, listing)

    def _known_run(self, request: Any) -> str:
        """The ``run`` parameter, if it names a run the provider lists.

        Raises:
            BadRequest: it is missing, malformed, or not a run.
        """
        run = _one(request, "run")
        ctx, experiment = self._where(request)
        runs, others = reader.list_runs(self._provider, ctx, experiment)
        if run not in runs and run not in others:
            shown = ", ".join(repr(r) for r in runs[:5]) or "none"
            raise BadRequest(f"unknown run {run[:80]!r}; runs with kmix data: {shown}")
        return run

    @wrappers.Request.application
    def _serve_run(self, request: Any) -> Any:
        try:
            run = self._known_run(request)
            points = _integer(
                request, "points", view.MIN_POINTS, view.MAX_POINTS, view.DEFAULT_POINTS
            )
        except BadRequest as error:
            return _json(request, {"error": str(error)}, code=400)
        ctx, experiment = self._where(request)
        data = reader.read_run(self._provider, ctx, experiment, run)
        return _json(request, view.run_payload(data, points))

    @wrappers.Request.application
    def _serve_exponents(self, request: Any) -> Any:
        try:
            run = self._known_run(request)
            step = _integer(request, "step", 0, 10**12, None)
            ctx, experiment = self._where(request)
            points = reader.read_run(  # the text's policy records tell the runs apart
                self._provider, ctx, experiment, run, plugins=(reader.TEXT, reader.HISTOGRAMS)
            )
            rows = view.to_log(points).histograms
            steps = view.histogram_steps(rows)
            if not steps:
                raise BadRequest(f"run {run[:80]!r} has no gradient exponent histograms")
            if step is None:
                step = steps[-1]
            if step not in steps:
                raise BadRequest(
                    f"no gradient exponent histogram at step {step} in run {run[:80]!r}; "
                    f"they are at steps {steps[0]}..{steps[-1]} ({len(steps)} of them)"
                )
        except BadRequest as error:
            return _json(request, {"error": str(error)}, code=400)
        return _json(request, json_ready(view.heatmap(rows, step)))

    @wrappers.Request.application
    def _serve_comparison(self, request: Any) -> Any:
        from kmix.compare import CompareError, comparison_from_dict

        ctx, experiment = self._where(request)
        listed, _ = reader.list_runs(self._provider, ctx, experiment)
        shown = []
        for run, text in reader.read_comparisons(self._provider, ctx, experiment):
            data = tags.parse_comparison(text)
            try:
                comparison = None if data is None else comparison_from_dict(data)
            except CompareError:
                comparison = None
            if comparison is None:
                continue
            markdown = comparison.to_markdown()
            shown.append({"run": run, "markdown": markdown, "runs": _trained(run, listed)})
        return _json(request, {"comparisons": shown})

    @wrappers.Request.application
    def _serve_static(self, request: Any) -> Any:
        name = request.path.rpartition("/static/")[2]
        content_type = STATIC_FILES.get(name)
        if content_type is None:  # only names on the list: no path is ever built from a query
            return http_util.Respond(request, "not found", "text/plain", code=404)
        with open(os.path.join(_STATIC_DIR, name), "rb") as file:
            content = file.read()
        return http_util.Respond(request, content, content_type)
