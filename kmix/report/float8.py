"""The report's Float8 section: what the monitor wrote of a run's float8 layers.

Reads the ``kmix/fp8_*`` scalars (per layer and tensor, at each read) and the saturation
episodes (``kmix/fp8_record``) into a :class:`~kmix.report.values.Float8Summary`, states
findings in plain words (growths of the loss scale that saturated output gradients, a
stale spike that keeps a scale too coarse, the tensors clipped most often) and formats the
section's text. A run without float8 layers has no section. Free of printing, matplotlib,
TensorFlow and Keras: the TensorBoard plugin reuses it.
"""

from __future__ import annotations

import math

from kmix import tags
from kmix._words import percent, plural, steps_list
from kmix.report.read import KmixLog
from kmix.report.values import Finding, Float8Summary, Float8TensorHealth, GrowthSaturation, Summary

__all__ = [
    "EPISODES_LISTED",
    "FLUSH_FRESH_BITS",
    "ROUNDING_BITS",
    "SATURATED_SHARE_WARN",
    "STALE_WARN_BITS",
    "float8_findings",
    "float8_lines",
    "output_gradient_headroom",
    "spike_of",
    "summarize_float8",
]

STALE_WARN_BITS = 4.0
"""A tensor whose amax history's max sits this many bits above its latest amax (a stale
spike) at the latest read gets a warning: its scale is that much too coarse."""
SATURATED_SHARE_WARN = 0.1
"""A tensor clipped at more than this share of the run's steps gets a warning."""
EPISODES_LISTED = 12
"""The text lists this many episodes (the JSON lists every one)."""
ROUNDING_BITS = tags.ROUNDING_BITS  # the name, kept here too
_TENSOR_ORDER = {"inputs": 0, "kernel": 1, "outputs_grad": 2}
_TENSOR_WORDS = {"inputs": "inputs", "kernel": "kernel", "outputs_grad": "output gradients"}
FLUSH_FRESH_BITS = {
    tensor: math.log2(tags.FLOAT8_FORMAT_TINY[fmt] / 2 / tags.FLOAT8_FORMAT_MAX[fmt])
    for tensor, fmt in tags.FLOAT8_FORMATS.items()
}
"""log2 of the share of a fresh scale's amax below which a value flushes to zero: half the
format's smallest subnormal over its max (E4M3: 2^-9 / 448; E5M2 for the output gradients:
2^-16 / 57344), from :data:`kmix.tags.FLOAT8_FORMAT_TINY` and ``FLOAT8_FORMAT_MAX``."""


def _latest(log: KmixLog, prefix: str, layer: str, tensor: str) -> tuple[int, float] | None:
    series = log.scalars.get(tags.float8_tag(prefix, layer, tensor))
    if series is None or series.values.size == 0:
        return None
    return int(series.steps[-1]), float(series.values[-1])


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _lost(log: KmixLog) -> int:
    """Episodes counted lost, each read's count once (a resumed run writes some again)."""
    once: dict[int, int] = {}
    for _, text in log.texts.get(tags.FP8_RECORD, []):
        for line in text.splitlines():
            record = tags.parse_lost_record(line.strip())
            if record is not None:
                once[record.step] = max(once.get(record.step, 0), record.episodes)
    return sum(once.values())


def _episodes(log: KmixLog) -> tuple[tags.Float8Saturation, ...]:
    """Every episode once, in step then write order: its longest record (a resumed run
    writes some again; an episode open when a fit ended is written again once the next
    fit has made it longer)."""
    once: dict[tuple[int, str, str], tags.Float8Saturation] = {}
    for _, text in log.texts.get(tags.FP8_RECORD, []):
        for line in text.splitlines():
            record = tags.parse_saturation_record(line.strip())
            if record is None:
                continue
            key = (record.step, record.layer, record.tensor)
            if key not in once or record.steps > once[key].steps:
                once[key] = record
    return tuple(sorted(once.values(), key=lambda e: e.step))


