"""Precision moves and plans: which layers left float16, and how the next run starts healed.

:class:`PrecisionMove` is one layer moved from float16 during ``fit`` (by
:class:`kmix.callbacks.PrecisionAutopilot`), at its step and for its reason;
:class:`PrecisionPlan` maps layer paths to Keras dtype-policy names and is written as
JSON (:meth:`PrecisionPlan.to_json`, :meth:`PrecisionPlan.from_json`);
:func:`apply_plan` sets those policies on a model before ``compile`` so the next run
starts where the last one ended. :func:`float16_share` says how much of the model's
work is still computed in float16 (pure, over :class:`LayerCost` values that
:func:`layer_costs` reads from a model).

A leaf for the training code: it imports Keras and :mod:`kmix._layers` only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from kmix import _layers

__all__ = [
    "Float16Share",
    "LayerCost",
    "PrecisionMove",
    "PrecisionPlan",
    "apply_plan",
    "base_path",
    "computes_float16",
    "float16_share",
    "layer_costs",
    "layers_by_path",
    "move_layer",
]

MULTIPLY_ADDS = "multiply-adds"
PARAMETERS = "parameters"
_MAC_CLASSES = frozenset(
    {
        "Dense",
        "Conv1D",
        "Conv2D",
        "Conv3D",
        "Conv1DTranspose",
        "Conv2DTranspose",
        "Conv3DTranspose",
        "DepthwiseConv1D",
        "DepthwiseConv2D",
    }
)
"""Layers whose multiply-adds per example are ``kernel size × output positions``."""


@dataclasses.dataclass(frozen=True)
class PrecisionMove:
    """One layer moved out of float16 during ``fit``.

    Attributes:
        step: the attempted optimizer step at which the move was decided (counted from
            1); it takes effect from the next step (the next execution with
            ``steps_per_execution > 1``).
        layer: the layer's path, e.g. ``"block_3/ffn_out"``.
        layer_class: its class name, e.g. ``"Dense"``.
        reason: why, in words: ``"forward overflow at step 412"`` or
            ``"headroom 0.62 bits, falling 0.31 bits per 100 steps"``.
        from_policy: the Keras dtype-policy name before, e.g. ``"mixed_float16"``.
        to_policy: the name after, ``"float32"`` or ``"mixed_bfloat16"``.
    """

    step: int
    layer: str
    layer_class: str
    reason: str
    from_policy: str
    to_policy: str

    def to_dict(self) -> dict[str, Any]:
        """The move as a JSON-ready dict (the fields above)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PrecisionMove:
        """The move from :meth:`to_dict`'s dict.

        Raises:
            ValueError: a field is missing or of the wrong type.
        """
        try:
            move = cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a precision move record: {dict(values)!r} ({error})") from None
        if not isinstance(move.step, int) or not all(
            isinstance(getattr(move, f), str) for f in ("layer", "layer_class", "reason")
        ):
            raise ValueError(f"not a precision move record: {dict(values)!r}")
        return move


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """Layer path → Keras dtype-policy name, the layers that must not compute in float16.

    Example::

        plan = autopilot.plan                      # after a fit that moved layers
        open("plan.json", "w").write(plan.to_json())
        ...
        kmix.apply_plan(model, kmix.PrecisionPlan.from_json(open("plan.json").read()))
        model.compile(...)                         # the next run starts healed

    Attributes:
        policies: layer path → policy name, e.g. ``{"block_3/ffn_out": "float32"}``.
    """

    policies: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_moves(cls, moves: Iterable[PrecisionMove]) -> PrecisionPlan:
        """The plan that makes ``moves`` permanent (a later move of a layer wins)."""
        return cls({move.layer: move.to_policy for move in moves})

    def to_json(self) -> str:
        """``{"format": "kmix.precision_plan", "version": 1, "policies": {...}}``."""
        return json.dumps(
            {"format": "kmix.precision_plan", "version": 1, "policies": dict(self.policies)},
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> PrecisionPlan:
        """Reads :meth:`to_json`'s text (a bare ``{path: policy}`` object is accepted too).

        Args:
            text: the JSON text.

        Returns:
            The plan.

        Raises:
            ValueError: the text is not JSON, or not a plan (each policy a string).
        """
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"PrecisionPlan.from_json: the text is not JSON ({error}); pass the text "
                "PrecisionPlan.to_json() wrote."
            ) from None
        policies = data.get("policies", data) if isinstance(data, dict) else None
        if not isinstance(policies, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in policies.items()
        ):
            raise ValueError(
                "PrecisionPlan.from_json: expected an object whose 'policies' maps layer "
                f"paths to dtype-policy names, got {text[:200]!r}."
            )
        return cls(dict(policies))

    def code(self, model_name: str = "model") -> str:
        """Python that makes the plan permanent, for the report and the tab."""
        lines = [
            f"kmix.apply_plan({model_name}, kmix.PrecisionPlan({dict(self.policies)!r}))",
            f"{model_name}.compile(...)  # after apply_plan",
        ]
        return "\n".join(lines)


