"""Trains a float8 MLP under MirroredStrategy on two logical CPUs, with a spike in replica
1's share of one batch, and replays every replica's float8 variables in NumPy. A batch
normalization between the layers keeps per-replica moving statistics too: a skipped step
must give each replica's copy its own value back.

Run as ``python mirrored_float8.py [GROWTH_STEPS]`` (the loss scale's growth interval,
default 2000: no growth); prints one JSON line. A separate process is needed
because logical devices must be configured before TensorFlow starts.
"""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import kmix  # noqa: E402

GLOBAL_BATCH = 64
STEPS = 8
SPIKE_STEP = 6  # 1-based; the spike is in the batch's second half: replica 1's
MAX = {"inputs": 448.0, "kernel": 448.0, "outputs_grad": 57344.0}


def float8_layers(model):
    return [layer for layer in model.layers if hasattr(layer, "inputs_amax_history")]


def per_replica(variable):
    """Each replica's copy of a Keras variable, as NumPy."""
    return [np.asarray(v.numpy(), "float32") for v in variable.value.values]


def kernel_underflow(model):
    """Each float8 layer's kernel underflow as kmix reads it, and as NumPy computes it
    from the kernel and the first replica's ``kernel_scale`` (the copy a read gives):
    the share of non-zero float16 values whose quotient by the float16 scale is at most
    half E4M3's smallest subnormal (2**-10)."""
    read = {
        h.layer: h.underflow_fraction
        for h in kmix.float8.read_health(model.trainable_variables, model=model)
        if h.tensor == "kernel"
    }
    replay = {}
    for layer in float8_layers(model):
        kernel = per_replica(layer.kernel)[0].astype("float16")
        scale = np.float16(per_replica(layer.kernel_scale)[0])
        nonzero = kernel != 0
        flushed = nonzero & (np.abs(kernel / scale) <= np.float16(2.0**-10))
        replay[layer.path] = float(flushed.sum() / nonzero.sum())
    return read, replay


def build(name=None):
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(4, name="out"),
        ],
        name=name,
    )


class ReplicaReplay(keras.callbacks.Callback):
    """Each replica's float8 scales before a batch and amax histories after it, with the
    loss scale and the applied steps around it (a skipped step saturates nothing; where
    the loss scale changed, kmix multiplied the output gradients' history by the change)."""

    def __init__(self):
        super().__init__()
        self.scales, self.amaxes, self.loss_scales, self.norms = [], [], [], []

    def _state(self):
        opt = self.model.optimizer
        return float(opt.loss_scale), int(keras.ops.convert_to_numpy(opt.iterations))

    def on_train_batch_begin(self, batch, logs=None):
        self.loss_scales.append(self._state())
        self.scales.append(
            {
                (layer.path, t): per_replica(getattr(layer, f"{t}_scale"))
                for layer in float8_layers(self.model)
                for t in MAX
            }
        )

    def on_train_batch_end(self, batch, logs=None):
        self.loss_scales[-1] += self._state()
        self.norms.append(per_replica(self.model.get_layer("norm").moving_mean))
        self.amaxes.append(
            {
                (layer.path, t): [h[0] for h in per_replica(getattr(layer, f"{t}_amax_history"))]
                for layer in float8_layers(self.model)
                for t in MAX
            }
        )

    def saturated(self):
        """``(step, layer, tensor)`` -> ``(amax, limit)`` of the replica that clipped most."""
        found = {}
        steps = zip(self.scales, self.amaxes, self.loss_scales, strict=True)
        for step, (scales, amaxes, (old, before, new, after)) in enumerate(steps, start=1):
            if after == before:  # skipped
                continue
            for (path, t), scale in scales.items():
                factor = np.float32(new / old) if t == "outputs_grad" else np.float32(1)
                pairs = [
                    (float(a / factor), float(s * np.float32(MAX[t])))
                    for a, s in zip(amaxes[(path, t)], scale, strict=True)
                ]
                clipped = [(a / lim, a, lim) for a, lim in pairs if a > lim]
                if clipped:
                    found[(step, path, t)] = max(clipped)[1:]
        return found


def main() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 16)).astype("float32")
    y = rng.normal(size=(GLOBAL_BATCH * STEPS, 4)).astype("float32")
    x[(SPIKE_STEP - 1) * GLOBAL_BATCH + GLOBAL_BATCH * 3 // 4] *= 50.0
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = build()
        model.quantize("float8")
        growth = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
        opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.01), dynamic_growth_steps=growth)
        model.compile(optimizer=opt, loss="mse")
    replay = ReplicaReplay()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0, callbacks=[replay])
    hidden = model.get_layer("hidden")
    copies = per_replica(hidden.inputs_scale)
    grads_copies = per_replica(hidden.outputs_grad_amax_history)
    episodes = {(e.step, e.layer, e.tensor): (e.amax, e.limit) for e in opt.float8_episodes()}
    skipped = [i for i, (_, before, _, after) in enumerate(replay.loss_scales) if after == before]
    norms = replay.norms
    with strategy.scope():  # a second model of the same shapes, a quarter of one kernel tiny
        other = build("other")
        other.quantize("float8")
    kernel = keras.ops.convert_to_numpy(other.get_layer("hidden").kernel)
    kernel[::4] = 1e-6  # 1e-6 / 1.0 (the scale as built) flushes; float16 keeps it non-zero
    other.get_layer("hidden").kernel.assign(kernel)
    print(
        json.dumps(
            {
                "kmix": sorted([s.step, s.layer, s.tensor] for s in opt.float8_saturations()),
                "replay": sorted([list(k) for k in replay.saturated()]),
                "spike_kmix": episodes.get((SPIKE_STEP, "sequential/hidden", "inputs")),
                "spike_replay": replay.saturated().get((SPIKE_STEP, "sequential/hidden", "inputs")),
                "replicas_differ": bool(copies[0] != copies[1]),
                "outputs_grad_differ": bool((grads_copies[0] != grads_copies[1]).any()),
                "read_is_first_replica": bool(
                    float(keras.ops.convert_to_numpy(hidden.inputs_scale)) == float(copies[0])
                ),
                "said": [str(w.message) for w in caught if "replica" in str(w.message)],
                "skipped": opt.skipped_steps,
                # each replica's moving mean after a skipped step is its own from before it
                "skips_give_back": [
                    all((a == b).all() for a, b in zip(norms[i], norms[i - 1], strict=True))
                    for i in skipped
                ],
                "norms_differ": bool((norms[-1][0] != norms[-1][1]).any()),
                "changes": len(opt.scale_events()),
                # read after the trained model's, each its own: [read, replay] per model
                "kernel_underflow": [kernel_underflow(model), kernel_underflow(other)],
            }
        )
    )


if __name__ == "__main__":
    main()
