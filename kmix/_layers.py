"""One walk over a model's nested layers, shared by the audit, the optimizer and the monitor.

It reads Keras's ``_flatten_layers`` (private, but stable across Keras 3 releases);
this module is the only place that does.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any


def children(layer: Any) -> list[Any]:
    """The layers directly nested in ``layer`` (not itself, not deeper)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def walk_layers(layer: Any) -> Iterator[tuple[str, Any]]:
    """Yields ``(path, layer)`` for every layer nested in ``layer``, depth first, once each.

    A path names one layer: Keras's ``layer.path`` (for a layer without one, built when
    made, its name under the prefix its siblings' Keras paths share, e.g.
    ``sequential/max_pooling2d`` beside ``sequential/conv2d``, else its parent's path)
    where no other nested layer has the same; else the path through the
    names of ``layer`` and the layers enclosing it (``net/tower_b/proj``: Keras gives two
    layers built with one name outside any model, e.g. two towers made by one helper
    function, one path), numbered ``~2``, ``~3`` in walk order if even that repeats (two
    layers of one name in one subclassed model). kmix names a layer this way everywhere:
    the audit, the tap and its records (forward origins, activation tags), precision
    moves and plans.

    Args:
        layer: a model or layer.

    Returns:
        An iterator of ``(path, layer)``; ``layer`` itself is not included.
    """
    nested = list(_nested(layer, "", getattr(layer, "name", ""), set()))
    taken = collections.Counter(path for path, _, _ in nested)
    used: set[str] = set()
    for path, qualified, child in nested:
        name = path if taken[path] == 1 else qualified
        base, number = name, 2
        while name in used:
            name, number = f"{base}~{number}", number + 1
        used.add(name)
        yield name, child


def _nested(
    layer: Any, parent: str, qualified: str, seen: set[int]
) -> Iterator[tuple[str, str, Any]]:
    """``(path, qualified path, layer)``, depth first: the path is Keras's ``layer.path``
    or ``parent/name``; the qualified one, every enclosing name from the walk's root. A
    layer reached twice (shared) is yielded the first time only."""
    kids = children(layer)
    scope = _keras_scope(kids, parent)
    for child in kids:
        if id(child) in seen:
            continue
        seen.add(id(child))
        path = getattr(child, "path", None) or "/".join(filter(None, (scope, child.name)))
        inner = "/".join(filter(None, (qualified, child.name)))
        yield path, inner, child
        yield from _nested(child, path, inner, seen)


def _keras_scope(kids: list[Any], parent: str) -> str:
    """Where Keras's paths put ``kids``: the prefix their Keras paths share before their
    names (``"seq"`` for ``seq/conv``; ``""`` in a Functional model, whose layers are
    built outside its scope), else ``parent``. A layer Keras builds when it is made
    (pooling, dropout, an input) gets no path, and is named as its siblings are."""
    scopes = {
        path[: -len(kid.name)].rstrip("/")
        for kid in kids
        if (path := getattr(kid, "path", None))
        and (path == kid.name or path.endswith("/" + kid.name))
    }
    return scopes.pop() if len(scopes) == 1 else parent


def own_variables(layer: Any) -> list[Any]:
    """The variables a layer holds itself, not through its nested layers."""
    nested = {id(variable) for child in children(layer) for variable in child.weights}
    return [variable for variable in layer.weights if id(variable) not in nested]


def variable_compute_dtypes(model: Any) -> dict[int, str]:
    """Maps ``id(variable)`` to the compute dtype of the innermost layer holding it.

    Args:
        model: a model (built or not: unbuilt layers simply hold no variables yet).

    Returns:
        A dict over every trainable variable of the model.
    """
    dtypes = {id(v): model.compute_dtype for v in getattr(model, "trainable_weights", [])}
    for _, layer in walk_layers(model):  # depth first: inner layers come later and win
        for variable in layer.trainable_weights:
            dtypes[id(variable)] = layer.compute_dtype
    return dtypes


