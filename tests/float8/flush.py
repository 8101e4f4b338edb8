"""Output-gradient flushes of a model's last float8 Dense layer, replayed in NumPy (a helper).

Keras quantizes a float8 ``Dense`` layer's output gradient ``g`` (float16 under
``mixed_float16``) to E5M2 at the layer's ``outputs_grad_scale`` ``s`` (its value before
the step): ``q = fl16(g / fl16(s))``, clipped to ±57344, cast to ``float8_e5m2``. E5M2's
smallest subnormal is 2**-16, so a non-zero ``g`` whose ``|q|`` is at most 2**-17 (ties go
to the even zero) becomes 0: it is *flushed*, silently (so is one whose dequantized
``fl16(q) * fl16(s)`` underflows float16, where ``s`` is tiny).

For the model's last layer, with no activation, trained with Keras's ``"mse"`` (default
reduction), ``g`` is the gradient of the scaled loss with respect to the model's output,
which is computable from that output alone: the loss is computed in float32 as
``sum(mean((y_true - y_pred)**2, axis=-1)) / batch``, so TensorFlow's gradient is
``-(c * (2 * (y_true - y_pred)))`` in float32 with ``c = (loss_scale / batch) / outputs``,
cast to float16. The output itself is the model's, called on the step's batch with the
weights before the step (the same kernels as the compiled step's forward pass). Each step's
``max |g|`` is checked against Keras's own record of it, the newest entry of the layer's
``outputs_grad_amax_history`` after the step: the replay checks itself. Nothing here
reads kmix.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import ml_dtypes
import numpy as np
from replay import _sync, float8_layers

E5M2_MAX = np.float16(57344.0)


class FlushStep(NamedTuple):
    """One training step of the last float8 layer's output gradient (steps from 1).

    Attributes:
        step: the step, from 1.
        applied: whether the optimizer applied it (False: skipped, non-finite gradients).
        loss_scale: the loss scale the step used.
        flushed: non-zero output-gradient values that quantized to zero.
        amax: ``max |g|`` of the replayed output gradient, float32.
        recorded_amax: Keras's record of it (the history's newest entry after the step,
            taken back to the step's loss scale where the optimizer rescaled it).
    """

    step: int
    applied: bool
    loss_scale: float
    flushed: int
    amax: float
    recorded_amax: float


def mse_output_grad(y_pred: np.ndarray, y_true: np.ndarray, loss_scale: float) -> np.ndarray:
    """The gradient of ``loss_scale`` × Keras's ``"mse"`` with respect to a float16 output.

    Args:
        y_pred: the model's output, float16, shape ``(batch, outputs)``.
        y_true: the targets, shape ``(batch, outputs)``.
        loss_scale: the loss scale the step multiplies the loss by.

    Returns:
        The gradient as TensorFlow computes it: float32 ops in its order, cast to float16
        (non-finite where it overflows float16).
    """
    batch, outputs = y_pred.shape
    c = np.float32(np.float32(loss_scale) / np.float32(batch)) / np.float32(outputs)
    diff = np.asarray(y_true, np.float32) - y_pred.astype(np.float32)
    with np.errstate(over="ignore"):
        return (-(c * (np.float32(2.0) * diff))).astype(np.float16)


def e5m2_flushed(grad: np.ndarray, scale: float) -> int:
    """How many non-zero values of a float16 gradient Keras's E5M2 quantize-dequantize zeroes.

    Keras's ``quantize_and_dequantize`` in float16: ``q = clip(grad / fl16(scale))`` cast to
    E5M2, then ``fl16(q) * fl16(scale)``. A value is zeroed where ``q`` flushes (``|q|`` at
    most 2**-17) or, with a scale in float16's subnormal range, where the product underflows.

    Args:
        grad: the output gradient, float16.
        scale: the layer's ``outputs_grad_scale`` in force at the step (float32).

    Returns:
        The count of values with ``grad != 0`` that reach the matmul as 0.
    """
    scale16 = np.float16(scale)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        quantized = np.clip(grad / scale16, -E5M2_MAX, E5M2_MAX).astype(ml_dtypes.float8_e5m2)
        dequantized = quantized.astype(np.float16) * scale16
    return int(np.count_nonzero((grad != 0) & (dequantized == 0)))


def steps_with_flushes(steps: list[FlushStep]) -> tuple[int, int]:
    """Applied steps where the output gradient had values flushed, and how many values.

    Args:
        steps: the replayed steps.

    Returns:
        ``(steps, values)`` over the steps the optimizer applied.
    """
    applied = [s for s in steps if s.applied]
    return sum(1 for s in applied if s.flushed), sum(s.flushed for s in applied)


def amax_mismatches(steps: list[FlushStep]) -> int:
    """Applied steps whose replayed ``max |g|`` differs from Keras's record of it.

    Args:
        steps: the replayed steps.

    Returns:
        The count (0 when the replay computed the gradient Keras quantized).
    """
    return sum(1 for s in steps if s.applied and s.amax != s.recorded_amax)


def _loss_scale(optimizer) -> float:
    if getattr(optimizer, "built", False):
        return float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    return float(optimizer.initial_scale)


class OutputGradFlushes(keras.callbacks.Callback):
    """Replays the last float8 layer's output gradient at every batch of one-epoch fits.

    Args:
        x: the inputs, in the order ``fit`` sees them (``shuffle=False``).
        y: the targets, likewise.
        batch_size: the fit's batch size.
        rescaled: whether the optimizer multiplies the output gradients' float8 state by
            the loss scale's change (kmix following the loss scale): the recorded amax is
            then taken back to the step's loss scale.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, rescaled: bool):
        super().__init__()
        self.x, self.y, self.batch_size, self.rescaled = x, y, batch_size, rescaled
        self.steps: list[FlushStep] = []

    def _layer(self):
        return float8_layers(self.model)[-1][1]

    def on_train_batch_begin(self, batch, logs=None):
        _sync(self.model)
        opt = self.model.optimizer
        rows = slice(batch * self.batch_size, (batch + 1) * self.batch_size)
        y_pred = keras.ops.convert_to_numpy(self.model(self.x[rows], training=True))
        loss_scale = _loss_scale(opt)
        grad = mse_output_grad(y_pred, self.y[rows], loss_scale)
        scale = np.float32(keras.ops.convert_to_numpy(self._layer().outputs_grad_scale))
        self._before = (
            int(keras.ops.convert_to_numpy(opt.iterations)),
            loss_scale,
            e5m2_flushed(grad, scale),
            np.float32(np.max(np.abs(grad.astype(np.float32)))),
        )

    def on_train_batch_end(self, batch, logs=None):
        _sync(self.model)
        opt = self.model.optimizer
        iterations, loss_scale, flushed, amax = self._before
        recorded = np.float32(
            keras.ops.convert_to_numpy(self._layer().outputs_grad_amax_history)[0]
        )
        if self.rescaled:
            recorded = recorded / np.float32(_loss_scale(opt) / loss_scale)
        self.steps.append(
            FlushStep(
                step=len(self.steps) + 1,
                applied=int(keras.ops.convert_to_numpy(opt.iterations)) != iterations,
                loss_scale=loss_scale,
                flushed=flushed,
                amax=float(amax),
                recorded_amax=float(recorded),
            )
        )


