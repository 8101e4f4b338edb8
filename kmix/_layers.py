"""One walk over a model's nested layers, shared by the audit, the optimizer and the monitor.

It reads Keras's ``_flatten_layers`` (private, but stable across Keras 3 releases);
this module is the only place that does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def children(layer: Any) -> list[Any]:
    """The layers directly nested in ``layer`` (not itself, not deeper)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def walk_layers(
    layer: Any, parent_path: str = "", seen: set[int] | None = None
) -> Iterator[tuple[str, Any]]:
    """Yields ``(path, layer)`` for every layer nested in ``layer``, depth first, once each.

    Args:
        layer: a model or layer.
        parent_path: the path to prefix when a layer has no ``path`` of its own.
        seen: ids of layers already yielded (shared layers are yielded once).

    Returns:
        An iterator of ``(path, layer)``; ``layer`` itself is not included.
    """
    seen = set() if seen is None else seen
    for child in children(layer):
        if id(child) in seen:
            continue
        seen.add(id(child))
        path = getattr(child, "path", None) or "/".join(filter(None, (parent_path, child.name)))
        yield path, child
        yield from walk_layers(child, path, seen)


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


def call_count(layer: Any) -> int:
    """How many times ``layer`` is called in its Keras graph (2+: a shared layer); 0 unknown."""
    return len(getattr(layer, "_inbound_nodes", []))
