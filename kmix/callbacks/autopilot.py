"""PrecisionAutopilot: a layer that overflows float16 moves to float32 during ``fit``.

The rules are pure (:mod:`kmix.callbacks._autopilot_rules`); this module is the glue:
it reads the optimizer's counters (one small transfer) every ``update_freq`` steps and
after an execution whose logged loss is non-finite, the events when there are new ones,
and the activation statistics at each health step; a healthy step between reads costs
nothing. It sets the chosen layers' dtype policies, rebuilds the train function and
tells the open monitors of the model, which write each move at its step
(:meth:`MixedPrecisionMonitor.write_precision_moves`).
"""

from __future__ import annotations

from typing import Any

from kmix import _layers
from kmix import backend as _backend
from kmix._checks import check_choice, check_int, check_real, invalid
from kmix._runs import OPEN
from kmix.callbacks._autopilot_rules import (
    Candidate,
    HeadroomHistory,
    headroom_candidates,
    overflow_candidates,
    unhealable_overflows,
)
from kmix.callbacks._base import StepCallback, warn_user
from kmix.callbacks._trip import is_nonfinite
from kmix.callbacks.monitor import MixedPrecisionMonitor
from kmix.precision_plan import (
    Float16Share,
    PrecisionMove,
    PrecisionPlan,
    computes_float16,
    float16_share,
    layer_costs,
    layers_by_path,
    move_layer,
)

_OWNER = "kmix.callbacks.PrecisionAutopilot"
FALLBACKS = {
    "float32": "float32 compute and variables",
    "bfloat16": "mixed_bfloat16: float32's range at half the bytes, where the hardware computes it",
}
_TO_POLICY = {"float32": "float32", "bfloat16": "mixed_bfloat16"}
_NEVER = 2**62  # no scheduled read: reactive only


def _bfloat16_hardware_reason() -> str | None:
    """None where the hardware computes bfloat16 natively, else why not (kmix.hardware())."""
    from kmix.policy import choose_auto, hardware

    policy, reason = choose_auto(hardware())
    return None if policy == "mixed_bfloat16" else reason


