"""The float8 record's one owner: its optimizer variables, written in the step, read on the host.

Created by :class:`kmix.LossScaleOptimizer` beside its step record, and only when the
variables it trains include Keras float8 state (so the saved layout of other models does
not change). In the step, every backend runs :meth:`Float8State.check` (two vectors and
one ``any``); then::

    TensorFlow and torch (kmix.optimizer.assigned_step, assigning variables):
        check = state.before_apply(aligned, applies)             # the scales used
        quiet = the step record's quiet check and no tensor saturated
        in the step record's full branch (a saturation, or the loss scale changed):
            state.write_after(check, packed, old_scale, new_scale)
                record: counts and episodes    (advance_float8: the same record when
                                                nothing saturated)
                rescale: output gradients * factor           (exact when factor is 1)
    JAX (kmix.optimizer.jax_step, values in, values out):
        state.step_values(...)            # advanced(old, check, step): the same, as values
        state.rescaled(values, factor)

Healthy steps pay no branch of their own on TensorFlow (their saturation joins the step
record's quiet check) and no host read of their own on torch (the check's ``any`` is read with
the step's counters and flags); JAX's step keeps its values-in, values-out branch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from kmix._checks import KmixWarning, WarnOnce
from kmix.backend import (
    host_value,
    initialized,
    rare_cond,
    read_in_step,
    replica_copies,
)
from kmix.float8.health import read_health
from kmix.float8.reads import Float8Health, decode_saturations
from kmix.float8.saturation import (
    FIELDS,
    Float8Record,
    StepCheck,
    StoredRecord,
    advance_float8,
    check_step,
    kept_where_zero,
    record_shapes,
    rescaled,
    stored,
    stored_shapes,
    unstored,
)
from kmix.float8.tensors import Float8Tensor, float8_tensors
from kmix.record import Counters
from kmix.tags import Float8Saturation

ATTEMPTED = Counters._fields.index("attempted_steps")
"""The attempted steps' position in the step record's packed counters."""

__all__ = ["Float8Reads", "Float8State", "attempted_step"]

_SAID = WarnOnce()
_PASS_TRAINING = (
    "Keras updates them only when the float8 layer is called with training=True: pass "
    "`training` on to the layers your model's call calls"
)

MIN_CAPACITY = 128
"""Episodes the ring keeps at least (at least one per float8 tensor)."""


class Float8State:
    """Float8 saturation counters and episodes kept in optimizer variables.

    Args:
        follows_loss_scale: multiply the output gradients' float8 scale and amax history
            by the loss scale's change at the step it changes.

    Attributes:
        tensors: the float8 tensors found at build (empty: nothing is kept or done).
        record: the variables (:class:`StoredRecord`), None without float8 tensors.
    """

    def __init__(self, follows_loss_scale: bool = True) -> None:
        self.follows_loss_scale = bool(follows_loss_scale)
        self.tensors: list[Float8Tensor] = []
        self.record: StoredRecord | None = None
        self._tracked: list[Any] = []
        self._holds_values = False
        self._held: Float8Record | None = None

    @property
    def active(self) -> bool:
        """Whether the optimizer trains float8 layers (the record exists)."""
        return self.record is not None

    def readable(self) -> bool:
        """Whether the record holds values to read on the host: it exists and (on
        TensorFlow) a first step whose trace failed after creating it (a ``fit`` ended by
        an exception there) did not leave it empty. True stays true."""
        if self.record is not None and not self._holds_values:
            self._holds_values = initialized(self.record.ints)
        return self._holds_values

    def build(
        self, add_variable: Callable[..., Any], var_list: Sequence[Any], int_dtype: str
    ) -> None:
        """Creates the record's variables (:data:`FIELDS`) when ``var_list`` holds float8 state."""
        self._tracked = list(var_list)
        self.tensors = float8_tensors(var_list)
        if not self.tensors:
            return
        n = len(self.tensors)
        shapes = stored_shapes(n, max(MIN_CAPACITY, n))
        self.record = StoredRecord(
            *(
                add_variable(
                    shape=shape,
                    dtype=dtype,
                    initializer=keras.initializers.Constant(0),
                    aggregation="only_first_replica",
                    name=name,
                )
                for name, shape, dtype in zip(FIELDS, shapes, (int_dtype, "float32"), strict=True)
            )
        )

    def completed(self, store: Any, variables: Sequence[Any]) -> Any:
        """``store`` as this record keeps it, where a ``.keras`` file saved it otherwise:

        - saved before the record existed (the store lacks it): the record left at zero,
          so the rest loads;
        - saved with the record as four variables (:class:`Float8Record`'s fields, of
          :func:`record_shapes`, where the two are now): joined into the two of
          :class:`StoredRecord`, counts and episodes kept.

        ``store`` itself otherwise (Keras then says what it skips).

        Args:
            store: what Keras hands ``load_own_variables`` (keys ``"0"``, ``"1"``...).
            variables: the optimizer's variables, in the saved order.
        """
        if self.record is None:
            return store
        saved = [store[str(i)] for i in range(len(store.keys()))]
        first = next(i for i, v in enumerate(variables) if v is self.record.ints)
        split = record_shapes(len(self.tensors), self.capacity)
        if len(saved) == len(variables) - len(FIELDS):
            mine = [np.zeros(v.shape, v.dtype) for v in self.record]
        elif len(saved) == len(variables) - len(FIELDS) + len(split) and all(
            np.shape(value) == shape
            for value, shape in zip(saved[first : first + len(split)], split, strict=False)
        ):
            old = Float8Record(*(np.asarray(v) for v in saved[first : first + len(split)]))
            mine = [
                np.asarray(value, variable.dtype)
                for variable, value in zip(self.record, stored(old, np), strict=True)
            ]
            del saved[first : first + len(split)]
        else:
            return store
        saved[first:first] = mine
        return {str(i): value for i, value in enumerate(saved)}

    # ------------------------------------------------------------- in the step
    def check(self, grads: Sequence[Any], values: Sequence[Any], applies: Any) -> StepCheck:
        """The step's fused check (:func:`kmix.float8.saturation.check_step`); values before it.

        A tensor whose new amax history is None (Keras computed none: a float8 layer called
        without ``training=True`` leaves its inputs' and kernel's scales as they are) is
        not checked; said once, by name. (On JAX it is 0, which checks nothing either;
        :meth:`health` says so at the reads.)
        """
        unchecked = [
            f"`{t.layer}` {t.tensor}" for t in self.tensors if grads[t.history_index] is None
        ]
        if unchecked:
            _SAID(
                f"kmix: Keras computed no new float8 scale for {', '.join(unchecked)} in "
                "this step, so those scales never follow their tensors and kmix cannot check "
                f"them for saturation ({_PASS_TRAINING}).",
                KmixWarning,
                key=tuple(unchecked),
            )
        return check_step(self.tensors, grads, values, applies)

    def _write_record(self, check: StepCheck, step: Any) -> None:
        """Assigns the record after the step (:func:`advance_float8`)."""
        old = unstored(StoredRecord(*(ops.copy(v) for v in self.record)), len(self.tensors))
        new = stored(advance_float8(old, check, step))
        for variable, value in zip(self.record, new, strict=True):
            variable.assign(ops.cast(value, variable.dtype))

    def _write_rescale(self, factor: Any) -> None:
        """Multiplies the output gradients' float8 state by ``factor`` (when followed):
        each replica's copy by itself (:func:`kmix.backend.replica_copies`)."""
        if not self.follows_loss_scale:
            return
        followed = [
            i
            for t in self.tensors
            if t.tensor == "outputs_grad"
            for i in (t.scale_index, t.history_index)
        ]
        for copies in replica_copies(self._tracked):
            values = {i: ops.convert_to_tensor(copies[i]) for i in followed}
            for index, value in rescaled(self.tensors, values, factor).items():
                copies[index].assign(value)

    def advanced(self, old: StoredRecord, check: StepCheck, step: Any) -> StoredRecord:
        """JAX: the record's variables' values after the step, unpacked and packed again
        only in the branch a saturation takes (as given when nothing saturated)."""

        def advance() -> StoredRecord:
            return stored(advance_float8(unstored(old, len(self.tensors)), check, step))

        return rare_cond(ops.any(check.saturated), advance, lambda: old)

    def kept(self, grads: Sequence[Any], values: Sequence[Any]) -> list[Any]:
        """JAX: ``grads`` keeping a scale Keras did not update (:func:`kept_where_zero`)."""
        return kept_where_zero(self.tensors, grads, values)

    def rescaled(self, values: list, factor: Any) -> list:
        """JAX: ``values`` (the tracked variables' after the step) with the rescale applied."""
        if not self.follows_loss_scale:
            return values
        changed = rescaled(self.tensors, values, factor)
        return [changed.get(i, value) for i, value in enumerate(values)]

    # -------------------------------------------- what each backend's step calls
    def before_apply(self, aligned: Sequence[Any], applies: Any) -> StepCheck:
        """TensorFlow and torch, before the inner optimizer assigns: the check over the scales
        used (on TensorFlow the forward pass's own reads of them: :func:`read_in_step`)."""
        values = {t.scale_index: read_in_step(self._tracked[t.scale_index]) for t in self.tensors}
        return self.check(aligned, values, applies)

    def write_after(self, check: StepCheck, packed: Any, old_scale: Any, new_scale: Any) -> None:
        """TensorFlow and torch, in the step record's full branch (a saturated step is never
        quiet; a change of the loss scale never is): counts saturations and follows the
        scale's change. Both writes are identities where not due (the record is unchanged
        when nothing saturated, and a factor of 1 keeps every value), so a healthy step pays
        no branch of its own.

        Args:
            check: the step's :class:`StepCheck`.
            packed: the step record's counters before the step.
            old_scale: the loss scale before the step; new_scale: after it.
        """
        self._write_record(check, attempted_step(packed))
        self._write_rescale(ops.divide(new_scale, old_scale))

    def step_values(
        self,
        optimizer_values: Sequence[Any],
        slot_of: dict[int, int],
        grads: Sequence[Any],
        trainable: Sequence[Any],
        applies: Any,
        packed: Any,
    ) -> dict[int, Any]:
        """JAX: optimizer slot -> the float8 record's value after the step.

        Args:
            optimizer_values: the optimizer's values before the step.
            slot_of: ``id(variable)`` -> its position among the optimizer's variables.
            grads: the step's gradients; trainable: the tracked values before it.
            applies: boolean scalar; packed: the step record's counters before the step.
        """
        slots = [slot_of[id(v)] for v in self.record]
        old = StoredRecord(*(optimizer_values[i] for i in slots))
        new = self.advanced(old, self.check(grads, trainable, applies), attempted_step(packed))
        return dict(zip(slots, new, strict=True))

    # ------------------------------------------------------------- on the host
    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within it, every host read of the record gives what one read at its start
        gave: a monitor's questions at a read (counts, episodes, their number, the open
        ones) cost one read of each variable, and answer from one moment. Sync the step's
        state to the variables first (``recorder.sync()``). Nested, the outer read holds.

        Yields:
            Nothing: the reads inside are what changes.
        """
        outer = self._held
        self._held = self._read(floats=True)
        try:
            yield
        finally:
            self._held = outer

    def _read(self, floats: bool = False) -> Float8Record:
        """The record as it is now, on the host (NumPy): its integers, one read; the
        episodes' floats too where ``floats`` (a second read), else None. Inside
        :meth:`held`, what its read gave."""
        if self._held is not None:
            return self._held
        ints = host_value(self.record.ints)
        kept = StoredRecord(ints, host_value(self.record.floats) if floats else None)
        return unstored(kept, len(self.tensors))

    def saturated_steps(self) -> list[int]:
        """Steps at which each tensor was clipped, in :attr:`tensors` order."""
        if self.record is None:
            return []
        return [int(c) for c in self._read().tensors[:, 0]]

    @property
    def capacity(self) -> int:
        """Episodes the ring keeps (0 without float8 tensors)."""
        return 0 if self.record is None else int(self.record.floats.shape[0])

    def episode_count(self) -> int:
        """Episodes started so far (the ring keeps the last :attr:`capacity`)."""
        return 0 if self.record is None else int(self._read().episode_count)

    def open_episodes(self, step: int) -> list[int]:
        """The numbers of the episodes still open at ``step`` (their tensor saturated then)."""
        if self.record is None:
            return []
        rows = self._read().tensors
        return [int(e) for last, e in rows[:, 1:3] if int(last) >= step and int(e) > 0]

    def saturations(self, per_step: bool = True, since_step: int = 0) -> list[Float8Saturation]:
        """The saturations the ring holds (see :func:`kmix.float8.reads.decode_saturations`)."""
        if self.record is None:
            return []
        now = self._read(floats=True)
        return decode_saturations(
            self.tensors,
            int(now.episode_count),
            now.episode_ints,
            now.episode_floats,
            per_step=per_step,
            since_step=since_step,
        )

    def health(
        self,
        inputs_underflow: dict[str, float] | None = None,
        model: Any = None,
        applied_steps: int = 0,
    ) -> list[Float8Health]:
        """Each tensor's :class:`Float8Health` now, with the optimizer's counts, the
        inputs' underflow by layer (``StepRecorder.float8_inputs_underflow``) and, from
        ``model``, the layers' compute dtypes.

        After ``applied_steps`` >= 1, tensors whose newest amax is still 0 are named once
        in a :class:`KmixWarning`: Keras has not updated their scales (on JAX, where the
        step gives no None to tell, this is where it is said), or they were all zero.
        """
        found = read_health(self._tracked, self.saturated_steps() or None, inputs_underflow, model)
        unmoved = [f"`{h.layer}` {h.tensor}" for h in found if h.amax == 0.0]
        if applied_steps and unmoved:
            _SAID(
                f"kmix: after {applied_steps} applied steps the newest amax of "
                f"{', '.join(unmoved)} is still 0: Keras has not updated those float8 "
                f"scales ({_PASS_TRAINING}), or those tensors were all zero. Such a scale "
                "stays as it is, and kmix cannot check it for saturation.",
                KmixWarning,
                key=tuple(unmoved),
            )
        return found


def attempted_step(packed: Any) -> Any:
    """The step being attempted (from 1), from the step record's packed counters before it."""
    return packed[ATTEMPTED] + 1


