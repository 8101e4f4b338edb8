"""The typed values of ``kmix compare``: one :class:`PolicyRow` per policy, the table.

Light (no TensorFlow, no Keras): ``kmix report`` and the TensorBoard tab rebuild a
:class:`PolicyComparison` from its JSON record (:func:`comparison_from_dict`) and
print or draw it with the same :meth:`PolicyComparison.to_markdown`. The rules that
fill these values live in :mod:`kmix.compare.rules`; the measuring in
:mod:`kmix.compare.comparison`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kmix._json import json_ready

__all__ = [
    "MEASURED",
    "OUT_OF_MEMORY",
    "ROW_STATUSES",
    "STOPPED_SLOW",
    "CompareError",
    "PolicyComparison",
    "PolicyRow",
    "Recommendation",
    "comparison_from_dict",
]

MEASURED = "measured"
"""A policy that trained every step it was asked to."""
STOPPED_SLOW = "stopped: too slow"
"""A policy stopped after its time budget: pathologically slow on this machine."""
OUT_OF_MEMORY = "out of memory"
"""A policy whose model did not fit in the device's memory."""
ROW_STATUSES = (MEASURED, STOPPED_SLOW, OUT_OF_MEMORY)


class CompareError(ValueError):
    """Input ``kmix compare`` cannot use; the message names it, echoes it, says what to do."""


