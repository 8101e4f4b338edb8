"""A host read of float8 layers' variables: one compiled call, a few numbers back.

:func:`read_health` describes each float8 tensor of any model (with or without kmix's
optimizer) from its variables as they are now: every tensor's scale, newest amax and history
maximum, and every kernel's underflow share, in one call compiled where the backend has a
compiler (:func:`kmix.backend.compiled`), so a read moves a few numbers to the host, not the
histories or the kernels, and pays one dispatch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from kmix._layers import walk_layers
from kmix.backend import compiled
from kmix.float8.reads import Float8Health, tensor_health
from kmix.float8.saturation import inputs_underflow
from kmix.float8.tensors import float8_tensors, inputs_scale_of, layer_of

__all__ = ["compute_dtypes", "kernel_underflows", "read_health"]


def read_health(
    variables: Sequence[Any],
    saturated_steps: Sequence[int] | None = None,
    inputs_underflow: dict[str, float] | None = None,
    model: Any = None,
) -> list[Float8Health]:
    """Each float8 tensor's :class:`Float8Health` from ``variables`` as they are now.

    Works on any model's variables (``model.trainable_variables``), with or without kmix's
    optimizer: a run with a float32 base and no loss scaling is read this way.

    Args:
        variables: trainable variables holding float8 state (others are ignored).
        saturated_steps: the optimizer's counts in :func:`float8_tensors` order, or None.
        inputs_underflow: layer path -> its inputs' underflow measured in the step, or None.
        model: the model, for its float8 layers' compute dtypes (:func:`compute_dtypes`);
            None: the kernels' underflow is not given.

    Returns:
        One :class:`Float8Health` per float8 tensor.
    """
    variables = list(variables)
    tensors = float8_tensors(variables)
    if not tensors:
        return []
    by_path = {str(v.path): v for v in variables}
    dtypes = {} if model is None else compute_dtypes(model)
    measured = [  # (tensor, its kernel): the kernels whose underflow is measured
        (t, by_path[f"{t.layer}/kernel"])
        for t in tensors
        if t.tensor == "kernel" and f"{t.layer}/kernel" in by_path and t.layer in dtypes
    ]
    read = _health_values(tuple(dtypes[t.layer] for t, _ in measured))
    stats, shares = (
        ops.convert_to_numpy(value)
        for value in read(
            [_handed(variables[t.scale_index]) for t in tensors],
            [_handed(variables[t.history_index]) for t in tensors],
            [_handed(kernel) for _, kernel in measured],
            [_handed(variables[t.scale_index]) for t, _ in measured],
        )
    )
    underflow = {t: _share(share) for (t, _), share in zip(measured, shares, strict=True)}
    return [
        tensor_health(
            t,
            *(float(value) for value in stats[i]),
            None if saturated_steps is None else int(saturated_steps[i]),
            underflow.get(t),
            (inputs_underflow or {}).get(t.layer),
        )
        for i, t in enumerate(tensors)
    ]


def kernel_underflows(
    kernels: Sequence[Any], scales: Sequence[Any], compute_dtypes: Sequence[str]
) -> list[float | None]:
    """The share of each float8 layer's non-zero kernel values that its scale flushes to zero.

    Computed where the kernels live, with the ops that measure the inputs' share in the
    step (:func:`kmix.float8.inputs_underflow`: the kernel's format is the inputs', E4M3,
    and Keras quantizes both alike, in the layer's compute dtype), all layers in one
    call, compiled where the backend has a compiler (:func:`kmix.backend.compiled`), so a
    read moves one number per layer to the host, not the kernels, and (on TensorFlow and
    JAX) pays one dispatch, not one per op: the call :func:`read_health` makes, without
    the scales and histories.

    Args:
        kernels: the layers' kernel variables (or their values).
        scales: their ``kernel_scale`` variables (or values): the scales the next step uses.
        compute_dtypes: the layers' compute dtypes (Keras quantizes the autocast kernel).

    Returns:
        One share per layer, None where no kernel value is non-zero in the compute dtype.
    """
    if not kernels:
        return []
    _, shares = _health_values(tuple(compute_dtypes))(
        [], [], [_handed(k) for k in kernels], [_handed(s) for s in scales]
    )
    return [_share(share) for share in ops.convert_to_numpy(shares)]


def _handed(value: Any) -> Any:
    """What a compiled read is handed: a Keras variable's backend variable, else ``value``."""
    return value.value if isinstance(value, keras.Variable) else value


def _share(share: float) -> float | None:
    """A measured share as given (None for the NaN of no non-zero value)."""
    return None if np.isnan(share) else float(share)


def _stacked(rows: list, empty: tuple[int, ...]) -> Any:
    """``rows`` stacked; float32 zeros of shape ``empty`` where there are none."""
    return ops.stack(rows) if rows else ops.zeros(empty, "float32")


@functools.cache
def _health_values(compute_dtypes: tuple[str, ...]) -> Callable[[list, list, list, list], Any]:
    """One compiled read of float8 tensors (:func:`read_health`), compiled once per tuple
    of the measured kernels' dtypes: ``(scales, histories, kernels, kernel_scales)`` ->
    ``(stats, shares)``: ``stats`` one row per tensor (its scale, its history's newest
    entry and its history's maximum, float32), ``shares`` each kernel's
    :func:`inputs_underflow` by its scale in its compute dtype. One dispatch and two small
    transfers a read, where each variable's read would cost one of each."""

    def read(scales: list, histories: list, kernels: list, kernel_scales: list) -> Any:
        # Keras's histories are never empty (its own update reads entry 0 too).
        stats = [
            ops.stack(
                [ops.cast(s, "float32"), ops.cast(h[0], "float32"), ops.cast(ops.max(h), "float32")]
            )
            for s, h in zip(scales, histories, strict=True)
        ]
        shares = [
            inputs_underflow(k, s, d)
            for k, s, d in zip(kernels, kernel_scales, compute_dtypes, strict=True)
        ]
        return _stacked(stats, (0, 3)), _stacked(shares, (0,))

    return compiled(read)


def compute_dtypes(model: Any) -> dict[str, str]:
    """The compute dtype of each float8 layer of ``model``, nested layers included.

    Args:
        model: a Keras model (or layer).

    Returns:
        Float8 layer path (as :class:`Float8Tensor` names it) -> the layer's compute dtype.
    """
    return {
        layer_of(scale): layer.compute_dtype
        for _, layer in walk_layers(model)
        if (scale := inputs_scale_of(layer)) is not None
    }
