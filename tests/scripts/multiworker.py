"""One worker of a two-worker MultiWorkerMirroredStrategy custom training loop.

Run as ``python multiworker.py INDEX PORT0 PORT1 SCENARIO LOGDIR``; prints one JSON
line with the worker's final state. Scenarios (worker 1 misbehaves, worker 0 never):

* ``overflow``: worker 1's float16 gradients overflow at step BAD_STEP only;
* ``nan``: worker 1's inputs are NaN from step BAD_STEP on, so its loss is NaN and
  kmix.callbacks.LossScaleGuard (patience=PATIENCE) must stop both workers;
* ``fit``: both try ``model.fit``; reports whether it ran and what kmix warned.

The launcher (the test) starts both workers with a timeout and kills them if they hang.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

STEPS = 8
BAD_STEP = 3
PATIENCE = 3


def main(index: int, ports: list[str], scenario: str, log_dir: str) -> None:
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": index},
        }
    )
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    import keras

    import kmix

    keras.mixed_precision.set_global_policy("mixed_float16")
    with warnings.catch_warnings(record=True) as caught, strategy.scope():
        warnings.simplefilter("always")
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")]
        )
        opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.01), dynamic_growth_steps=1000)
        model.compile(optimizer=opt, loss="mse")
    result: dict = {"index": index, "warnings": [str(w.message) for w in caught]}
    if scenario == "fit":
        try:
            model.fit(np.ones((16, 4), "float32"), np.zeros((16, 1)), batch_size=8, verbose=0)
            result["fit"] = "ok"
        except Exception as error:  # the upstream failure this scenario documents
            result["fit"] = f"{type(error).__name__}: {str(error)[:200]}"
        print(json.dumps(result), flush=True)
        return

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            pred = tf.cast(model(x, training=True), "float32")
            loss = tf.reduce_sum(tf.square(pred - y)) / 8.0  # global batch: 2 x 4
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
        return loss

    @tf.function
    def train_step(x, y):
        strategy.run(replica_step, args=(x, y))

    guard = kmix.callbacks.LossScaleGuard(patience=PATIENCE, verbose=0)
    monitor = kmix.callbacks.MixedPrecisionMonitor(log_dir, update_freq=2, verbose=0)
    with kmix.callbacks.LoopDriver(model, [monitor, guard], strategy) as driver:
        for step in range(1, STEPS + 1):
            bad = index == 1 and step >= BAD_STEP if scenario == "nan" else step == BAD_STEP
            x = tf.fill((4, 4), np.nan if bad and scenario == "nan" else 0.25)
            y = tf.fill((4, 1), 1e4 if bad and scenario == "overflow" else 0.0)
            train_step(x, y)
            if driver.step_end():
                break
    kernel = np.asarray(model.layers[0].kernel.numpy()).ravel()
    result.update(
        kernel=kernel.tolist(),
        finite=bool(np.isfinite(kernel).all()),
        scale=opt.loss_scale,
        skipped=opt.skipped_steps,
        steps=driver.step,
        chief=driver.is_chief,
        guard=guard.reason,
        events=[
            [e.step, e.kind, e.old_scale, e.new_scale, e.loss_finite] for e in opt.scale_events()
        ],
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    idx, p0, p1, scenario, log_dir = sys.argv[1:6]
    main(int(idx), [p0, p1], scenario, log_dir)
