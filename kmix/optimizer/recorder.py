"""The step record's one owner: its optimizer variables, their in-graph writes, their reads.

:mod:`kmix.record.step_record` says *what* a step does to the record (pure functions over values);
this module keeps the values: it creates one optimizer variable per field (names and
order are a file format: ``.keras`` files saved by kmix 0.1.0 load unchanged), writes
them inside the compiled step (:meth:`StepRecorder.record`) and reads them on the host
(:meth:`StepRecorder.read_state` and the per-variable, per-layer and event reads).
The optimizer decides *whether* to apply; the recorder remembers.

In the step::

    before = recorder.before_step()                 # packed counters, what is due
    ... apply the inner optimizer when every flag is 0 ...
    recorder.record(aligned, flags, before, forward, on_skip)
        quiet step: counters += QUIET_DELTA          (one constant, nothing else moves)
        otherwise (a called branch): every field's new value from the pure step that
        every backend runs (:func:`kmix.record.step.advance_record`: the rule,
        statistics when due, the forward pass's statistics and origin, the event into
        the ring), assigned; ``on_skip()`` on a skipped step
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from kmix import record
from kmix.backend import constant_initializer, host_value, initialized, int64_dtype, rare_cond
from kmix.optimizer.config import OptimizerConfig, RunSettings, invalid_argument
from kmix.record import (
    ACTIVATION_CAPACITY,
    ACTIVATION_FIELDS,
    HEALTH_FIELDS,
    STORED_FIELDS,
    RecordedEvent,
    Snapshot,
    snapshot,
)
from kmix.tags import ScaleEvent

__all__ = ["Before", "HostRead", "RecordReads", "StepRecorder", "is_gradient"]


class Before(NamedTuple):
    """The packed counters before a step and ``[health_due, histogram_due]`` at it."""

    packed: Any
    due: Any


class HostRead(NamedTuple):
    """A step's counters and flags read on the host at once (:meth:`StepRecorder.host_before_step`).

    Attributes:
        before: the counters before the step (a tensor) and what is due (NumPy).
        counters: the counters before the step, NumPy.
        flagged: the step's flags as 0/1 in the counters' dtype, NumPy.
    """

    before: Before
    counters: np.ndarray
    flagged: np.ndarray


def _noop() -> None:
    return None


def is_gradient(variable: Any) -> bool:
    """Whether a tracked variable's gradient is one: Keras hands a float8 layer's scales and
    amax histories (``overwrite_with_gradient``) their new value instead."""
    return not getattr(variable, "overwrite_with_gradient", False)


class StepRecorder:
    """Keeps the step record in optimizer variables: created, written in-graph, read.

    Args:
        config: the optimizer's validated arguments (the rule, capacities, statistics).
        initial_scale: the scale before the first step (what reads return until built).

    Attributes:
        settings: the run-time settings read in-graph (health and histogram steps, the
            float16 mask); callbacks request them through the optimizer.
        layers: ``(path, class)`` of the forward-pass records the last traced step kept
            (on torch, the last step that measured: a quiet step drops its records).
        sync: called before every host read (on JAX: the trained model's
            ``jax_state_sync``, since ``fit`` keeps the state outside the variables).
    """

    def __init__(self, config: OptimizerConfig, initial_scale: float) -> None:
        self.config = config
        self.initial_scale = initial_scale
        self.settings = RunSettings(
            health_every=config.health_every,
            histogram_every=config.histogram_every,
            float16_mask=None,
        )
        self.layers: list[tuple[str, str]] = []
        self.not_float16: frozenset[str] = frozenset()  # outputs without float16's range
        self.float8_inputs: dict[str, str] = {}  # record path -> float8 layer (ModelHooks)
        self.sync: Callable[[], None] = _noop
        self.built = False
        self._holds_values = False
        self._variables: list[Any] = []

    # ------------------------------------------------------------------ state
    def build(self, add_variable: Callable[..., Any], var_list: list[Any], mask: Any) -> None:
        """Creates one variable per field, in the saved order, through ``add_variable``.

        Args:
            add_variable: the optimizer's ``add_variable`` (so Keras tracks and saves them).
            var_list: the trainable variables, in the order of per-variable state.
            mask: 1.0 per variable whose layer computes in float16.
        """

        def state(name: str, dtype: str, value: Any = 0, shape: tuple = ()) -> Any:
            return add_variable(
                shape=shape,
                dtype=dtype,
                initializer=constant_initializer(value),
                aggregation="only_first_replica",
                name=name,
            )

        n, capacity = len(var_list), self.config.event_capacity
        counters = record.initial_counters(self.config.rule.hysteresis)
        self.scale = state("dynamic_scale", "float32", self.initial_scale)
        self.counters = add_variable(
            shape=(len(counters),),
            dtype=int64_dtype(),
            initializer=lambda shape, dtype: ops.convert_to_tensor(list(counters), dtype),
            aggregation="only_first_replica",
            name="counters",
        )
        self.health = state("health", "float32", np.nan, (len(HEALTH_FIELDS),))
        self.underflow_per_variable = state("underflow_per_variable", "float32", 0, (n,))
        self.subnormal_per_variable = state("subnormal_per_variable", "float32", 0, (n,))
        self.exponent_histograms = state(
            "exponent_histograms", "int32", 0, (n, record.NUM_EXPONENT_BINS)
        )
        self.event_ints = state(
            "event_ints", int64_dtype(), 0, (capacity, len(record.EVENT_INT_FIELDS))
        )
        self.event_floats = state(
            "event_floats", "float32", 0, (capacity, len(record.EVENT_FLOAT_FIELDS))
        )
        self.activation_stats = state(
            "activation_stats", "float32", np.nan, (ACTIVATION_CAPACITY, len(STORED_FIELDS))
        )
        self.settings.base["float16_mask"] = mask
        self.settings.create()
        self._variables = list(var_list)
        self.built = True

    def readable(self) -> bool:
        """Whether the record holds values to read: built, and (on TensorFlow) not left
        empty by a first step whose trace failed after creating it (a ``fit`` ended by an
        exception there, e.g. a metric that raises); the reads then answer as before
        :meth:`build`. Asked once per read; true stays true."""
        if self.built and not self._holds_values:
            self._holds_values = initialized(self.scale)
        return self.built and self._holds_values

    def widened(self, store: Any, variables: list) -> Any:
        """``store`` (a saved optimizer's values by position) with tables saved before
        their newest columns padded: the event ring (:data:`kmix.record.EVENT_INT_FIELDS`
        grows at the end) with -1, "unknown"; the per-layer rows
        (:data:`kmix.record.STORED_FIELDS`) with NaN, "not measured". ``store`` itself
        when nothing needs widening.

        Args:
            store: what Keras hands ``load_own_variables`` (keys ``"0"``, ``"1"``...).
            variables: the optimizer's variables, in the saved order.
        """
        tables = (
            ("event_ints", len(record.EVENT_INT_FIELDS), -1),
            ("activation_stats", len(STORED_FIELDS), np.nan),
        )
        widened = {}
        for name, width, fill in tables:
            where = [i for i, v in enumerate(variables) if v is getattr(self, name, None)]
            key = str(where[0]) if where else None
            if key is None or key not in store.keys():
                continue
            saved = np.asarray(store[key])
            if saved.ndim == 2 and saved.shape[1] < width:
                pad = np.full((saved.shape[0], width - saved.shape[1]), fill, saved.dtype)
                widened[key] = np.concatenate([saved, pad], 1)
        if not widened:
            return store
        return {k: store[k] for k in store.keys()} | widened

    # ------------------------------------------------------------- in graph
    def before_step(self) -> Before:
        """The counters before this step and what is due at it, read once per step."""
        packed = ops.copy(self.counters)
        return Before(packed, self.statistics().due(packed))

    def host_before_step(self, flags: Any) -> HostRead:
        """:meth:`before_step` decided on the host, with the step's flags: one host read.

        Args:
            flags: the step's float flags (1.0 where non-finite).

        Returns:
            The :class:`HostRead`.
        """
        packed = ops.copy(self.counters)
        dtype = keras.backend.standardize_dtype(packed.dtype)
        read = ops.convert_to_numpy(ops.concatenate([packed, ops.cast(flags, dtype)]))
        counters, flagged = read[: packed.shape[0]], read[packed.shape[0] :]
        every = np.stack([self.settings.synced(n) for n in ("health_every", "histogram_every")])
        due = record.due_now(counters, every, record.HOST_OPS)
        return HostRead(Before(packed, due), counters, flagged)

    def record(
        self,
        aligned: list,
        flags: Any,
        before: Before,
        forward: tuple[Any, Any] | None,
        on_skip: Callable[[], None] | None,
        quiet: Any = None,
        source: record.NonfiniteSource = record.NO_SOURCE,
        also: Callable[[Any, Any], None] | None = None,
    ) -> None:
        """Records one attempted step; everything but a quiet step's count in one branch.

        The common step (quiet: see :func:`record.is_quiet`) adds one constant to the
        counters; everything else (the rule, statistics, events, ``on_skip``) is a
        called branch, which costs a quiet step only the passing of its arguments.

        Args:
            aligned: the scaled gradients, one per tracked variable (None allowed).
            flags: float vector: per gradient non-finite, then loss non-finite, then
                loss unknown (already agreed across replicas).
            before: :meth:`before_step`'s values.
            forward: ``(origin, stats)`` of :func:`kmix.record.measure_forward`,
                or None without a tapped forward pass.
            on_skip: called in-graph on a skipped step (undoes what the forward pass
                assigned), or None.
            quiet: whether the step is quiet, where the step has read it already (a
                Python bool on torch); None computes it in the step.
            source: which replica held the first non-finite values, where known.
            also: called at the end of the full branch with the loss scale before and after
                the step (the float8 record's writes, which make a saturated step not
                quiet), or None.
        """

        fields = [getattr(self, field) for field in record.RECORD_FIELDS]

        def advance() -> tuple[record.RecordValues, Any]:  # the pure step, in the branch
            old = record.RecordValues(  # the counters as read before the step
                *(before.packed if v is self.counters else ops.copy(v) for v in fields)
            )
            rule = self.config.rule
            return record.advance_record(
                old, aligned, flags, self.statistics(), forward, rule, source
            )

        def count(delta: np.ndarray) -> None:  # the common step: nothing else moves
            self.counters.assign_add(ops.convert_to_tensor(delta))  # torch.compile: a tensor

        def write(new: record.RecordValues, outcome: Any) -> None:
            old_scale = None if also is None else ops.copy(self.scale)  # before it is assigned
            for variable, value in zip(fields, new, strict=True):
                variable.assign(ops.cast(value, variable.dtype))
            if on_skip is not None:  # the batch never happened
                ops.cond(outcome.skipped, on_skip, _noop)
            if also is not None:
                also(old_scale, new.scale)

        record.record_step(
            before.packed,
            before.due,
            flags,
            self.config.rule,
            count=count,
            advance=advance,
            write=write,
            cond=rare_cond,
            quiet=quiet,
        )

    def statistics(self) -> record.Statistics:
        """The statistics settings in force, read once in the step being built.

        On JAX they are constants of the compiled step (``fit`` passes no settings into
        its ``jit``), so a change retraces it.
        """
        settings = self.settings.variables
        return record.Statistics(
            *(settings[name].value for name in ("health_every", "histogram_every", "float16_mask")),
            not_gradients=tuple(i for i, v in enumerate(self._variables) if not is_gradient(v)),
        )

    # ------------------------------------------------------------- on the host
    def read_state(self, counters_only: bool = False) -> Snapshot:
        """Reads the whole record: three variable reads (one with ``counters_only``).

        Args:
            counters_only: read the counters alone; ``loss_scale`` is then None and
                ``health`` empty.

        Returns:
            A :class:`kmix.record.host_read.Snapshot`; until :meth:`readable`, the initial scale
            and zeros.
        """
        if not self.readable():
            counters = record.initial_counters(self.config.rule.hysteresis)
            return snapshot(self.initial_scale, list(counters), None)
        self.sync()
        counters = host_value(self.counters).tolist()
        if counters_only:
            return snapshot(None, counters, None)
        return snapshot(float(host_value(self.scale)), counters, host_value(self.health))

    def variable_paths(self) -> list[str]:
        """Paths of the tracked trainable variables, in the order of per-variable state."""
        return [v.path for v in self._variables]

    def by_variable(self, name: str) -> dict[str, Any]:
        """Variable path -> value of one per-variable field (empty before :meth:`build`).

        Args:
            name: ``"underflow_per_variable"``, ``"subnormal_per_variable"`` or
                ``"exponent_histograms"``.

        Returns:
            Floats for the fractions, int arrays (layout in :mod:`kmix.tags`) for histograms.
        """
        if not self.readable():
            return {}
        self.sync()
        values = host_value(getattr(self, name))
        if values.ndim == 1:
            values = [float(v) for v in values]
        return {  # a float8 scale or amax history has no gradient to describe
            v.path: value
            for v, value in zip(self._variables, values, strict=True)
            if is_gradient(v)
        }

    def activations_by_layer(self) -> dict[str, dict[str, float]]:
        """Layer path -> :data:`ACTIVATION_FIELDS` -> value at the latest health step.

        Only layers the last traced step recorded, and only rows that were measured. An
        output that is not float16 (:attr:`not_float16`) has no ``headroom_bits``:
        float16's range does not apply to it.
        """
        if not self.readable() or not self.layers:
            return {}
        self.sync()
        values = host_value(self.activation_stats)[: len(self.layers), : len(ACTIVATION_FIELDS)]
        found = {}
        for (path, _), row in zip(self.layers, values, strict=True):
            if np.isfinite(row).all():
                measured = dict(zip(ACTIVATION_FIELDS, map(float, row), strict=True))
                if path in self.not_float16:
                    del measured["headroom_bits"]
                found[path] = measured
        return found

    def float8_inputs_underflow(self) -> dict[str, float]:
        """Float8 layer path -> its inputs' underflow at the latest health step
        (:data:`kmix.record.FLOAT8_INPUTS_FIELD`); only layers the forward tap measured."""
        if not self.readable() or not self.float8_inputs:
            return {}
        self.sync()
        column = host_value(self.activation_stats)[: len(self.layers), len(ACTIVATION_FIELDS)]
        return {
            self.float8_inputs[path]: float(value)
            for (path, _), value in zip(self.layers, column, strict=True)
            if path in self.float8_inputs and np.isfinite(value)
        }

    def recorded_events(self, since: int = 0) -> list[RecordedEvent]:
        """Events with ``index > since`` the ring still holds, each with its step's health.

        Args:
            since: the index of the last event already seen (0 for all).

        Returns:
            Events in order; when more than ``event_capacity`` happened after ``since``,
            the oldest are gone (compare ``event_count - since`` with the number returned).

        Raises:
            ValueError: ``since`` is not an integer >= 0.
        """
        if isinstance(since, bool) or not isinstance(since, int | np.integer) or since < 0:
            raise invalid_argument(
                "since", since, "an integer >= 0 (the index of the last event seen)"
            )
        if not self.readable():
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
            self.layers,
        )


def _state_field(name: str, doc: str) -> property:
    """A read-only property reading one field of :meth:`LossScaleOptimizer.read_state`."""
    return property(lambda self: getattr(self.read_state(), name), doc=doc)


class RecordReads:
    """The optimizer's public reads of its step record: each is a host read of the recorder.

    Mixed into :class:`kmix.LossScaleOptimizer` (which sets ``self.recorder``), so
    ``optimizer.loss_scale`` and ``optimizer.scale_events()`` read like attributes of the
    optimizer while the reading lives with the record's other owner code.
    """

    recorder: StepRecorder

    @property
    def event_capacity(self) -> int:
        """How many recent events the in-graph ring keeps."""
        return self.recorder.config.event_capacity

    loss_scale = _state_field("loss_scale", "The current loss scale.")
    skipped_steps = _state_field("skipped_steps", "Cumulative skipped (non-finite) steps.")
    attempted_steps = _state_field(
        "attempted_steps", "Optimizer steps attempted so far, skipped ones included."
    )
    good_steps = _state_field(
        "good_steps", "Consecutive finite steps since the scale last changed or a step was skipped."
    )
    last_overflow_step = _state_field(
        "last_overflow_step", "Attempted step of the most recent skipped step; 0 if none yet."
    )
    event_count = _state_field(
        "event_count", "Scale events recorded since training began (the ring keeps the last ones)."
    )

    @property
    def float16_mask(self) -> np.ndarray:
        """1.0 per variable counted as float16 by the health statistics."""
        mask = self.recorder.settings.base["float16_mask"]
        return np.asarray([] if mask is None else mask, "float32")

    def read_state(self, counters_only: bool = False) -> Snapshot:
        """Reads the whole record (see :meth:`StepRecorder.read_state`)."""
        return self.recorder.read_state(counters_only)

    def variable_paths(self) -> list[str]:
        """Paths of the tracked trainable variables, in the order of per-variable state."""
        return self.recorder.variable_paths()

    def underflow_by_variable(self) -> dict[str, float]:
        """Per-variable underflow fraction (zeros included) at the latest health step."""
        return self.recorder.by_variable("underflow_per_variable")

    def subnormal_by_variable(self) -> dict[str, float]:
        """Per-variable share of non-zero values below float16's smallest normal."""
        return self.recorder.by_variable("subnormal_per_variable")

    def exponent_histograms_by_variable(self) -> dict[str, np.ndarray]:
        """Per-variable exponent histograms at ``histogram_step`` (layout in kmix.tags)."""
        return self.recorder.by_variable("exponent_histograms")

    def activations_by_layer(self) -> dict[str, dict[str, float]]:
        """Per-layer activation statistics at the latest health step, by layer path.

        Empty before the first measurement or without a tap (see :meth:`watch`).
        """
        return self.recorder.activations_by_layer()

    def recorded_events(self, since: int = 0) -> list[RecordedEvent]:
        """Like :meth:`scale_events`, each event with the health measured at its step."""
        return self.recorder.recorded_events(since)

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
