"""Reads kmix data through TensorBoard's data provider (never from files by itself).

The data provider is what TensorBoard's own dashboards read, so the tab works with
``--logdir``, ``--logdir_spec``, several runs and runs still being written. Raw
points are turned into a :class:`kmix.report.KmixLog` by the report's own reader,
so the tab and ``kmix report`` share one source of truth: scale events come from
their ``kmix/event_record`` records (a text tag, read with the others), and from the
``kmix/events`` lines only in runs that have no record
(:func:`kmix.report.read.scale_events_of`). Every point keeps the wall time it was written
at, which tells apart the kmix runs a script wrote into one log dir
(:mod:`kmix.report.runs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from tensorboard.data import provider as tb_provider

from kmix import tags

SCALARS = "scalars"
TEXT = "text"
HISTOGRAMS = "histograms"
READ_LIMIT = 1_000_000
"""``downsample`` given to the provider: keep what it holds (it samples on ingest)."""

TEXT_SAMPLES_DEFAULT = 10
"""How many points per text tag TensorBoard keeps unless told otherwise."""


@dataclasses.dataclass(frozen=True)
class RunPoints:
    """The raw kmix points of one run, as the data provider gave them.

    Attributes:
        run: the run's name (TensorBoard's: a directory, which may hold several kmix
            runs).
        scalars: scalar tag -> ``[(step, value, wall_time)]``.
        tensors: tensor tag -> ``(plugin name, [(step, array, wall_time)])``.
    """

    run: str
    scalars: dict[str, list[tuple[int, float, float]]]
    tensors: dict[str, tuple[str, list[tuple[int, np.ndarray, float]]]]

    @property
    def empty(self) -> bool:
        """Whether the run holds no kmix point at all."""
        return not self.scalars and not self.tensors


def _kmix_tags(listing: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Run -> sorted kmix tags of a provider listing; runs without any are left out."""
    found = {
        run: sorted(t for t in by_tag if t.startswith(tags.PREFIX))
        for run, by_tag in listing.items()
    }
    return {run: names for run, names in found.items() if names}


def list_runs(
    provider: tb_provider.DataProvider, ctx: Any, experiment_id: str
) -> tuple[list[str], list[str]]:
    """Splits the experiment's runs into those with kmix data and the others.

    Args:
        provider: TensorBoard's data provider.
        ctx: the request's ``RequestContext``.
        experiment_id: the request's experiment id.

    Returns:
        ``(runs with kmix data, other runs)``, each sorted by name.
    """
    with_kmix: set[str] = set()
    listings = [provider.list_scalars(ctx, experiment_id=experiment_id, plugin_name=SCALARS)]
    for plugin in (TEXT, HISTOGRAMS):
        listings.append(provider.list_tensors(ctx, experiment_id=experiment_id, plugin_name=plugin))
    for listing in listings:
        with_kmix.update(
            run  # a kmix compare record alone is no training run (read_comparisons)
            for run, names in _kmix_tags(listing or {}).items()
            if set(names) - {tags.COMPARISON}
        )
    every = {run.run_name for run in provider.list_runs(ctx, experiment_id=experiment_id)}
    return sorted(with_kmix), sorted(every - with_kmix)


def read_comparisons(
    provider: tb_provider.DataProvider, ctx: Any, experiment_id: str
) -> list[tuple[str, str]]:
    """The ``kmix compare`` records of the experiment: the latest text of each run's.

    Args:
        provider: TensorBoard's data provider.
        ctx: the request's ``RequestContext``.
        experiment_id: the request's experiment id.

    Returns:
        ``[(run, record text)]``, sorted by run.
    """
    only = tb_provider.RunTagFilter(tags=[tags.COMPARISON])
    data = provider.read_tensors(
        ctx, experiment_id=experiment_id, plugin_name=TEXT, downsample=10, run_tag_filter=only
    )
    found = []
    for run, by_tag in sorted((data or {}).items()):
        points = by_tag.get(tags.COMPARISON) or []
        if points:
            value = np.asarray(points[-1].numpy).reshape(-1)[0]
            found.append((run, value.decode("utf-8") if isinstance(value, bytes) else str(value)))
    return found


