"""Where the monitor's cost goes on the MLP: the in-graph watch versus the host reads.

Issue 20 measured the MLP 784-1024-1024-10 with ``MixedPrecisionMonitor`` at its defaults
at 1.04-1.07x stock. The monitor adds two things to a step: (1) at train begin it calls
``optimizer.watch(model)``, which taps the float16 layers (the forward statistics then
sit in the compiled step) and wraps ``train_step``; (2) every ``update_freq`` steps it
reads the record and writes summaries on the host. This script separates them, one
process, configurations alternating round by round:

* ``stock``: Keras's ``LossScaleOptimizer(Adam)``; ``optimizer``: kmix's, no callbacks;
* ``watched``: kmix's, ``optimizer.watch(model)`` called by hand, no callbacks (the
  in-graph part of the monitor alone);
* ``wrapped``: as ``watched`` with the activation tap removed again (the train-step
  wrapper alone, no forward statistics);
* ``monitor``: kmix's with ``MixedPrecisionMonitor(verbose=0)`` (defaults).

Each step's time is measured twice: wall clock, and the process's CPU time (all
threads; less sensitive to other processes on a shared machine, since waiting for a
core is not counted). It also times every host read of the monitor (``_on_read``, wall
clock) and prints the reads' cost per step (their total over the steps fitted): the host
part.

Usage: ``python bench/bench_monitor_parts.py [--steps 300] [--rounds 7] [--model mlp]
[--configs stock,optimizer,wrapped,watched,monitor]``. To compare another kmix version on
the same machine, put its checkout first on ``PYTHONPATH`` (``git worktree add /tmp/old
643f46e; PYTHONPATH=/tmp/old python bench/bench_monitor_parts.py --configs
stock,optimizer,monitor``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from bench_matrix import MODELS, kmix_optimizer, stock_optimizer  # noqa: E402

import kmix  # noqa: E402
from kmix.callbacks import monitor as monitor_module  # noqa: E402

READ_SECONDS: list[float] = []
_original_on_read = monitor_module.MixedPrecisionMonitor._on_read


def _timed_on_read(self, logs):  # noqa: ANN001, ANN202 - a bench patch
    start = time.perf_counter()
    try:
        return _original_on_read(self, logs)
    finally:
        READ_SECONDS.append(time.perf_counter() - start)


monitor_module.MixedPrecisionMonitor._on_read = _timed_on_read


class BatchTimer(keras.callbacks.Callback):
    """Wall and CPU times between the first and the last batch end of a fit."""

    def on_train_begin(self, logs=None):  # noqa: ANN001, ANN201
        self.ends: list[tuple[float, float]] = []

    def on_train_batch_end(self, batch, logs=None):  # noqa: ANN001, ANN201
        self.ends.append((time.perf_counter(), time.process_time()))

    def per_step(self) -> tuple[float, float]:
        steps = len(self.ends) - 1
        return tuple((b - a) / steps for a, b in zip(self.ends[0], self.ends[-1], strict=True))


def build(name: str, config: str, log_dir: str) -> tuple[keras.Model, tf.data.Dataset, list]:
    keras.utils.set_random_seed(0)
    model, x = MODELS[name][1]()
    y = np.random.randint(0, 10, len(x))
    opt = stock_optimizer() if config == "stock" else kmix_optimizer()
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if config in ("watched", "wrapped"):
        opt.watch(model)
    if config == "wrapped":
        opt.hooks._tap.remove()
        model.make_train_function(force=True)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    callbacks = (
        [kmix.callbacks.MixedPrecisionMonitor(log_dir, verbose=0)] if config == "monitor" else []
    )
    return model, data, callbacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--configs",
        default="stock,optimizer,wrapped,watched,monitor",
        help="comma-separated; stock always runs (e.g. stock,optimizer,monitor for kmix "
        "versions without optimizer.hooks)",
    )
    args = parser.parse_args()
    keras.mixed_precision.set_global_policy("mixed_float16")
    configs = ("stock", *(c for c in args.configs.split(",") if c != "stock"))
    root = tempfile.mkdtemp(prefix="kmix-bench-parts-")
    setups = {c: build(args.model, c, os.path.join(root, c)) for c in configs}
    for model, data, callbacks in setups.values():  # warm up: trace everything
        model.fit(data, steps_per_epoch=3, epochs=1, verbose=0, callbacks=callbacks)
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in configs}
    READ_SECONDS.clear()
    print(f"load before: {os.getloadavg()[0]:.2f}")
    for _ in range(args.rounds):
        for config in configs:
            model, data, callbacks = setups[config]
            timer = BatchTimer()
            model.fit(
                data, steps_per_epoch=args.steps, epochs=1, verbose=0, callbacks=[*callbacks, timer]
            )
            times[config].append(timer.per_step())
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"\n{MODELS[args.model][0]}, {args.steps} steps x {args.rounds} rounds\n")
    print("| configuration | wall ms / step | ratio | CPU ms / step | CPU ratio |")
    print("|---|---|---|---|---|")
    for config in configs:
        cells = []
        for kind in (0, 1):
            mine = [t[kind] for t in times[config]]
            stock = [t[kind] for t in times["stock"]]
            ratio = statistics.median(m / s for m, s in zip(mine, stock, strict=True))
            cells += [f"{1e3 * statistics.median(mine):.2f}", f"{ratio:.3f}x"]
        print(f"| {config} | " + " | ".join(cells) + " |")
    steps = args.rounds * args.steps
    print(f"kmix from {os.path.dirname(os.path.dirname(os.path.abspath(kmix.__file__)))}")
    print(
        f"\nmonitor host reads: {len(READ_SECONDS)} reads, median "
        f"{1e3 * statistics.median(READ_SECONDS):.1f} ms, "
        f"{1e3 * sum(READ_SECONDS) / steps:.3f} ms per step"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