def base_path(path: str) -> str:
    """A recorded call's layer path without its ``#k`` call suffix."""
    return path.split("#", 1)[0]


def layers_by_path(model: Any) -> dict[str, Any]:
    """Every nested layer of ``model`` by its path (:func:`kmix._layers.walk_layers`), and by
    Keras's ``layer.path`` where that names one layer only."""
    walked = list(_layers.walk_layers(model))
    found = dict(walked)
    owners: dict[str, list[Any]] = {}
    for _, layer in walked:
        own = getattr(layer, "path", None)
        if own:
            owners.setdefault(own, []).append(layer)
    for own, layers in owners.items():
        if len(layers) == 1:
            found.setdefault(own, layers[0])
    return found


def computes_float16(layer: Any) -> bool:
    """Whether ``layer``, or a layer nested in it, computes in float16."""
    nested = (inner for _, inner in _layers.walk_layers(layer))
    return any(getattr(x, "compute_dtype", None) == "float16" for x in (layer, *nested))


def move_layer(layer: Any, policy: Any) -> None:
    """Sets ``layer``'s dtype policy, and that of each layer nested in it that computes in
    float16 (``MultiHeadAttention``'s projections and softmax): moving a layer moves what
    it computes with; nested layers already in another dtype keep theirs."""
    nested = [inner for _, inner in _layers.walk_layers(layer) if inner.compute_dtype == "float16"]
    for target in (layer, *nested):
        target.dtype_policy = policy


def _unnumbered(name: str) -> str:
    """A model name without the ``_N`` Keras appends to repeated names."""
    return re.sub(r"_\d+$", "", name)


def _without_root(path: str) -> str:
    return path.split("/", 1)[1] if "/" in path else path


def find_layer(model: Any, path: str) -> Any | None:
    """The layer of ``model`` a plan's path names, or None (none, or more than one).

    A path matches a layer's own ``path`` or its path in the model; then, so that a
    plan made on one instance applies to another built by the same code (Keras numbers
    the second ``sequential_1`` and puts that name first in its layers' paths), the
    path without its first part matches such a path without the model's name, or, when
    the first part is the model's name but for Keras's number, the path of a layer not
    built yet (which has no model name in it); then a unique layer name matches.

    Args:
        model: the model.
        path: e.g. ``"sequential/dense_1"`` or ``"block_3/ffn_out"``.

    Returns:
        The layer, or None.
    """
    by_path = layers_by_path(model)
    if path in by_path:
        return by_path[path]
    layers = {id(layer): layer for layer in by_path.values()}
    name = getattr(model, "name", "")
    root = f"{name}/"
    key_root = path.split("/", 1)[0] if "/" in path else None
    same_model = key_root is not None and _unnumbered(key_root) == _unnumbered(name)
    for matches in (
        {
            id(layer)
            for own, layer in by_path.items()
            if own.startswith(root) and own[len(root) :] == _without_root(path)
        },
        {  # an unbuilt model's layers have no path yet: their walk path lacks the root
            id(layer)
            for own, layer in by_path.items()
            if same_model and not own.startswith(root) and own == _without_root(path)
        },
        {key for key, layer in layers.items() if layer.name == path},
    ):
        if len(matches) == 1:
            return layers[matches.pop()]
    return None


def apply_plan(model: Any, plan: PrecisionPlan) -> list[str]:
    """Sets each planned layer's dtype policy, so the run starts where the plan says.

    Call it before ``compile`` (after it, the train function is rebuilt). Each planned
    layer moves with the float16 layers nested in it, as the autopilot moved it
    (:func:`move_layer`). The policies are kept by a ``.keras`` save.

    Args:
        model: the model (built or not).
        plan: the plan, e.g. ``autopilot.plan`` or ``PrecisionPlan.from_json(text)``.

    Returns:
        The paths of the layers whose policy changed.

    Raises:
        TypeError: ``plan`` is not a :class:`PrecisionPlan`.
        ValueError: a path names no layer of ``model``, or a policy name is not one
            Keras knows; nothing is changed then.
    """
    import keras

    if not isinstance(plan, PrecisionPlan):
        raise TypeError(
            f"kmix.apply_plan: plan={plan!r} is a {type(plan).__name__}; pass a "
            "kmix.PrecisionPlan (autopilot.plan, or PrecisionPlan.from_json(text))."
        )
    layers, missing = {}, []
    for path in plan.policies:
        found = find_layer(model, path)
        if found is None:
            missing.append(path)
        else:
            layers[path] = found
    if missing:
        known = sorted(
            p for p, layer in layers_by_path(model).items() if type(layer).__name__ != "InputLayer"
        )
        shown = ", ".join(known[:12]) + (", …" if len(known) > 12 else "")
        raise ValueError(
            f"kmix.apply_plan: the plan names {missing!r}, not layers of model "
            f"{getattr(model, 'name', model)!r} (its layers: {shown}). Apply a plan to "
            "the model it was made for."
        )
    policies = {}
    for path, name in plan.policies.items():
        try:
            policies[path] = keras.dtype_policies.get(name)
        except ValueError as error:
            raise ValueError(
                f"kmix.apply_plan: policy {name!r} for layer {path!r} is not a Keras dtype "
                f"policy ({error}); use e.g. 'float32' or 'mixed_bfloat16'."
            ) from None
    changed = []
    for path, policy in policies.items():
        layer = layers[path]
        if layer.dtype_policy.name != policy.name or computes_float16(layer):
            move_layer(layer, policy)
            changed.append(path)
    if changed and getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)
    return changed


