"""The audit's float8 rule: which layers are float8, and which layers cannot be.

Keras trains only ``Dense`` and ``EinsumDense`` in float8 (``model.quantize("float8")`` or a
``float8_from_*`` dtype policy): every other layer with weights (convolutions, embeddings,
normalization) stays in its own dtype. Said only for a model with a float8 layer.
"""

from __future__ import annotations

from typing import Any

from kmix.tags import AuditFinding

__all__ = ["FLOAT8_CLASSES", "float8_layers", "is_float8"]

FLOAT8_CLASSES = ("Dense", "EinsumDense")
"""The Keras layer classes that can be float8."""

_LISTED = 8


def is_float8(layer: Any) -> bool:
    """Whether a layer is quantized to float8 (its ``quantization_mode``, or its policy's)."""
    mode = getattr(layer, "quantization_mode", None)
    if mode is None:
        mode = getattr(getattr(layer, "dtype_policy", None), "quantization_mode", None)
    return mode == "float8"


def _can_be_float8(layer: Any) -> bool:
    """Keras's own ``Dense`` or ``EinsumDense``: their ``quantize`` refuses a subclass
    (``type(self) is not Dense``)."""
    import keras

    return type(layer) in (keras.layers.Dense, keras.layers.EinsumDense)


def _subclass(layer: Any) -> bool:
    return not _can_be_float8(layer) and any(
        cls.__name__ in FLOAT8_CLASSES and cls.__module__.startswith("keras.")
        for cls in type(layer).__mro__
    )


def _names(paths: list[str]) -> str:
    shown = ", ".join(f"`{p}`" for p in paths[:_LISTED])
    return shown + (f" and {len(paths) - _LISTED} more" if len(paths) > _LISTED else "")


def float8_layers(model: Any, layers: list[tuple[str, Any]]) -> list[AuditFinding]:
    """Lists the float8 layers; the layers with weights that cannot be float8, and the
    Dense/EinsumDense layers that are not. Nothing for a model without float8 layers."""
    float8 = [path for path, layer in layers if is_float8(layer)]
    if not float8:
        return []
    found = [
        AuditFinding(
            "info",
            "",
            f"{len(float8)} float8 layer{'s' if len(float8) != 1 else ''}: {_names(float8)}. "
            f"Keras clips {'its' if len(float8) == 1 else 'their'} inputs, kernels and output "
            "gradients to their delayed scales, silently.",
            "compile with kmix.LossScaleOptimizer (it checks every float8 tensor for "
            "saturation at every step and keeps the output gradients' scales in step with "
            "the loss scale) and add kmix.callbacks.MixedPrecisionMonitor (kmix/fp8_* "
            "health; `kmix report` and the Mixed Precision tab show it)",
        )
    ]
    weighted = [
        (path, layer)
        for path, layer in layers
        if not is_float8(layer)
        and getattr(layer, "built", False)
        and getattr(layer, "_trainable_variables", None)
        and not getattr(layer, "_layers", None)  # a block: its own layers are listed
    ]
    subclasses = [path for path, layer in weighted if _subclass(layer)]
    cannot = [
        path for path, layer in weighted if not _can_be_float8(layer) and not _subclass(layer)
    ]
    if subclasses:
        found.append(
            AuditFinding(
                "info",
                "",
                f"cannot be float8 (subclasses of {' or '.join(FLOAT8_CLASSES)}: Keras's "
                f"quantize accepts only those classes themselves): {_names(subclasses)}; "
                "they compute in their own dtype policy.",
                "to run them in float8, build them as Dense or EinsumDense layers "
                "(or implement quantize in the subclass)",
            )
        )
    if cannot:
        found.append(
            AuditFinding(
                "info",
                "",
                f"cannot be float8 (Keras quantizes only {' and '.join(FLOAT8_CLASSES)} to "
                f"float8): {_names(cannot)}; they compute in their own dtype policy.",
                "nothing to do; to run more of the model in float8, use Dense or "
                "EinsumDense layers where the model allows",
            )
        )
    could = [path for path, layer in weighted if _can_be_float8(layer)]
    if could:
        found.append(
            AuditFinding(
                "info",
                "",
                f"not float8, though they could be: {_names(could)}.",
                "leave them out on purpose (a small head, a sensitive last layer), or quantize "
                "them: `layer.quantize('float8')` before compile",
            )
        )
    return found
