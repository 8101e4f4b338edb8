"""kmix on Keras's torch backend imports no TensorFlow: the callbacks in a short ``fit``.

A fresh process (``KERAS_BACKEND=torch``) imports kmix and its callbacks, sets
``mixed_float16``, fits a small model for a few steps with :class:`kmix.LossScaleOptimizer`,
:class:`MixedPrecisionMonitor` and :class:`LossScaleGuard`, and reads the log back with
``kmix.report``; ``sys.modules`` then must hold no ``tensorflow``. An import hook notes the
kmix frames of any import of TensorFlow, so a failure says where it came from. (The script
seeds nothing: ``keras.utils.set_random_seed`` imports TensorFlow on every backend, which
kmix avoids with ``kmix.backend.set_random_seed``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

FIT = textwrap.dedent(
    """
    import json, sys, traceback

    stacks = []


    class Watch:  # notes who imports TensorFlow, and imports nothing itself
        def find_spec(self, name, path=None, target=None):
            frames = traceback.extract_stack()[:-1]
            # importlib.util.find_spec only looks (torch's dynamo asks whether it exists)
            if name == "tensorflow" and not any("importlib.util" in f.filename for f in frames):
                stacks.append([f"{f.filename}:{f.lineno}" for f in frames if "kmix" in f.filename])
            return None


    sys.meta_path.insert(0, Watch())
    import numpy as np

    import kmix
    import kmix.callbacks
    import keras

    logdir = sys.argv[1]
    kmix.use("mixed_float16")  # its float16 probe times torch's kernels
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**24)
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 8)).astype("float32"), rng.standard_normal((64, 1))
    callbacks = [
        kmix.callbacks.MixedPrecisionMonitor(logdir, update_freq=2, histogram_freq=4, verbose=0),
        kmix.callbacks.LossScaleGuard(check_freq=2),
    ]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    state = optimizer.read_state()

    from kmix import report

    summary = report.summarize(report.read_log(logdir))
    facts = {
        "backend": keras.backend.backend(),
        "tensorflow": "tensorflow" in sys.modules,
        "stacks": stacks,
        "steps_seen": summary.steps_seen,
        "events": len(optimizer.scale_events()),
        "skipped": int(state.skipped_steps),
    }
    print(json.dumps(facts))
    """
)


@pytest.mark.slow
@pytest.mark.torch
def test_callbacks_in_fit_on_torch_import_no_tensorflow(tmp_path):
    pytest.importorskip("torch")
    env = {**os.environ, "KERAS_BACKEND": "torch", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", FIT, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["backend"] == "torch"
    assert facts["tensorflow"] is False, f"imported from: {facts['stacks'][:1]}"
    assert facts["steps_seen"] == 8  # 64 examples, batch 8: the monitor's log read back
    assert facts["skipped"] >= 1  # 2^24 overflows float16: the first step skips and backs off
    assert facts["events"] >= facts["skipped"]
