"""kmix.LossScaleOptimizer: Keras's loss-scale optimizer, made safe and observable.

Glue only: arguments -> a validated :class:`OptimizerConfig`; ``build`` -> the step
record's variables (:class:`kmix.step_recorder.StepRecorder`); ``apply`` -> the finite
check, agreed across replicas, then apply or skip, and the recorder records the step;
plus what Keras and ``tf.distribute`` need. On JAX, ``stateless_apply`` runs the same
rules as values (:mod:`kmix._jax_step`). The record's variables, writes and reads live
in :mod:`kmix.step_recorder`, over the pure rules of :mod:`kmix.scaling` (the scale),
:mod:`kmix.record` (counters and events) and :mod:`kmix.health` (statistics); what the
optimizer attaches to its model lives in :mod:`kmix.model_hooks`.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

import keras
import numpy as np
from keras import ops

from kmix import (
    _backend,
    _jax_step,
    _runs,  # noqa: F401  (wraps fit: runs end with evidence)
    health,
)
from kmix._checks import check_int
from kmix._cluster import worker_count
from kmix._config import OWNER, OptimizerConfig, invalid_argument, migrated_scale
from kmix.model_hooks import ModelHooks, restore
from kmix.record import INT64_MAX, RecordedEvent  # noqa: F401  (the 0.1.0 names)
from kmix.snapshot import Snapshot
from kmix.step_recorder import Before, RecordReads, StepRecorder
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


def _setting(name: str, low: int, doc: str) -> property:
    """A run-time setting kept by the recorder, checked (an int >= ``low``) when assigned."""

    def get(self: LossScaleOptimizer) -> int:
        return int(self.recorder.settings.value(name))

    def set_(self: LossScaleOptimizer, value: int) -> None:
        self.recorder.settings.set_base(name, check_int(OWNER, name, value, low))

    return property(get, set_, doc=doc)


@keras.saving.register_keras_serializable(package="kmix")
class LossScaleOptimizer(RecordReads, keras.mixed_precision.LossScaleOptimizer):
    """A dynamic loss-scale optimizer that never corrupts weights and records why.

    It subclasses ``keras.mixed_precision.LossScaleOptimizer``, so ``model.compile``
    does not wrap it again. Each step it checks the scaled gradients of every replica
    and the unscaled loss: all finite, it unscales them and applies the inner optimizer;
    otherwise it skips the step, leaving weights, inner state and the state the forward
    pass assigned (BatchNormalization's statistics: :meth:`protect_forward_state`) as
    they were. The scale follows :func:`kmix.scaling.update_scale`: gradient overflows
    back it off; a non-finite loss (a forward overflow) keeps it, since no scale can fix
    the forward pass. Counters, gradient health and a ring of recent events are kept
    in-graph (:mod:`kmix.step_recorder`) for :mod:`kmix.callbacks` to read. Under a
    ``tf.distribute`` strategy the skip decision, counters and events are agreed across
    replicas; gradient health describes the first local replica's gradients.

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
            is unknown or already scales the loss, or the backend is neither
            TensorFlow nor JAX (on JAX: see :mod:`kmix._jax_step`).
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
        _backend.check_supported(OWNER)
        config = OptimizerConfig.from_arguments(
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            health_every=health_every,
            histogram_every=histogram_every,
            event_capacity=event_capacity,
            backoff_on_forward_overflow=backoff_on_forward_overflow,
        )
        super().__init__(
            _resolve_inner(inner_optimizer),
            initial_scale=config.initial_scale,
            dynamic_growth_steps=config.rule.growth_steps,
            name=name,
            **kwargs,
        )
        self.config = config
        self.recorder = StepRecorder(config, self.initial_scale)
        self.hooks = ModelHooks()
        self._trace = threading.local()  # what scale_loss saw in this step's graph
        _warn_at_creation(config)

    def build(self, var_list: list[Any]) -> None:
        """Creates the step record's variables (:class:`StepRecorder`), then the inner ones."""
        self.recorder.build(self.add_variable, var_list, self.hooks.float16_mask(var_list))
        self.dynamic_scale = self.recorder.scale  # the name Keras's scale_loss reads
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
        if previous is not None and _backend.reachable(previous):
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
        grads = list(grads)
        if not grads:
            return
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if _backend.on_jax():
            return _jax_step.apply_now(self, grads, trainable_variables, _loss_flags(self._trace))
        import tensorflow as tf

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
        flags = ops.concatenate([health.nonfinite_flags(aligned), _loss_flags(self._trace)])
        # Replicas agree: every replica sees the same flags before any update.
        context = tf.distribute.get_replica_context()
        if context.num_replicas_in_sync > 1:
            flags = context.all_reduce(tf.distribute.ReduceOp.SUM, flags)
        forward_state = self.hooks.take_forward_state()
        before = self.recorder.before_step()
        forward = self.hooks.forward_statistics(flags[len(aligned)] > 0, before.due[0])
        self.recorder.layers = self.hooks.layers
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            apply_inner = functools.partial(self._apply_inner, grads, variables)
            self._step(aligned, flags, before, forward_state, apply_inner, forward)
        else:  # the cross-replica step reads the first replica's forward statistics
            context.merge_call(
                self._merged_step,
                args=(aligned, flags, before, forward_state, forward, grads, variables),
            )

    def stateless_apply(self, optimizer_variables: list, grads: list, variables: list) -> tuple:
        """The step as values (what ``fit`` calls on JAX): :func:`kmix._jax_step.stateless_apply`.

        Args:
            optimizer_variables: the values of ``self.variables``, in that order.
            grads: the gradients of the scaled loss, one per trainable variable.
            variables: the values of the trainable variables the optimizer was built with.

        Returns:
            ``(trainable_values, optimizer_values)`` after the step (a skip: as given).
        """
        flags = _loss_flags(self._trace)
        return _jax_step.stateless_apply(self, optimizer_variables, grads, variables, flags)

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
        before: Before,
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
        before: Before,
        forward_state: list,
        apply_inner: Any,
        forward: tuple[Any, Any] | None,
    ) -> None:
        """Applies when every gradient and the loss are finite; records the step either way."""
        applies = ops.logical_not(ops.any(flags[: len(aligned) + 1] > 0))
        ops.cond(applies, apply_inner, _noop)
        on_skip = (lambda: restore(forward_state)) if forward_state else None
        self.recorder.record(aligned, flags, before, forward, on_skip)

    # ------------------------------------------------------------- the model
    def watch(self, model: keras.Model) -> list[str]:
        """:meth:`protect_forward_state`, and taps the float16 layers (:mod:`kmix.model_hooks`).

        Float16's range statistics then cover only the variables whose layers compute in
        float16 (the mask is taken once the variables exist), and a forward overflow is
        named by layer. kmix's callbacks call this at train begin; custom loops may call
        it themselves. Calling it again for the same model does nothing new.

        Args:
            model: the model whose trainable variables this optimizer updates.

        Returns:
            The paths of the model's trainable variables counted as float16 now
            (empty while a lazily built model has no variables yet).
        """
        self.protect_forward_state(model)
        self.hooks.tap(model)
        mask = self.hooks.float16_mask(model.trainable_weights)
        return [v.path for v, m in zip(model.trainable_weights, mask, strict=True) if m]

    watch_float16_layers = watch  # the 0.1.0 name

    def protect_forward_state(self, model: keras.Model) -> None:
        """Makes a skipped step leave ``model``'s forward-pass state as it was; no tap.

        kmix calls it before each ``model.fit`` with this optimizer, callbacks or not. A
        custom loop calling ``model.train_step`` gets it by calling this once; one with
        its own forward pass does not (its BatchNormalization statistics keep the
        skipped batch's update).

        Args:
            model: the model whose trainable variables this optimizer updates.
        """
        if _backend.on_jax():  # the trainer's step is not wrapped: values are returned
            _jax_step.remember(self, model)
        else:
            self.hooks.protect(model)
        if self.built:
            mask = self.hooks.float16_mask(self._trainable_variables)
            self.recorder.settings.set_base("float16_mask", mask)

    # ------------------------------------------------------------ settings
    health_every = _setting(
        "health_every", 1, "Steps between gradient health computations in force (run-time)."
    )
    histogram_every = _setting(
        "histogram_every", 0, "Steps between exponent histograms in force; 0 means off."
    )

    def request_statistics(self, owner: Any, health_every: int, histogram_every: int) -> None:
        """Asks for statistics at least every N steps until :meth:`release_statistics`.

        Requests compose: the steps in force are the greatest common divisor of the
        optimizer's own setting and every open request, so each requester gets its steps.

        Args:
            owner: who asks (a callback); one request per owner.
            health_every: health statistics every this many steps, >= 1.
            histogram_every: histograms every this many steps; 0 asks for none.
        """
        self.recorder.settings.request(
            owner,
            health_every=check_int(OWNER, "health_every", health_every, 1),
            histogram_every=check_int(OWNER, "histogram_every", histogram_every, 0),
        )

    def release_statistics(self, owner: Any) -> None:
        """Withdraws ``owner``'s request; the settings go back to what the others need."""
        self.recorder.settings.release(owner)

    # ------------------------------------------------------------ config
    def get_config(self) -> dict[str, Any]:
        """Returns the constructor arguments, Keras's and kmix's."""
        return super().get_config() | self.config.arguments()

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
        _check_stock(optimizer)
        if "initial_scale" not in kwargs:
            kwargs["initial_scale"] = migrated_scale(optimizer, kwargs)
        kwargs.setdefault("dynamic_growth_steps", optimizer.dynamic_growth_steps)
        return cls(optimizer.inner_optimizer, **kwargs)


