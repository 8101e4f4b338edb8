"""An independent NumPy replay of Keras's float8 variables, step by step (test helper).

A callback reads every float8 layer's scale and amax history before and after each batch,
with the optimizer's loss scale and skipped steps; a tensor saturated at a step when the
step applied and its amax (the history's entry 0 after the step, taken back to the loss
scale the step used when the output gradients were rescaled) exceeds the scale before
the step times its format's max (448 for E4M3, 57344 for E5M2).
"""

from __future__ import annotations

import keras
import numpy as np

MAX = {"inputs": 448.0, "kernel": 448.0, "outputs_grad": 57344.0}


def float8_layers(model):
    """(path, layer) of every layer holding float8 state, nested ones too."""
    found = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if hasattr(layer, "outputs_grad_amax_history"):
            found.append((layer.path, layer))
    return found


def _sync(model):
    if hasattr(model, "jax_state_sync") and keras.backend.backend() == "jax":
        model.jax_state_sync()


class Replay(keras.callbacks.Callback):
    """Records the variables around each batch; :meth:`saturated` replays them."""

    def __init__(self):
        super().__init__()
        self.steps = []  # (before, after) dicts

    def _read(self):
        _sync(self.model)
        opt = self.model.optimizer
        state = {
            "loss_scale": float(keras.ops.convert_to_numpy(opt.dynamic_scale))
            if getattr(opt, "built", False)
            else float(opt.initial_scale),
            "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
        }
        for path, layer in float8_layers(self.model):
            for t in MAX:
                state[(path, t, "scale")] = np.float32(
                    keras.ops.convert_to_numpy(getattr(layer, f"{t}_scale"))
                )
                state[(path, t, "history")] = np.array(
                    keras.ops.convert_to_numpy(getattr(layer, f"{t}_amax_history")), "float32"
                )
        return state

    def on_train_batch_begin(self, batch, logs=None):
        self._before = self._read()

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append((self._before, self._read()))

    def saturated(self):
        """Set of (step, layer, tensor) from the replay (steps from 1)."""
        found = set()
        for step, (before, after) in enumerate(self.steps, start=1):
            if after["iterations"] == before["iterations"]:  # skipped: nothing applied
                continue
            factor = after["loss_scale"] / before["loss_scale"]
            for key, value in before.items():
                if not (isinstance(key, tuple) and key[2] == "scale"):
                    continue
                path, tensor, _ = key
                amax = after[(path, tensor, "history")][0]
                if tensor == "outputs_grad" and self.rescaled:
                    amax = amax / np.float32(factor)
                if amax > value * np.float32(MAX[tensor]):
                    found.add((step, path, tensor))
        return found

    rescaled = True
