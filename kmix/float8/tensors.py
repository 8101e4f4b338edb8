"""Which of an optimizer's variables are Keras float8 state, and what each tensor's range is.

A Keras layer quantized to float8 (``Dense``, ``EinsumDense``: ``model.quantize("float8")``)
keeps, for each quantized tensor ``t`` in :data:`TENSORS`, two float32 variables that take
their gradient as their new value: ``<t>_scale`` (the delayed scale this step uses) and
``<t>_amax_history`` (the largest ``|value|`` of recent steps; the step's own amax is entry 0
of the new value). Keras quantizes ``x`` as ``clip(x / scale, -max, max)`` in the format's
range (``keras.quantizers.quantize_and_dequantize``), so a tensor whose amax exceeds
``scale * max`` was clipped: :data:`FORMAT_MAX` is that ``max``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kmix.tags import FLOAT8_FORMAT_MAX, FLOAT8_FORMAT_TINY, FLOAT8_FORMATS

__all__ = [
    "FORMATS",
    "FORMAT_MAX",
    "FORMAT_TINY",
    "TENSORS",
    "Float8Tensor",
    "float8_tensors",
    "inputs_scale_of",
    "layer_of",
]

TENSORS = ("inputs", "kernel", "outputs_grad")
"""The tensors a Keras float8 layer quantizes, in the order kmix keeps them."""

FORMATS = FLOAT8_FORMATS
"""Each tensor's float8 format (:data:`kmix.tags.FLOAT8_FORMATS`)."""
FORMAT_MAX = FLOAT8_FORMAT_MAX
"""The largest finite value of each format (:data:`kmix.tags.FLOAT8_FORMAT_MAX`)."""
FORMAT_TINY = FLOAT8_FORMAT_TINY
"""Each format's smallest subnormal (:data:`kmix.tags.FLOAT8_FORMAT_TINY`)."""


class Float8Tensor(NamedTuple):
    """One quantized tensor of one float8 layer, located among the optimizer's variables.

    Attributes:
        layer: the layer's path (the variables' path without their name).
        tensor: ``"inputs"``, ``"kernel"`` or ``"outputs_grad"``.
        scale_index: position of ``<tensor>_scale`` among the tracked variables.
        history_index: position of ``<tensor>_amax_history`` among them.
        format_max: the largest value of the tensor's float8 format.
    """

    layer: str
    tensor: str
    scale_index: int
    history_index: int
    format_max: float

    @property
    def format(self) -> str:
        """The tensor's float8 format name."""
        return FORMATS[self.tensor]


def float8_tensors(variables: Sequence[Any]) -> list[Float8Tensor]:
    """The float8 tensors whose scale and history are both among ``variables``.

    Found by Keras's names and flag (``overwrite_with_gradient``), so nested layers and
    any layer class that keeps float8 state the way ``Dense`` does are found alike.

    Args:
        variables: the optimizer's tracked trainable variables, in its order.

    Returns:
        One :class:`Float8Tensor` per (layer, tensor), layers in variable order and
        tensors in :data:`TENSORS` order; empty without float8 layers.
    """
    where: dict[tuple[str, str], int] = {}
    layers: list[str] = []
    for index, variable in enumerate(variables):
        if not getattr(variable, "overwrite_with_gradient", False):
            continue
        layer, _, name = str(variable.path).rpartition("/")
        where[(layer, name)] = index
        if layer not in layers:
            layers.append(layer)
    found = []
    for layer in layers:
        for tensor in TENSORS:
            scale = where.get((layer, f"{tensor}_scale"))
            history = where.get((layer, f"{tensor}_amax_history"))
            if scale is not None and history is not None:
                fmt = FORMATS[tensor]
                found.append(Float8Tensor(layer, tensor, scale, history, FORMAT_MAX[fmt]))
    return found


def inputs_scale_of(layer: Any) -> Any | None:
    """A Keras float8 layer's ``inputs_scale`` variable; None for any other layer.

    Args:
        layer: a layer (the forward tap's records name theirs).

    Returns:
        The variable, or None where ``layer`` is not quantized to float8.
    """
    if getattr(layer, "quantization_mode", None) != "float8":
        return None
    scale = getattr(layer, "inputs_scale", None)
    return scale if getattr(scale, "overwrite_with_gradient", False) else None


def layer_of(variable: Any) -> str:
    """The layer path a float8 variable belongs to, as :class:`Float8Tensor` names it."""
    return str(variable.path).rpartition("/")[0]