def summarize_float8(log: KmixLog, events: tuple[tags.ScaleEvent, ...]) -> Float8Summary | None:
    """The Float8 section of a log; None when it holds nothing of float8.

    Args:
        log: the run's log.
        events: its scale events (the growths are read from them).

    Returns:
        The :class:`~kmix.report.values.Float8Summary`.
    """
    pairs: dict[tuple[str, str], None] = {}
    for tag in log.scalars:
        parsed = tags.parse_float8_tag(tag)
        if parsed is not None:
            pairs.setdefault(parsed[1:], None)
    episodes = _episodes(log)
    for episode in episodes:
        pairs.setdefault((episode.layer, episode.tensor), None)
    if not pairs:
        return None
    layers = tuple(dict.fromkeys(layer for layer, _ in pairs))
    episodes = tuple(  # as the optimizer lists them: by step, then layer and tensor
        sorted(
            episodes, key=lambda e: (e.step, layers.index(e.layer), _TENSOR_ORDER.get(e.tensor, 3))
        )
    )
    ordered = sorted(pairs, key=lambda p: (layers.index(p[0]), _TENSOR_ORDER.get(p[1], 3), p[1]))
    tensors = []
    for layer, tensor in ordered:
        latest = {prefix: _latest(log, prefix, layer, tensor) for prefix in tags.FP8_TAG_PREFIXES}

        def value(prefix: str, latest: dict = latest) -> float | None:
            point = latest[prefix]
            return None if point is None else _finite(point[1])

        headroom = log.scalars.get(tags.float8_tag(tags.FP8_HEADROOM_BITS, layer, tensor))
        finite = [] if headroom is None else [float(v) for v in headroom.values if math.isfinite(v)]
        saturated = value(tags.FP8_SATURATED_STEPS)
        tensors.append(
            Float8TensorHealth(
                layer=layer,
                tensor=tensor,
                step=max((point[0] for point in latest.values() if point), default=0),
                scale=value(tags.FP8_SCALE),
                headroom_bits=value(tags.FP8_HEADROOM_BITS),
                min_headroom_bits=min(finite) if finite else None,
                staleness_bits=value(tags.FP8_STALENESS_BITS),
                saturated_steps=None if saturated is None else int(saturated),
                underflow_fraction=value(tags.FP8_UNDERFLOW_FRACTION),
                episodes=sum(1 for e in episodes if (e.layer, e.tensor) == (layer, tensor)),
            )
        )
    counted = [t.saturated_steps for t in tensors if t.saturated_steps is not None]
    total = sum(counted) if counted else sum(e.steps for e in episodes)
    growths = []
    for event in events:
        if event.kind != "growth":
            continue
        hit = tuple(
            dict.fromkeys(
                e.layer for e in episodes if e.tensor == "outputs_grad" and e.step == event.step + 1
            )
        )
        if hit:
            growths.append(GrowthSaturation(event.step, hit))
    return Float8Summary(layers, tuple(tensors), episodes, total, tuple(growths), _lost(log))


def output_gradient_headroom(log: KmixLog) -> dict[str, list[tuple[int, float]]]:
    """Float8 layer path -> ``[(step, headroom bits)]`` of its output gradients at each read
    (``kmix/fp8_headroom_bits/<layer>/outputs_grad``), for the precision what-if."""
    found = {}
    for tag, series in log.scalars.items():
        parsed = tags.parse_float8_tag(tag)
        if parsed is not None and parsed[::2] == (tags.FP8_HEADROOM_BITS, "outputs_grad"):
            steps, values = series.steps.tolist(), series.values.tolist()
            found[parsed[1]] = [(int(a), float(b)) for a, b in zip(steps, values, strict=True)]
    return found


def spike_of(section: Float8Summary, health: Float8TensorHealth) -> tags.Float8Saturation | None:
    """The latest saturation episode of a tensor: the spike its history still holds, when it
    is stale (a spike is clipped by its own step's delayed scale, so kmix's optimizer
    records it); None without one."""
    found = [e for e in section.episodes if (e.layer, e.tensor) == (health.layer, health.tensor)]
    return max(
        found, key=lambda e: (e.amax if math.isfinite(e.amax) else 0.0, -e.step), default=None
    )


