"""kmix.LossScaleOptimizer: Keras's loss-scale optimizer, made safe and observable."""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
from keras import ops

from kmix import health, scaling
from kmix._checks import check_int, check_real, invalid
from kmix._cluster import worker_count

INT64_MAX = 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_EVENT_FIELDS = 5  # step, kind, first non-finite variable, non-finite variables, loss finite


@dataclass(frozen=True)
class ScaleEvent:
    """One loss-scale event, as recorded in-graph at the step it happened.

    Attributes:
        index: 1-based sequence number of the event since training began.
        step: attempted optimizer step, skipped steps included, counted from 1.
        kind: ``"growth"``, ``"backoff"``, ``"skip_absorbed"`` (a skipped step the
            hysteresis tolerated) or ``"overflow_at_floor"`` (skipped at ``min_scale``).
        old_scale: loss scale before the step.
        new_scale: loss scale after the step.
        variable: path of the first variable whose gradient was non-finite, if any.
        nonfinite_variables: how many variables had a non-finite gradient.
        loss_finite: whether the unscaled loss itself was finite (False means the
            forward pass made the NaN/Inf, which no loss scale can fix).
    """

    index: int
    step: int
    kind: str
    old_scale: float
    new_scale: float
    variable: str | None
    nonfinite_variables: int
    loss_finite: bool


class _Settings:
    """Run-time settings read in-graph (what to compute, and where).

    They steer the step but are not training state: kept out of the optimizer's
    tracked variables, they are never saved, so a checkpoint cannot carry a
    monitor's settings into a later run. Plain Python values until ``create``.
    """

    def __init__(self, **values: Any) -> None:
        self.values = values
        self.variables: dict[str, Any] = {}

    def create(self, **extra: Any) -> None:
        self.values.update(extra)
        for name, value in self.values.items():
            value = np.asarray(value)
            self.variables[name] = keras.Variable(
                value,
                dtype="int64" if value.dtype.kind in "iu" else "float32",
                trainable=False,
                aggregation="only_first_replica",
                name=name,
            )

    def get(self, name: str) -> Any:
        variable = self.variables.get(name)
        return self.values[name] if variable is None else ops.convert_to_numpy(variable)

    def set(self, name: str, value: Any) -> None:
        self.values[name] = value
        if name in self.variables:
            self.variables[name].assign(value)


def _saturating_add(counter: Any, amount: Any) -> Any:
    amount = ops.cast(amount, "int64")
    return ops.where(counter > INT64_MAX - amount, INT64_MAX, counter + amount)


_OWNER = "kmix.LossScaleOptimizer"


def _invalid(name: str, value: Any, valid: str) -> ValueError:
    return invalid(_OWNER, name, value, valid)


def _check_int(name: str, value: Any, low: int) -> int:
    return check_int(_OWNER, name, value, low)


