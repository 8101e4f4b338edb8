"""One process of a two-process ``keras.distribution`` run on JAX (two CPU devices each).

Run as ``python jax_processes.py INDEX PORT SCENARIO DIR``; prints one JSON line with
what this process observed. Process 1 misbehaves, process 0 never; each feeds its own
half of every global batch (``DataParallel`` with ``auto_shard_dataset=False``).
Scenarios:

* ``gradient``: process 1's targets at step BAD_STEP make its float16 gradients overflow;
* ``forward``: process 1's inputs at step BAD_STEP overflow float16 in layer ``wide``;
* ``guard``: process 1's inputs are NaN from step BAD_STEP on; LossScaleGuard(patience=
  PATIENCE, verbose=1) must stop both processes at the same step (what each printed is
  kept);
* ``logdir``: process 0's monitor cannot create its log directory (under /proc); both
  processes must fail at train begin (the error each raised is kept);
* ``autopilot``: as ``forward``; PrecisionAutopilot must move ``wide`` in both at the
  same step;
* ``float8``: the model quantized to float8; process 0's monitor reads the float8 layers'
  health (their kernels' underflow computed where the replicated kernels live);
* ``hang``: process 1 never joins; process 0 waits for it in ``initialize`` (the
  launcher's own test: both must be killed at its timeout).

The launcher (tests/callbacks/test_processes.py) starts both with a timeout and kills
their process groups if they hang. Nothing here decides what is right.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import time
import warnings

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["CUDA_VISIBLE_DEVICES"] = ""

STEPS = 8
BAD_STEP = 3
PATIENCE = 3
ROWS = 4  # per process and step: two per device


def data(index: int, scenario: str) -> tuple:
    import numpy as np

    x = np.full((STEPS * ROWS, 4), 0.25, "float32")
    y = np.zeros((STEPS * ROWS, 1), "float32")
    if index == 1:
        bad = slice((BAD_STEP - 1) * ROWS, BAD_STEP * ROWS)
        if scenario == "gradient":
            y[bad][1] = 1e5  # the float32 loss is finite, its float16 gradient is not
        elif scenario in ("forward", "autopilot"):
            x[bad][1] = 90000.0  # past float16's 65504 where ``wide`` casts its input
        elif scenario == "guard":
            x[(BAD_STEP - 1) * ROWS :] = np.nan
    return x, y


def main(index: int, port: str, scenario: str, directory: str) -> None:
    if scenario == "hang" and index == 1:
        time.sleep(3600)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras
    import numpy as np

    keras.distribution.initialize(
        job_addresses=f"127.0.0.1:{port}", num_processes=2, process_id=index
    )
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False)
    )

    import kmix
    from kmix import demo

    keras.mixed_precision.set_global_policy("mixed_float16")
    ones = keras.initializers.Constant(0.5)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, kernel_initializer=ones, name="wide")(inputs)
    outputs = keras.layers.Dense(1, dtype="float32", kernel_initializer=ones, name="top")(hidden)
    model = keras.Model(inputs, outputs)
    if scenario == "float8":
        model.quantize("float8")
    optimizer = kmix.LossScaleOptimizer(
        keras.optimizers.SGD(1e-3), initial_scale=2.0**10, dynamic_growth_steps=1000
    )
    model.compile(optimizer=optimizer, loss="mse")

    class Observe(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.scales: list[float] = []

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.scales.append(optimizer.read_state().loss_scale)

    log_dir = os.path.join(directory, "logs")
    if scenario == "logdir" and index == 0:  # nobody, root included, makes a folder there
        log_dir = "/proc/kmix_cannot_write_here/logs"
    observe = Observe()
    guard = kmix.callbacks.LossScaleGuard(patience=PATIENCE, verbose=int(scenario == "guard"))
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    callbacks = [
        kmix.callbacks.MixedPrecisionMonitor(log_dir, update_freq=2, verbose=0),
        observe,
    ]
    if scenario == "guard":
        callbacks.append(guard)
    if scenario == "autopilot":
        callbacks.append(autopilot)
    x, y = data(index, scenario)
    printed, error = io.StringIO(), None
    with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
        warnings.simplefilter("ignore")
        try:
            model.fit(
                x, y, batch_size=ROWS, shuffle=False, epochs=1, verbose=0, callbacks=callbacks
            )
        except ValueError as raised:
            if scenario != "logdir":
                raise
            error = [type(raised).__name__, str(raised)]
    if error is not None:
        print(json.dumps({"index": index, "error": error}), flush=True)
        return
    state = optimizer.read_state()
    result = {
        "index": index,
        "pid": os.getpid(),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "scales": observe.scales,
        "state": dataclasses.asdict(state),
        "events": [
            {
                "step": e.step,
                "kind": e.kind,
                "old_scale": e.old_scale,
                "new_scale": e.new_scale,
                "variable": e.variable,
                "loss_finite": e.loss_finite,
                "origin": None if e.origin is None else dataclasses.asdict(e.origin),
                "source": None if e.source is None else dataclasses.asdict(e.source),
            }
            for e in optimizer.scale_events()
        ],
        "kernel": np.asarray(model.get_layer("wide").kernel.value).tolist(),
        "guard": [guard.reason, guard.step],
        "moves": [[m.step, m.layer, m.from_policy, m.to_policy] for m in autopilot.moves],
        "wide_policy": model.get_layer("wide").dtype_policy.name,
        "printed": printed.getvalue(),
    }
    if scenario == "gradient":  # the single-process tools refuse, in every process
        result["refused"] = {}
        for tool, call in (
            ("compare", lambda: kmix.compare_policies(lambda: model, (x, y), steps=9)),
            ("demo", lambda: demo.run(os.path.join(directory, f"demo{index}"))),
        ):
            try:
                call()
                result["refused"][tool] = None
            except ValueError as error:
                result["refused"][tool] = [type(error).__name__, str(error)]
    if scenario == "float8":  # what process 0's monitor read, and the variables themselves
        result["float8"] = [
            [h.layer, h.tensor, h.underflow_fraction] for h in optimizer.float8_health()
        ]
    if index == 0:  # what kmix report reads from what process 0 wrote
        from kmix import report

        summary = report.summarize(report.read_log(log_dir))
        text = report.format_summary(summary).splitlines()
        result["report"] = {
            "processes": [line for line in text if line.startswith("processes")],
            "event_lines": [line.strip() for line in text if "first non-finite in" in line],
            "event_steps": [e.step for e in summary.events],
            "skipped_steps": summary.skipped_steps,
            "steps_seen": summary.steps_seen,
            "run_end": None if summary.run_end is None else summary.run_end.reason,
        }
        if summary.float8 is not None:
            result["report"]["float8"] = [
                [t.layer, t.tensor, t.step, t.underflow_fraction] for t in summary.float8.tensors
            ]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
