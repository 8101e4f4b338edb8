"""Trains under MirroredStrategy on two logical CPUs with an overflow on replica 1 only.

Run as ``python mirrored_overflow.py kmix|keras``; prints one JSON line with the
outcome. A separate process is needed because logical devices must be configured
before TensorFlow starts.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import kmix  # noqa: E402

BAD_STEP = 3  # 1-based optimizer step whose replica-1 shard overflows
GLOBAL_BATCH = 8


def main(which: str) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(
                    1, use_bias=False, kernel_initializer=keras.initializers.Constant(0.1)
                ),
            ]
        )
        inner = keras.optimizers.SGD(0.01)
        opt = (
            kmix.LossScaleOptimizer(inner)
            if which == "kmix"
            else (keras.mixed_precision.LossScaleOptimizer(inner))
        )
        model.compile(optimizer=opt, loss="mse")
    x = np.ones((GLOBAL_BATCH * 4, 4), "float32")
    y = np.zeros((GLOBAL_BATCH * 4, 1), "float32")
    # Second half of the global batch goes to replica 1: a huge target makes its
    # float16 gradient overflow at the default scale 2**15, replica 0 stays finite.
    start = (BAD_STEP - 1) * GLOBAL_BATCH
    y[start + GLOBAL_BATCH // 2 : start + GLOBAL_BATCH] = 1e4
    # Elsewhere the scaled gradient stays far below float16's max: with w = 0.1,
    # |d loss/d w| * 2**15 <= 4 * 2 * 0.4 / 8 * 2**15 ~ 13107 < 65504.
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    kernel = model.layers[0].kernel.value
    replicas = [np.asarray(v.numpy()) for v in kernel.values]
    print(
        json.dumps(
            {
                "finite": bool(all(np.isfinite(r).all() for r in replicas)),
                "replicas_equal": bool(np.array_equal(replicas[0], replicas[1])),
                "scale": float(keras.ops.convert_to_numpy(opt.dynamic_scale)),
                "skipped": opt.skipped_steps if which == "kmix" else None,
                "events": [[e.step, e.kind, e.old_scale, e.new_scale] for e in opt.scale_events()]
                if which == "kmix"
                else None,
                "iterations": int(opt.iterations.numpy()),
                "lines": [kmix.tags.format_event(e) for e in opt.scale_events()]
                if which == "kmix"
                else None,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
