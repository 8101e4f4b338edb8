"""The monitor's float8 part: per-tensor health at each read, saturation episodes at their step.

With kmix's optimizer the counts and episodes come from its record
(:meth:`kmix.LossScaleOptimizer.float8_health`, ``float8_episodes``); with another
optimizer the variables alone are read (:func:`kmix.float8.read_health`: scale, headroom,
staleness, kernel underflow; no counts, since nothing watched every step). An episode is
written once it has ended (or at the run's end), at its first step.
"""

from __future__ import annotations

from typing import Any

from kmix import tags
from kmix.float8 import Float8Health, read_health

__all__ = ["Float8Monitor"]

_FIELDS = {
    "scale": tags.FP8_SCALE,
    "headroom_bits": tags.FP8_HEADROOM_BITS,
    "staleness_bits": tags.FP8_STALENESS_BITS,
    "saturated_steps": tags.FP8_SATURATED_STEPS,
    "underflow_fraction": tags.FP8_UNDERFLOW_FRACTION,
}


class Float8Monitor:
    """What one monitor has written of float8 so far (kept across the fits it watches).

    Attributes:
        written: ``(first step, layer, tensor)`` -> the length written (an episode open
            when a fit ended is written again once the next fit has made it longer).
    """

    def __init__(self) -> None:
        self.written: dict[tuple[int, str, str], int] = {}

    def write(
        self,
        optimizer: Any,
        model: Any,
        writer: Any,
        batch: Any,
        step: int,
        run_id: str,
        final: bool = False,
    ) -> None:
        """Writes the read's float8 scalars into ``batch`` and ended episodes to ``writer``.

        Args:
            final: the fit is ending: episodes still open are written as they are now.
        """
        state = getattr(optimizer, "float8", None)
        if state is not None and state.active:
            health: list[Float8Health] = optimizer.float8_health()
            episodes = optimizer.float8_episodes()
        elif any(
            getattr(v, "overwrite_with_gradient", False)
            for v in getattr(model, "trainable_variables", ())
        ):
            health, episodes = read_health(model.trainable_variables), []
        else:
            return
        for h in health:
            for field, prefix in _FIELDS.items():
                value = getattr(h, field)
                if value is not None:
                    batch.scalar(tags.float8_tag(prefix, h.layer, h.tensor), float(value), step)
        for episode in episodes:
            key = (episode.step, episode.layer, episode.tensor)
            ended = episode.step + episode.steps - 1 < step
            if self.written.get(key, 0) >= episode.steps or not (ended or final):
                continue
            self.written[key] = episode.steps
            writer.text(tags.FP8_EVENTS, tags.format_saturation(episode), step=episode.step)
            record = tags.format_saturation_record(episode, run_id)
            writer.text(tags.FP8_RECORD, record, step=episode.step)
