"""The typed values of a report: a :class:`Summary` of a run, its parts, and :class:`Finding`.

Plain frozen dataclasses, computed elsewhere: :mod:`kmix.report.summary` builds the
:class:`Summary` from a log and :mod:`kmix.report.finding_rules` the :class:`Finding` list
from a :class:`Summary`. Both import this module, and this module imports neither,
so the report's modules import in one direction. JSON through :meth:`Summary.to_dict`
(the contract of ``kmix report --json``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kmix._json import json_ready
from kmix.precision_plan import PrecisionMove, PrecisionPlan
from kmix.report.runs import RunInfo
from kmix.report.whatif import PrecisionWhatIf
from kmix.tags import Float8Saturation, PolicyRecord, RunEnd, ScaleEvent


@dataclasses.dataclass(frozen=True)
class Finding:
    """One observation about the run.

    Attributes:
        severity: ``"warning"`` (something to act on) or ``"info"``.
        rule: the name of the rule that made it.
        message: the observation and what it means, in plain words.
    """

    severity: str
    rule: str
    message: str


@dataclasses.dataclass(frozen=True)
class LossScale:
    """Initial, final, lowest and highest loss scale; None when unknown or non-finite.

    ``initial`` is the scale written at train begin (``PolicyRecord.loss_scale``)
    or, in logs without it, the earliest scale the log holds; it is None when
    scale events were lost before any scale was written (the log lost its
    beginning), and then ``min`` and ``max`` are None too. When events were lost
    later, ``min`` and ``max`` are over the scales the log holds.
    """

    initial: float | None
    final: float | None
    min: float | None
    max: float | None


@dataclasses.dataclass(frozen=True)
class Trend:
    """One scalar over the run, its finite points only for the numbers.

    Attributes:
        points: how many points were logged.
        nonfinite_points: how many of them were inf or NaN.
        first_step: step of the first point.
        last_step: step of the last point.
        first: first finite value (None: none is finite; likewise below).
        last: last finite value.
        min: lowest finite value.
        max: highest finite value.
        direction: ``"rising"``, ``"falling"`` or ``"steady"`` (the second half's
            mean against the first half's; see :mod:`kmix.report.summary`).
    """

    points: int
    nonfinite_points: int
    first_step: int
    last_step: int
    first: float | None
    last: float | None
    min: float | None
    max: float | None
    direction: str | None


@dataclasses.dataclass(frozen=True)
class ExponentShares:
    """One exponent histogram split into the ranges that matter for float16.

    Attributes:
        step: the step of the histogram.
        elements: how many elements it counts.
        zero: share of exact zeros.
        below_normal: non-zero, below ``2**-14``: float16 loses precision, then flushes.
        in_range: normal float16 values.
        above_max: finite, ``2**16`` or more.
        nonfinite: inf or NaN.
    """

    step: int
    elements: int
    zero: float
    below_normal: float
    in_range: float
    above_max: float
    nonfinite: float


@dataclasses.dataclass(frozen=True)
class Note:
    """A note of the writer (``kmix/notes``) or a ``kmix/events`` line that is no event."""

    step: int
    text: str


@dataclasses.dataclass(frozen=True)
class Forecast:
    """Where a falling headroom series reaches 0 bits (float16's max) at its trend.

    Attributes:
        series: ``"activations of <layer>"`` (the gradients' headroom is not forecast:
            the loss scale drives it toward 0 on every run).
        zero_step: the step at which the fitted line reaches 0 bits.
        bits_per_step: the fitted slope (negative).
        last_step: the last step fitted.
        last_bits: the headroom at that step.
        points: how many points were fitted.
    """

    series: str
    zero_step: int
    bits_per_step: float
    last_step: int
    last_bits: float
    points: int


@dataclasses.dataclass(frozen=True)
class Float8TensorHealth:
    """One float8 tensor of one layer as the monitor last read it (``kmix/fp8_*``).

    Attributes:
        layer: the float8 layer's path.
        tensor: ``"inputs"``, ``"kernel"`` or ``"outputs_grad"``.
        step: the step of the latest read.
        scale: the delayed scale in force at that read; None if not logged.
        headroom_bits: log2(scale x format max / the latest amax) at that read.
        min_headroom_bits: the lowest headroom over every read.
        staleness_bits: log2(amax history's max / the latest amax) at that read.
        saturated_steps: cumulative steps at which it was clipped (counted by kmix's
            optimizer; None without it).
        underflow_fraction: for the kernel, share of its non-zero values that flush to
            zero at the scale in force; None where not measured.
        episodes: saturation episodes recorded for it.
    """

    layer: str
    tensor: str
    step: int
    scale: float | None
    headroom_bits: float | None
    min_headroom_bits: float | None
    staleness_bits: float | None
    saturated_steps: int | None
    underflow_fraction: float | None
    episodes: int


@dataclasses.dataclass(frozen=True)
class GrowthSaturation:
    """A loss-scale growth whose next step saturated float8 output gradients.

    Attributes:
        step: the step of the growth (the scale grew after it).
        layers: the float8 layers whose output gradients were clipped at the next step.
    """

    step: int
    layers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Float8Summary:
    """What a run's float8 layers went through (``kmix report``'s "Float8" section).

    Attributes:
        layers: the float8 layers' paths, in the order they were written.
        tensors: each layer's tensors as last read, layer by layer.
        episodes: every saturation episode recorded (a tensor clipped at consecutive
            steps), in step order; ``steps`` is its length.
        saturated_tensor_steps: saturated tensor-steps: the optimizer's counts where
            logged, else the episodes' lengths.
        growth_saturations: loss-scale growths followed by output-gradient saturations.
        lost_episodes: episodes the optimizer's ring overwrote before the monitor read
            them (counted, not listed: ``kmix/fp8_record``'s ``float8_lost`` records).
    """

    layers: tuple[str, ...]
    tensors: tuple[Float8TensorHealth, ...]
    episodes: tuple[Float8Saturation, ...]
    saturated_tensor_steps: int
    growth_saturations: tuple[GrowthSaturation, ...] = ()
    lost_episodes: int = 0


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a run did to its loss scale and gradients, and what it means.

    Attributes:
        logdir: the directory read.
        steps_seen: the last step anything was logged at.
        loss_scale: the scale's range.
        skipped_steps: skipped (non-finite) steps.
        skip_rate: ``skipped_steps / steps_seen``.
        recent_skip_rate: the skip rate of the latest window, None if not logged.
        events: every scale event, in step order, each once.
        event_counts: kind -> count.
        trends: ``overflow_headroom_bits``, ``underflow_fraction``, ``grad_norm``
            -> :class:`Trend`, None when not logged.
        underflow_by_variable: variable -> latest zero-or-subnormal share, largest first.
        gradient_exponents: variable -> :class:`ExponentShares` of its latest histogram.
        policy: the ``kmix/policy`` text, None if not logged.
        compute_dtype: the model's compute dtype, None if unknown.
        notes: the writer's notes, and lines of ``kmix/events`` that are no event.
        findings: what :data:`kmix.report.RULES` found.
        events_lost: how many events the writer said were lost.
        policy_record: the structured ``kmix/policy_record``, None for 0.1.0 logs.
        run_end: how the run ended, None if not recorded.
        underflow_split: ``zero_fraction``, ``subnormal_fraction`` -> :class:`Trend`
            or None.
        subnormal_by_variable: variable -> latest subnormal share, largest first.
        activation_headroom: layer -> :class:`Trend` of its activation headroom
            bits, tightest (lowest latest) first.
        min_activation_headroom: :class:`Trend` of the minimum over layers, or None.
        forecasts: falling headroom series and where they would reach 0 bits.
        precision_whatif: ``{"gradients": PrecisionWhatIf | None}``.
        variables_not_float16: variable -> the compute dtype of its layer, for the
            variables whose layer the policy record says does not compute in
            float16. Float16's range does not apply to them: they are left out of
            ``underflow_by_variable``, ``subnormal_by_variable`` and
            ``gradient_exponents`` (the precision what-if keeps them).
        run: which run of the log dir this summary is of (a log dir a script wrote
            twice into holds several; every count here is of this run alone); None
            when not known.
        runs: every kmix run of the log dir, oldest first.
        plots: the PNG files written for it (set by the caller).
        precision_moves: the layers ``PrecisionAutopilot`` moved out of float16, in order.
        float16_share: :class:`Trend` of ``kmix/float16_share``, None if not logged.
        float8: the float8 layers' saturations and health; None for a run without
            float8 layers.
    """

    logdir: str
    steps_seen: int
    loss_scale: LossScale
    skipped_steps: int
    skip_rate: float
    recent_skip_rate: float | None
    events: tuple[ScaleEvent, ...]
    event_counts: dict[str, int]
    trends: dict[str, Trend | None]
    underflow_by_variable: dict[str, float | None]
    gradient_exponents: dict[str, ExponentShares]
    policy: str | None
    compute_dtype: str | None
    notes: tuple[Note, ...]
    events_lost: int
    policy_record: PolicyRecord | None
    run_end: RunEnd | None
    underflow_split: dict[str, Trend | None]
    subnormal_by_variable: dict[str, float | None]
    activation_headroom: dict[str, Trend]
    min_activation_headroom: Trend | None
    forecasts: tuple[Forecast, ...]
    precision_whatif: dict[str, PrecisionWhatIf | None]
    variables_not_float16: dict[str, str] = dataclasses.field(default_factory=dict)
    run: RunInfo | None = None
    runs: tuple[RunInfo, ...] = ()
    findings: tuple[Finding, ...] = ()
    plots: tuple[str, ...] = ()
    precision_moves: tuple[PrecisionMove, ...] = ()
    float16_share: Trend | None = None
    float8: Float8Summary | None = None

    @property
    def precision_plan(self) -> PrecisionPlan:
        """The moves as a plan (``kmix.apply_plan`` starts the next run healed)."""
        return PrecisionPlan.from_moves(self.precision_moves)

    def to_dict(self) -> dict[str, Any]:
        """The summary as JSON-ready data: lists for tuples, None for non-finite numbers.

        Events leave out ``index``, which logs without event records do not hold,
        so every log gives the same keys, and hold ``source`` only where it is known
        (several processes or replicas).

        Returns:
            A dict with one key per field.
        """
        data = json_ready(dataclasses.asdict(self))
        for event in data["events"]:
            del event["index"]
            if event.get("source", 0) is None:
                del event["source"]
        data["precision_plan"] = dict(self.precision_plan.policies)  # {} without moves
        return data

    def __getitem__(self, key: str) -> Any:
        """``summary["skipped_steps"]``: kmix 0.1.0 returned the dict :meth:`to_dict` gives."""
        return self.to_dict()[key]
