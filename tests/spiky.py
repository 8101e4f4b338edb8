"""The two-input test model shared by the callback tests.

``a(x1) + b(x2)`` under mixed_float16 with SGD(0): a "spike" row overflows only
``b``'s float16 gradient, at the step the data chooses; a NaN row makes the loss itself
non-finite. Weights never change, so every step sees the same model.
"""

from __future__ import annotations

import keras
import numpy as np

import kmix


def spiky_data(n: int, spikes=(), nan_rows=()) -> tuple[list[np.ndarray], np.ndarray]:
    """Rows of the model below; ``spikes`` and ``nan_rows`` are 1-based row numbers."""
    x1 = np.ones((n, 1), np.float32)
    x2 = np.zeros((n, 1), np.float32)
    y = np.zeros((n, 1), np.float32)
    for row in spikes:
        x1[row - 1], x2[row - 1], y[row - 1] = 0.0, 10000.0, 9999.0
    for row in nan_rows:
        x1[row - 1] = np.nan
    return [x1, x2], y


def spiky_model(optimizer=None, steps_per_execution: int = 1) -> keras.Model:
    """``a(x1) + b(x2)`` under mixed_float16, compiled with ``optimizer``."""
    keras.config.set_dtype_policy("mixed_float16")
    x1, x2 = keras.Input((1,)), keras.Input((1,))
    a = keras.layers.Dense(1, kernel_initializer="ones", name="a")(x1)
    b = keras.layers.Dense(1, kernel_initializer="ones", name="b")(x2)
    out = keras.layers.Activation("linear", dtype="float32")(keras.layers.Add()([a, b]))
    model = keras.Model([x1, x2], out)
    if optimizer is None:
        optimizer = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1024)
    model.compile(optimizer, "mse", steps_per_execution=steps_per_execution)
    return model
