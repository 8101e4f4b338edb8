"""What kmix's optimizer attaches to the model it trains, and what it takes back each step.

:meth:`kmix.LossScaleOptimizer.watch` hands the model to a :class:`ModelHooks`, which

* wraps the model's ``train_step`` so that it notes the values of the non-trainable
  float variables the forward pass assigns (BatchNormalization's moving statistics)
  before the forward pass runs: a skipped step puts them back (:func:`restore`). This
  part alone (:meth:`ModelHooks.protect`) runs before every ``model.fit`` whose
  optimizer is kmix's, callbacks or not (``kmix._runs`` wraps ``fit``);
* taps the forward pass (:class:`kmix.optimizer.tap.ActivationTap`), so a forward
  overflow can name its first layer and activation statistics can be kept;
* knows which trainable variables compute in float16 (:meth:`ModelHooks.float16_mask`).

The hooks hold the model weakly and are never saved with it. Inside the step the
optimizer calls :meth:`ModelHooks.take_forward_state` and
:meth:`ModelHooks.forward_statistics` in the replica context, in the same trace as the
forward pass.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from kmix._checks import KmixWarning, StateNotRestoredWarning, WarnOnce
from kmix._layers import (
    forward_state_variables,
    unrestored_state_variables,
    variable_compute_dtypes,
)
from kmix.backend import reachable
from kmix.float8 import inputs_scale_of, inputs_underflow, layer_of
from kmix.optimizer.tap import ActivationTap, tensors_in
from kmix.optimizer.trace import PerThread, StepTrace
from kmix.record import ACTIVATION_CAPACITY, measure_forward

__all__ = ["ModelHooks", "restore", "warn_unrestored"]


def restore(forward_state: list[tuple[Any, Any]]) -> None:
    """Assigns each variable the value it had before the step's forward pass (in-graph)."""
    for variable, old in forward_state:
        variable.assign(old)


_said = WarnOnce()


def _float16_output(outputs: Any) -> bool:
    """True when every floating-point tensor of a call's output is float16."""
    dtypes = [keras.backend.standardize_dtype(t.dtype) for t in tensors_in(outputs)]
    floats = [d for d in dtypes if "float" in d]
    return bool(floats) and all(d == "float16" for d in floats)


def warn_unrestored(model: keras.Model) -> None:
    """Says once per model which of its variables a skipped step does not give back.

    A skipped step gives back the float variables the forward pass assigned; integer
    ones (a step counter a layer keeps) keep the skipped step's update.
    """
    unrestored = [v.path for v in unrestored_state_variables(model)]
    if unrestored:
        _said(
            "kmix: a skipped step gives back the float variables the forward pass "
            "assigned (BatchNormalization's statistics); these integer variables keep "
            f"the skipped step's update: {', '.join(unrestored)}.",
            StateNotRestoredWarning,
            key=weakref.ref(model),  # this model: a new one at the same id is told again
        )


