"""A tap on the forward pass: every float16 layer's inputs and outputs, recorded at trace time.

:class:`ActivationTap` wraps the ``call`` of every layer computing in float16 so that,
while the train step is traced, each call appends a :class:`TappedCall` ``(path, inputs,
outputs, class_name)`` to a per-thread list. The optimizer (through
:class:`kmix.optimizer.model_hooks.ModelHooks`) reads that list with :meth:`ActivationTap.take`
inside ``apply()``, in the same trace: the recorded tensors belong to the same graph (they
are alive for the backward pass anyway), so reducing them (:mod:`kmix.record.activations`) adds
ops to the step and nothing else.

Wiring: ``tap = ActivationTap(model).install()`` at train begin, and retrace
(``model.make_train_function(force=True)``) if a train function was already traced
without it; ``tap.remove()`` restores every layer. In ``apply()`` (replica context,
before ``merge_call``, whose function runs in another thread): ``records = tap.take()``.
The number of records and their paths are Python values at trace time.
Cost: recording adds Python at trace time only. Reducing the records in ``apply`` keeps
the recorded activations alive until then (past the backward pass), also when the
reduction sits in a ``cond`` not taken: peak memory can grow by the activations. On
JAX under ``jit`` only the executions that hold a step where statistics are due measure
their own pass (and keep it); the others run the pass again when the loss is non-finite
(:mod:`kmix.optimizer.jax_train_function`).

Which layers are tapped: every layer nested in the model (found by
``kmix._layers.walk_layers``, the model itself excluded) whose ``compute_dtype`` is
``"float16"``, except ``InputLayer`` and pure containers, i.e. Functional and Sequential
models whose ``call`` is Keras's own graph runner (their outputs are their layers'
outputs, already recorded). Layers with nested layers that compute themselves (a
residual block, ``MultiHeadAttention``'s softmax, a subclassed model nested in another)
are tapped too. A record is appended when a call *returns*, so a block's record follows
its inner layers' records: :func:`kmix.record.activations.forward_origin` names the innermost
layer first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import keras
from keras import ops

from kmix import _layers, backend
from kmix.backend import reachable
from kmix.optimizer.trace import PerThread
from kmix.record import LayerCall, TappedCall

__all__ = ["ActivationTap", "tapped_layers", "tensors_in"]


def _is_container(layer: Any) -> bool:
    """True for Functional/Sequential models whose ``call`` is Keras's graph runner."""
    from keras.src.models.functional import Functional

    call = getattr(type(layer), "call", None)
    return call is Functional.call or call is keras.Sequential.call


def tapped_layers(model: Any) -> list[tuple[str, Any]]:
    """The layers an :class:`ActivationTap` instruments, with their paths.

    Args:
        model: a model (built or not; a lazily built Sequential's layers already exist).

    Returns:
        ``(path, layer)`` pairs, depth first: layers nested in ``model`` whose
        ``compute_dtype`` is ``"float16"``, except ``InputLayer`` and pure containers
        (Functional and Sequential models that do not override ``call``).
    """
    return [
        (path, layer)
        for path, layer in _layers.walk_layers(model)
        if getattr(layer, "compute_dtype", None) == "float16"
        and not isinstance(layer, keras.layers.InputLayer)
        and not _is_container(layer)
    ]


def _called(layer: Any) -> str:
    """The method ``Layer.__call__`` runs: ``quantized_call`` for a quantized layer."""
    return "quantized_call" if getattr(layer, "quantization_mode", None) else "call"


def _in_symbolic_scope() -> bool:
    """True while Keras infers shapes (``compute_output_spec``) in a scratch graph."""
    try:
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    except ImportError:  # pragma: no cover - Keras moved it; record anyway
        return False
    return bool(in_symbolic_scope())


def _call_name(path: str, calls: int) -> str:
    """A recorded call's name: the layer's path, ``#k`` for its k-th call (k >= 2)."""
    return path if calls == 1 else f"{path}#{calls}"


