"""LossScaleGuard: stop a run that loss scaling cannot save, and say why."""

from __future__ import annotations

import collections
import warnings
from typing import TYPE_CHECKING, Any

from kmix import backend as _backend
from kmix import tags
from kmix._checks import KmixDeprecationWarning, KmixWarning, check_choice, check_int, check_real
from kmix._runs import OPEN
from kmix.callbacks import _source
from kmix.callbacks._base import StepCallback, end_run, warn_user
from kmix.callbacks._diagnosis import diagnosis, moves_text
from kmix.callbacks._forecast import HeadroomForecast, headroom_series
from kmix.callbacks._trip import (
    Point,
    Rules,
    Streaks,
    Trip,
    first_possible_trip,
    first_window_over,
    inferred_streaks,
    is_nonfinite,
    kept_from,
    skip_points,
    skip_rate_trip,
    steps_to_next_read,
    streak_trip,
)
from kmix.callbacks.autopilot import PrecisionAutopilot
from kmix.tags import GUARD_RAISED, STOPPED_BY_GUARD, ScaleEvent

if TYPE_CHECKING:
    from kmix.record import Snapshot

__all__ = [
    "MODES",
    "LossScaleGuard",
    "LossScaleGuardError",
    "first_possible_trip",
    "first_window_over",
]

_OWNER = "kmix.callbacks.LossScaleGuard"


def __getattr__(name: str) -> Any:
    """``STOCK_MIN_SCALE``, deprecated here: it is ``kmix.callbacks._source``'s."""
    if name == "STOCK_MIN_SCALE":
        warnings.warn(
            "kmix.callbacks.guard.STOCK_MIN_SCALE is deprecated and removed in kmix 0.2: "
            "the stock Keras optimizer's floor is 1.0.",
            KmixDeprecationWarning,
            stacklevel=2,
        )
        return _source.STOCK_MIN_SCALE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MODES = {"stop": "set model.stop_training", "raise": "raise LossScaleGuardError"}


