"""The monitor's float8 part: per-tensor health at each read, saturation episodes at their step.

With kmix's optimizer the counts and episodes come from its record
(:meth:`kmix.LossScaleOptimizer.float8_health`, ``float8_episodes``); with another
optimizer the variables alone are read (:func:`kmix.float8.read_health`: scale, headroom,
staleness, kernel underflow; no counts, since nothing watched every step). An episode is
written once it has ended (or at the fit's end, and again when the next fit made it
longer), at its first step; episodes the optimizer's ring overwrote between two reads are
counted (:class:`kmix.tags.Float8Lost`).
"""

from __future__ import annotations

from typing import Any

from kmix import tags
from kmix.float8 import Float8Health, lost_episodes, read_health

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
        seen: the optimizer's episode count at the previous read or train begin:
            episodes after it that the ring no longer holds were lost.
        pending: the episodes open at the previous read (not written yet): lost too
            when the ring no longer holds them.
    """

    def __init__(self) -> None:
        self.written: dict[tuple[int, str, str], int] = {}
        self.seen = 0
        self.pending: list[int] = []

    def begin(self, optimizer: Any) -> None:
        """At train begin: episodes counted before this fit are not this fit's to lose."""
        state = getattr(optimizer, "float8", None)
        self.seen = state.episode_count() if state is not None and state.active else 0
        self.pending = []

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
            if not state.readable():  # the fit ended before its first step ran
                return
            optimizer.recorder.sync()
            with state.held():  # one read of the record answers all four
                health: list[Float8Health] = optimizer.float8_health()
                episodes = optimizer.float8_episodes()
                count = state.episode_count()
                open_now = [] if final else state.open_episodes(step)
            held_from = count - state.capacity + 1
            lost = lost_episodes(count, state.capacity, self.seen)
            lost += sum(1 for e in self.pending if e < held_from)
            self.seen, self.pending = count, open_now
            if lost:
                item = tags.Float8Lost(step, lost)
                writer.text(tags.FP8_EVENTS, tags.format_lost(item), step=step)
                writer.text(tags.FP8_RECORD, tags.format_lost_record(item, run_id), step=step)
        elif any(
            getattr(v, "overwrite_with_gradient", False)
            for v in getattr(model, "trainable_variables", ())
        ):
            health, episodes = read_health(model.trainable_variables, model=model), []
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
