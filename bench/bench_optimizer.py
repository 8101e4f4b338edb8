"""Step time of kmix.LossScaleOptimizer against Keras's own, side by side in one process.

Trains the same model in ``mixed_float16`` with the stock Keras loss-scale optimizer
and with kmix's (health statistics every step, and every 100 steps), alternating the
configurations round by round so that machine noise hits all of them alike, and
prints each configuration's median step time as a ratio to stock Keras.

Usage:
    python bench/bench_optimizer.py [--model mlp|cnn|deep|all] [--steps 30] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kmix  # noqa: E402

BATCH = 256


def mlp() -> tuple[keras.Model, np.ndarray]:
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10, dtype="float32"),
        ]
    )
    return model, np.random.rand(BATCH, 784).astype("float32")


def cnn() -> tuple[keras.Model, np.ndarray]:
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, dtype="float32"),
        ]
    )
    return model, np.random.rand(BATCH, 32, 32, 3).astype("float32")


def deep() -> tuple[keras.Model, np.ndarray]:
    """Many small variables (82): per-variable overhead dominates, the worst case."""
    model = keras.Sequential(
        [keras.Input((16,))]
        + [keras.layers.Dense(16, activation="relu") for _ in range(40)]
        + [keras.layers.Dense(10, dtype="float32")]
    )
    return model, np.random.rand(BATCH, 16).astype("float32")


CONFIGS = {
    "stock keras": lambda: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam()),
    "kmix, health every step": lambda: kmix.LossScaleOptimizer(
        keras.optimizers.Adam(), health_every=1
    ),
    "kmix, health every 100": lambda: kmix.LossScaleOptimizer(
        keras.optimizers.Adam(), health_every=100
    ),
}


class StepTimer(keras.callbacks.Callback):
    """Wall time between consecutive batch ends (so one value per step after the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def build(make_model, make_optimizer) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    keras.utils.set_random_seed(0)
    model, x = make_model()
    y = np.random.randint(0, 10, (BATCH,))
    model.compile(
        optimizer=make_optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)  # trace and warm up
    return model, x, y


def measure(model: keras.Model, x: np.ndarray, y: np.ndarray, steps: int) -> float:
    timer = StepTimer()
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    model.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    return statistics.median(timer.times)


def run(name: str, make_model, steps: int, rounds: int) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    built = {label: build(make_model, make_opt) for label, make_opt in CONFIGS.items()}
    times: dict[str, list[float]] = {label: [] for label in CONFIGS}
    for _ in range(rounds):
        for label, (model, x, y) in built.items():
            times[label].append(measure(model, x, y, steps))
    base = times["stock keras"]
    print(f"\n{name}: batch {BATCH}, mixed_float16, {rounds} rounds x {steps} steps")
    print("| configuration | median step (ms) | ratio to stock (median of rounds) |")
    print("|---|---|---|")
    for label, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"| {label} | {1000 * statistics.median(values):.1f} | {ratio:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn", "deep", "all"], default="all")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    models = {
        "MLP 784-1024-1024-10": mlp,
        "CNN 32x32x3 conv32-conv64": cnn,
        "41 x Dense(16), 82 variables": deep,
    }
    for name, make_model in models.items():
        if args.model in ("all", make_model.__name__):
            run(name, make_model, args.steps, args.rounds)


if __name__ == "__main__":
    main()