class ModelHooks:
    """The optimizer's hooks into one model: train-step wrapper, activation tap, float16 mask.

    Attributes:
        layers: ``(path, class)`` of the forward-pass records the last traced step took
            (on torch, the last step that measured: a quiet step drops its records).
        not_float16: the paths among them whose output is not float16 (a float16 layer
            that returns float32, e.g. a block whose layers compute in float32): float16's
            range, so its headroom, does not apply to that output.
        float8_inputs: record path -> float8 layer path (:func:`kmix.float8.layer_of`) for
            the first call of each float8 layer among them: the rows whose
            :data:`kmix.record.FLOAT8_INPUTS_FIELD` is measured.
    """

    def __init__(self, trace: PerThread[StepTrace] | None = None) -> None:
        """Hooks that hand the step what they saved through ``trace`` (the optimizer's)."""
        self._model_ref: Any = None
        self._tap: ActivationTap | None = None
        self.trace = trace or PerThread(StepTrace)  # the wrapped train step leaves state here
        self.layers: list[tuple[str, str]] = []
        self.not_float16: frozenset[str] = frozenset()
        self.float8_inputs: dict[str, str] = {}
        self._state_variables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def model(self) -> keras.Model | None:
        """The watched model, or None (none yet, or it was garbage-collected)."""
        return self._model_ref() if self._model_ref is not None else None

    def protect(self, model: keras.Model) -> None:
        """Wraps ``model``'s train step so a skipped step gives its forward state back.

        Idempotent for the same model; retraces a train step traced without the wrapper.
        Says once, by name, which of the model's own variables a skipped step does not
        give back (integer ones, such as a step counter a layer keeps).

        Args:
            model: the model the optimizer trains.
        """
        self.attach(model)
        self._state_variables.pop(model, None)  # found again: it may have changed since
        self._wrap_train_step(model)
        warn_unrestored(model)

    def state_variables(self, model: keras.Model) -> list[Any]:
        """:func:`kmix._layers.forward_state_variables` of ``model``, walked once it is built.

        An eager step (torch) calls the wrapped train step at every step. Once a model is
        built, Keras locks its layers' trackers (a layer refuses new state), so the list
        holds until :meth:`protect` (before every fit) finds it again.

        Args:
            model: the model whose train step is wrapped (each model has its own list).

        Returns:
            The variables, in walk order.
        """
        found = self._state_variables.get(model)
        if found is None:
            found = forward_state_variables(model)
            if getattr(model, "built", False):
                self._state_variables[model] = found
        return found

    def attach(self, model: keras.Model) -> None:
        """Holds ``model`` (weakly) as the model the hooks serve: its float16 mask."""
        self._model_ref = weakref.ref(model)

    @property
    def tapping(self) -> bool:
        """Whether a tap is installed (the forward pass is recorded when traced)."""
        return self._tap is not None and self._tap.installed

    def tap(self, model: keras.Model) -> None:
        """Taps the float16 layers' calls (forward statistics); retraces a traced step.

        Idempotent for the same model (layers added or quantized since are wrapped, and
        the step retraced); a tap on another model is removed first.

        Args:
            model: the model the optimizer trains.
        """
        if self._tap is not None and self._tap.model is model:
            before = self._tap.wrapped()
            if self._tap.install().wrapped() == before:  # nothing new (added or quantized)
                return
        else:
            if self._tap is not None:
                self._tap.remove()
            self._tap = ActivationTap(model).install()
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)

    def float16_mask(self, variables: list[Any]) -> np.ndarray:
        """1.0 for each variable whose layer computes in float16 (all, without a model).

        A float8 layer's scales and amax histories (``overwrite_with_gradient``: Keras
        hands them their new value as gradient) are 0.0: they hold no gradient.

        Args:
            variables: the optimizer's tracked trainable variables.

        Returns:
            A float32 vector, one entry per variable.
        """
        model = self.model
        dtypes = None if model is None else variable_compute_dtypes(model)
        return np.asarray(
            [
                not getattr(v, "overwrite_with_gradient", False)
                and (dtypes is None or dtypes.get(id(v)) == "float16")
                for v in variables
            ],
            "float32",
        )

    def _wrap_train_step(self, model: keras.Model) -> None:
        wrapped_for = getattr(model, "_kmix_train_step_of", None)
        if wrapped_for is not None and wrapped_for() is self:
            return
        original = type(model).train_step.__get__(model)
        hooks = weakref.ref(self)

        def train_step(data: Any) -> Any:
            owner = hooks()
            if owner is not None:
                # Read before the forward pass assigns them (reads are ordered
                # before later assignments of the same variable in the graph).
                owner.trace.get().forward_state = [
                    (v, ops.copy(v.value)) for v in owner.state_variables(model)
                ]
            return original(data)

        model.train_step = train_step
        model._kmix_train_step_of = weakref.ref(self)  # weak: the model is not saved with it
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)

    # ------------------------------------------------------------- in the step
    def take_forward_state(self) -> list[tuple[Any, Any]]:
        """The forward-assigned variables and their values before this step's forward pass."""
        trace = self.trace.get()
        state, trace.forward_state = trace.forward_state or [], None
        return [(v, old) for v, old in state if reachable(old)]

    def take_records(self) -> list[Any]:
        """This trace's tapped records, the first :data:`ACTIVATION_CAPACITY` (said once).

        Also sets :attr:`layers` and :attr:`not_float16`. Taking forgets them: records of a
        pass nobody measures are dropped this way before another pass of the same trace is
        recorded.

        Returns:
            The :class:`kmix.record.TappedCall` list, ``[]`` without a tap.
        """
        records = self._tap.take() if self._tap is not None else []
        if len(records) > ACTIVATION_CAPACITY:
            warnings.warn(
                f"kmix: {len(records)} layer calls in one step; activation statistics "
                f"cover the first {ACTIVATION_CAPACITY}.",
                KmixWarning,
                stacklevel=3,
            )
        records = records[:ACTIVATION_CAPACITY]
        self.layers = [(r.path, r.class_name) for r in records]
        self.not_float16 = frozenset(r.path for r in records if not _float16_output(r.outputs))
        self.float8_inputs = {
            r.path: layer_of(scale)
            for r in records
            if "#" not in r.path and (scale := inputs_scale_of(r.layer)) is not None
        }
        return records

    def drop_records(self) -> None:
        """Forgets the tapped records of this step unread (:attr:`layers` stay as they were)."""
        if self._tap is not None:
            self._tap.drop()

    def recording(self) -> contextlib.AbstractContextManager:
        """Records the tapped layers' calls in the block, whatever the trace (needs a tap)."""
        if self._tap is None:
            raise RuntimeError("kmix: ModelHooks.recording() needs a tap: call tap(model).")
        return self._tap.recording()

    def forward_statistics(
        self,
        loss_nonfinite: Any,
        health_due: Any,
        measure: Any = None,
        value_of: Callable[[Any], Any] | None = None,
    ) -> tuple[Any, Any] | None:
        """This replica's forward pass, measured (see :func:`kmix.record.measure_forward`),
        with each float8 layer's inputs' underflow at the scale the step used
        (:func:`kmix.float8.inputs_underflow`).

        Args:
            loss_nonfinite: boolean scalar: the step's unscaled loss was inf/NaN.
            health_due: boolean scalar: statistics are due at this step.
            measure: either of them, where the step has read it already; or None.
            value_of: a variable's value in this step (JAX: from the step's values); None
                reads the variable (TensorFlow and torch, before the step assigns it).

        Returns:
            ``(origin, stats)`` tensors, or None when no tapped layer was traced.
        """
        records = self.take_records()
        if not records:
            return None
        read = value_of or ops.convert_to_tensor
        scales = [inputs_scale_of(r.layer) for r in records]

        def float8_inputs() -> Any:  # in the measuring branch only
            return ops.stack(
                [
                    np.float32(np.nan)
                    if scale is None or not r.inputs
                    else inputs_underflow(r.inputs[0], read(scale), r.layer.compute_dtype)
                    for r, scale in zip(records, scales, strict=True)
                ]
            )

        found = any(s is not None for s in scales)
        return measure_forward(
            records, loss_nonfinite, health_due, measure, float8_inputs if found else None
        )