@dataclasses.dataclass(frozen=True)
class PolicyRow:
    """What one dtype policy did for the model on this machine.

    Times are of whole training steps (``fit``, one step per call of the train
    function), measured between the ends of consecutive steps; the first step of each
    round is left out (it starts the round's data iterator).

    Attributes:
        policy: the Keras policy name, e.g. ``"mixed_float16"``.
        status: one of :data:`ROW_STATUSES`.
        steps: steps trained (fewer than asked when stopped).
        step_time_s: median step time in seconds; None if no step was timed.
        step_time_iqr_s: the interquartile range of the step times (their spread).
        examples_per_s: examples per second at the median step time.
        speedup: float32's median step time over this one's (2.0: twice as fast).
        within_noise: whether the difference from float32 is inside the noise floor
            (then it is "no measurable difference"); None for float32 itself.
        peak_memory_bytes: the peak memory measured (see ``memory_note``), or None.
        memory_baseline_bytes: what that process held before the model was built
            (Python and TensorFlow), where it was measured.
        memory_note: what ``peak_memory_bytes`` is, or why it was not measured.
        weights_bytes: the model's variables (weights and non-trainable state).
        activation_bytes: every layer's output for one batch, from the output shapes
            and compute dtypes (computed, not measured); None where the shapes are
            unknown.
        loss_curve: each step's own loss, in order (not a running mean); not finite
            where the step was skipped for it.
        final_loss: the mean of the finite losses of the last tenth of the steps; None
            if none is finite (:func:`kmix.compare.rules.final_loss`).
        loss_departure: ``final_loss - float32's final_loss`` (positive: higher);
            None for float32.
        loss_ok: whether the loss is no higher than float32's by more than float32's
            own run-to-run spread (a lower loss is no departure to worry about); False
            when not finite; None for float32, and for a higher loss while the spread
            is unknown (shown, not judged).
        skipped_steps: steps the loss-scale optimizer skipped (a non-finite loss or
            gradients).
        min_headroom_bits: the least float16 range left by any layer's output over
            the run (log2 of 65504 over the largest absolute activation), the forward
            pass's headroom that no loss scale can change; None where the policy does
            not compute in float16 or nothing was measured.
        min_grad_headroom_bits: the least float16 range left by the scaled
            gradients; the loss scale keeps it near 0 by design (an overflow lowers
            the scale), so it is shown, not judged.
        tightest_layer: the layer with the least activation headroom.
        overflow_layers: layers where a non-finite forward pass started.
        native: whether this hardware computes the policy's compute dtype natively;
            None when unknown.
        native_note: why.
        note: what else to know (why a policy was stopped, and the cause).
    """

    policy: str
    status: str = MEASURED
    steps: int = 0
    step_time_s: float | None = None
    step_time_iqr_s: float | None = None
    examples_per_s: float | None = None
    speedup: float | None = None
    within_noise: bool | None = None
    peak_memory_bytes: int | None = None
    memory_baseline_bytes: int | None = None
    memory_note: str = ""
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    loss_curve: tuple[float, ...] = ()
    final_loss: float | None = None
    loss_departure: float | None = None
    loss_ok: bool | None = None
    skipped_steps: int = 0
    min_headroom_bits: float | None = None
    min_grad_headroom_bits: float | None = None
    tightest_layer: str | None = None
    overflow_layers: tuple[str, ...] = ()
    native: bool | None = None
    native_note: str = ""
    note: str = ""

    @property
    def compute_dtype(self) -> str:
        """The dtype the policy computes in: ``"mixed_bfloat16"`` -> ``"bfloat16"``."""
        return self.policy.removeprefix("mixed_")


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The policy to use, and why, in words that follow from the table.

    Attributes:
        policy: the recommended policy name.
        reasons: sentences, the deciding one first.
    """

    policy: str
    reasons: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PolicyComparison:
    """The policies compared side by side on one model and machine.

    Attributes:
        rows: one :class:`PolicyRow` per policy, in the order asked.
        noise_floor: the relative difference of float32's step time from itself (a
            second float32 model timed in the same rounds; see
            :func:`kmix.compare.rules.noise_floor`); a time difference inside it is
            "no measurable difference".
        noise_ratios: that second model's median step time over float32's, per round.
        loss_spread: ``|final loss of float32 - final loss of float32's second run|``
            (another seed, the data in another order): float32's own run-to-run
            spread; None when unknown (see ``loss_spread_note``).
        recommendation: what to use, and why.
        steps: steps asked of each policy.
        rounds: how many turns each policy took (policies alternate between turns).
        batch_size: examples per step.
        timing: how the times were taken, in words.
        hardware: ``kmix.hardware()`` as a dict.
        model: the model's name.
        loss_spread_note: why ``loss_spread`` is None, or "" (records written before
            it existed read back as "").
    """

    rows: tuple[PolicyRow, ...]
    noise_floor: float | None
    noise_ratios: tuple[float, ...]
    loss_spread: float | None
    recommendation: Recommendation
    steps: int
    rounds: int
    batch_size: int | None
    timing: str
    hardware: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: str = ""
    loss_spread_note: str = ""

    def row(self, policy: str) -> PolicyRow:
        """The row of ``policy``.

        Raises:
            KeyError: no row has that policy.
        """
        for row in self.rows:
            if row.policy == policy:
                return row
        raise KeyError(policy)

    def to_dict(self) -> dict[str, Any]:
        """The comparison as plain dicts, lists, numbers and strings (non-finite as None).

        Returns:
            A JSON-ready dict; :func:`comparison_from_dict` reads it back.
        """
        return json_ready(dataclasses.asdict(self))

    def to_markdown(self) -> str:
        """The table, the noise floor and the recommendation as markdown.

        Returns:
            The text, lines joined by newlines.
        """
        from kmix.compare.text import comparison_markdown

        return comparison_markdown(self)

    def __str__(self) -> str:
        return self.to_markdown()


def comparison_from_dict(data: dict[str, Any]) -> PolicyComparison:
    """Rebuilds a :class:`PolicyComparison` from :meth:`PolicyComparison.to_dict`.

    Args:
        data: the dict (keys added by later versions are ignored).

    Returns:
        The comparison.

    Raises:
        CompareError: ``data`` lacks a field or a row is not a dict.
    """
    try:
        rows = tuple(_fields(PolicyRow, row) for row in data["rows"])
        recommendation = Recommendation(
            policy=data["recommendation"]["policy"],
            reasons=tuple(data["recommendation"]["reasons"]),
        )
        rest = _fields(PolicyComparison, data, skip=("rows", "recommendation"))
    except (KeyError, TypeError) as error:
        raise CompareError(f"not a kmix comparison record: missing or bad {error}") from None
    return PolicyComparison(rows=rows, recommendation=recommendation, **rest)


def _fields(cls: type, data: dict[str, Any], skip: tuple[str, ...] = ()) -> Any:
    """``cls``'s fields read from ``data``: lists become tuples, unknown keys are ignored."""
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in skip or field.name not in data:
            continue
        value = data[field.name]
        values[field.name] = tuple(value) if isinstance(value, list) else value
    if skip:
        return values
    if "loss_curve" in values:
        values["loss_curve"] = tuple(math.nan if v is None else v for v in values["loss_curve"])
    return cls(**values)
