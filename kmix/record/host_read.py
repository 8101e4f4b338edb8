"""What a host read of the step record returns: a typed :class:`Snapshot`; and
:data:`HOST_OPS`, for a step that decides on the host.

Pure and light (no TensorFlow): built from host copies of the record's variables by
:func:`snapshot`; the callbacks, the guard's rules and the tests read these values.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from kmix.record.step_record import HEALTH_FIELDS, Counters, loss_finite_from_state, measured_health

__all__ = ["HOST_OPS", "Snapshot", "snapshot"]

HOST_OPS = types.SimpleNamespace(
    cast=lambda x, dtype: np.asarray(x, dtype),
    **{
        name: getattr(np, name)
        for name in (
            "all",
            "any",
            "equal",
            "greater_equal",
            "less_equal",
            "logical_and",
            "logical_not",
            "maximum",
            "minimum",
            "mod",
        )
    },
)
"""The few ``keras.ops`` the step's decisions use (:func:`kmix.record.due_now`,
:func:`kmix.record.is_quiet`), over NumPy: an eager step decides on the host from one read
of its counters (pass ``xp=HOST_OPS``)."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The record as read at one moment: Python values, JSON-ready via ``asdict``.

    Attributes:
        loss_scale: the current scale (None where the optimizer has none).
        attempted_steps: optimizer steps attempted, skipped ones included.
        skipped_steps: steps not applied.
        good_steps: consecutive finite steps since the scale last changed or a skip.
        consecutive_skips: skipped steps in a row, up to now.
        last_overflow_step: the most recent skipped step, 0 if none.
        loss_finite: whether the latest step's unscaled loss was finite; None if unknown.
        consecutive_nonfinite_loss: steps in a row with a non-finite loss, up to now.
        event_count: events recorded since training began.
        health_step: step of the latest periodic health measurement, 0 if none (a
            skipped step's health goes with its event).
        histogram_step: step of the latest exponent histograms, 0 if none.
        health: the periodic gradient health (:data:`HEALTH_FIELDS` -> value), empty
            before the first periodic measurement; range statistics are absent when
            no float16 variable was measured.
    """

    loss_scale: float | None
    attempted_steps: int
    skipped_steps: int
    good_steps: int = 0
    consecutive_skips: int = 0
    last_overflow_step: int = 0
    loss_finite: bool | None = None
    consecutive_nonfinite_loss: int = 0
    event_count: int = 0
    health_step: int = 0
    histogram_step: int = 0
    health: dict[str, float] = dataclasses.field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """``snapshot["loss_scale"]``: the mapping access of kmix 0.1.0's dict, kept."""
        if key in HEALTH_FIELDS:
            return self.health.get(key, math.nan)
        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        return getattr(self, key)

    def _not_a_mapping(self, *args: Any) -> Any:
        raise TypeError(
            "a kmix Snapshot is a dataclass, not a mapping: snapshot['loss_scale'] reads one "
            "field; for all of them use dataclasses.asdict(snapshot)"
        )

    __iter__ = keys = values = items = _not_a_mapping


def snapshot(
    scale: float | None, counters: Sequence[int], health: Sequence[float] | None
) -> Snapshot:
    """Builds a :class:`Snapshot` from host copies of the record's variables.

    Args:
        scale: the scale variable's value; None when it was not read.
        counters: the counters vector, laid out as :class:`Counters`.
        health: the periodic health vector, or None before the optimizer is built.
    """
    c = Counters(*(int(x) for x in counters))
    return Snapshot(
        loss_scale=None if scale is None else float(scale),
        attempted_steps=c.attempted_steps,
        skipped_steps=c.skipped_steps,
        good_steps=c.good_steps,
        consecutive_skips=c.consecutive_skips,
        last_overflow_step=c.last_overflow_step,
        loss_finite=loss_finite_from_state(c.loss_state),
        consecutive_nonfinite_loss=c.consecutive_nonfinite_loss,
        event_count=c.event_count,
        health_step=c.health_step,
        histogram_step=c.histogram_step,
        health={} if health is None else measured_health(health),
    )