class InStepFlushes(keras.callbacks.Callback):
    """Counts, in the compiled step, every float8 layer's output-gradient values that
    Keras's own E5M2 quantize-dequantize turns to zero (TensorFlow; a helper).

    The last layer's count is replayed independently by :class:`OutputGradFlushes`; a hidden
    layer's output gradient comes through the float8 layers after it, so this counts what
    Keras computed instead. While the fit runs, ``keras.quantizers.quantize_and_dequantize``
    is wrapped: an E5M2 call (only output gradients are E5M2) adds to its layer's counters
    how many non-zero values came out 0, and the largest ``|value|``. The layer is the
    ``self`` of Keras's gradient function that called it. Each step's largest ``|value|`` is
    checked against the layer's recorded amax, as :class:`OutputGradFlushes` does.

    Args:
        rescaled: as for :class:`OutputGradFlushes`.

    Attributes:
        steps: layer path -> one :class:`FlushStep` per batch.
    """

    def __init__(self, rescaled: bool):
        super().__init__()
        self.rescaled = rescaled
        self.steps: dict[str, list[FlushStep]] = {}

    def on_train_begin(self, logs=None):
        import sys

        from keras.src import quantizers

        self._module, self._original = quantizers, quantizers.quantize_and_dequantize
        self._layers = dict(float8_layers(self.model))
        self._counts = {
            path: (keras.Variable(0, dtype="int32", trainable=False), keras.Variable(0.0))
            for path in self._layers
        }
        self.steps = {path: [] for path in self._layers}
        paths = {id(layer): path for path, layer in self._layers.items()}

        def counting(inputs, scale, quantized_dtype, compute_dtype):
            out = self._original(inputs, scale, quantized_dtype, compute_dtype)
            if quantized_dtype == "float8_e5m2":
                layer = sys._getframe(1).f_locals.get("self")
                flushed_var, amax_var = self._counts[paths[id(layer)]]
                flushed = (inputs != 0) & (out == 0)
                flushed_var.assign_add(keras.ops.sum(keras.ops.cast(flushed, "int32")))
                amax = keras.ops.max(keras.ops.abs(keras.ops.cast(inputs, "float32")))
                amax_var.assign(keras.ops.maximum(amax_var, amax))
            return out

        quantizers.quantize_and_dequantize = counting
        self.model.make_train_function(force=True)  # traced with the wrapper

    def on_train_end(self, logs=None):
        self._module.quantize_and_dequantize = self._original
        self.model.make_train_function(force=True)

    def on_train_batch_begin(self, batch, logs=None):
        for flushed_var, amax_var in self._counts.values():
            flushed_var.assign(0)
            amax_var.assign(0.0)
        opt = self.model.optimizer
        self._before = (int(keras.ops.convert_to_numpy(opt.iterations)), _loss_scale(opt))

    def on_train_batch_end(self, batch, logs=None):
        opt = self.model.optimizer
        iterations, loss_scale = self._before
        applied = int(keras.ops.convert_to_numpy(opt.iterations)) != iterations
        for path, layer in self._layers.items():
            flushed_var, amax_var = self._counts[path]
            recorded = np.float32(keras.ops.convert_to_numpy(layer.outputs_grad_amax_history)[0])
            if self.rescaled:
                recorded = recorded / np.float32(_loss_scale(opt) / loss_scale)
            steps = self.steps[path]
            steps.append(
                FlushStep(
                    step=len(steps) + 1,
                    applied=applied,
                    loss_scale=loss_scale,
                    flushed=int(keras.ops.convert_to_numpy(flushed_var)),
                    amax=float(keras.ops.convert_to_numpy(amax_var)),
                    recorded_amax=float(recorded),
                )
            )