def _declared_state(model: Any) -> list[Any]:
    """Every variable the model's layers declare non-trainable themselves, once, in walk order."""
    found: dict[int, Any] = {}
    for layer in [model, *(layer for _, layer in walk_layers(model))]:
        for variable in getattr(layer, "_non_trainable_variables", []):
            found.setdefault(id(variable), variable)
    return list(found.values())


def forward_state_variables(model: Any) -> list[Any]:
    """Float variables the model's layers declare non-trainable: state their call updates.

    BatchNormalization's moving mean and variance are the usual ones. A frozen
    layer's kernel (non-trainable because its layer is frozen) is not included:
    Keras keeps it among the layer's trainable variables, merely switched off.

    Args:
        model: a model (its layers may not be built yet: they then hold none).

    Returns:
        The variables, each once, in walk order.
    """
    return [v for v in _declared_state(model) if "float" in str(v.dtype)]


def unrestored_state_variables(model: Any) -> list[Any]:
    """Non-float variables the model's layers declare non-trainable (e.g. step counters).

    A skipped step restores only :func:`forward_state_variables`, not these. Random
    generator states (Dropout's) are not listed: they are not the layers' own variables.

    Args:
        model: a model (its layers may not be built yet: they then hold none).

    Returns:
        The variables, each once, in walk order.
    """
    return [v for v in _declared_state(model) if "float" not in str(v.dtype)]


def consumers(layer: Any) -> list[Any]:
    """The layers that take ``layer``'s output in a Keras graph (Functional, Sequential).

    Empty where Keras keeps no graph (a subclassed model's ``call``).
    """
    found: dict[int, Any] = {}
    for node in getattr(layer, "_outbound_nodes", []):
        operation = getattr(node, "operation", None)
        if operation is not None:
            found.setdefault(id(operation), operation)
    return list(found.values())


def producers(layer: Any) -> list[Any]:
    """The layers whose outputs reach ``layer``'s inputs in a Keras graph, through any ops
    that are not layers (``stem + res`` in a Functional model is an op, not a layer).

    Empty where Keras keeps no graph (a subclassed model's ``call``) and for model inputs.
    """
    return _layers_behind(
        [t for node in getattr(layer, "_inbound_nodes", []) for t in node.input_tensors]
    )


def producers_of_outputs(model: Any) -> list[Any]:
    """The layers whose outputs are ``model``'s outputs (through ops that are not layers);
    empty without a graph (a subclassed model)."""
    try:
        outputs = model.outputs or []
    except (AttributeError, ValueError):
        return []
    return _layers_behind(list(outputs))


def consumers_of_inputs(model: Any) -> list[Any]:
    """The layers that take ``model``'s inputs directly; empty without a graph."""
    try:
        inputs = model.inputs or []
    except (AttributeError, ValueError):
        return []
    found: dict[int, Any] = {}
    for tensor in inputs:
        operation = getattr(getattr(tensor, "_keras_history", None), "operation", None)
        for layer in consumers(operation) if operation is not None else []:
            found.setdefault(id(layer), layer)
    return list(found.values())


def _layers_behind(tensors: list[Any]) -> list[Any]:
    """The layers that made ``tensors``, looking through ops that are not layers."""
    import keras  # only where a model exists: Keras is loaded

    found: dict[int, Any] = {}
    todo, seen = list(tensors), set()
    while todo:
        history = getattr(todo.pop(), "_keras_history", None)
        operation = getattr(history, "operation", None)
        if operation is None or id(operation) in seen:
            continue
        seen.add(id(operation))
        if isinstance(operation, keras.layers.InputLayer):
            continue
        if isinstance(operation, keras.layers.Layer):
            found.setdefault(id(operation), operation)
            continue
        todo.extend(operation._inbound_nodes[history.node_index].input_tensors)
    return list(found.values())


def call_count(layer: Any) -> int:
    """How many times ``layer`` is called in its Keras graph (2+: a shared layer); 0 unknown."""
    return len(getattr(layer, "_inbound_nodes", []))
