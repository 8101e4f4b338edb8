"""Writes tests/data/optimizer_643f46e.keras and its expected state (run once, at 643f46e).

The file is a model saved with kmix's optimizer by main at commit 643f46e, before the
optimizer's record moved into ``kmix.optimizer.recorder``;
``tests/optimizer/test_loss_scale_optimizer.py`` loads it with today's code and checks
the variable names, their order and every value.
Run from the repository root: ``python tests/data/make_saved_optimizer.py``.
"""

import json
import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kmix  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

keras.utils.set_random_seed(0)
keras.mixed_precision.set_global_policy("mixed_float16")
model = keras.Sequential(
    [
        keras.Input((3,)),
        keras.layers.Dense(4, name="hidden"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ]
)
# 2**22 overflows float16's scaled gradients: the first steps back off (events with
# the first non-finite variable); growth every 3 good steps follows.
opt = kmix.LossScaleOptimizer(
    "sgd", initial_scale=2.0**22, dynamic_growth_steps=3, health_every=2, event_capacity=8
)
model.compile(optimizer=opt, loss="mse")
x = np.linspace(0.0, 1.0, 45, dtype="float32").reshape(15, 3)
y = np.arange(15, dtype="float32").reshape(15, 1)
model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0)
model.save(os.path.join(HERE, "optimizer_643f46e.keras"))
expected = {
    "state": {k: v for k, v in opt.read_state().__dict__.items() if k != "health"},
    "events": [
        {"step": e.step, "kind": e.kind, "old_scale": e.old_scale, "new_scale": e.new_scale}
        for e in opt.scale_events()
    ],
    "variables": [{"path": v.path, "value": np.asarray(v.numpy()).tolist()} for v in opt.variables],
}
with open(os.path.join(HERE, "optimizer_643f46e.json"), "w") as f:
    json.dump(expected, f, indent=1, default=float)
print(json.dumps(expected["state"]), [e["kind"] for e in expected["events"]])