# ------------------------------------------------------------------ findings
def _growth_findings(
    section: Float8Summary, loss_scaling: str | None, follows: bool | None
) -> list[Finding]:
    growths = section.growth_saturations
    if not growths:
        return []
    if len(growths) == 1:
        g = growths[0]
        head = (
            f"the loss-scale growth at step {g.step} saturated the output gradients of "
            f"{plural(len(g.layers), 'float8 layer')} (at step {g.step + 1})"
        )
    else:
        counts = sorted({len(g.layers) for g in growths})
        many = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
        head = (
            f"{len(growths)} loss-scale growths (at steps "
            f"{steps_list([g.step for g in growths])}) each saturated the output gradients "
            f"of {many} float8 layers at the next step"
        )
    fix = (
        "their float8 scales did not follow the loss scale: kmix.LossScaleOptimizer "
        "with float8_follows_loss_scale=True (its default) multiplies them by each change "
        "of the scale in the same step"
    )
    if loss_scaling == "kmix" and follows is False:  # the run's record says so
        fix = (
            "their float8 scales did not follow the loss scale "
            "(float8_follows_loss_scale=False in this run): with True, "
            "kmix.LossScaleOptimizer's default, they are multiplied by each change of the "
            "scale in the same step"
        )
    elif loss_scaling == "kmix":  # following, or not recorded: the flag is not to blame
        fix = (
            "the growth doubled them past their delayed float8 scales, which catch up "
            "only from the next steps' amax"
        )
    return [Finding("warning", "float8_growth", f"{head}; {fix}")]


def _stale_findings(section: Float8Summary) -> list[Finding]:
    found = []
    for t in section.tensors:
        if t.staleness_bits is None or t.staleness_bits < STALE_WARN_BITS:
            continue
        spike = spike_of(section, t)
        when = "a spike" if spike is None else f"a spike at step {spike.step}"
        flush = FLUSH_FRESH_BITS.get(t.tensor)
        message = (
            f"{when} keeps `{t.layer}`'s {_TENSOR_WORDS.get(t.tensor, t.tensor)}' scale "
            f"{t.staleness_bits:.1f} bits too coarse at step {t.step}"
        )
        if t.underflow_fraction is not None:
            message += f": {percent(t.underflow_fraction)} of its values flush to zero"
        elif flush is not None:
            message += (
                f": values below 2^{flush + t.staleness_bits:.1f} of its latest amax flush to "
                f"zero (2^{flush:.1f} with a fresh scale)"
            )
        history = f"{t.tensor}_amax_history"
        message += (
            "; the scale stays until the spike leaves the amax history (Keras keeps "
            "amax_history_length steps, 1024 by default). To recover now, reset "
            f"`{t.layer}`'s {history} between steps (e.g. from a callback: "
            f"layer.{history}.assign(keras.ops.zeros_like(layer.{history})); on JAX call "
            "model.jax_state_sync() first, or fit's own copy overwrites it): two steps "
            "later its scale comes from fresh amaxes. For spikes to leave sooner, build the "
            "layer with a shorter history (dtype=keras.dtype_policies."
            'QuantizedFloat8DTypePolicy("float8", its source policy, '
            "amax_history_length=...)), or keep the spike out of the data"
        )
        found.append(Finding("warning", "float8_stale", message))
    return found


def _saturated_findings(section: Float8Summary, steps_seen: int) -> list[Finding]:
    if not section.saturated_tensor_steps:
        return []
    counted = [t for t in section.tensors if t.saturated_steps]
    head = (
        f"float8: {plural(section.saturated_tensor_steps, 'saturated tensor-step')} in "
        f"{plural(len(section.episodes), 'episode')} (a tensor clipped at a step: its amax "
        "beyond its delayed scale x the format's max)"
    )
    often = [
        t for t in counted if steps_seen and t.saturated_steps / steps_seen > SATURATED_SHARE_WARN
    ]
    if not often:
        return [Finding("info", "float8_saturated", head)]
    often.sort(key=lambda t: -(t.saturated_steps or 0))
    named = ", ".join(
        f"`{t.layer}` {t.tensor} ({t.saturated_steps} of {steps_seen}, "
        f"{percent((t.saturated_steps or 0) / steps_seen)})"
        for t in often[:3]
    )
    more = f" and {len(often) - 3} more" if len(often) > 3 else ""
    return [
        Finding(
            "warning",
            "float8_saturated",
            f"{head}; clipped at more than {percent(SATURATED_SHARE_WARN)} of the steps: "
            f"{named}{more}. Delayed scaling clips any amax above every amax still in the "
            f"history: values that keep growing are clipped step after step. "
            + _often_clipped_advice(section, often),
        )
    ]


