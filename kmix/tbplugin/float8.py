"""The tab's Float8 section: a layer x tensor headroom grid over steps and the episodes.

Everything numeric comes from :mod:`kmix.report` (its Float8 section of the summary) and
the ``kmix/fp8_headroom_bits`` scalars; this module only lays them out for the page
(``static/float8.js`` draws them). A run without float8 layers has no section (None).
"""

from __future__ import annotations

import numpy as np

from kmix import report, tags
from kmix._json import json_ready

__all__ = ["MAX_EPISODES", "float8_payload"]

MAX_EPISODES = 1000
"""Episodes sent to the page (``kmix report --json`` lists every one)."""


def _picked(steps: list[int], limit: int) -> list[int]:
    if len(steps) <= limit:
        return steps
    index = np.unique(np.linspace(0, len(steps) - 1, limit).round().astype(int))
    return [steps[i] for i in index]


def float8_payload(log: report.KmixLog, summary: report.Summary, limit: int) -> dict | None:
    """The Float8 section of one run for the page; None without float8 layers.

    Args:
        log: the run's log.
        summary: its summary (``summary.float8`` is the report's Float8 section).
        limit: the most steps (columns) of the grid, evenly picked.

    Returns:
        ``{"headroom": {"steps", "names", "bits", "saturated"}`` (rows ``"<layer>
        <tensor>"`` in the report's order, headroom bits at each read, None where not
        read; saturated: the tensor was clipped after the previous column, up to this
        one), ``"tensors"``
        (each tensor as last read, :class:`kmix.report.Float8TensorHealth` as a dict),
        ``"episodes"`` (the first :data:`MAX_EPISODES`, each with its plain ``line``),
        ``"episode_count"``, ``"lost_episodes"`` (overwritten before a read: counted,
        not listed), ``"saturated_tensor_steps"``, ``"layers"``.
    """
    section = summary.float8
    if section is None:
        return None
    rows = [(t.layer, t.tensor) for t in section.tensors]
    by_row = {}
    for row in rows:
        series = log.scalars.get(tags.float8_tag(tags.FP8_HEADROOM_BITS, *row))
        by_row[row] = (
            {}
            if series is None
            else dict(zip(series.steps.tolist(), series.values.tolist(), strict=True))
        )
    steps = _picked(sorted({step for values in by_row.values() for step in values}), limit)
    bits = [
        [None if by_row[row].get(step) is None else round(by_row[row][step], 3) for step in steps]
        for row in rows
    ]
    saturated = [
        [
            any(
                (e.layer, e.tensor) == row and e.step <= step and e.step + e.steps - 1 > before
                for e in section.episodes
            )
            for before, step in zip([0, *steps[:-1]], steps, strict=True)
        ]
        for row in rows
    ]
    episodes = [
        {
            "step": e.step,
            "steps": e.steps,
            "layer": e.layer,
            "tensor": e.tensor,
            "amax": e.amax,
            "limit": e.limit,
            "bits_over": e.bits_over,
            "rounding": e.bits_over <= tags.ROUNDING_BITS,  # float32 rounding at the limit
            "line": tags.plain_text(tags.format_saturation(e)),
        }
        for e in section.episodes[:MAX_EPISODES]
    ]
    return json_ready(
        {
            "headroom": {
                "steps": steps,
                "names": [f"{a} {b}" for a, b in rows],
                "bits": bits,
                "saturated": saturated,
            },
            "tensors": [dict(vars(t)) for t in section.tensors],
            "episodes": episodes,
            "episode_count": len(section.episodes),
            "lost_episodes": section.lost_episodes,
            "saturated_tensor_steps": section.saturated_tensor_steps,
            "layers": list(section.layers),
        }
    )