class Float8Reads:
    """The optimizer's public float8 reads (mixed into :class:`kmix.LossScaleOptimizer`)."""

    float8: Float8State
    recorder: Any
    hooks: Any

    def float8_saturations(self, since_step: int = 0) -> list[Float8Saturation]:
        """Every saturated float8 tensor-step the ring still holds, in step order.

        Each is a :class:`kmix.Float8Saturation` ``(step, layer, tensor, amax, limit)``:
        at ``step``, Keras clipped ``tensor`` of ``layer`` (its amax exceeded ``limit``,
        its scale times the format's max). The ring keeps one row per episode (a run of
        consecutive saturated steps of one tensor), with amax and limit at its first and
        last step (NaN between); :meth:`float8_episodes` returns the episodes.

        Args:
            since_step: only steps after this one.
        """
        if not self.float8.readable():
            return []
        self.recorder.sync()
        return self.float8.saturations(per_step=True, since_step=since_step)

    def float8_episodes(self, since_step: int = 0) -> list[Float8Saturation]:
        """One :class:`kmix.Float8Saturation` per episode: its first step, ``steps`` its length."""
        if not self.float8.readable():
            return []
        self.recorder.sync()
        return self.float8.saturations(per_step=False, since_step=since_step)

    def float8_health(self) -> list[Float8Health]:
        """Each float8 tensor now (:class:`kmix.float8.Float8Health`), with its saturated steps."""
        if not self.float8.readable():
            return []
        self.recorder.sync()
        state = self.recorder.read_state(counters_only=True)
        return self.float8.health(
            self.recorder.float8_inputs_underflow(),
            self.hooks.model,
            state.attempted_steps - state.skipped_steps,
        )