def _often_clipped_advice(section: Float8Summary, often: list[Float8TensorHealth]) -> str:
    """What to do about tensors clipped at many steps: nothing where every episode of theirs
    the log holds is float32 rounding at the limit; otherwise leave their layers out of
    float8 in the next run (Keras cannot take a quantized layer back out of float8)."""
    keys = {(t.layer, t.tensor) for t in often}
    over = [
        e.bits_over
        for e in section.episodes
        if (e.layer, e.tensor) in keys and math.isfinite(e.bits_over)
    ]
    if over and max(over) <= ROUNDING_BITS:
        return (
            f"Their episodes clip by at most {max(over):.2g} bits: float32 rounding at a "
            "steady amax (Keras's margin of 0 puts it at the limit), nothing to do"
        )
    layers = ", ".join(f"`{layer}`" for layer in dict.fromkeys(t.layer for t in often))
    worst = ""
    if over:
        most = max(over)
        worst = (
            f" (up to {most:.2f} bits over: clipped values lose at most {percent(1 - 2**-most)})"
        )
    return (
        f"Where this clipping{worst} costs accuracy, train the next run with {layers} out "
        'of float8: model.quantize("float8", filters=...) quantizes only the layers the '
        "filter selects (Keras cannot take a quantized layer back out of float8)"
    )


def float8_findings(summary: Summary) -> list[Finding]:
    """The Float8 findings of a summary (none without float8 layers)."""
    section = summary.float8
    if section is None:
        return []
    record = summary.policy_record
    loss_scaling = None if record is None else record.loss_scaling
    follows = None if record is None else record.float8_follows_loss_scale
    return (
        _growth_findings(section, loss_scaling, follows)
        + _stale_findings(section)
        + _saturated_findings(section, summary.steps_seen)
    )


# ---------------------------------------------------------------------- text
def _lost_words(lost: int) -> str:
    return (
        f"{plural(lost, 'more episode')} lost: overwritten in the optimizer's ring before "
        "a read (a lower update_freq reads them all)"
    )


def _bits(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _episode_line(e: tags.Float8Saturation) -> str:
    length = plural(e.steps, "step")
    return f"    step {e.step:<6} {length:<9} `{e.layer}` {e.tensor}: {tags.amax_words(e)}"


def float8_lines(section: Float8Summary | None) -> list[str]:
    """The text of the Float8 section; no line without float8 layers."""
    if section is None:
        return []
    lines = [
        f"float8          {plural(len(section.layers), 'layer')}, "
        f"{plural(len(section.tensors), 'tensor')}; "
        f"{plural(len(section.episodes), 'saturation episode')}, "
        f"{plural(section.saturated_tensor_steps, 'saturated tensor-step')}"
    ]
    if section.lost_episodes:
        lines.append(f"  {_lost_words(section.lost_episodes)}")
    if section.episodes:
        lines.append("  saturation episodes (first step, length, layer and tensor, amax vs limit)")
        lines += [_episode_line(e) for e in section.episodes[:EPISODES_LISTED]]
        if len(section.episodes) > EPISODES_LISTED:
            lines.append(
                f"    and {len(section.episodes) - EPISODES_LISTED} more (kmix report --json "
                "lists every one)"
            )
    rows = [
        (
            f"{t.layer} {t.tensor}",
            str(t.step),
            "n/a" if t.scale is None else f"{t.scale:.4g}",
            _bits(t.headroom_bits),
            _bits(t.min_headroom_bits),
            _bits(t.staleness_bits),
            "n/a" if t.saturated_steps is None else str(t.saturated_steps),
            "" if t.underflow_fraction is None else percent(t.underflow_fraction),
        )
        for t in section.tensors
    ]
    header = ("layer tensor", "step", "scale", "headroom", "min", "stale", "saturated", "flushed")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines.append(
        "  latest read (headroom, its min over reads and staleness in bits; saturated "
        "steps so far; kernel values flushed to zero)"
    )
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("    " + "  ".join(cells).rstrip())
    return lines
