"""Audit a Keras model's dtypes: a per-layer table and findings with their fixes.

Example:
    >>> import keras, kmix
    >>> kmix.use("mixed_float16")                             # doctest: +SKIP
    >>> model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(10)])
    >>> print(kmix.audit(model))                              # doctest: +SKIP

Each rule is a small function ``rule(model, layers) -> list[Finding]``, where
``layers`` lists ``(path, layer)`` pairs; the rules are listed in
:data:`RULES`: add one there to extend the audit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kmix import _layers
from kmix._json import json_ready
from kmix._layers import own_variables, walk_layers
from kmix.policy.float8_audit import float8_layers
from kmix.tags import AuditFinding

SEVERITIES = ("error", "warning", "info")
HALF = ("float16", "bfloat16")
# Activations whose half-precision output is fragile: exp and a sum in float16.
FRAGILE_ACTIVATIONS = ("softmax", "log_softmax")
# Decimal digits a half-precision value keeps (11 and 8 significand bits).
SIGNIFICANT_DIGITS = {"float16": "about 3", "bfloat16": "about 2"}
UNKNOWN = "?"

COLUMNS = ("path", "class", "compute", "variables", "output", "params")


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One layer of the audited model.

    Attributes:
        path: its path in the model, one per layer (:func:`kmix._layers.walk_layers`).
        class_name: the layer's class, e.g. ``"Dense"``.
        compute_dtype: the dtype the layer computes in; ``"-"`` for an ``InputLayer``,
            which computes nothing.
        variable_dtype: the dtype of the variables it owns; its policy's variable
            dtype when it owns none.
        output_dtype: the dtype of its output in a functional graph, ``"?"`` when
            Keras does not know it (subclassed models, layers never called).
        params: ``layer.count_params()``, nested layers included; 0 if unbuilt.
    """

    path: str
    class_name: str
    compute_dtype: str
    variable_dtype: str
    output_dtype: str
    params: int

    def cells(self) -> tuple[str, ...]:
        """The row as the strings of :data:`COLUMNS`."""
        return (
            self.path,
            self.class_name,
            self.compute_dtype,
            self.variable_dtype,
            self.output_dtype,
            str(self.params),
        )