def read_policy_records(
    provider: tb_provider.DataProvider, ctx: Any, experiment_id: str
) -> dict[str, tags.PolicyRecord]:
    """The latest policy record of each run (what the tab opens on depends on it).

    Args:
        provider: TensorBoard's data provider.
        ctx: the request's ``RequestContext``.
        experiment_id: the request's experiment id.

    Returns:
        Run -> its latest :class:`kmix.tags.PolicyRecord` (the one of the directory's
        latest kmix run, by wall time); runs without a readable record are left out.
    """
    return _latest_records(
        provider, ctx, experiment_id, tags.POLICY_RECORD, tags.parse_policy_record
    )


def read_run_ends(
    provider: tb_provider.DataProvider, ctx: Any, experiment_id: str
) -> dict[str, tags.RunEnd]:
    """The latest run-end record of each run (the run list says how a run ended).

    Args:
        provider: TensorBoard's data provider.
        ctx: the request's ``RequestContext``.
        experiment_id: the request's experiment id.

    Returns:
        Run -> its latest :class:`kmix.tags.RunEnd`; runs without one are left out.
    """
    return _latest_records(provider, ctx, experiment_id, tags.RUN_END, tags.parse_run_end)


def _latest_records(
    provider: tb_provider.DataProvider,
    ctx: Any,
    experiment_id: str,
    tag: str,
    parse: Callable[[str], Any],
) -> dict[str, Any]:
    """Run -> the record ``parse`` reads from the latest ``tag`` text (by wall time)."""
    data = provider.read_tensors(
        ctx,
        experiment_id=experiment_id,
        plugin_name=TEXT,
        downsample=TEXT_SAMPLES_DEFAULT,
        run_tag_filter=tb_provider.RunTagFilter(tags=[tag]),
    )
    found = {}
    for run, by_tag in (data or {}).items():
        points = by_tag.get(tag) or []
        if not points:
            continue
        latest = max(points, key=lambda p: (p.wall_time, p.step))
        value = np.asarray(latest.numpy).reshape(-1)[0]
        record = parse(value.decode("utf-8") if isinstance(value, bytes) else str(value))
        if record is not None:
            found[run] = record
    return found


def read_run(
    provider: tb_provider.DataProvider,
    ctx: Any,
    experiment_id: str,
    run: str,
    plugins: tuple[str, ...] = (SCALARS, TEXT, HISTOGRAMS),
) -> RunPoints:
    """Reads every kmix point of one run that the provider holds.

    Args:
        provider: TensorBoard's data provider.
        ctx: the request's ``RequestContext``.
        experiment_id: the request's experiment id.
        run: a run name the provider listed (it is only used as a key).
        plugins: which kinds of data to read: ``"scalars"``, ``"text"``, ``"histograms"``.

    Returns:
        The run's :class:`RunPoints` (empty when it has no kmix data).
    """
    only_run = tb_provider.RunTagFilter(runs=[run])
    scalars: dict[str, list[tuple[int, float, float]]] = {}
    listing = {}
    if SCALARS in plugins:
        listing = provider.list_scalars(
            ctx, experiment_id=experiment_id, plugin_name=SCALARS, run_tag_filter=only_run
        )
    names = _kmix_tags(listing or {}).get(run, []) if SCALARS in plugins else []
    if names:
        data = provider.read_scalars(
            ctx,
            experiment_id=experiment_id,
            plugin_name=SCALARS,
            downsample=READ_LIMIT,
            run_tag_filter=tb_provider.RunTagFilter(runs=[run], tags=names),
        )
        for tag, points in data.get(run, {}).items():
            scalars[tag] = [(int(p.step), float(p.value), float(p.wall_time)) for p in points]
    tensors: dict[str, tuple[str, list[tuple[int, np.ndarray, float]]]] = {}
    for plugin in (p for p in (TEXT, HISTOGRAMS) if p in plugins):
        listing = provider.list_tensors(
            ctx, experiment_id=experiment_id, plugin_name=plugin, run_tag_filter=only_run
        )
        names = _kmix_tags(listing or {}).get(run, [])
        if not names:
            continue
        data = provider.read_tensors(
            ctx,
            experiment_id=experiment_id,
            plugin_name=plugin,
            downsample=READ_LIMIT,
            run_tag_filter=tb_provider.RunTagFilter(runs=[run], tags=names),
        )
        for tag, points in data.get(run, {}).items():
            tensors[tag] = (plugin, [(int(p.step), p.numpy, float(p.wall_time)) for p in points])
    return RunPoints(run=run, scalars=scalars, tensors=tensors)
