"""Step time of kmix's monitor against stock Keras and the usual numerics tools, in one run.

Trains a 784-1024-1024-10 MLP (batch 256, ``mixed_float16``, random data) in each
configuration below, alternating the configurations round by round so that machine
noise hits all of them alike, and prints each one's step time as a ratio to stock
Keras mixed precision without callbacks (the median over rounds of the per-round
ratio). The step time of a round is the mean time between batch ends over all its
steps, so the monitor's one read every ``update_freq`` steps is counted, not
hidden by a median.

Debugger V2 and check-numerics instrument graphs as they are traced: each is
switched on while its own model is traced and measured, and off otherwise.

Usage:
    python bench/bench_callbacks.py [--steps 200] [--repeats 3] [--warmup 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmix  # noqa: E402

BATCH = 256
LOG_ROOT = tempfile.mkdtemp(prefix="kmix_bench_")


def stock() -> keras.Optimizer:
    return keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())


def kmix_optimizer() -> keras.Optimizer:
    return kmix.LossScaleOptimizer(keras.optimizers.Adam())


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def debugger_v2() -> Iterator[None]:
    # A fresh dump root each time: re-enabling a closed one crashes TensorFlow.
    tf.debugging.experimental.enable_dump_debug_info(
        tempfile.mkdtemp(dir=LOG_ROOT, prefix="debugger_"), tensor_debug_mode="CURT_HEALTH"
    )
    try:
        yield
    finally:
        tf.debugging.experimental.disable_dump_debug_info()


@contextlib.contextmanager
def check_numerics() -> Iterator[None]:
    tf.debugging.enable_check_numerics()
    try:
        yield
    finally:
        tf.debugging.disable_check_numerics()


def log_dir(name: str) -> str:
    return os.path.join(LOG_ROOT, name)


# label -> (optimizer factory, callbacks factory, context while tracing and measuring)
CONFIGS: dict[str, tuple[Callable, Callable[[], list], Callable]] = {
    "stock Keras mixed precision, no callbacks": (stock, list, nothing),
    "kmix optimizer alone, no callbacks": (kmix_optimizer, list, nothing),
    "kmix optimizer + MixedPrecisionMonitor (defaults)": (
        kmix_optimizer,
        lambda: [kmix.callbacks.MixedPrecisionMonitor(log_dir("monitor"), verbose=0)],
        nothing,
    ),
    "kmix optimizer + monitor, histograms every 100 steps": (
        kmix_optimizer,
        lambda: [
            kmix.callbacks.MixedPrecisionMonitor(
                log_dir("histograms"), histogram_freq=100, verbose=0
            )
        ],
        nothing,
    ),
    "kmix optimizer + monitor + LossScaleGuard (check every step)": (
        kmix_optimizer,
        lambda: [
            kmix.callbacks.MixedPrecisionMonitor(log_dir("guard"), verbose=0),
            kmix.callbacks.LossScaleGuard(),
        ],
        nothing,
    ),
    "stock + keras.callbacks.TensorBoard(update_freq=1)": (
        stock,
        lambda: [keras.callbacks.TensorBoard(log_dir("keras_tb"), update_freq=1)],
        nothing,
    ),
    "stock + Debugger V2 (CURT_HEALTH)": (stock, list, debugger_v2),
    "stock + tf.debugging.enable_check_numerics": (stock, list, check_numerics),
}


class StepTimer(keras.callbacks.Callback):
    """Mean wall time between batch ends, first to last (callbacks' work included)."""

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.intervals = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.intervals += 1
        self.last = now

    @property
    def mean(self) -> float:
        return (self.last - self.first) / max(self.intervals, 1)


def data(steps: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.random((BATCH * steps, 784), dtype=np.float32)
    return x, rng.integers(0, 10, BATCH * steps)


def build(make_optimizer: Callable, context: Callable, warmup: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10, dtype="float32"),
        ]
    )
    model.compile(
        optimizer=make_optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = data(warmup)
    with context():
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # trace and warm up
    return model


def measure(model: keras.Model, callbacks: list, context: Callable, x, y) -> float:
    timer = StepTimer()
    with context():
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[*callbacks, timer],
        )
    return timer.mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all configs")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per model")
    args = parser.parse_args()

    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(args.steps)
    models = {label: build(opt, ctx, args.warmup) for label, (opt, _, ctx) in CONFIGS.items()}
    times: dict[str, list[float]] = {label: [] for label in CONFIGS}
    for _ in range(args.repeats):
        for label, (_, make_callbacks, ctx) in CONFIGS.items():
            times[label].append(measure(models[label], make_callbacks(), ctx, x, y))

    shutil.rmtree(LOG_ROOT, ignore_errors=True)
    base = times["stock Keras mixed precision, no callbacks"]
    print(
        f"\nMLP 784-1024-1024-10, batch {BATCH}, mixed_float16, "
        f"{args.repeats} rounds x {args.steps} steps, TF {tf.__version__}, "
        f"Keras {keras.__version__}"
    )
    print("| configuration | mean step (ms) | ratio to stock, no callbacks |")
    print("|---|---|---|")
    for label, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"| {label} | {1000 * statistics.median(values):.1f} | {ratio:.3f}× |")


if __name__ == "__main__":
    main()