def _loss_flags(trace: threading.local) -> Any:
    """Takes what ``scale_loss`` saw in this step's graph: ``[non-finite, unknown]`` as 1.0/0.0."""
    nonfinite = getattr(trace, "loss_nonfinite", None)
    trace.loss_nonfinite = None
    if nonfinite is None or not _backend.reachable(nonfinite):
        return ops.convert_to_tensor([0.0, 1.0], "float32")
    return ops.where(nonfinite, np.float32([1.0, 0.0]), np.float32([0.0, 0.0]))


def _check_stock(optimizer: Any) -> None:
    """Refuses what :meth:`LossScaleOptimizer.from_keras` cannot migrate."""
    if isinstance(optimizer, LossScaleOptimizer):
        raise invalid_argument(
            "optimizer",
            optimizer,
            "a stock keras.mixed_precision.LossScaleOptimizer; this one is already a "
            "kmix.LossScaleOptimizer: use it as it is",
        )
    if not isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        raise invalid_argument("optimizer", optimizer, "a keras.mixed_precision.LossScaleOptimizer")


FIT_UNDER_MULTI_WORKER = (
    "kmix.LossScaleOptimizer was created under tf.distribute.MultiWorkerMirroredStrategy: "
    "model.fit cannot train under this strategy with Keras {version} (keras-team/keras#20585: "
    "it fails before the first step with 'Attempt to convert a value (PerReplica...)'), so "
    "train with a custom loop driven by kmix.callbacks.LoopDriver, as in the README section "
    "'Distributed training'."
)


def _warn_at_creation(config: OptimizerConfig) -> None:
    """Says at creation what would otherwise surprise later: under
    MultiWorkerMirroredStrategy, what Keras would say with a deep traceback."""
    if _backend.name() != "tensorflow":
        return
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    if worker_count(strategy) > 1:  # one worker alone trains with fit fine
        warnings.warn(FIT_UNDER_MULTI_WORKER.format(version=keras.version()), stacklevel=3)


def _noop() -> None:
    return None