def tensors_in(value: Any) -> list[Any]:
    """The tensors in ``value`` (a tensor, or tuples, lists and dicts of them), in
    ``keras.tree.flatten``'s order.

    The common structures are walked here: on an eager backend (torch) the tap runs at
    every step, and ``keras.tree.flatten`` costs some 17 microseconds a call there.
    """
    if ops.is_tensor(value):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in tensors_in(value[key])]
    if value is None or isinstance(value, bool | int | float | str):
        return []
    return [t for t in keras.tree.flatten(value) if ops.is_tensor(t)]


def _record_reachable(record: TappedCall) -> bool:
    return all(reachable(t) for t in tensors_in((record.inputs, record.outputs)))


def _widened(given: Any, cast: Any) -> bool:
    """True when ``cast`` is ``given`` cast from float32/float64 down to float16."""
    try:
        return keras.backend.standardize_dtype(
            cast.dtype
        ) == "float16" and keras.backend.standardize_dtype(given.dtype) in {"float32", "float64"}
    except (AttributeError, TypeError, ValueError):
        return False


_CAST_NOTING_TAPS: weakref.WeakSet = weakref.WeakSet()
"""Installed taps on JAX: each notes the casts it may meet as inputs (:func:`_note_cast`)."""


def _note_cast(given: Any, cast: Any) -> None:
    """Where casts are noted (JAX), maps a value cast down to float16 while traced to the
    value given, for every installed tap (JAX has no graph to read a cast's input back
    from, see :func:`kmix.backend.as_arrived`): a tapped layer's record then holds its
    inputs as they arrived."""
    if (
        cast is not given
        and _CAST_NOTING_TAPS
        and backend.is_traced(cast)
        and _widened(given, cast)
    ):
        for tap in list(_CAST_NOTING_TAPS):
            tap._state().arrived[id(cast)] = (cast, given)  # cast kept: its id stays unique


def _watch_entry_casts() -> None:
    """Notes the casts a Functional model makes on entry, to its inputs' dtypes (once).

    A Sequential built without ``Input`` (lazily) takes float16 inputs: the data is cast
    before its first layer is called, not by that layer's policy. The class's conversion
    is wrapped once per process; it notes nothing while no JAX tap is installed.
    """
    from keras.src.models.functional import Functional

    original = Functional._convert_inputs_to_tensors
    if getattr(original, "kmix_notes_casts", False):
        return

    def convert(model: Any, flat_inputs: list) -> list:
        converted = original(model, flat_inputs)
        for given, cast in zip(flat_inputs, converted, strict=True):
            _note_cast(given, cast)
        return converted

    convert.kmix_notes_casts = True
    Functional._convert_inputs_to_tensors = convert


@dataclasses.dataclass
class TraceCalls:
    """One thread's tapped calls of the trace being recorded.

    Attributes:
        records: ``(layer, k, call)`` for the k-th call of each layer, in the order the
            calls returned (:meth:`ActivationTap.take` names them).
        counts: calls so far per layer object (``id``): its second call is ``path#2``.
        root: the trace they belong to (:func:`kmix.backend.trace_root`).
        arrived: on JAX, each value cast down to float16, by id: ``(cast, given)``.
    """

    records: list = dataclasses.field(default_factory=list)
    counts: dict = dataclasses.field(default_factory=dict)
    root: Any = None
    arrived: dict = dataclasses.field(default_factory=dict)


