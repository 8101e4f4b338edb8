"""LossScaleGuard: stop a run that loss scaling cannot save, and say why."""

from __future__ import annotations

import bisect
import collections
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from kmix import tags
from kmix._checks import check_choice, check_int, check_real
from kmix.callbacks._base import StepCallback, end_run, warn_user
from kmix.callbacks._forecast import HeadroomForecast, headroom_series
from kmix.callbacks._source import STOCK_MIN_SCALE  # noqa: F401  (the 0.1.0 name)
from kmix.tags import GUARD_RAISED, STOPPED_BY_GUARD

_OWNER = "kmix.callbacks.LossScaleGuard"
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


def _is_nonfinite(value: Any) -> bool:
    try:
        return not math.isfinite(float(np.asarray(value)))
    except (TypeError, ValueError):
        return False


def first_possible_trip(
    points: Sequence[tuple[int, int]],
    loss_streak: int,
    skip_streak: int,
    *,
    patience: int,
    max_skip_rate: float,
    window: int,
    rate_from: int,
) -> int:
    """The first step after the last read at which a rule could trip, whatever comes.

    Each step adds at most one to each streak and to the skipped count. So
    ``nonfinite_loss`` cannot trip before ``patience - loss_streak`` more steps,
    ``overflow_at_floor`` before ``patience - skip_streak`` (or the next step, when
    only the scale's floor is missing), and ``skip_rate`` at step ``t`` counts at most
    the skips already made after ``t - window`` plus one per step still to come in
    the window.

    Args:
        points: ``(step, skipped)`` pairs in step order, the last one the read just
            made, such that the skipped count at any step ``u`` from the first point on
            is at least that of the last point at or before ``u`` (exact where every
            skip has its point).
        loss_streak: consecutive non-finite losses at the last point.
        skip_streak: consecutive skipped steps at the last point.
        patience: the guard's ``patience``.
        max_skip_rate: the guard's ``max_skip_rate``.
        window: the guard's ``window``.
        rate_from: the first step at which ``skip_rate`` applies (the steps attempted
            before the fit + ``window``: once ``window`` steps of the fit have run).

    Returns:
        A step after the last point's. E.g. no streaks and a skip rate far from
        ``max_skip_rate``, ``patience=20``: the last point's step + 20.
    """
    step, skipped = points[-1]
    streaks = min(step + patience - loss_streak, step + max(patience - skip_streak, 1))
    if max_skip_rate >= 1.0:  # no share of skipped steps exceeds 1
        return streaks
    steps = [p for p, _ in points]
    # Returns within window + 1 steps: a whole window of skips exceeds any rate below 1.
    for t in range(max(step + 1, rate_from), streaks):
        before = points[max(bisect.bisect_right(steps, t - window) - 1, 0)][1]
        if (skipped - before + min(t - step, window)) / window > max_skip_rate:
            return t
    return streaks