# ------------------------------------------------------------------ float16 share
@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's share of the model's work.

    Attributes:
        path: the layer's path.
        compute_dtype: the dtype it computes in now.
        cost: multiply-adds per example, or its parameter count where those are unknown.
        measure: :data:`MULTIPLY_ADDS` or :data:`PARAMETERS`.
    """

    path: str
    compute_dtype: str
    cost: float
    measure: str


@dataclasses.dataclass(frozen=True)
class Float16Share:
    """How much of the model's work is computed in float16.

    Attributes:
        share: the float16 layers' cost over all layers' cost, in [0, 1]; None when no
            layer has a cost (nothing to weigh).
        by_parameters: the layers weighed by their parameter count because their
            multiply-adds are not estimated (their class, or their output shape unknown).
    """

    share: float | None
    by_parameters: tuple[str, ...]

    def words(self) -> str:
        """``"62.5% of the estimated multiply-adds"`` and which layers were weighed otherwise."""
        if self.share is None:
            return "no layer with weights to weigh"
        text = f"{100 * self.share:.3g}% of the estimated multiply-adds"
        if self.by_parameters:
            named = ", ".join(f"`{p}`" for p in self.by_parameters[:6])
            more = f" and {len(self.by_parameters) - 6} more" if len(self.by_parameters) > 6 else ""
            text += f" (weighed by parameters, multiply-adds unknown: {named}{more})"
        return text


def float16_share(costs: Iterable[LayerCost]) -> Float16Share:
    """The share of the costs computed in float16 (pure).

    Args:
        costs: one entry per layer that holds weights.

    Returns:
        The share, and the layers weighed by parameters.
    """
    costs = list(costs)
    total = math.fsum(c.cost for c in costs)
    half = math.fsum(c.cost for c in costs if c.compute_dtype == "float16")
    return Float16Share(
        share=half / total if total > 0 else None,
        by_parameters=tuple(c.path for c in costs if c.measure == PARAMETERS and c.cost > 0),
    )


def _output_positions(path: str, layer: Any, shapes: Mapping[str, tuple]) -> float | None:
    """Output positions per example (all dims but batch and channels), where known."""
    shape = shapes.get(getattr(layer, "path", None) or path, shapes.get(path))
    if shape is None:
        try:
            shape = tuple(layer.output.shape)
        except (AttributeError, ValueError):
            return None
    inner = shape[1:-1]
    if any(d is None for d in inner):
        return None
    return float(math.prod(inner)) if inner else 1.0


def layer_costs(model: Any, output_shapes: Mapping[str, tuple] | None = None) -> list[LayerCost]:
    """Each weighted layer's cost: multiply-adds for dense and convolution layers.

    Dense and convolution layers cost ``kernel size × output positions`` multiply-adds
    per example; other layers with weights are weighed by their parameter count.

    Args:
        model: the model (built: an unbuilt layer holds no weights and costs nothing).
        output_shapes: layer path → static output shape, where ``layer.output`` is not
            available (subclassed models): e.g. the activation tap's shapes.

    Returns:
        One :class:`LayerCost` per layer holding weights of its own.
    """
    shapes = output_shapes or {}
    costs = []
    for path, layer in _layers.walk_layers(model):
        own = _layers.own_variables(layer)
        if not own:
            continue
        kernel = getattr(layer, "kernel", None) if type(layer).__name__ in _MAC_CLASSES else None
        positions = _output_positions(path, layer, shapes) if kernel is not None else None
        if positions is not None:
            cost, measure = float(math.prod(kernel.shape)) * positions, MULTIPLY_ADDS
        else:
            cost = float(sum(math.prod(v.shape) for v in own))
            measure = PARAMETERS
        costs.append(LayerCost(path, layer.compute_dtype, cost, measure))
    return costs