Finding = AuditFinding
"""Something the audit found (:class:`kmix.tags.AuditFinding`: severity, layer, message, fix)."""


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The result of ``kmix.audit(model)``: one row per layer, and findings.

    Attributes:
        model: the model's name.
        policy: the global dtype policy when the audit ran.
        rows: one :class:`LayerRow` per layer, nested layers included.
        findings: the :class:`Finding` values, errors first.
    """

    model: str
    policy: str
    rows: tuple[LayerRow, ...]
    findings: tuple[Finding, ...]

    def to_dict(self) -> dict[str, Any]:
        """Returns the report as plain dicts, lists and strings, ready for JSON."""
        return json_ready(dataclasses.asdict(self))

    def to_markdown(self) -> str:
        """Returns the report as Markdown, e.g. for a TensorBoard text summary."""
        lines = [
            f"**kmix audit** of `{self.model}` (global policy `{self.policy}`)",
            "",
            "| " + " | ".join(COLUMNS) + " |",
            "|" + "---|" * len(COLUMNS),
            *("| " + " | ".join(row.cells()) + " |" for row in self.rows),
            "",
        ]
        lines += [
            f"- **{f.severity}** `{f.layer or self.model}`: {f.message} *Fix:* {f.fix}"
            for f in self.findings
        ] or ["No findings."]
        return "\n".join(lines)

    def __str__(self) -> str:
        table = [COLUMNS, *(row.cells() for row in self.rows)]
        widths = [max(len(cells[i]) for cells in table) for i in range(len(COLUMNS))]
        lines = [
            f"kmix audit of {self.model!r} (global policy {self.policy!r})",
            *(
                "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
                for cells in table
            ),
            "",
        ]
        lines += [str(finding) for finding in self.findings] or ["No findings."]
        return "\n".join(lines)


def audit(model: Any) -> AuditReport:
    """Lists every layer's dtypes and finds mixed-precision mistakes in a model.

    Works on Sequential, functional and subclassed models once they are built.
    Nothing is run: what Keras does not know without running the model (such as
    the output dtypes of a subclassed model) is reported as ``"?"``.

    Args:
        model: a built ``keras.Model``.

    Returns:
        An :class:`AuditReport`; ``print`` it, or use ``to_dict``/``to_markdown``.

    Raises:
        TypeError: if ``model`` is not a ``keras.Model``.
        ValueError: if ``model`` is not built yet.

    Example:
        >>> import keras, kmix
        >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8)])
        >>> [(row.class_name, row.params) for row in kmix.audit(model).rows]
        [('InputLayer', 0), ('Dense', 136)]
    """
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(
            f"kmix.audit expects a keras.Model; received model={model!r} of type "
            f"{type(model).__name__}."
        )
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built yet, so its layers have no variables "
            "to audit. Build it first: call it on a batch of data, e.g. "
            "`model(x[:1])`, or `model.build(input_shape)`, or give a Sequential "
            "model a `keras.Input(shape)` as its first layer."
        )
    layers = list(walk_layers(model))
    rows = tuple(_row(path, layer) for path, layer in layers)
    findings = [finding for rule in RULES for finding in rule(model, layers)]
    findings.sort(key=lambda finding: SEVERITIES.index(finding.severity))
    return AuditReport(
        model=model.name,
        policy=keras.config.dtype_policy().name,
        rows=rows,
        findings=tuple(findings),
    )


# --- layers ------------------------------------------------------------------


_HALF = ("float16", "bfloat16")

NOTHING = "-"
"""The compute dtype of a layer that computes nothing (``InputLayer``)."""


def _output_dtype(layer: Any) -> str:
    """The dtype of ``layer``'s output in its functional graph.

    The graph's symbolic tensors keep the dtypes of the policy the graph was built with:
    a half-precision output of a layer that computes in float32 now (moved by
    ``kmix.apply_plan`` or ``PrecisionAutopilot``) is read as the float32 it is at run
    time.
    """
    try:
        output = layer.output
    except (AttributeError, ValueError):  # never called, or not in a graph
        return UNKNOWN
    import keras

    compute = str(layer.compute_dtype)
    moved = compute not in _HALF and type(layer).__name__ != "InputLayer"  # it computes
    dtypes = dict.fromkeys(
        compute if moved and str(t.dtype) in _HALF else str(t.dtype)
        for t in keras.tree.flatten(output)
    )
    return ",".join(dtypes) or UNKNOWN


def _row(path: str, layer: Any) -> LayerRow:
    own = dict.fromkeys(str(variable.dtype) for variable in own_variables(layer))
    computes = type(layer).__name__ != "InputLayer"  # it hands the data on, computing nothing
    return LayerRow(
        path=path,
        class_name=type(layer).__name__,
        compute_dtype=str(layer.compute_dtype) if computes else NOTHING,
        variable_dtype=",".join(own) or str(layer.variable_dtype),
        output_dtype=_output_dtype(layer),
        params=layer.count_params() if layer.built else 0,
    )


# --- rules: each takes (model, [(path, layer), ...]) and returns findings ---

Layers = list[tuple[str, Any]]


def _half_precision_outputs(model: Any, layers: Layers) -> list[Finding]:
    """The model's outputs are float16/bfloat16 (needs a functional graph)."""
    try:
        outputs = model.outputs
    except AttributeError:  # subclassed models have no symbolic outputs
        return []
    import keras

    producers = {id(layer): path for path, layer in layers}
    findings = []
    for output in keras.tree.flatten(outputs):
        if str(output.dtype) not in HALF:
            continue
        layer = output._keras_history.operation  # the layer that produced it
        path = producers.get(id(layer), layer.name)
        findings.append(
            Finding(
                "warning",
                path,
                f"the model outputs {output.dtype}: a softmax or the logits in half "
                "precision lose probability mass and make the loss inexact",
                'give the last layer dtype="float32" (e.g. '
                'keras.layers.Activation("softmax", dtype="float32")), as the '
                "Keras mixed-precision guide says",
            )
        )
    return findings


def _half_precision_variables(model: Any, layers: Layers) -> list[Finding]:
    """Variables stored in float16/bfloat16: small updates round away."""
    findings = []
    for path, layer in layers:
        half = [v.name for v in own_variables(layer) if str(v.dtype) in HALF]
        if half:
            findings.append(
                Finding(
                    "warning",
                    path,
                    f"variables {', '.join(half)} are stored in "
                    f"{layer.variable_dtype}: updates smaller than the weight's "
                    "rounding step are lost and training stalls",
                    'keep variables in float32: use the policy "mixed_float16" or '
                    '"mixed_bfloat16" instead of "float16"/"bfloat16"',
                )
            )
    return findings


def _float16_without_loss_scaling(model: Any, layers: Layers) -> list[Finding]:
    """float16 compute with an optimizer that does not scale the loss."""
    if not any(layer.compute_dtype == "float16" for _, layer in layers):
        return []
    import keras

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return [
            Finding(
                "info",
                "",
                "the model computes in float16 but is not compiled, so its loss "
                "scaling could not be checked",
                "compile it with kmix.LossScaleOptimizer(...) and audit again",
            )
        ]
    if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        return []
    return [
        Finding(
            "error",
            "",
            f"layers compute in float16 but the optimizer "
            f"{type(optimizer).__name__} does not scale the loss: small gradients "
            "underflow to zero in float16 (Keras only wraps the optimizer when the "
            "global policy is mixed_float16)",
            "compile with optimizer=kmix.LossScaleOptimizer(optimizer)",
        )
    ]


def keras_own(layer: Any) -> bool:
    """Whether a layer runs Keras's own ``call`` (a built-in layer, or a subclass keeping it).

    Keras's own layers choose their precision on purpose: those that turn autocast off
    (``Embedding``, ``LayerNormalization``, ``GroupNormalization``) look up values or
    compute their statistics in float32, and ``BatchNormalization`` upcasts to float32.

    Args:
        layer: a Keras layer.

    Returns:
        True if the method ``call`` of the layer's class is defined in the ``keras`` package.
    """
    module = getattr(getattr(type(layer), "call", None), "__module__", None) or ""
    return module == "keras" or module.startswith("keras.")