def first_window_over(
    points: Sequence[tuple[int, int]],
    first: int,
    last: int,
    *,
    window: int,
    max_skip_rate: float,
    exact_from: int | None,
) -> tuple[int, int] | None:
    """The first window of ``window`` steps ending in ``[first, last]`` that skipped
    more than ``max_skip_rate`` of its steps, among those the points count exactly.

    The skipped count at step ``u`` is the last point's at or before ``u``; it is exact
    from ``exact_from`` on (every later skip has its point). A window's count only
    grows at a point, so the first window over the rate ends at ``first`` or at a point.

    Args:
        points: ``(step, skipped)`` pairs in step order.
        first: the earliest window end to check.
        last: the latest window end to check.
        window: the guard's ``window``.
        max_skip_rate: the guard's ``max_skip_rate``.
        exact_from: the first step whose skipped count the points give exactly;
            None when no step's is (they are reads some steps apart).

    Returns:
        ``(end, skipped)``: the window's last step and the steps it skipped; None when
        no exactly counted window is over the rate.
    """
    if exact_from is None:
        return None
    steps = [p for p, _ in points]
    start = max(first, exact_from + window, steps[0] + window)
    if start > last:
        return None
    for end in [start] + [p for p in steps if start < p <= last]:
        at = points[bisect.bisect_right(steps, end) - 1][1]
        before = points[bisect.bisect_right(steps, end - window) - 1][1]
        if (at - before) / window > max_skip_rate:
            return end, at - before
    return None


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
        if not self._source.scales_loss:
            warnings.warn(
                f"{_OWNER}: the model's optimizer {type(self.model.optimizer).__name__} does "
                "not scale the loss, so only the non-finite loss check applies.",
                stacklevel=2,
            )
        state = self._read_state()
        # (step, skipped) at every read and, with kmix, at every skipped step the event
        # ring kept, back to the points the next read's windows start from.
        self._history = collections.deque([(state.attempted_steps, state.skipped_steps)])
        self._rate_from = state.attempted_steps + self.window
        self._events_seen = state.event_count
        self._exact_from = state.attempted_steps  # every skip after it has its point
        self._skip_streak = self._loss_streak = 0
        self._health_step = state.health_step
        self._forecast = HeadroomForecast()
        # Read after the first step, once every callback has begun (a monitor may ask
        # for health more often than the optimizer's default); each read then
        # schedules the next (kmix).
        self._every = self.check_freq

    # ------------------------------------------------------------------ checks
    def _on_read(self, logs: dict) -> None:
        if self.diagnosis is not None:
            return
        source = self._source
        state = self._read_state(counters_only=True)  # one small transfer per check
        step, skipped = state.attempted_steps, state.skipped_steps
        previous = self._history[-1][0]
        if source.records_events:
            self._note_skips(state)
        if source.knows_loss:
            loss_streak = state.consecutive_nonfinite_loss
            skip_streak = state.consecutive_skips
            if skip_streak >= self.patience or state.health_step > self._health_step:
                state = self._read_state()  # the scale and the health too
        else:  # inferred from the steps applied and the logged loss
            steps = step - self._history[-1][0]
            new_skips = skipped - self._history[-1][1]
            all_skipped = source.scales_loss and new_skips == steps
            self._skip_streak = self._skip_streak + steps if all_skipped else 0
            bad_loss = _is_nonfinite(logs.get("loss")) and (not source.scales_loss or all_skipped)
            self._loss_streak = self._loss_streak + steps if bad_loss else 0
            loss_streak, skip_streak = self._loss_streak, self._skip_streak
        self._history.append((step, skipped))
        self._warn_on_forecast(state)
        if loss_streak >= self.patience:
            self._trip("nonfinite_loss", step, self._nonfinite_loss_text(step, loss_streak))
        elif skip_streak >= self.patience and source.scales_loss:
            if state.loss_scale <= source.min_scale:
                self._trip(
                    "overflow_at_floor",
                    step,
                    self._floor_text(step, skip_streak, state.loss_scale),
                )
        if self.diagnosis is None and source.scales_loss:
            self._check_skip_rate(max(previous + 1, self._rate_from), step)
        # Keep the points the next read's windows start from.
        while len(self._history) > 1 and self._history[1][0] <= step + 1 - self.window:
            self._history.popleft()
        if self.diagnosis is None and source.records_events:
            self._schedule(loss_streak, skip_streak)

    def _note_skips(self, state: Any) -> None:
        """Adds a history point at each skipped step recorded since the last read.

        The skipped count at each is counted back from the state's total, so it is
        exact even when the ring no longer holds the oldest of them (then the history
        is exact from the first skip it still holds on).
        """
        if state.event_count == self._events_seen:
            return
        events = self._source.events(self._events_seen)
        skips = [r.event.step for r in events if r.event.kind in tags.SKIP_KINDS]
        first = state.skipped_steps - len(skips)
        self._history.extend((step, first + i) for i, step in enumerate(skips, start=1))
        if len(events) < state.event_count - self._events_seen:  # the ring overflowed
            self._exact_from = skips[0] if skips else state.attempted_steps
        self._events_seen = state.event_count

    def _check_skip_rate(self, first: int, step: int) -> None:
        """Trips on the first window of ``window`` steps ending in ``[first, step]`` that
        skipped more than ``max_skip_rate``, each counted exactly where the history is
        (kmix). Where it is not (the stock optimizer's reads; skips the event ring lost
        between reads), on the share skipped since the last count before the unknown
        steps and at least ``window`` steps back."""
        if first > step:
            return
        history = self._history
        exact_from = self._exact_from if self._source.records_events else None
        over = first_window_over(
            history,
            first,
            step,
            window=self.window,
            max_skip_rate=self.max_skip_rate,
            exact_from=exact_from,
        )
        if over is not None:
            end, skipped = over
            self._trip("skip_rate", step, self._skip_rate_text(step, end, self.window, skipped))
            return
        last = step - self.window
        if exact_from is not None:
            if first - self.window >= exact_from:
                return  # every window was counted exactly
            last = min(last, exact_from - 1)
        # _on_read keeps a point at or before first - window, so one is at or before last.
        start, counted = history[bisect.bisect_right([p for p, _ in history], last) - 1]
        skipped = history[-1][1] - counted
        if skipped / (step - start) > self.max_skip_rate:
            self._trip("skip_rate", step, self._skip_rate_text(step, step, step - start, skipped))

    def _schedule(self, loss_streak: int, skip_streak: int) -> None:
        """Sets the steps until the next read (kmix): until the first step at which a rule
        could trip, the next health measurement (each is read before the next replaces
        it), or before the event ring could overflow, whichever comes first."""
        step = self._history[-1][0]
        trip = first_possible_trip(
            self._history,
            loss_streak,
            skip_streak,
            patience=self.patience,
            max_skip_rate=self.max_skip_rate,
            window=self.window,
            rate_from=self._rate_from,
        )
        every = self._source.health_every
        health = step + every - step % every if every > 0 else trip
        # Keras calls back once per execution, so a read comes up to
        # steps_per_execution - 1 steps after the step it was asked for.
        late = max(int(getattr(self.model, "steps_per_execution", 1) or 1) - 1, 0)
        ring = step + max(self._source.event_capacity - late, 1)
        self._every = max(self.check_freq, min(trip, health, ring) - step)

    def _warn_on_forecast(self, state: Any) -> None:
        """Warns (never stops) when a headroom is forecast to reach float16's max."""
        if not self._source.measures_health or state.health_step <= self._health_step:
            return
        self._health_step = state.health_step
        series = headroom_series(state.health, self._source.per_layer())
        for message in self._forecast.add(state.health_step, series):
            warn_user(f"{_OWNER}: {message}")

    def _trip(self, reason: str, step: int, message: str) -> None:
        self.diagnosis, self.reason, self.step = message, reason, step
        # Every open kmix callback of this model writes its evidence first.
        end_run(self.model, GUARD_RAISED if self.mode == "raise" else STOPPED_BY_GUARD, message)
        if self.mode == "raise":
            raise LossScaleGuardError(message, reason, step)
        self.model.stop_training = True
        if self.verbose:
            print(f"\n{message}")

    # -------------------------------------------------------------- messages
    def _recent_events(self) -> list:
        """The events of the last ``patience`` indices, newest first (one ring read)."""
        if not self._source.records_events:
            return []
        count = self._read_state(counters_only=True).event_count
        return [event for event, _ in reversed(self._source.events(max(count - self.patience, 0)))]

    def _first_variable(self, events: list) -> str:
        """Where the last recorded event says the gradients first went non-finite."""
        if not self._source.records_events:
            return (
                "unknown (the stock Keras optimizer does not record it; "
                "kmix.LossScaleOptimizer does)"
            )
        for event in events:
            if event.variable is not None:
                return f"`{event.variable}`"
        return "none (the gradients stayed finite)"

    @staticmethod
    def _forward_origin(events: list) -> str:
        """Where the last recorded event says the forward pass first went non-finite."""
        origin = next((event.origin for event in events if event.origin is not None), None)
        if origin is None:
            return ""
        if not origin.inputs_finite:
            return (
                f" The first non-finite layer output is in `{origin.layer}` "
                f"({origin.layer_class}), whose inputs were already non-finite: the "
                "NaN/Inf comes with the data or from outside the tapped layers."
            )
        max_abs = "" if origin.max_abs_input is None else f", max |input| {origin.max_abs_input:g}"
        return (
            f" Forward overflow in `{origin.layer}` ({origin.layer_class}): inputs finite"
            f"{max_abs}; keep this layer in float32 with `kmix.policy_scope('float32')` "
            "or `dtype='float32'`."
        )

    def _nonfinite_loss_text(self, step: int, streak: int) -> str:
        events = self._recent_events()
        return (
            f"kmix.LossScaleGuard stopped training at step {step}: the loss has been "
            f"NaN/Inf before any loss scaling for {streak} consecutive steps (since step "
            f"{step - streak + 1}; patience={self.patience}). The forward pass produces "
            f"it, so lowering the loss scale cannot help.{self._forward_origin(events)} First "
            f"non-finite gradient: {self._first_variable(events)}. Usual causes: NaN/Inf in the "
            "input data or labels; a learning rate so high that the weights diverged; log, sqrt or "
            "division of zero or negative values in the model or the loss; an "
            "activation or reduction (softmax, exp, large sums) overflowing float16 — "
            "keep such layers in float32 (dtype='float32'); run kmix.audit(model)."
        )

    def _floor_text(self, step: int, streak: int, scale: float) -> str:
        first = self._first_variable(self._recent_events())
        return (
            f"kmix.LossScaleGuard stopped training at step {step}: the loss scale is "
            f"{scale:g}, at or below its floor {self._source.min_scale:g}, and the gradients "
            f"have overflowed for {streak} consecutive steps (since step "
            f"{step - streak + 1}; patience={self.patience}), so every step is skipped. "
            f"First non-finite gradient: {first}. Float16 cannot hold these gradients even "
            "unscaled. Usual causes: exploding gradients (lower the learning rate or clip, "
            "e.g. clipnorm=1.0); a layer whose float16 output "
            "overflows (run kmix.audit(model) and keep it in float32). 'mixed_bfloat16' "
            "has float32's range, where the hardware supports it."
        )

    def _skip_rate_text(self, step: int, end: int, steps: int, skipped: int) -> str:
        which = f"the last {steps} steps" if end == step else f"the {steps} steps up to step {end}"
        return (
            f"kmix.LossScaleGuard stopped training at step {step}: {skipped} of {which} "
            f"({skipped / steps:.0%}) were skipped for non-finite gradients, "
            f"more than max_skip_rate={self.max_skip_rate:g}, so the model barely trains. "
            "Usual causes: gradients that overflow float16 at every scale the optimizer "
            "tries (lower the learning rate or clip, e.g. clipnorm=1.0), or a scale that "
            "grows too often (raise dynamic_growth_steps or hysteresis of "
            "kmix.LossScaleOptimizer). Run kmix.audit(model) and look at kmix/events in "
            "TensorBoard."
        )