def _resolve_inner(inner_optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(inner_optimizer, str | dict):
        try:
            inner_optimizer = keras.optimizers.get(inner_optimizer)
        except ValueError:
            raise _invalid(
                "inner_optimizer",
                inner_optimizer,
                "a keras.optimizers.Optimizer instance (e.g. keras.optimizers.Adam(1e-3))"
                " or the name of a Keras optimizer such as 'adam', 'adamw', 'sgd' or"
                " 'rmsprop'",
            ) from None
    if isinstance(inner_optimizer, keras.mixed_precision.LossScaleOptimizer):
        raise _invalid(
            "inner_optimizer",
            inner_optimizer,
            "a plain optimizer: this one already scales the loss; pass its"
            " `.inner_optimizer` instead",
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise _invalid(
            "inner_optimizer",
            inner_optimizer,
            "a keras.optimizers.Optimizer or its name",
        )
    return inner_optimizer


@keras.saving.register_keras_serializable(package="kmix")
class LossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """A dynamic loss-scale optimizer that never corrupts weights and records why.

    It subclasses ``keras.mixed_precision.LossScaleOptimizer``, so ``model.compile``
    does not wrap it again. On every step it checks the scaled gradients of every
    replica; if all are finite it unscales them and applies the inner optimizer,
    otherwise it skips the step (weights and inner state untouched). The scale
    follows :func:`kmix.scaling.update_scale`. Counters, gradient health
    statistics and a ring of recent scale events are kept in optimizer variables,
    computed in-graph, for :mod:`kmix.callbacks` to read. Under a ``tf.distribute``
    strategy the skip decision, counters and events are agreed across replicas;
    the gradient health statistics describe the first local replica's gradients
    (before Keras all-reduces them, so their norm is that replica's share).

    Example:
        >>> opt = kmix.LossScaleOptimizer(keras.optimizers.Adam(1e-3))  # doctest: +SKIP
        >>> model.compile(optimizer=opt, loss="mse")                    # doctest: +SKIP

    Args:
        inner_optimizer: the optimizer to wrap, or a Keras optimizer name.
        initial_scale: starting loss scale, in ``[min_scale, max_scale]``.
        dynamic_growth_steps: consecutive finite steps before the scale grows.
        growth_factor: multiplier applied on growth, > 1.
        backoff_factor: multiplier applied on backoff, in (0, 1).
        hysteresis: overflows that back off the scale: 1 backs off on every one,
            ``n`` tolerates ``n - 1`` first (the budget refills on growth and backoff).
        min_scale: lowest scale, > 0.
        max_scale: highest scale, >= ``min_scale``.
        health_every: compute gradient health statistics every this many steps
            (about 5% of a step's time on a CPU when done every step, see bench/).
            ``kmix.callbacks.MixedPrecisionMonitor`` sets it to its ``update_freq``.
            The non-finite check, counters and events run on every step regardless.
        histogram_every: compute per-variable exponent histograms every this many
            steps; 0 switches them off.
        event_capacity: how many recent scale events the in-graph ring keeps.
        name: optimizer name.
        **kwargs: accepted for Keras compatibility (see Keras's class).

    Raises:
        ValueError: an argument is outside its valid range, the inner optimizer
            is unknown or already scales the loss, or the backend is not TensorFlow.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer | str,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        health_every: int = 100,
        histogram_every: int = 0,
        event_capacity: int = 128,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if keras.backend.backend() != "tensorflow":
            raise ValueError(
                "kmix.LossScaleOptimizer needs the TensorFlow backend; the active "
                f"Keras backend is {keras.backend.backend()!r}. Set "
                "KERAS_BACKEND=tensorflow before importing keras."
            )
        inf = math.inf
        # The scale is a float32 variable: its bounds must be float32 normal numbers.
        min_scale = check_real(
            _OWNER,
            "min_scale",
            min_scale,
            FLOAT32_TINY,
            FLOAT32_MAX,
            f"a number in [{FLOAT32_TINY:.9g}, {FLOAT32_MAX:.9g}] (the scale is float32)",
        )
        max_scale = check_real(
            _OWNER,
            "max_scale",
            max_scale,
            min_scale,
            FLOAT32_MAX,
            f"a number in [min_scale, {FLOAT32_MAX:.9g}] = [{min_scale:.9g}, "
            f"{FLOAT32_MAX:.9g}] (the scale is float32)",
        )
        initial_scale = check_real(
            _OWNER,
            "initial_scale",
            initial_scale,
            min_scale,
            max_scale,
            f"a finite number in [min_scale, max_scale] = [{min_scale}, {max_scale}]",
        )
        growth_factor = check_real(
            _OWNER, "growth_factor", growth_factor, 1.0, inf, "a finite number > 1", open_low=True
        )
        backoff_factor = check_real(
            _OWNER, "backoff_factor", backoff_factor, 0.0, 1.0, open_low=True, open_high=True
        )
        rule = scaling.ScaleConfig(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_steps=_check_int("dynamic_growth_steps", dynamic_growth_steps, 1),
            hysteresis=_check_int("hysteresis", hysteresis, 1),
            min_scale=min_scale,
            max_scale=max_scale,
        )
        health_every = _check_int("health_every", health_every, 1)
        histogram_every = _check_int("histogram_every", histogram_every, 0)
        event_capacity = _check_int("event_capacity", event_capacity, 1)
        super().__init__(
            _resolve_inner(inner_optimizer),
            initial_scale=initial_scale,
            dynamic_growth_steps=rule.growth_steps,
            name=name,
            **kwargs,
        )
        self._scale_config = rule
        self._health_every = health_every  # the arguments, as get_config reports them
        self._histogram_every = histogram_every
        self._settings = _Settings(health_every=health_every, histogram_every=histogram_every)
        self.event_capacity = event_capacity
        self._loss_flag = threading.local()
        _warn_if_fit_cannot_run_here()

    # ------------------------------------------------------------------ state
    def build(self, var_list: list[Any]) -> None:
        """Creates the scale, counter, health and event variables, then the inner ones."""

        def state(name: str, dtype: str, value: float = 0, shape: tuple = ()) -> Any:
            return self.add_variable(
                shape=shape,
                dtype=dtype,
                initializer=keras.initializers.Constant(value),
                aggregation="only_first_replica",
                name=name,
            )

        n = len(var_list)
        self.dynamic_scale = state("dynamic_scale", "float32", self.initial_scale)
        self.good_steps_var = state("good_steps", "int64")
        self.hysteresis_left = state("hysteresis_left", "int64", self._scale_config.hysteresis)
        self.attempted_steps_var = state("attempted_steps", "int64")
        self.skipped_steps_var = state("skipped_steps", "int64")
        self.consecutive_skips = state("consecutive_skips", "int64")
        self.last_overflow_step_var = state("last_overflow_step", "int64")
        self.loss_finite = state("loss_finite", "int64", 1)
        self.consecutive_nonfinite_loss = state("consecutive_nonfinite_loss", "int64")
        self.health_step = state("health_step", "int64")
        self.health_stats = state("health_stats", "float32", 0, (len(_HEALTH_FIELDS),))
        self.underflow_per_variable = state("underflow_per_variable", "float32", 0, (n,))
        self.histogram_step = state("histogram_step", "int64")
        self.exponent_histograms = state(
            "exponent_histograms", "int32", 0, (n, health.NUM_EXPONENT_BINS)
        )
        self.event_count_var = state("event_count", "int64")
        self.event_records = state(
            "event_records", "int64", 0, (self.event_capacity, _EVENT_FIELDS)
        )
        self.event_scales = state("event_scales", "float32", 0, (self.event_capacity, 2))
        self._settings.create(float16_mask=self._float16_mask(var_list))
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    # ------------------------------------------------------------ train step
    def scale_loss(self, loss: Any) -> Any:
        """Multiplies ``loss`` by the current scale and notes whether it was finite.

        Args:
            loss: the unscaled loss.

        Returns:
            The scaled loss.
        """
        self._loss_flag.nonfinite = ops.logical_not(ops.all(ops.isfinite(loss)))
        return super().scale_loss(loss)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        """Applies scaled gradients: skip on any non-finite value, else unscale and apply.

        Args:
            grads: gradients of the scaled loss, one per variable (``None`` allowed).
            trainable_variables: the variables; defaults to those the optimizer
                was built with.

        Raises:
            ValueError: called in a cross-replica context.
        """
        import tensorflow as tf

        grads = list(grads)
        if not grads:
            return
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "kmix.LossScaleOptimizer.apply() must be called in a replica context, "
                "e.g. inside `strategy.run(...)`."
            )
        variables = (
            self._trainable_variables if trainable_variables is None else list(trainable_variables)
        )
        # Align gradients with the variables the optimizer tracks, so per-variable
        # state has a fixed layout whatever subset this call updates.
        aligned = [None] * len(self._trainable_variables)
        for grad, variable in zip(grads, variables, strict=True):
            aligned[self._get_variable_index(variable)] = grad
        bad = ops.concatenate(
            [health.nonfinite_flags(aligned), ops.reshape(self._pop_loss_flag(), (1,))]
        )
        # Replicas agree: every replica sees the same non-finite flags before any update.
        context = tf.distribute.get_replica_context()
        if context.num_replicas_in_sync > 1:
            bad = context.all_reduce(tf.distribute.ReduceOp.SUM, bad)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._step(aligned, bad, lambda: self._apply_inner(grads, variables))
        else:
            context.merge_call(self._merged_step, args=(aligned, bad, grads, variables))

    def _apply_inner(self, grads: list, variables: list) -> None:
        """Unscales the gradients and applies the inner optimizer (replica context)."""
        scale = self.dynamic_scale
        self.inner_optimizer.apply(
            [
                g
                if g is None or self._overwrite_variable_with_gradient(v)
                else ops.divide(g, scale)
                for g, v in zip(grads, variables, strict=True)
            ],
            variables,
        )

    def _merged_step(
        self, distribution: Any, aligned: list, bad: Any, grads: list, variables: list
    ) -> None:
        """Cross-replica part: one decision for all (the flags are already all-reduced)."""

        def first(value: Any) -> Any:
            return None if value is None else distribution.experimental_local_results(value)[0]

        self._step(
            [first(g) for g in aligned],
            first(bad),
            lambda: distribution.extended.call_for_each_replica(
                self._apply_inner, args=(grads, variables)
            ),
        )

    def _step(self, aligned: list, bad: Any, apply_inner: Any) -> None:
        n = len(aligned)
        var_bad = bad[:n] > 0
        all_finite = ops.logical_not(ops.any(var_bad))
        loss_finite = bad[n] <= 0
        ops.cond(all_finite, apply_inner, _noop)

        old = scaling.ScaleState(  # snapshots, read before the assignments below
            ops.copy(self.dynamic_scale),
            ops.copy(self.good_steps_var),
            ops.copy(self.hysteresis_left),
        )
        new, event = scaling.update_scale(old, all_finite, self._scale_config)
        self.dynamic_scale.assign(new.scale)
        self.good_steps_var.assign(new.good_steps)
        self.hysteresis_left.assign(new.hysteresis_left)

        skipped = ops.logical_not(all_finite)
        step = _saturating_add(self.attempted_steps_var, 1)
        self.attempted_steps_var.assign(step)
        self.skipped_steps_var.assign(_saturating_add(self.skipped_steps_var, skipped))
        self.consecutive_skips.assign(
            ops.where(skipped, _saturating_add(self.consecutive_skips, 1), 0)
        )
        self.last_overflow_step_var.assign(ops.where(skipped, step, self.last_overflow_step_var))
        self.loss_finite.assign(ops.cast(loss_finite, "int64"))
        self.consecutive_nonfinite_loss.assign(
            ops.where(loss_finite, 0, _saturating_add(self.consecutive_nonfinite_loss, 1))
        )
        self._record_event(step, event, old.scale, new.scale, var_bad, loss_finite)
        settings = self._settings.variables
        health_due = ops.equal(ops.mod(step, settings["health_every"]), 0)
        histogram_every = settings["histogram_every"]
        histogram_due = ops.logical_and(
            histogram_every > 0, ops.equal(ops.mod(step, ops.maximum(histogram_every, 1)), 0)
        )

        def record_statistics() -> None:
            ops.cond(health_due, lambda: self._record_health(step, aligned, old.scale), _noop)
            ops.cond(histogram_due, lambda: self._record_histograms(step, aligned), _noop)

        # One cond on the hot path: each cond costs a switch per gradient without XLA.
        ops.cond(ops.logical_or(health_due, histogram_due), record_statistics, _noop)

    def _record_event(
        self,
        step: Any,
        event: Any,
        old_scale: Any,
        new_scale: Any,
        var_bad: Any,
        loss_finite: Any,
    ) -> None:
        happened = ops.not_equal(event, scaling.NONE)
        slot = ops.equal(
            ops.arange(self.event_capacity, dtype="int64"),
            ops.mod(self.event_count_var, self.event_capacity),
        )
        mask = ops.expand_dims(ops.logical_and(slot, happened), 1)
        any_bad = ops.any(var_bad)
        record = ops.stack(
            [
                step,
                ops.cast(event, "int64"),
                ops.where(
                    any_bad,
                    ops.cast(ops.argmax(ops.cast(var_bad, "int32")), "int64"),
                    -1,
                ),
                ops.cast(ops.sum(ops.cast(var_bad, "int32")), "int64"),
                ops.cast(loss_finite, "int64"),
            ]
        )
        self.event_records.assign(ops.where(mask, record[None, :], self.event_records))
        scales = ops.stack([ops.cast(old_scale, "float32"), ops.cast(new_scale, "float32")])
        self.event_scales.assign(ops.where(mask, scales[None, :], self.event_scales))
        self.event_count_var.assign(_saturating_add(self.event_count_var, happened))

    def _record_health(self, step: Any, aligned: list, scale: Any) -> None:
        stats = health.gradient_health(aligned, scale, self._settings.variables["float16_mask"])
        self.health_stats.assign(
            ops.stack([ops.cast(getattr(stats, f), "float32") for f in _HEALTH_FIELDS])
        )
        self.underflow_per_variable.assign(stats.underflow_per_variable)
        self.health_step.assign(step)

    def _record_histograms(self, step: Any, aligned: list) -> None:
        empty = ops.zeros((health.NUM_EXPONENT_BINS,), "int32")
        self.exponent_histograms.assign(
            ops.stack([empty if g is None else health.exponent_histogram(g) for g in aligned])
        )
        self.histogram_step.assign(step)

    def _pop_loss_flag(self) -> Any:
        """The flag ``scale_loss`` left for this train step, if it is usable here."""
        import tensorflow as tf

        flag = getattr(self._loss_flag, "nonfinite", None)
        self._loss_flag.nonfinite = None
        if flag is None or not _reachable_from_current_graph(flag, tf):
            return ops.zeros((), "float32")
        return ops.cast(flag, "float32")

    # ------------------------------------------------------------- reading
    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return float(self._read("dynamic_scale", self.initial_scale))

    @property
    def skipped_steps(self) -> int:
        """Cumulative skipped (non-finite) steps."""
        return int(self._read("skipped_steps_var", 0))

    @property
    def attempted_steps(self) -> int:
        """Optimizer steps attempted so far, skipped ones included."""
        return int(self._read("attempted_steps_var", 0))

    @property
    def good_steps(self) -> int:
        """Consecutive finite steps since the scale last changed or a step was skipped."""
        return int(self._read("good_steps_var", 0))

    @property
    def last_overflow_step(self) -> int:
        """Attempted step of the most recent skipped step; 0 if none yet."""
        return int(self._read("last_overflow_step_var", 0))

    @property
    def event_count(self) -> int:
        """Scale events recorded since training began (the ring keeps the last ones)."""
        return int(self._read("event_count_var", 0))

    @property
    def health_every(self) -> int:
        """Steps between gradient health computations (a run-time setting, not saved)."""
        return int(self._settings.get("health_every"))

    @health_every.setter
    def health_every(self, value: int) -> None:
        self._settings.set("health_every", _check_int("health_every", value, 1))

    @property
    def histogram_every(self) -> int:
        """Steps between exponent histograms; 0 means off (a run-time setting, not saved)."""
        return int(self._settings.get("histogram_every"))

    @histogram_every.setter
    def histogram_every(self, value: int) -> None:
        self._settings.set("histogram_every", _check_int("histogram_every", value, 0))

    @property
    def float16_mask(self) -> np.ndarray:
        """1.0 per variable counted as float16 by the health statistics (see below)."""
        return np.asarray(self._settings.get("float16_mask"))

    def _read(self, attribute: str, default: Any) -> Any:
        """One variable's value, or ``default`` before the optimizer is built."""
        variable = getattr(self, attribute, None) if self.built else None
        return default if variable is None else ops.convert_to_numpy(variable)

    def read_state(self) -> dict[str, Any]:
        """Reads scale, counters and the latest gradient health with two transfers.

        Returns:
            A dict of Python numbers: ``loss_scale``, ``attempted_steps``,
            ``skipped_steps``, ``good_steps``, ``consecutive_skips``,
            ``last_overflow_step``, ``loss_finite``, ``consecutive_nonfinite_loss``,
            ``event_count``, ``health_step`` and ``histogram_step`` (0 before the
            first health step or histogram) and
            the :class:`kmix.health.GradientHealth` scalars. Before the optimizer
            is built: the initial scale and zeros.
        """
        if not self.built:
            ints = [int(name == "loss_finite") for name in _INT_STATE]
            floats = [self.initial_scale] + [0.0] * len(_HEALTH_FIELDS)
        else:
            # Stack on the device first: one host transfer per dtype, not per value.
            ints = ops.convert_to_numpy(
                ops.stack([ops.cast(getattr(self, a), "int64") for a in _INT_STATE.values()])
            )
            floats = ops.convert_to_numpy(
                ops.concatenate([ops.reshape(self.dynamic_scale, (1,)), self.health_stats])
            )
        state: dict[str, Any] = {name: int(x) for name, x in zip(_INT_STATE, ints, strict=True)}
        state["loss_finite"] = bool(state["loss_finite"])
        state["loss_scale"] = float(floats[0])
        state.update({f: float(x) for f, x in zip(_HEALTH_FIELDS, floats[1:], strict=True)})
        return state

    def watch_float16_layers(self, model: keras.Model) -> list[str]:
        """Tells the health statistics which variables' layers compute in float16.

        Float16's range (headroom, underflow) matters only where float16 computes;
        a float32 layer in a mixed model may hold larger gradients harmlessly.
        ``kmix.callbacks.MixedPrecisionMonitor`` calls this at train begin; until
        then every variable counts. Works before and after the optimizer is built.

        Args:
            model: the model whose trainable variables this optimizer updates.

        Returns:
            The paths of the model's trainable variables counted as float16.
        """
        compute_dtype = {}
        for layer in model._flatten_layers(include_self=True, recursive=True):
            for variable in layer.trainable_weights:  # inner layers come later and win
                compute_dtype[id(variable)] = layer.compute_dtype
        float16 = [v for v in model.trainable_weights if compute_dtype[id(v)] == "float16"]
        self._float16_ids = frozenset(id(v) for v in float16)
        if self.built:
            self._settings.set("float16_mask", self._float16_mask(self._trainable_variables))
        return [v.path for v in float16]

    def _float16_mask(self, variables: list[Any]) -> np.ndarray:
        """1.0 for variables counted as float16 (all until watch_float16_layers)."""
        ids = getattr(self, "_float16_ids", None)
        return np.asarray([ids is None or id(v) in ids for v in variables], "float32")

    def variable_paths(self) -> list[str]:
        """Paths of the tracked trainable variables, in the order of per-variable state."""
        return [v.path for v in self._trainable_variables]

    def underflow_by_variable(self) -> dict[str, float]:
        """Per-variable underflow fraction at the latest health step, by variable path."""
        if not self.built:
            return {}
        values = ops.convert_to_numpy(self.underflow_per_variable)
        return dict(zip(self.variable_paths(), map(float, values), strict=True))

    def exponent_histograms_by_variable(self) -> dict[str, np.ndarray]:
        """Per-variable exponent histograms at ``histogram_step`` (layout in kmix.health)."""
        if not self.built:
            return {}
        counts = ops.convert_to_numpy(self.exponent_histograms)
        return dict(zip(self.variable_paths(), counts, strict=True))

    def scale_events(self, since: int = 0) -> list[ScaleEvent]:
        """Returns the recorded events with ``index > since`` that the ring still holds.

        Args:
            since: the index of the last event already seen (0 for all).

        Returns:
            Events in order. If more than ``event_capacity`` events happened after
            ``since``, the oldest are gone: compare ``event_count - since`` with
            the number returned.
        """
        if not self.built:
            return []
        count = self.event_count
        records = ops.convert_to_numpy(self.event_records)
        scales = ops.convert_to_numpy(self.event_scales)
        paths = self.variable_paths()
        events = []
        for index in range(max(since, count - self.event_capacity) + 1, count + 1):
            slot = (index - 1) % self.event_capacity
            step, kind, first_var, n_bad, loss_finite = (int(x) for x in records[slot])
            events.append(
                ScaleEvent(
                    index=index,
                    step=step,
                    kind=scaling.EVENT_KINDS[kind],
                    old_scale=float(scales[slot, 0]),
                    new_scale=float(scales[slot, 1]),
                    variable=paths[first_var] if first_var >= 0 else None,
                    nonfinite_variables=n_bad,
                    loss_finite=bool(loss_finite),
                )
            )
        return events

    # ------------------------------------------------------------ config
    def get_config(self) -> dict[str, Any]:
        """Returns the constructor arguments, Keras's and kmix's."""
        config = super().get_config()
        rule = self._scale_config
        config.update(
            growth_factor=rule.growth_factor,
            backoff_factor=rule.backoff_factor,
            hysteresis=rule.hysteresis,
            min_scale=rule.min_scale,
            max_scale=rule.max_scale,
            health_every=self._health_every,
            histogram_every=self._histogram_every,
            event_capacity=self.event_capacity,
        )
        return config

    @classmethod
    def from_keras(
        cls, optimizer: keras.mixed_precision.LossScaleOptimizer, **kwargs: Any
    ) -> LossScaleOptimizer:
        """Migrates a stock Keras loss-scale optimizer (e.g. from an older ``.keras`` file).

        The new optimizer wraps the same inner optimizer (its state included) and
        starts from the stock optimizer's current scale.

        Args:
            optimizer: a ``keras.mixed_precision.LossScaleOptimizer``.
            **kwargs: other kmix arguments (``hysteresis``, ``min_scale``...).

        Returns:
            A ``kmix.LossScaleOptimizer``.

        Raises:
            ValueError: ``optimizer`` is not a Keras loss-scale optimizer.
        """
        if not isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
            raise _invalid("optimizer", optimizer, "a keras.mixed_precision.LossScaleOptimizer")
        if "initial_scale" not in kwargs:
            scale = float(
                ops.convert_to_numpy(optimizer.dynamic_scale)
                if optimizer.built
                else optimizer.initial_scale
            )
            low, high = kwargs.get("min_scale", 1.0), kwargs.get("max_scale", 2.0**24)
            kwargs["initial_scale"] = min(max(scale, low), high) if math.isfinite(scale) else high
            if kwargs["initial_scale"] != scale:  # e.g. stock Keras halved it to 0.0
                warnings.warn(
                    f"The stock optimizer's loss scale {scale:.9g} is outside kmix's "
                    f"[min_scale, max_scale] = [{low:.9g}, {high:.9g}]; the migrated "
                    f"optimizer starts at {kwargs['initial_scale']:.9g}.",
                    stacklevel=2,
                )
        kwargs.setdefault("dynamic_growth_steps", optimizer.dynamic_growth_steps)
        return cls(optimizer.inner_optimizer, **kwargs)


_INT_STATE = {  # read_state() key -> variable attribute
    "attempted_steps": "attempted_steps_var",
    "skipped_steps": "skipped_steps_var",
    "good_steps": "good_steps_var",
    "consecutive_skips": "consecutive_skips",
    "last_overflow_step": "last_overflow_step_var",
    "loss_finite": "loss_finite",
    "consecutive_nonfinite_loss": "consecutive_nonfinite_loss",
    "event_count": "event_count_var",
    "health_step": "health_step",
    "histogram_step": "histogram_step",
}
_HEALTH_FIELDS = (
    "grad_norm",
    "max_abs_scaled",
    "headroom_bits",
    "underflow_fraction",
    "nonfinite_elements",
)


FIT_UNDER_MULTI_WORKER = (
    "kmix.LossScaleOptimizer was created under tf.distribute.MultiWorkerMirroredStrategy: "
    "model.fit cannot train under this strategy with Keras {version} (keras-team/keras#20585: "
    "it fails before the first step with 'Attempt to convert a value (PerReplica...)'), so "
    "train with a custom loop driven by kmix.callbacks.LoopDriver, as in the README section "
    "'Distributed training'."
)


def _warn_if_fit_cannot_run_here() -> None:
    """Says once, at creation, what Keras would otherwise say with a deep traceback."""
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    if worker_count(strategy) > 1:  # one worker alone trains with fit fine
        warnings.warn(FIT_UNDER_MULTI_WORKER.format(version=keras.version()), stacklevel=3)


def _noop() -> None:
    return None


def _reachable_from_current_graph(tensor: Any, tf: Any) -> bool:
    """True if ``tensor`` can be used where ops are being built now."""
    if tf.executing_eagerly():
        return hasattr(tensor, "numpy")
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(tensor, "graph", None) is graph:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False
