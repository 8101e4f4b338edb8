"""LossScaleGuard: stop a run that loss scaling cannot save, and say why."""

from __future__ import annotations

import collections
import math
import warnings
from typing import Any

import numpy as np

from kmix._checks import check_choice, check_int, check_real
from kmix.callbacks._base import GUARD_RAISED, STOPPED_BY_GUARD, StepCallback, end_run, warn_user
from kmix.callbacks._forecast import HeadroomForecast, headroom_series
from kmix.callbacks._source import STOCK_MIN_SCALE  # noqa: F401  (the 0.1.0 name)

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


class LossScaleGuard(StepCallback):
    """Stops training that loss scaling cannot save, with a diagnosis a user can act on.

    It trips on the first of:

    * ``nonfinite_loss``: the loss, before scaling, has been NaN/Inf for
      ``patience`` consecutive steps. The forward pass makes it, so no loss scale helps.
    * ``overflow_at_floor``: the loss scale is at its minimum and the gradients
      have overflowed for ``patience`` consecutive steps.
    * ``skip_rate``: more than ``max_skip_rate`` of the last ``window`` steps were
      skipped (checked once ``window`` steps have run in this ``fit``).

    With ``kmix.LossScaleOptimizer`` it reads the optimizer's in-graph counters,
    one read per check, and names the first non-finite variable. With the stock
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
        check_freq: check every this many steps, >= 1. Default 1, so the guard
            trips exactly after ``patience`` steps; larger values save host syncs
            and trip up to ``check_freq - 1`` steps later.
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
        super().__init__(every=check_int(_OWNER, "check_freq", check_freq, 1))
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
        self._history = collections.deque([(state.attempted_steps, state.skipped_steps)])
        self._skip_streak = self._loss_streak = 0
        self._health_step = state.health_step
        self._forecast = HeadroomForecast()

    # ------------------------------------------------------------------ checks
    def _on_read(self, logs: dict) -> None:
        if self.diagnosis is not None:
            return
        source = self._source
        state = self._read_state(counters_only=True)  # one small transfer per check
        step, skipped = state.attempted_steps, state.skipped_steps
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
        while len(self._history) > 1 and self._history[1][0] <= step - self.window:
            self._history.popleft()
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
            first_step, first_skipped = self._history[0]
            if first_step <= step - self.window:
                rate = (skipped - first_skipped) / (step - first_step)
                if rate > self.max_skip_rate:
                    self._trip(
                        "skip_rate",
                        step,
                        self._skip_rate_text(step, step - first_step, skipped - first_skipped),
                    )

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

    def _skip_rate_text(self, step: int, steps: int, skipped: int) -> str:
        return (
            f"kmix.LossScaleGuard stopped training at step {step}: {skipped} of the last "
            f"{steps} steps ({skipped / steps:.0%}) were skipped for non-finite gradients, "
            f"more than max_skip_rate={self.max_skip_rate:g}, so the model barely trains. "
            "Usual causes: gradients that overflow float16 at every scale the optimizer "
            "tries (lower the learning rate or clip, e.g. clipnorm=1.0), or a scale that "
            "grows too often (raise dynamic_growth_steps or hysteresis of "
            "kmix.LossScaleOptimizer). Run kmix.audit(model) and look at kmix/events in "
            "TensorBoard."
        )
