"""Float8 in the TensorBoard contract: saturations (line and record) and per-tensor tags.

Part of :mod:`kmix.tags`, which re-exports every public name here. A saturation episode
(one float8 tensor clipped at consecutive steps) is written at its first step twice, as
scale events are: a markdown line under ``kmix/fp8_events`` and a JSON record under
``kmix/fp8_record``. Per-tensor health goes under the prefixes below, each followed by
``<layer path>/<tensor>``. Nothing here imports TensorFlow or Keras.
"""

from __future__ import annotations

import dataclasses
import math

from kmix._words import plural
from kmix.tags.records import json_object, record_fields, record_json

__all__ = [
    "FP8_EVENTS",
    "FP8_HEADROOM_BITS",
    "FP8_RECORD",
    "FP8_SATURATED_STEPS",
    "FP8_SCALE",
    "FP8_STALENESS_BITS",
    "FP8_TAG_PREFIXES",
    "FP8_UNDERFLOW_FRACTION",
    "FLOAT8_FORMATS",
    "FLOAT8_FORMAT_MAX",
    "FLOAT8_FORMAT_TINY",
    "FLOAT8_LOST_RECORD",
    "FLOAT8_SATURATION_RECORD",
    "Float8Lost",
    "Float8Saturation",
    "float8_tag",
    "format_lost",
    "format_lost_record",
    "format_saturation",
    "format_saturation_record",
    "parse_float8_tag",
    "parse_lost_record",
    "parse_saturation_record",
]

FLOAT8_FORMATS = {
    "inputs": "float8_e4m3fn",
    "kernel": "float8_e4m3fn",
    "outputs_grad": "float8_e5m2",
}
"""Each float8 tensor's format (Keras: E4M3 forward, E5M2 for the output gradient)."""
FLOAT8_FORMAT_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
"""The largest finite value of each format (``ml_dtypes.finfo(...).max``)."""
FLOAT8_FORMAT_TINY = {"float8_e4m3fn": 2.0**-9, "float8_e5m2": 2.0**-16}
"""The smallest positive (subnormal) value of each format: half of it rounds to zero."""

FP8_SCALE = "kmix/fp8_scale/"
"""+ ``<layer>/<tensor>``: the delayed scale the next step uses (Keras's ``<tensor>_scale``)."""
FP8_HEADROOM_BITS = "kmix/fp8_headroom_bits/"
"""+ ``<layer>/<tensor>``: log2(limit / the newest amax); below 0: the next step clips at
this amax (the limit is the scale in force, the one the next step uses)."""
FP8_SATURATED_STEPS = "kmix/fp8_saturated_steps/"
"""+ ``<layer>/<tensor>``: cumulative steps at which the tensor was clipped."""
FP8_UNDERFLOW_FRACTION = "kmix/fp8_underflow_fraction/"
"""+ ``<layer>/kernel`` and ``<layer>/inputs``: share of non-zero values that flush to zero:
the kernel at the scale in force at the read, the inputs at the scale of the latest
statistics step (measured in that step, on the inputs the layer quantized)."""
FP8_STALENESS_BITS = "kmix/fp8_staleness_bits/"
"""+ ``<layer>/<tensor>``: log2(amax history's max / the newest amax): a stale spike."""
FP8_TAG_PREFIXES = (
    FP8_SCALE,
    FP8_HEADROOM_BITS,
    FP8_SATURATED_STEPS,
    FP8_UNDERFLOW_FRACTION,
    FP8_STALENESS_BITS,
)
FP8_EVENTS = "kmix/fp8_events"
"""Markdown lines, one per saturation episode, at its first step (and one per read that
found episodes lost)."""
FP8_RECORD = "kmix/fp8_record"
"""JSON records (:func:`format_saturation_record`), one per saturation episode; and
:func:`format_lost_record` where episodes were lost."""
FLOAT8_SATURATION_RECORD = "float8_saturation"
FLOAT8_LOST_RECORD = "float8_lost"


@dataclasses.dataclass(frozen=True)
class Float8Saturation:
    """A float8 tensor clipped by Keras at a step: its amax beyond what its scale can hold.

    Attributes:
        step: the attempted optimizer step, from 1 (the first of the episode's steps).
        layer: the float8 layer's path.
        tensor: ``"inputs"``, ``"kernel"`` or ``"outputs_grad"``.
        amax: the step's largest ``|value|`` of the tensor (NaN where the ring kept only
            an episode's first and last step).
        limit: what the step's scale could represent: ``scale * 448`` (E4M3) or
            ``* 57344`` (E5M2).
        steps: consecutive saturated steps this entry stands for (an episode; 1 for one
            tensor-step).
    """

    step: int
    layer: str
    tensor: str
    amax: float
    limit: float
    steps: int = 1

    @property
    def bits_over(self) -> float:
        """log2(amax / limit): how far past the limit the tensor went (NaN if unknown)."""
        if not (self.amax > 0 and self.limit > 0):
            return math.nan
        return math.log2(self.amax / self.limit)