class LossScaleGuardError(RuntimeError):
    """Raised by :class:`LossScaleGuard` with ``mode="raise"``.

    Attributes:
        reason: ``"nonfinite_loss"``, ``"overflow_at_floor"`` or ``"skip_rate"``.
        step: the attempted optimizer step at which the guard tripped.
    """

    kmix_reason = GUARD_RAISED
    """How the run ended, for the monitor's ``kmix/run_end`` record."""

    def __init__(self, message: str, reason: str, step: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.step = step


class LossScaleGuard(StepCallback):
    """Stops training that loss scaling cannot save, with a diagnosis a user can act on.

    It trips on the first of:

    * ``nonfinite_loss``: the loss, before scaling, has been NaN/Inf for
      ``patience`` consecutive steps. The forward pass makes it, so no loss scale helps.
    * ``overflow_at_floor``: the loss scale is at its minimum and the gradients
      have overflowed for ``patience`` consecutive steps.
    * ``skip_rate``: more than ``max_skip_rate`` of ``window`` consecutive steps were
      skipped (checked once ``window`` steps have run in this ``fit``).

    With ``kmix.LossScaleOptimizer`` it reads the optimizer's in-graph counters and
    names the first non-finite variable. It reads them only at the steps where a rule
    could first trip (:func:`first_possible_trip`), at each health measurement and
    before the event ring could overflow: a healthy run with the defaults costs one
    small read every ``patience`` steps (and a read of the events recorded since, if
    any), not one per step; more often when ``window * max_skip_rate`` or
    ``event_capacity`` is below ``patience``. With ``check_freq=1`` and one step per
    execution it trips at the same step as a check after every step would. At each
    read it counts every window of ``window`` steps that ended since the last read
    exactly, from the steps of the recorded skip events. Only when reads are more than
    ``event_capacity`` steps apart (``check_freq + steps_per_execution - 1`` above it)
    can the ring lose events between them; the windows it no longer covers are then
    judged by the share skipped since the last counted step at least ``window`` steps
    back, as with the stock optimizer (a span longer than ``window`` can exceed the
    rate where no single window does). With the stock
    Keras optimizer, which halves its scale down to 0.0 and trains on with NaN
    loss, it infers skipped steps from the optimizer's iterations, counts a step
    as a non-finite loss when it was skipped and the logged loss is NaN/Inf, and
    takes 1.0 as the floor. Without loss scaling only ``nonfinite_loss`` applies
    (from the logged loss, which is the epoch's running mean).

    Example:
        >>> model.fit(x, y, callbacks=[kmix.callbacks.LossScaleGuard()])  # doctest: +SKIP

    Args:
        patience: consecutive bad steps before tripping, >= 1. Default 20: a
            healthy run skips a few steps in a row at most while the scale settles.
        max_skip_rate: trip when the share of skipped steps over ``window``
            exceeds this, in (0, 1]. Default 0.5: a run that skips half its steps
            barely trains.
        window: steps over which the skip rate is measured, >= 1. Default 200.
        mode: ``"stop"`` sets ``model.stop_training`` and prints the diagnosis;
            ``"raise"`` raises :class:`LossScaleGuardError`.
        check_freq: check at most every this many steps, >= 1. Default 1, so the
            guard trips exactly after ``patience`` steps; larger values save host
            syncs (with the stock optimizer, which is read at every check) and trip
            at the first check after a rule is met. A streak counts only while it
            lasts at a check. Keras calls callbacks once per ``steps_per_execution``
            steps, so a check is at most that often.
        verbose: 1 prints the diagnosis when stopping; 0 is quiet.

    Attributes:
        diagnosis: the message, once tripped; None before.
        reason: one of ``"nonfinite_loss"``, ``"overflow_at_floor"``,
            ``"skip_rate"`` once tripped; None before.
        step: the attempted optimizer step at which it tripped; None before.

    Raises:
        ValueError: an argument is invalid; at train begin, the model is not compiled.
    """

    def __init__(
        self,
        patience: int = 20,
        max_skip_rate: float = 0.5,
        window: int = 200,
        mode: str = "stop",
        check_freq: int = 1,
        verbose: int = 1,
    ) -> None:
        self.check_freq = check_int(_OWNER, "check_freq", check_freq, 1)
        super().__init__(every=self.check_freq)
        self.patience = check_int(_OWNER, "patience", patience, 1)
        self.max_skip_rate = check_real(
            _OWNER, "max_skip_rate", max_skip_rate, 0.0, 1.0, open_low=True
        )
        self.window = check_int(_OWNER, "window", window, 1)
        self.mode = check_choice(_OWNER, "mode", mode, MODES)
        self.verbose = int(check_choice(_OWNER, "verbose", verbose, {0: "quiet", 1: "print"}))
        self.diagnosis: str | None = None
        self.reason: str | None = None
        self.step: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Resets the guard and reads the optimizer's starting point.

        Raises:
            ValueError: the model is not compiled.
        """
        super().on_train_begin(logs)
        self.diagnosis = self.reason = self.step = None
        source = self._source
        if not source.scales_loss:
            warnings.warn(
                f"{_OWNER}: the model's optimizer {source.optimizer_name} does "
                "not scale the loss, so only the non-finite loss check applies.",
                KmixWarning,
                stacklevel=2,
            )
        state = self._read_state()
        # (step, skipped) at every read and, with kmix, at every skipped step the event
        # ring kept, back to the points the next read's windows start from.
        self._history = collections.deque([Point(state.attempted_steps, state.skipped_steps)])
        self._rate_from = state.attempted_steps + self.window
        self._events_seen = state.event_count
        self._exact_from = state.attempted_steps  # every skip after it has its point
        self._streaks = Streaks()  # inferred where the source does not count them
        self._health_step = state.health_step
        self._forecast = HeadroomForecast()
        self._moves_seen = 0  # PrecisionAutopilot moves in this fit at the previous read
        # Read after the first step, once every callback has begun (a monitor may ask
        # for health more often than the optimizer's default); each read then
        # schedules the next (kmix).
        self._every = self.check_freq

    @property
    def _rules(self) -> Rules:
        """The settings the trip rules read."""
        return Rules(self.patience, self.max_skip_rate, self.window)

    # ------------------------------------------------------------------ checks
    def _on_read(self, logs: dict) -> None:
        """Reads the source, applies the rules (:mod:`kmix.callbacks._trip`), trips or
        schedules the next read."""
        if self.diagnosis is not None:
            return
        source = self._source
        state = self._read_state(counters_only=True)  # one small transfer per check
        previous = self._history[-1]
        if source.records_events:
            self._note_skips(state)
        if source.knows_loss:
            streaks = Streaks(state.consecutive_nonfinite_loss, state.consecutive_skips)
            if streaks.skips >= self.patience or state.health_step > self._health_step:
                state = self._read_state()  # the scale and the health too
        else:  # inferred from the steps applied and the logged loss
            streaks = self._streaks = inferred_streaks(
                self._streaks,
                state.attempted_steps - previous.step,
                state.skipped_steps - previous.skipped,
                loss_nonfinite=is_nonfinite(logs.get("loss")),
                scales_loss=source.scales_loss,
            )
        step = state.attempted_steps
        self._history.append(Point(step, state.skipped_steps))
        self._warn_on_forecast(state)
        trip = streak_trip(
            step,
            streaks,
            patience=self.patience,
            loss_scale=state.loss_scale,
            floor=source.floor_scale,
        )
        if trip is None and source.scales_loss:
            trip = skip_rate_trip(
                self._history,
                max(previous.step + 1, self._rate_from),
                self._rules,
                exact_from=self._exact_from if source.records_events else None,
            )
        if trip is not None and not self._autopilot_moved():
            self._trip(trip)
            return
        self._moves_seen = self._moves_made(self._autopilots())
        for _ in range(kept_from(self._history, step, self.window)):
            self._history.popleft()
        if source.records_events:
            self._schedule(streaks)

    def _autopilots(self) -> list[PrecisionAutopilot]:
        """The open PrecisionAutopilots of this model."""
        return OPEN.of_model(self.model, PrecisionAutopilot)

    def _autopilot_moved(self) -> bool:
        """Lets the model's PrecisionAutopilot act first: True when it moved a layer now or
        since the guard's previous read, whichever callback came first (the rule is judged
        again once the moves have taken effect)."""
        autopilots = self._autopilots()
        moved_now = any([autopilot.act() for autopilot in autopilots])
        seen, self._moves_seen = self._moves_seen, self._moves_made(autopilots)
        return moved_now or self._moves_seen > seen

    @staticmethod
    def _moves_made(autopilots: list[PrecisionAutopilot]) -> int:
        return sum(len(autopilot.moves_in_fit) for autopilot in autopilots)

    def _note_skips(self, state: Snapshot) -> None:
        """Adds a history point at each skipped step recorded since the last read."""
        if state.event_count == self._events_seen:
            return
        events = self._source.events(self._events_seen)
        points, self._exact_from = skip_points(
            [r.event.step for r in events if r.event.kind in tags.SKIP_KINDS],
            state.skipped_steps,
            lost=len(events) < state.event_count - self._events_seen,
            attempted_steps=state.attempted_steps,
            exact_from=self._exact_from,
        )
        self._history.extend(points)
        self._events_seen = state.event_count

    def _schedule(self, streaks: Streaks) -> None:
        """Sets the steps until the next read (kmix): see :func:`steps_to_next_read`."""
        trip = first_possible_trip(
            self._history,
            streaks.loss,
            streaks.skips,
            patience=self.patience,
            max_skip_rate=self.max_skip_rate,
            window=self.window,
            rate_from=self._rate_from,
        )
        self._every = steps_to_next_read(
            self._history[-1].step,
            trip,
            health_every=self._source.health_every,
            event_capacity=self._source.event_capacity,
            steps_per_execution=int(getattr(self.model, "steps_per_execution", 1) or 1),
            check_freq=self.check_freq,
        )

    def _warn_on_forecast(self, state: Snapshot) -> None:
        """Warns (never stops) when a headroom is forecast to reach float16's max."""
        if not self._source.measures_health or state.health_step <= self._health_step:
            return
        self._health_step = state.health_step
        # A proactive PrecisionAutopilot acts on falling activation headroom itself.
        healing = any(autopilot.watching_headroom for autopilot in self._autopilots())
        series = headroom_series(state.health, {} if healing else self._source.per_layer())
        for message in self._forecast.add(state.health_step, series):
            warn_user(f"{_OWNER}: {message}")

    def _trip(self, trip: Trip) -> None:
        """Records the trip with its diagnosis, ends the run, then stops or raises.

        Raises:
            LossScaleGuardError: in ``mode="raise"``.
        """
        message = diagnosis(
            trip,
            patience=self.patience,
            max_skip_rate=self.max_skip_rate,
            events=self._recent_events(),
            loss_scaling=self._source.kind,
        )
        for autopilot in self._autopilots():
            if autopilot.moves:
                message += "\n\n" + moves_text(autopilot.moves, autopilot.max_layers)
        self.diagnosis, self.reason, self.step = message, trip.reason, trip.step
        # Every open kmix callback of this model writes its evidence first.
        end_run(self.model, GUARD_RAISED if self.mode == "raise" else STOPPED_BY_GUARD, message)
        if self.mode == "raise":
            raise LossScaleGuardError(message, trip.reason, trip.step)
        self.model.stop_training = True
        if self.verbose and _backend.is_first_process():  # one diagnosis for the run
            print(f"\n{message}")

    def _recent_events(self) -> list[ScaleEvent]:
        """The events of the last ``patience`` indices, newest first (one ring read)."""
        if not self._source.records_events:
            return []
        count = self._read_state(counters_only=True).event_count
        return [event for event, _ in reversed(self._source.events(max(count - self.patience, 0)))]