class PrecisionAutopilot(StepCallback):
    """Moves a layer out of float16 during ``fit`` when it overflows, or is about to.

    * **Reactive.** A skipped step whose forward pass overflowed names its origin layer
      (kmix's optimizer measures it); that layer's dtype policy becomes ``fallback`` and
      the train function is rebuilt: the next batch trains with it (the next execution
      with ``steps_per_execution > 1``). A float32 output beyond float16's range then
      overflows the cast into the layer that receives it: that layer is named by the next
      step and moves too, until the values are back in range (a normalization, a float32
      head). A skipped step leaves the model as if the batch never happened, so each
      moved layer costs at most one skipped step.
    * **Proactive** (``proactive=True``). Every ``update_freq`` steps it reads the
      activation statistics; a float16 layer whose headroom is below ``margin_bits``, or
      is forecast to reach 0 bits within the next ``update_freq`` steps, moves before it
      overflows. The default, every 100 steps, is the monitor's and the optimizer's: the
      statistics are due no more often than without the autopilot, so healthy steps pay
      nothing more for it; a smaller ``update_freq`` acts sooner and makes them due that
      often (every 10 steps cost 1.07x on a residual CNN).
    * At most ``max_layers`` moves; past that it stops moving and says so, and
      ``LossScaleGuard`` decides. The guard asks the autopilot first and stops only when
      moving did not help.

    Each move is a :class:`kmix.PrecisionMove` in :attr:`moves`; :attr:`plan` makes them
    permanent (``kmix.apply_plan(model, autopilot.plan)`` before ``compile``; a ``.keras``
    file keeps the policies too). A ``MixedPrecisionMonitor`` in the same ``fit`` writes
    each move at its step and ``kmix/float16_share`` after it.

    Example:
        >>> model.fit(x, y, callbacks=[kmix.callbacks.PrecisionAutopilot(),  # doctest: +SKIP
        ...                            kmix.callbacks.MixedPrecisionMonitor("runs/a")])

    Args:
        update_freq: read the activation statistics every this many steps, >= 1 (the
            statistics are computed at least that often while the autopilot runs).
        margin_bits: the least activation headroom (bits below float16's max) a float16
            layer may keep, >= 0.
        fallback: ``"float32"``, or ``"bfloat16"`` (the ``mixed_bfloat16`` policy) where
            the hardware computes bfloat16 natively.
        max_layers: the most layers moved, >= 1.
        proactive: also move layers whose headroom is low or falling (not only after an
            overflow).

    Attributes:
        moves: the moves made, in order.
        float16_share: the share of the model's estimated multiply-adds computed in
            float16, after the latest move (None before train begin).

    Raises:
        ValueError: an argument is invalid, ``fallback="bfloat16"`` on hardware that does
            not compute bfloat16; at train begin, the model is not compiled with
            ``kmix.LossScaleOptimizer``.
    """

    def __init__(
        self,
        update_freq: int = 100,
        margin_bits: float = 1.0,
        fallback: str = "float32",
        max_layers: int = 8,
        proactive: bool = True,
    ) -> None:
        self.update_freq = check_int(_OWNER, "update_freq", update_freq, 1)
        super().__init__(every=self.update_freq if proactive is True else _NEVER)
        self.margin_bits = check_real(_OWNER, "margin_bits", margin_bits, 0.0, 15.0)
        self.fallback = check_choice(_OWNER, "fallback", fallback, FALLBACKS)
        self.max_layers = check_int(_OWNER, "max_layers", max_layers, 1)
        if not isinstance(proactive, bool):
            raise invalid(_OWNER, "proactive", proactive, "True or False")
        self.proactive = proactive
        if fallback == "bfloat16":
            why = _bfloat16_hardware_reason()
            if why is not None:
                raise ValueError(
                    f"Invalid `fallback` for {_OWNER}: fallback='bfloat16', but this machine "
                    f"does not compute bfloat16 natively ({why}). Use fallback='float32'."
                )
        self.to_policy = _TO_POLICY[fallback]
        self.moves: list[PrecisionMove] = []
        self.float16_share: Float16Share | None = None
        self._model_id: int | None = None
        self._active = False
        self._told: set[str] = set()  # messages said (this fit)
        self._unreceived: set[str] = set()  # moved layers with no known float16 receiver
        self._moves_at_begin = 0  # max_layers counts the moves of this fit

    @property
    def moves_in_fit(self) -> list[PrecisionMove]:
        """The moves made in the current (or latest) ``fit``."""
        return self.moves[self._moves_at_begin :]

    @property
    def watching_headroom(self) -> bool:
        """True while it acts on falling activation headroom itself (proactive, in a run,
        under ``max_layers``): the guard then leaves such forecasts to it."""
        return (
            self._active
            and self.proactive
            and self in OPEN
            and len(self.moves_in_fit) < self.max_layers
        )

    @property
    def plan(self) -> PrecisionPlan:
        """The moves as a plan: ``kmix.apply_plan(model, plan)`` starts the next run healed."""
        return PrecisionPlan.from_moves(self.moves)

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs: dict | None = None) -> None:
        """Checks the optimizer, asks for activation statistics, notes where it starts.

        Raises:
            ValueError: the model is not compiled with ``kmix.LossScaleOptimizer``.
        """
        super().on_train_begin(logs)
        model, source = self.model, self._source
        self._told, self._unreceived, self._moves_at_begin = set(), set(), len(self.moves)
        float16 = [p for p, layer in _layers.walk_layers(model) if layer.compute_dtype == "float16"]
        self._active = bool(float16) or model.compute_dtype == "float16"
        if not self._active:
            self._say(
                f"{_OWNER}: model {model.name!r} computes in {model.compute_dtype} and no layer "
                "computes in float16: there is nothing to move."
            )
            return
        if source.kind != "kmix":
            OPEN.discard(self)
            self._active = False
            raise ValueError(
                f"{_OWNER} needs kmix's optimizer, which names the layer where the forward "
                f"pass overflows; model {model.name!r} is compiled with "
                f"{source.describe()}. Compile with "
                "`optimizer=kmix.LossScaleOptimizer(keras.optimizers.Adam())`."
            )
        if self._model_id != id(model):  # moves accumulate over the fits of one model
            self._model_id, self.moves, self._moves_at_begin = id(model), [], 0
        self.float16_share = float16_share(layer_costs(model))
        if self.proactive:
            source.request_statistics(self, self.update_freq, 0)
        state = self._read_state(counters_only=True)
        self._events_seen = state.event_count
        self._health_step = state.health_step
        self._history = HeadroomHistory()

    def finish(self, reason: str, message: str, logs: dict | None = None) -> None:
        """Withdraws the statistics request and closes the run."""
        self._source.release_statistics(self)
        super().finish(reason, message, logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Reads every ``update_freq`` steps (proactive), and after any execution whose
        logged loss is non-finite (a forward overflow makes it so; Keras's running mean
        then stays so until the epoch ends) or not logged: a healthy step costs no read."""
        read_before = self._steps_at_read
        super().on_train_batch_end(batch, logs)
        loss = (logs or {}).get("loss")
        if self._active and self in OPEN and self._steps_at_read == read_before:
            if loss is None or is_nonfinite(loss):
                self._read(logs)

    def _on_read(self, logs: dict) -> None:
        if self._active:
            self.act()

    # ---------------------------------------------------------------- acting
    def act(self) -> list[PrecisionMove]:
        """Reads what is new and moves the layers the rules name (the guard calls this
        before it stops a run).

        Returns:
            The moves made now (empty: nothing new to act on, or nothing movable).
        """
        if not self._active or self.model is None or self not in OPEN:
            return []
        state = self._read_state(counters_only=True)
        candidates: list[Candidate] = []
        if state.event_count > self._events_seen:
            events = [r.event for r in self._source.events(self._events_seen)]
            self._events_seen = state.event_count
            candidates += overflow_candidates(events)
            for event in unhealable_overflows(events)[:1]:
                self._say(
                    f"{_OWNER}: the forward pass overflowed at step {event.step}, but no "
                    "layer was named (the optimizer's tap saw no float16 layer go "
                    "non-finite), so there is nothing to move."
                )
        if self.proactive and state.health_step > self._health_step:
            self._health_step = state.health_step
            layers = self._source.per_layer(float16_only=False)
            headroom = {p: v["headroom_bits"] for p, v in layers.items() if "headroom_bits" in v}
            self._history.add(state.health_step, headroom)  # float16 outputs only
            candidates += headroom_candidates(
                self._history, state.health_step, self.margin_bits, self.update_freq
            )
        return self._move(candidates, state.attempted_steps) if candidates else []

    def _move(self, candidates: list[Candidate], step: int) -> list[PrecisionMove]:
        """Moves the candidates' layers (or, for a layer moved already, its float16
        receivers), rebuilds the model's functions and tells the monitors."""
        model = self.model
        by_path = layers_by_path(model)
        made = []
        for candidate in candidates:
            for path, layer, reason in self._targets(candidate, by_path):
                if len(self.moves_in_fit) >= self.max_layers:
                    self._say(
                        f"{_OWNER}: max_layers={self.max_layers} layers moved in this fit, so "
                        "it stops moving; LossScaleGuard decides what happens next."
                    )
                    break
                from_policy = layer.dtype_policy.name
                move_layer(layer, self.to_policy)
                move = PrecisionMove(
                    step, path, type(layer).__name__, reason, from_policy, self.to_policy
                )
                self.moves.append(move)
                made.append(move)
        if not made:
            return []
        _backend.retrace_all(model)  # train, and validation, evaluate, predict
        model.optimizer.watch(model)  # float16 statistics cover the float16 layers only
        self.float16_share = float16_share(layer_costs(model))
        self._tell_about(made)
        for monitor in OPEN.of_model(model, MixedPrecisionMonitor):
            monitor.write_precision_moves(made, self.float16_share)
        return made

    def _targets(self, candidate: Candidate, by_path: dict[str, Any]) -> list[tuple[str, Any, str]]:
        """``(path, layer, reason)`` to move for a candidate: the layer while it (or a layer
        nested in it) computes in float16; for a layer out of float16 already, the float16
        layers receiving its output that cast it to float16 (not LayerNormalization,
        BatchNormalization or others with ``autocast=False``: they compute in float32)."""
        layer = by_path.get(candidate.layer)
        if layer is None:
            return []
        if candidate.upstream:
            return self._upstream_targets(candidate, layer, by_path)
        if computes_float16(layer):
            reason = candidate.reason
            if _layers.call_count(layer) > 1 or f"{candidate.layer}#2" in self._recorded_calls():
                reason += " (a shared layer: every call of it moves)"
            return [(candidate.layer, layer, reason)]
        if candidate.overflow:  # it overflowed out of float16: no move can help
            self._say(
                f"{_OWNER}: `{candidate.layer}` overflowed at step {candidate.step} although "
                f"it no longer computes in float16 ({layer.compute_dtype}): moving cannot help "
                "there; LossScaleGuard decides what happens next."
            )
            return []
        if candidate.layer in self._unreceived:
            return []
        paths = {id(v): p for p, v in by_path.items()}
        receivers = [
            (
                paths[id(c)],
                c,
                f"its input from `{candidate.layer}` (out of float16): {candidate.reason}",
            )
            for c in _layers.consumers(layer)
            if id(c) in paths and computes_float16(c) and getattr(c, "autocast", True)
        ]  # a receiver overflows only where it casts its input to float16
        if not receivers:
            self._unreceived.add(candidate.layer)  # none known (a subclassed model's call)
        return receivers

    def _upstream_targets(
        self, candidate: Candidate, layer: Any, by_path: dict[str, Any]
    ) -> list[tuple[str, Any, str]]:
        """An overflow that started before ``layer`` (its inputs were non-finite): in an op
        between layers (``stem + res`` in a Functional model), whose float16 operands come
        from the float16 layers feeding ``layer``; those move, so the op computes in
        float32. Where Keras keeps no graph, it says where to look instead."""
        paths = {id(v): p for p, v in by_path.items()}
        order = {id(v): i for i, v in enumerate(by_path.values())}
        feeding = sorted(  # in the model's order
            (p for p in _layers.producers(layer) if id(p) in paths), key=lambda p: order[id(p)]
        )
        targets = [
            (paths[id(p)], p, f"{candidate.reason}; it feeds `{candidate.layer}`")
            for p in feeding
            if computes_float16(p)
        ]
        if not targets:
            names = ", ".join(f"`{paths[id(p)]}`" for p in feeding) or "none kmix can see"
            self._say(
                f"{_OWNER}: the forward pass overflowed at step {candidate.step} before "
                f"`{candidate.layer}` (its inputs were already non-finite): in an op between "
                f"layers, or in the data (layers feeding it: {names}). No float16 layer feeds "
                "it that a move would help: compute that op in float32 (cast its operands "
                "with keras.ops.cast), or check the data for inf and NaN."
            )
        return targets

    def _recorded_calls(self) -> set[str]:
        """The layer calls the optimizer's tap recorded in the traced step (``path#2`` for a
        second call of one layer: how a subclassed model's shared layer shows)."""
        hooks = getattr(self.model.optimizer, "hooks", None)
        return {path for path, _ in getattr(hooks, "layers", ())}

    def _tell_about(self, made: list[PrecisionMove]) -> None:
        """Says once what a move means for ``steps_per_execution`` and for custom loops."""
        per_execution = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if per_execution > 1:
            self._say(
                f"{_OWNER}: with steps_per_execution={per_execution} a move takes effect at "
                "the next execution; the steps left in the current one keep the old policy "
                "(each may be skipped by the same overflow)."
            )

    def _say(self, message: str) -> None:
        if message not in self._told:
            self._told.add(message)
            warn_user(message)