ROUNDING_BITS = 2.0**-20
"""A saturation at most this far over its limit (a few float32 ulps) is rounding at the
limit: delayed scaling's margin of 0 puts a steady amax at its limit, and the float32
rounding of Keras's scale (``1 / (max / amax)``, then ``* max``) puts the limit a fraction
of an ulp under some amaxes (255: 254.99998), so Keras's clip moves the value by as little."""


def amax_words(item: Float8Saturation) -> str:
    """``amax A > limit L (how far)``: with nine digits and "float32 rounding at the limit"
    where the amax is within :data:`ROUNDING_BITS` of it (six digits would read 850 > 850)."""
    over = item.bits_over
    if math.isnan(over):
        return f"amax {item.amax:.6g} > limit {item.limit:.6g}"
    if over <= ROUNDING_BITS:
        return (
            f"amax {item.amax:.9g} > limit {item.limit:.9g} (float32 rounding at the limit: "
            "clipped by under a millionth)"
        )
    return f"amax {item.amax:.6g} > limit {item.limit:.6g} ({over:.2f} bits over)"


def format_saturation(item: Float8Saturation) -> str:
    """The markdown line of a saturation episode (``kmix/fp8_events``)."""
    span = (
        f"step {item.step}"
        if item.steps == 1
        else f"steps {item.step}-{item.step + item.steps - 1} ({plural(item.steps, 'step')})"
    )
    return f"**float8 saturation** at {span}: `{item.layer}` {item.tensor} {amax_words(item)}"


def format_saturation_record(item: Float8Saturation, run_id: str | None = None) -> str:
    """One JSON record of a saturation episode (``kmix/fp8_record``)."""
    run = {} if run_id is None else {"run_id": run_id}
    return record_json(item, type=FLOAT8_SATURATION_RECORD, **run)


def parse_saturation_record(text: str) -> Float8Saturation | None:
    """Reads :func:`format_saturation_record`'s text; None if it is not such a record."""
    data = json_object(text)
    if data is None or data.get("type") != FLOAT8_SATURATION_RECORD:
        return None
    fields = record_fields(data, Float8Saturation)
    if fields is None:
        return None
    try:
        return Float8Saturation(
            step=int(fields["step"]),
            layer=str(fields["layer"]),
            tensor=str(fields["tensor"]),
            amax=float(fields["amax"]),
            limit=float(fields["limit"]),
            steps=int(fields.get("steps", 1)),
        )
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class Float8Lost:
    """Saturation episodes the optimizer's ring overwrote before a read: counted, not known.

    Attributes:
        step: the read that found them lost (the attempted step).
        episodes: how many episodes were lost since the previous read.
    """

    step: int
    episodes: int


def format_lost(item: Float8Lost) -> str:
    """The markdown line of lost episodes (``kmix/fp8_events``)."""
    return (
        f"**float8 episodes lost** by step {item.step}: "
        f"{plural(item.episodes, 'saturation episode')} overwritten in the optimizer's ring "
        "before a read (read more often: a lower update_freq)"
    )


def format_lost_record(item: Float8Lost, run_id: str | None = None) -> str:
    """One JSON record of lost episodes (``kmix/fp8_record``)."""
    run = {} if run_id is None else {"run_id": run_id}
    return record_json(item, type=FLOAT8_LOST_RECORD, **run)


def parse_lost_record(text: str) -> Float8Lost | None:
    """Reads :func:`format_lost_record`'s text; None if it is not such a record."""
    data = json_object(text)
    if data is None or data.get("type") != FLOAT8_LOST_RECORD:
        return None
    fields = record_fields(data, Float8Lost)
    if fields is None:
        return None
    try:
        return Float8Lost(step=int(fields["step"]), episodes=int(fields["episodes"]))
    except (TypeError, ValueError):
        return None


def float8_tag(prefix: str, layer: str, tensor: str) -> str:
    """``prefix + layer + "/" + tensor``, e.g. ``kmix/fp8_scale/mlp/dense/inputs``."""
    return f"{prefix}{layer}/{tensor}"


def parse_float8_tag(tag: str) -> tuple[str, str, str] | None:
    """``(prefix, layer, tensor)`` of a float8 tag; None for another tag."""
    for prefix in FP8_TAG_PREFIXES:
        if tag.startswith(prefix):
            layer, _, tensor = tag[len(prefix) :].rpartition("/")
            if layer and tensor:
                return prefix, layer, tensor
    return None