class ActivationTap:
    """Records every float16 layer's inputs and outputs while a train step is traced.

    Recording: when ``auto_record`` (the default), every call traced into a graph
    (``tf.function``, the compiled train step, with or without ``jit_compile``) is
    recorded; eager calls are recorded only inside ``with tap.recording():``. Shape
    inference (Keras's symbolic calls) is never recorded. Each thread has its own list
    (each ``MirroredStrategy`` replica records its own calls); a list holds the calls
    of one trace and is emptied by :meth:`take` or when another trace starts recording.

    Example::

        tap = ActivationTap(model).install()
        @tf.function
        def step(x):
            y = model(x)
            records = tap.take()
            return activation_stats([r.outputs for r in records])

    Args:
        model: a Functional, Sequential (built or not) or subclassed model.
        auto_record: record calls traced into graphs without :meth:`recording`.
    """

    def __init__(self, model: Any, *, auto_record: bool = True) -> None:
        self.model = model
        self.auto_record = auto_record
        self.last_taken: tuple[LayerCall, ...] = ()
        """Paths and classes of the records the last :meth:`take` returned (any thread)."""
        self._forced = 0
        self._lock = threading.Lock()
        self._calls = PerThread(TraceCalls)
        self._installed: dict[int, tuple[Any, bool, Any, str, Any]] = {}
        self._casts: dict[int, tuple[Any, Any]] = {}  # JAX: policies whose casts are noted
        self._final_names: dict[int, str] | None = None  # once every wrapped layer is built

    # -- installing
    @property
    def installed(self) -> bool:
        """Whether the tap currently wraps any layer."""
        return bool(self._installed)

    @property
    def paths(self) -> list[str]:
        """The paths of the wrapped layers, depth first, as records name their first call
        (:func:`kmix._layers.walk_layers`: unique in the model)."""
        names = self._names()
        return [names.get(id(e[0]), e[3]) for e in self._installed.values()]

    def _names(self) -> dict[int, str]:
        """Each nested layer's unique path, by ``id``, as the model is now.

        Kept once the model and every wrapped layer are built (Keras's paths are final
        then; an eager step asks at every step): :meth:`install` and :meth:`remove` forget
        them.
        """
        if self._final_names is not None:
            return self._final_names
        names = {id(layer): path for path, layer in _layers.walk_layers(self.model)}
        built = getattr(self.model, "built", False)
        if built and all(entry[0].built for entry in self._installed.values()):
            self._final_names = names
        return names

    def install(self) -> ActivationTap:
        """Wraps ``call`` of every layer of :func:`tapped_layers` (idempotent); a quantized
        layer's ``quantized_call``, which Keras calls instead (a float8 ``Dense``'s).

        The wrapper is set on the layer instance and keeps the original signature
        (``inspect.signature`` follows ``__wrapped__``), so Keras still sees the
        ``training`` and ``mask`` arguments. A model's train function traced before
        ``install()`` does not see the tap: retrace it (``model.make_train_function(
        force=True)``) to record.

        Returns:
            ``self``, so ``tap = ActivationTap(model).install()`` reads naturally.
        """
        self._final_names = None
        for path, layer in tapped_layers(self.model):
            entry = self._installed.get(id(layer))
            if entry is not None and entry[5] == _called(layer):
                continue
            if entry is not None:  # quantized since it was wrapped: Keras runs another method
                self._unwrap(entry)
            name = _called(layer)
            had_own = name in vars(layer)
            original = getattr(layer, name)
            wrapper = self._wrap(layer, path, original)
            object.__setattr__(layer, name, wrapper)
            self._installed[id(layer)] = (layer, had_own, original, path, wrapper, name)
            if backend.NOTES_CASTS:
                self._watch_casts(layer.dtype_policy)
        if backend.NOTES_CASTS and self._installed:
            _CAST_NOTING_TAPS.add(self)
            _watch_entry_casts()
        return self

    def _watch_casts(self, policy: Any) -> None:
        """On JAX, notes each float input a float16 layer's policy casts, as it arrived.

        JAX has no graph to read a cast's input back from (TensorFlow:
        :func:`kmix.backend.as_arrived`): the policy's ``convert_input`` (what
        ``Layer.__call__`` autocasts with, before ``call``) is wrapped on the policy
        instance so that, while traced, the cast value maps to the value given; the call
        wrapper records the latter.
        """
        if id(policy) in self._casts:
            return
        original = policy.convert_input

        def convert_input(x: Any, autocast: bool, dtype: Any) -> Any:
            y = original(x, autocast, dtype)
            _note_cast(x, y)
            return y

        object.__setattr__(policy, "convert_input", convert_input)
        self._casts[id(policy)] = (policy, convert_input)

    def remove(self) -> None:
        """Restores every wrapped layer's original ``call`` exactly (idempotent)."""
        self._final_names = None
        for entry in list(self._installed.values()):
            self._unwrap(entry)
        self._installed.clear()
        _CAST_NOTING_TAPS.discard(self)
        for policy, wrapper in self._casts.values():
            if vars(policy).get("convert_input") is wrapper:
                object.__delattr__(policy, "convert_input")
        self._casts.clear()

    def wrapped(self) -> frozenset[tuple[int, str]]:
        """``(id(layer), method)`` of every wrapped layer: what :meth:`install` changed."""
        return frozenset((key, entry[5]) for key, entry in self._installed.items())

    def _unwrap(self, entry: tuple) -> None:
        """Gives one wrapped layer its method back and forgets it."""
        layer, had_own, original, _path, wrapper, name = entry
        self._installed.pop(id(layer), None)
        if vars(layer).get(name) is not wrapper:
            return  # wrapped again by someone else: our wrapper stays, inert
        if had_own:
            object.__setattr__(layer, name, original)
        else:
            object.__delattr__(layer, name)

    def _wrap(self, layer: Any, path: str, original: Any) -> Any:
        tap = self

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            outputs = original(*args, **kwargs)
            if id(layer) in tap._installed and tap._should_record(outputs):
                tap._append(layer, path, args, kwargs, outputs)
            return outputs

        return call

    # -- recording
    @contextlib.contextmanager
    def recording(self) -> Iterator[ActivationTap]:
        """Records every call in the block, eager ones included (all threads)."""
        with self._lock:
            self._forced += 1
        try:
            yield self
        finally:
            with self._lock:
                self._forced -= 1

    def _should_record(self, outputs: Any) -> bool:
        if _in_symbolic_scope():
            return False
        if self._forced > 0:
            return True
        if not self.auto_record:
            return False
        return backend.is_traced(outputs)

    def _state(self) -> TraceCalls:
        return self._calls.get()

    def _append(self, layer: Any, path: str, args: tuple, kwargs: dict, outputs: Any) -> None:
        state = self._state()
        root = backend.trace_root(outputs)
        arrived_before = state.arrived
        if root is not state.root:  # another trace: its records are not this one's
            state = self._calls.reset()  # its casts were noted just now: kept
            state.root, state.arrived = root, arrived_before
        calls = state.counts.get(id(layer), 0) + 1  # the k-th call of this layer object
        state.counts[id(layer)] = calls
        arrived = state.arrived
        inputs = tuple(
            arrived[id(x)][1] if id(x) in arrived else backend.as_arrived(x)
            for x in tensors_in((args, kwargs))
        )
        call = TappedCall(path, inputs, outputs, type(layer).__name__, layer)  # named at take()
        state.records.append((layer, calls, call))

    def drop(self) -> None:
        """Forgets this thread's records of the current trace unread (a step that measures
        nothing: an eager quiet step)."""
        self._calls.reset()

    def take(self) -> list[TappedCall]:
        """Returns this thread's records of the current trace, and forgets them all.

        Call it where the statistics are built (the optimizer's ``apply``, in the
        replica context, before any ``merge_call``), in the same trace as the forward
        pass. Records whose tensors belong to another graph (another trace, a
        ``while_loop`` body such as an RNN cell's) are dropped, never returned.

        Returns:
            The :class:`TappedCall` list in the order the calls returned; ``[]`` when
            nothing usable was recorded.
        """
        state = self._state()
        names = self._names()  # after the pass: every layer built, Keras's paths final
        records = [
            call._replace(path=_call_name(names.get(id(layer), call.path), calls))
            for layer, calls, call in state.records
        ]
        self._calls.reset()
        usable = [r for r in records if _record_reachable(r)]
        if usable:
            self.last_taken = tuple(LayerCall(r.path, r.class_name) for r in usable)
        return usable
