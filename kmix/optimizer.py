"""kmix.LossScaleOptimizer: Keras's loss-scale optimizer, made safe and observable.

This module is glue only: arguments -> a validated :class:`OptimizerConfig`,
``build`` -> one variable per field of the step record (:mod:`kmix.record`),
``apply`` -> read the variables, run the pure update, assign; plus what Keras and
``tf.distribute`` need. The rules live in :mod:`kmix.scaling` (the scale),
:mod:`kmix.record` (counters and events) and :mod:`kmix.health` (statistics).
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from kmix import (
    _runs,  # noqa: F401  (wraps fit: runs end with evidence)
    health,
    record,
    scaling,
)
from kmix._checks import check_int
from kmix._cluster import worker_count
from kmix._config import OWNER, OptimizerConfig, RunSettings, invalid_argument
from kmix._graph import host_value, rare_cond, reachable
from kmix._layers import forward_state_variables, variable_compute_dtypes
from kmix.activations import (
    ACTIVATION_CAPACITY,
    ACTIVATION_FIELDS,
    ActivationTap,
    measure_forward,
)
from kmix.record import HEALTH_FIELDS, INT64_MAX, RecordedEvent, Snapshot  # noqa: F401
from kmix.tags import ScaleEvent

__all__ = ["LossScaleOptimizer", "OptimizerConfig", "ScaleEvent", "Snapshot"]


def _resolve_inner(inner_optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(inner_optimizer, str | dict):
        try:
            inner_optimizer = keras.optimizers.get(inner_optimizer)
        except ValueError:
            raise invalid_argument(
                "inner_optimizer",
                inner_optimizer,
                "a keras.optimizers.Optimizer instance (e.g. keras.optimizers.Adam(1e-3))"
                " or the name of a Keras optimizer such as 'adam', 'adamw', 'sgd' or"
                " 'rmsprop'",
            ) from None
    if isinstance(inner_optimizer, keras.mixed_precision.LossScaleOptimizer):
        raise invalid_argument(
            "inner_optimizer",
            inner_optimizer,
            "a plain optimizer: this one already scales the loss; pass its"
            " `.inner_optimizer` instead",
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise invalid_argument(
            "inner_optimizer", inner_optimizer, "a keras.optimizers.Optimizer or its name"
        )
    return inner_optimizer


@keras.saving.register_keras_serializable(package="kmix")
class LossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """A dynamic loss-scale optimizer that never corrupts weights and records why.

    It subclasses ``keras.mixed_precision.LossScaleOptimizer``, so ``model.compile``
    does not wrap it again. On every step it checks the scaled gradients of every
    replica and the unscaled loss; if all are finite it unscales the gradients and
    applies the inner optimizer, otherwise it skips the step: weights and inner state
    untouched, and, once it knows the model (kmix's callbacks tell it at train
    begin; custom loops call :meth:`watch`), the non-trainable state the forward
    pass assigned (BatchNormalization's moving statistics) too. The scale follows
    :func:`kmix.scaling.update_scale`: gradient overflows back it off; a non-finite
    loss (a forward overflow) keeps it, since no scale can fix the forward pass.
    Counters, gradient health and a ring of recent events are kept in optimizer
    variables (:mod:`kmix.record`), computed in-graph, for :mod:`kmix.callbacks` to
    read. Under a ``tf.distribute`` strategy the skip decision, counters and events
    are agreed across replicas; the gradient health statistics describe the first
    local replica's gradients (before Keras all-reduces them).

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
            (and at every skipped step). ``kmix.callbacks.MixedPrecisionMonitor``
            requests its ``update_freq``. The non-finite check, counters and events
            run on every step regardless.
        histogram_every: compute per-variable exponent histograms every this many
            steps; 0 switches them off.
        event_capacity: how many recent scale events the in-graph ring keeps.
        backoff_on_forward_overflow: False (default) skips a step whose unscaled
            loss is non-finite without lowering the scale; True treats it like a
            gradient overflow, as stock Keras does.
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
        backoff_on_forward_overflow: bool = False,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if keras.backend.backend() != "tensorflow":
            raise ValueError(
                "kmix.LossScaleOptimizer needs the TensorFlow backend; the active "
                f"Keras backend is {keras.backend.backend()!r}. Set "
                "KERAS_BACKEND=tensorflow before importing keras."
            )
        config = OptimizerConfig(
            rule=scaling.ScaleConfig(
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_steps=dynamic_growth_steps,
                hysteresis=hysteresis,
                min_scale=min_scale,
                max_scale=max_scale,
                backoff_on_forward_overflow=backoff_on_forward_overflow,
            ),
            initial_scale=initial_scale,
            health_every=health_every,
            histogram_every=histogram_every,
            event_capacity=event_capacity,
        )
        super().__init__(
            _resolve_inner(inner_optimizer),
            initial_scale=config.initial_scale,
            dynamic_growth_steps=config.rule.growth_steps,
            name=name,
            **kwargs,
        )
        self.config = config
        self._settings = RunSettings(
            health_every=self.config.health_every,
            histogram_every=self.config.histogram_every,
            float16_mask=None,
        )
        self._trace = threading.local()  # what scale_loss and the model left for apply
        self._model_ref: Any = None
        self._tap: Any = None  # kmix.activations.ActivationTap, set by watch()
        self._layers: list[tuple[str, str]] = []  # (path, class) of the tap's records
        _warn_if_fit_cannot_run_here()

    @property
    def event_capacity(self) -> int:
        """How many recent events the in-graph ring keeps."""
        return self.config.event_capacity

    # ------------------------------------------------------------------ state
    def build(self, var_list: list[Any]) -> None:
        """Creates one variable per field of the step record, then the inner optimizer's."""

        def state(name: str, dtype: str, value: Any = 0, shape: tuple = ()) -> Any:
            return self.add_variable(
                shape=shape,
                dtype=dtype,
                initializer=keras.initializers.Constant(value),
                aggregation="only_first_replica",
                name=name,
            )

        n, capacity = len(var_list), self.config.event_capacity
        counters = record.initial_counters(self.config.rule.hysteresis)
        self.dynamic_scale = state("dynamic_scale", "float32", self.initial_scale)
        self.counters = self.add_variable(
            shape=(len(counters),),
            dtype="int64",
            initializer=lambda shape, dtype: ops.convert_to_tensor(list(counters), dtype),
            aggregation="only_first_replica",
            name="counters",
        )
        self.health = state("health", "float32", np.nan, (len(HEALTH_FIELDS),))
        self.underflow_per_variable = state("underflow_per_variable", "float32", 0, (n,))
        self.subnormal_per_variable = state("subnormal_per_variable", "float32", 0, (n,))
        self.exponent_histograms = state(
            "exponent_histograms", "int32", 0, (n, health.NUM_EXPONENT_BINS)
        )
        self.event_ints = state("event_ints", "int64", 0, (capacity, len(record.EVENT_INT_FIELDS)))
        self.event_floats = state(
            "event_floats", "float32", 0, (capacity, len(record.EVENT_FLOAT_FIELDS))
        )
        self.activation_stats = state(
            "activation_stats", "float32", np.nan, (ACTIVATION_CAPACITY, len(ACTIVATION_FIELDS))
        )
        self._settings.base["float16_mask"] = self._float16_mask(var_list)
        self._settings.create()
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    # ------------------------------------------------------------ train step
    def scale_loss(self, loss: Any) -> Any:
        """Multiplies ``loss`` by the current scale and notes whether it was finite.

        Called more than once in a step, the step's loss counts as non-finite if
        any of them was.

        Args:
            loss: the unscaled loss.

        Returns:
            The scaled loss.
        """
        nonfinite = ops.logical_not(ops.all(ops.isfinite(loss)))
        previous = getattr(self._trace, "loss_nonfinite", None)
        if previous is not None and reachable(previous):
            nonfinite = ops.logical_or(previous, nonfinite)
        self._trace.loss_nonfinite = nonfinite
        return super().scale_loss(loss)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        """Applies scaled gradients: skip on any non-finite value, else unscale and apply.

        Args:
            grads: gradients of the scaled loss, one per variable (``None`` allowed).
            trainable_variables: the variables; defaults to those the optimizer
                was built with.

        Raises:
            ValueError: called in a cross-replica context, or with variables the
                optimizer was not built with.
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
        self._check_variables_are_known(variables)
        # Align gradients with the variables the optimizer tracks, so per-variable
        # state has a fixed layout whatever subset this call updates.
        aligned = [None] * len(self._trainable_variables)
        for grad, variable in zip(grads, variables, strict=True):
            aligned[self._get_variable_index(variable)] = grad
        flags = ops.concatenate([health.nonfinite_flags(aligned), self._take_loss_flags()])
        # Replicas agree: every replica sees the same flags before any update.
        context = tf.distribute.get_replica_context()
        if context.num_replicas_in_sync > 1:
            flags = context.all_reduce(tf.distribute.ReduceOp.SUM, flags)
        forward_state = self._take_forward_state()
        before = self._before_step()
        forward = self._forward_statistics(flags[len(aligned)] > 0, before.due[0])
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._step(
                aligned,
                flags,
                before,
                forward_state,
                lambda: self._apply_inner(grads, variables),
                forward,
            )
        else:  # the cross-replica step reads the first replica's forward statistics
            context.merge_call(
                self._merged_step,
                args=(aligned, flags, before, forward_state, forward, grads, variables),
            )

    def _before_step(self) -> _Before:
        """The counters before this step and what is due at it, read once per step."""
        packed = ops.copy(self.counters)
        settings = self._settings.variables
        every = ops.stack([settings["health_every"].value, settings["histogram_every"].value])
        return _Before(packed, record.due_now(packed, every))

    def _forward_statistics(self, loss_nonfinite: Any, health_due: Any) -> tuple[Any, Any] | None:
        """This replica's forward pass, from the tap (see :func:`activations.measure_forward`)."""
        records = self._tap.take() if self._tap is not None else []
        if len(records) > ACTIVATION_CAPACITY:
            warnings.warn(
                f"kmix: {len(records)} layer calls in one step; activation statistics "
                f"cover the first {ACTIVATION_CAPACITY}.",
                stacklevel=3,
            )
        records = records[:ACTIVATION_CAPACITY]
        self._layers = [(r.path, r.class_name) for r in records]
        if not records:
            return None
        return measure_forward(records, loss_nonfinite, health_due)

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
        self,
        distribution: Any,
        aligned: list,
        flags: Any,
        before: _Before,
        forward_state: list,
        forward: tuple[Any, Any] | None,
        grads: list,
        variables: list,
    ) -> None:
        """Cross-replica part: one decision for all (the flags are already all-reduced)."""

        def first(value: Any) -> Any:
            return None if value is None else distribution.experimental_local_results(value)[0]

        self._step(
            [first(g) for g in aligned],
            first(flags),
            keras.tree.map_structure(first, before),
            [(v, first(old)) for v, old in forward_state],
            lambda: distribution.extended.call_for_each_replica(
                self._apply_inner, args=(grads, variables)
            ),
            None if forward is None else tuple(first(t) for t in forward),
        )

    def _step(
        self,
        aligned: list,
        flags: Any,
        before: _Before,
        forward_state: list,
        apply_inner: Any,
        forward: tuple[Any, Any] | None = None,
    ) -> None:
        """Applies or skips; the record's update and statistics in one rare branch.

        The common step (quiet: see :func:`record.is_quiet`) runs the finite check, the
        update and one constant added to the counters; everything else (the rule,
        statistics, events, restoring the forward pass's state) is a called branch, which
        costs a quiet step only the passing of its arguments (the gradients among them).
        """
        n = len(aligned)
        applies = ops.logical_not(ops.any(flags[: n + 1] > 0))  # gradients and loss finite
        ops.cond(applies, apply_inner, _noop)

        def quiet() -> None:  # the common step: one constant added, nothing else moves
            self.counters.assign_add(np.asarray(record.QUIET_DELTA, "int64"))  # one constant

        def full() -> None:
            scale = ops.copy(self.dynamic_scale)
            settings = self._settings.variables
            var_bad = flags[:n] > 0
            loss_state = ops.where(
                flags[n] > 0,
                record.LOSS_NONFINITE,
                ops.where(flags[n + 1] > 0, record.LOSS_UNKNOWN, record.LOSS_FINITE),
            )
            new, outcome = record.advance(
                record.StepRecord(scale, record.unpack(before.packed)),
                ops.logical_not(ops.any(var_bad)),
                loss_state,
                self.config.rule,
                settings["health_every"],
                settings["histogram_every"],
            )
            measured = self._record_statistics(aligned, scale, outcome)
            self.dynamic_scale.assign(new.scale)
            self.counters.assign(record.pack(new.counters))
            if forward_state:  # the batch never happened: undo what the forward pass assigned
                ops.cond(outcome.skipped, lambda: _restore(forward_state), _noop)
            origin = self._keep_forward_statistics(forward, outcome)
            ops.cond(
                ops.not_equal(outcome.event, scaling.NONE),
                lambda: self._write_event(
                    outcome, (scale, new), var_bad, loss_state, measured, origin
                ),
                _noop,
            )

        quiet_step = record.is_quiet(before.packed, flags, before.due, self.config.rule)
        rare_cond(quiet_step, quiet, full)

    def _record_statistics(self, aligned: list, scale: Any, outcome: record.StepOutcome) -> Any:
        """Gradient health (and histograms) when due; returns the health vector (NaN if not)."""
        unmeasured = ops.full((len(HEALTH_FIELDS),), np.nan, "float32")

        def statistics() -> Any:
            measured = ops.cond(
                outcome.statistics_due,
                lambda: self._record_health(outcome.health_due, aligned, scale),
                lambda: unmeasured,
            )
            ops.cond(outcome.histogram_due, lambda: self._record_histograms(aligned), _noop)
            return measured

        # Called: between statistics steps the gradients pass by reference.
        return rare_cond(
            ops.logical_or(outcome.statistics_due, outcome.histogram_due),
            statistics,
            lambda: unmeasured,
        )

    def _keep_forward_statistics(
        self, forward: tuple[Any, Any] | None, outcome: record.StepOutcome
    ) -> record.EventOrigin:
        """Keeps the activation statistics when due; returns the forward origin, if any."""
        if forward is None:
            return record.NO_ORIGIN
        rows = ops.shape(forward[1])[0]
        padded = ops.concatenate(
            [forward[1], ops.full((ACTIVATION_CAPACITY - rows, len(ACTIVATION_FIELDS)), np.nan)]
        )

        def keep_statistics() -> None:
            self.activation_stats.assign(padded)

        ops.cond(outcome.health_due, keep_statistics, _noop)
        return record.EventOrigin(*ops.unstack(forward[0]))

    def _write_event(
        self,
        outcome: record.StepOutcome,
        scales: tuple[Any, Any],
        var_bad: Any,
        loss_state: Any,
        measured: Any,
        origin: record.EventOrigin,
    ) -> None:
        """Writes this step's event into the ring (the rare branch)."""
        old_scale, new = scales
        ints, floats = record.encode_event(
            outcome.step,
            outcome.event,
            (old_scale, new.scale),
            var_bad,
            loss_state,
            measured,
            origin,
        )
        ring = record.write_event(
            record.EventRing(self.event_ints, self.event_floats),
            new.counters.event_count,
            ints,
            floats,
        )
        self.event_ints.assign(ring.ints)
        self.event_floats.assign(ring.floats)

    def _record_health(self, health_due: Any, aligned: list, scale: Any) -> Any:
        stats = health.gradient_health(aligned, scale, self._settings.variables["float16_mask"])
        vector = ops.stack([ops.cast(getattr(stats, f), "float32") for f in HEALTH_FIELDS])

        def periodic() -> None:
            self.health.assign(vector)
            self.underflow_per_variable.assign(stats.underflow_per_variable)
            self.subnormal_per_variable.assign(stats.subnormal_per_variable)

        ops.cond(health_due, periodic, _noop)
        return vector

    def _record_histograms(self, aligned: list) -> None:
        self.exponent_histograms.assign(health.exponent_histograms(aligned))

    def _take_loss_flags(self) -> Any:
        """What ``scale_loss`` saw in this step's graph: ``[non-finite, unknown]`` as 1.0/0.0."""
        nonfinite = getattr(self._trace, "loss_nonfinite", None)
        self._trace.loss_nonfinite = None
        if nonfinite is None or not reachable(nonfinite):
            return ops.convert_to_tensor([0.0, 1.0], "float32")
        return ops.where(nonfinite, np.float32([1.0, 0.0]), np.float32([0.0, 0.0]))

    def _take_forward_state(self) -> list:
        """The forward-updated variables and their values before this step's forward pass."""
        state = getattr(self._trace, "forward_state", None) or []
        self._trace.forward_state = None
        return [(v, old) for v, old in state if reachable(old)]

    # ------------------------------------------------------------- the model
    def watch(self, model: keras.Model) -> list[str]:
        """Learns the model: which variables compute in float16, what its forward pass assigns.

        Float16's range (headroom, underflow) matters only where float16 computes;
        the mask is taken whenever the model's variables come to exist (now if they
        do, else when the optimizer is built at the first step). The model's train
        step is wrapped so that a skipped step leaves the non-trainable float
        variables its forward pass assigns (BatchNormalization's moving statistics)
        as they were. kmix's callbacks call this at train begin; custom loops may call
        it themselves. Calling it again for the same model does nothing new.

        Args:
            model: the model whose trainable variables this optimizer updates.

        Returns:
            The paths of the model's trainable variables counted as float16 now
            (empty while a lazily built model has no variables yet).
        """
        self._model_ref = weakref.ref(model)
        self._wrap_train_step(model)
        self._tap_forward_pass(model)
        if self.built:
            self._settings.set_base("float16_mask", self._float16_mask(self._trainable_variables))
        dtypes = variable_compute_dtypes(model)
        return [v.path for v in model.trainable_weights if dtypes.get(id(v)) == "float16"]

    watch_float16_layers = watch  # the 0.1.0 name

    def _float16_mask(self, variables: list[Any]) -> np.ndarray:
        """1.0 for variables whose layer computes in float16 (all, without a model)."""
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            return np.ones(len(variables), "float32")
        dtypes = variable_compute_dtypes(model)
        return np.asarray([dtypes.get(id(v)) == "float16" for v in variables], "float32")

    def _tap_forward_pass(self, model: keras.Model) -> None:
        """Taps the float16 layers' calls, so a forward overflow can name its first layer."""
        if self._tap is not None and self._tap.model is model:
            return
        if self._tap is not None:
            self._tap.remove()
        self._tap = ActivationTap(model).install()
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)

    def _wrap_train_step(self, model: keras.Model) -> None:
        wrapped_for = getattr(model, "_kmix_train_step_of", None)
        if wrapped_for is not None and wrapped_for() is self:
            return
        original = type(model).train_step.__get__(model)
        optimizer = weakref.ref(self)

        def train_step(data: Any) -> Any:
            opt = optimizer()
            if opt is not None:
                # Read before the forward pass assigns them (reads are ordered
                # before later assignments of the same variable in the graph).
                opt._trace.forward_state = [
                    (v, ops.copy(v.value)) for v in forward_state_variables(model)
                ]
            return original(data)

        model.train_step = train_step
        model._kmix_train_step_of = weakref.ref(self)  # a weak link: the model is not saved with it
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)

    # ------------------------------------------------------------- reading
    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self.read_state().loss_scale

    @property
    def skipped_steps(self) -> int:
        """Cumulative skipped (non-finite) steps."""
        return self.read_state().skipped_steps

    @property
    def attempted_steps(self) -> int:
        """Optimizer steps attempted so far, skipped ones included."""
        return self.read_state().attempted_steps

    @property
    def good_steps(self) -> int:
        """Consecutive finite steps since the scale last changed or a step was skipped."""
        return self.read_state().good_steps

    @property
    def last_overflow_step(self) -> int:
        """Attempted step of the most recent skipped step; 0 if none yet."""
        return self.read_state().last_overflow_step

    @property
    def event_count(self) -> int:
        """Scale events recorded since training began (the ring keeps the last ones)."""
        return self.read_state().event_count

    @property
    def health_every(self) -> int:
        """Steps between gradient health computations in force (a run-time setting)."""
        return int(self._settings.value("health_every"))

    @health_every.setter
    def health_every(self, value: int) -> None:
        self._settings.set_base("health_every", check_int(OWNER, "health_every", value, 1))

    @property
    def histogram_every(self) -> int:
        """Steps between exponent histograms in force; 0 means off (a run-time setting)."""
        return int(self._settings.value("histogram_every"))

    @histogram_every.setter
    def histogram_every(self, value: int) -> None:
        self._settings.set_base("histogram_every", check_int(OWNER, "histogram_every", value, 0))

    def request_statistics(self, owner: Any, health_every: int, histogram_every: int) -> None:
        """Asks for statistics at least every N steps until :meth:`release_statistics`.

        Requests compose: the steps in force are the greatest common divisor of the
        optimizer's own setting and every open request, so each requester gets its steps.

        Args:
            owner: who asks (a callback); one request per owner.
            health_every: health statistics every this many steps, >= 1.
            histogram_every: histograms every this many steps; 0 asks for none.
        """
        self._settings.request(
            owner,
            health_every=check_int(OWNER, "health_every", health_every, 1),
            histogram_every=check_int(OWNER, "histogram_every", histogram_every, 0),
        )

    def release_statistics(self, owner: Any) -> None:
        """Withdraws ``owner``'s request; the settings go back to what the others need."""
        self._settings.release(owner)

    @property
    def float16_mask(self) -> np.ndarray:
        """1.0 per variable counted as float16 by the health statistics."""
        mask = self._settings.base["float16_mask"]
        return np.asarray([] if mask is None else mask, "float32")

    def read_state(self, counters_only: bool = False) -> Snapshot:
        """Reads the whole record: three variable reads.

        Args:
            counters_only: read the counters alone, with one read (what a check on
                every step needs); ``loss_scale`` is then None and ``health`` empty.

        Returns:
            A :class:`kmix.record.Snapshot`. Before the optimizer is built: the
            initial scale and zeros.
        """
        if not self.built:
            counters = record.initial_counters(self.config.rule.hysteresis)
            return record.snapshot(self.initial_scale, list(counters), None)
        counters = host_value(self.counters).tolist()
        if counters_only:
            return record.snapshot(None, counters, None)
        return record.snapshot(
            float(host_value(self.dynamic_scale)), counters, host_value(self.health)
        )

    def variable_paths(self) -> list[str]:
        """Paths of the tracked trainable variables, in the order of per-variable state."""
        return [v.path for v in self._trainable_variables]

    def _by_variable(self, attribute: str) -> dict[str, Any]:
        if not self.built:
            return {}
        values = host_value(getattr(self, attribute))
        return dict(zip(self.variable_paths(), values, strict=True))

    def underflow_by_variable(self) -> dict[str, float]:
        """Per-variable underflow fraction (zeros included) at the latest health step."""
        return {k: float(v) for k, v in self._by_variable("underflow_per_variable").items()}

    def subnormal_by_variable(self) -> dict[str, float]:
        """Per-variable share of non-zero values below float16's smallest normal."""
        return {k: float(v) for k, v in self._by_variable("subnormal_per_variable").items()}

    def exponent_histograms_by_variable(self) -> dict[str, np.ndarray]:
        """Per-variable exponent histograms at ``histogram_step`` (layout in kmix.tags)."""
        return self._by_variable("exponent_histograms")

    def activations_by_layer(self) -> dict[str, dict[str, float]]:
        """Per-layer activation statistics at the latest health step, by layer path.

        Returns:
            Layer path -> :data:`ACTIVATION_FIELDS` -> value, for the float16 layers the
            optimizer's tap saw in the last traced step; empty before the first
            measurement or without a tap (see :meth:`watch`).
        """
        if not self.built or not self._layers:
            return {}
        values = host_value(self.activation_stats)[: len(self._layers)]
        return {
            path: dict(zip(ACTIVATION_FIELDS, map(float, row), strict=True))
            for (path, _), row in zip(self._layers, values, strict=True)
            if np.isfinite(row).all()
        }

    def recorded_events(self, since: int = 0) -> list[RecordedEvent]:
        """Like :meth:`scale_events`, each event with the health measured at its step."""
        if isinstance(since, bool) or not isinstance(since, int | np.integer) or since < 0:
            raise invalid_argument(
                "since", since, "an integer >= 0 (the index of the last event seen)"
            )
        if not self.built:
            return []
        count = self.read_state(counters_only=True).event_count
        if count == since:
            return []
        return record.decode_events(
            host_value(self.event_ints),
            host_value(self.event_floats),
            count,
            int(since),
            self.variable_paths(),
            self._layers,
        )

    def scale_events(self, since: int = 0) -> list[ScaleEvent]:
        """Returns the recorded events with ``index > since`` that the ring still holds.

        Args:
            since: the index of the last event already seen (0 for all).

        Returns:
            Events in order. If more than ``event_capacity`` events happened after
            ``since``, the oldest are gone: compare ``event_count - since`` with
            the number returned.

        Raises:
            ValueError: ``since`` is not an integer >= 0.
        """
        return [recorded.event for recorded in self.recorded_events(since)]

    # ------------------------------------------------------------ config
    def get_config(self) -> dict[str, Any]:
        """Returns the constructor arguments, Keras's and kmix's."""
        config = super().get_config()
        rule = self.config.rule
        config.update(
            growth_factor=rule.growth_factor,
            backoff_factor=rule.backoff_factor,
            hysteresis=rule.hysteresis,
            min_scale=rule.min_scale,
            max_scale=rule.max_scale,
            health_every=self.config.health_every,
            histogram_every=self.config.histogram_every,
            event_capacity=self.config.event_capacity,
            backoff_on_forward_overflow=rule.backoff_on_forward_overflow,
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
            optimizer: a stock ``keras.mixed_precision.LossScaleOptimizer``.
            **kwargs: other kmix arguments (``hysteresis``, ``min_scale``...).

        Returns:
            A ``kmix.LossScaleOptimizer``.

        Raises:
            ValueError: ``optimizer`` is not a stock Keras loss-scale optimizer (a
                kmix one is refused: migrating would reset its counters and bounds).
        """
        if isinstance(optimizer, LossScaleOptimizer):
            raise invalid_argument(
                "optimizer",
                optimizer,
                "a stock keras.mixed_precision.LossScaleOptimizer; this one is already a "
                "kmix.LossScaleOptimizer: use it as it is",
            )
        if not isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
            raise invalid_argument(
                "optimizer", optimizer, "a keras.mixed_precision.LossScaleOptimizer"
            )
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


class _Before(NamedTuple):
    """The packed counters before a step and ``[health_due, histogram_due]`` at it."""

    packed: Any
    due: Any


def _noop() -> None:
    return None


def _restore(forward_state: list) -> None:
    for variable, old in forward_state:
        variable.assign(old)