def inside_keras_layers(layers: Layers) -> set[int]:
    """The ids of layers nested in one of Keras's own layers (not in a model).

    ``MultiHeadAttention`` computes its attention softmax in its compute dtype by
    design; such inner layers are Keras's choice, not the user's.

    Args:
        layers: ``(path, layer)`` pairs, as from :func:`kmix._layers.walk_layers`.

    Returns:
        ``{id(layer)}`` of every layer nested in a built-in layer that is not a model.
    """
    import keras

    inside: set[int] = set()
    for _, layer in layers:
        if keras_own(layer) and not isinstance(layer, keras.Model):
            inside.update(id(nested) for _, nested in walk_layers(layer))
    return inside


def _fragile_half_precision(model: Any, layers: Layers) -> list[Finding]:
    """Layers whose half-precision output or reduction is known to be fragile.

    Not flagged, because Keras chose their precision on purpose: layers nested in
    Keras's own layers (the softmax of ``MultiHeadAttention``), and Keras's own
    layers that turn autocast off (see :func:`keras_own`).
    """
    by_keras = inside_keras_layers(layers)
    findings = []
    for path, layer in layers:
        if layer.compute_dtype not in HALF or id(layer) in by_keras:
            continue
        activation = getattr(getattr(layer, "activation", None), "__name__", "")
        if type(layer).__name__ == "Softmax" or activation in FRAGILE_ACTIVATIONS:
            message = (
                f"softmax computed in {layer.compute_dtype}: probabilities keep only "
                f"{SIGNIFICANT_DIGITS[layer.compute_dtype]} significant digits"
                + (" and those below 6e-8 round to 0" if layer.compute_dtype == "float16" else "")
                + ", so a loss or log computed from them is inexact"
            )
        elif not layer.autocast and not keras_own(layer):
            message = (
                f"autocast=False while computing in {layer.compute_dtype}: its "
                "inputs and variables are not cast, so its own sums, means and "
                "variances may run in half precision and overflow past 65504"
            )
        else:
            continue
        findings.append(
            Finding(
                "warning",
                path,
                message,
                'create the layer with dtype="float32" (or inside kmix.policy_scope("float32"))',
            )
        )
    return findings


def _tensor_core_alignment(model: Any, layers: Layers) -> list[Finding]:
    """Dense/Conv sizes not multiples of 8 keep half precision off tensor cores.

    Said only where there are tensor cores (a GPU of compute capability 7.0 or newer), and
    only of the sizes the model's author chooses: not the input features of a layer fed
    by the model's inputs (the data's channels) nor the units of a layer whose output is
    the model's (the task's classes).
    """
    import keras

    if not any(layer.compute_dtype in HALF for _, layer in layers) or not _tensor_cores():
        return []
    fed = {id(layer) for layer in _layers.consumers_of_inputs(model)}
    final = {id(layer) for layer in _layers.producers_of_outputs(model)}
    findings = []
    for path, layer in layers:
        if layer.compute_dtype not in HALF:
            continue
        if isinstance(layer, keras.layers.Dense):
            sizes = {"units": layer.units}
        elif isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)):
            sizes = {"filters": layer.filters}
        else:
            continue
        if id(layer) in final:
            sizes = {}  # the task sets them (the classes)
        if layer.built and id(layer) not in fed:  # kernel: (..., input features, units)
            sizes["input features"] = layer.kernel.shape[-2]
        odd = [f"{name}={size}" for name, size in sizes.items() if size % 8]
        if odd:
            findings.append(
                Finding(
                    "info",
                    path,
                    f"not a multiple of 8: {', '.join(odd)}; {layer.compute_dtype} "
                    "matrix multiplies cannot use tensor cores fully",
                    "round these sizes up to a multiple of 8 (pad the input "
                    "features, e.g. the vocabulary or the channels)",
                )
            )
    return findings


def _tensor_cores() -> bool:
    """Whether this machine has tensor cores (a GPU of compute capability 7.0 or newer),
    asked only on Keras's TensorFlow or JAX backend (elsewhere detecting GPUs would import
    TensorFlow for this question alone)."""
    from kmix.policy import machine

    if machine.keras_backend() not in ("tensorflow", "jax"):
        return False
    return any(
        g.compute_capability and g.compute_capability >= (7, 0) for g in machine.hardware().gpus
    )


def _unbuilt_layers(model: Any, layers: Layers) -> list[Finding]:
    """Layers that are not built yet: their variables could not be audited."""
    return [
        Finding(
            "info",
            path,
            "not built, so its variables and parameters are unknown",
            "call the model on a batch of data, e.g. `model(x[:1])`, and audit again",
        )
        for path, layer in layers
        if not layer.built
    ]


RULES: tuple[Callable[[Any, Layers], list[Finding]], ...] = (
    _half_precision_outputs,
    _half_precision_variables,
    _float16_without_loss_scaling,
    _fragile_half_precision,
    _tensor_core_alignment,
    float8_layers,
    _unbuilt_layers,
)
