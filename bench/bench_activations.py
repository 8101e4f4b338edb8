"""Cost of kmix.record.activations in a train step, side by side in one process.

Trains the same model in ``mixed_float16`` with Keras's loss-scale optimizer, the way
kmix's optimizer will use the tap: ``tap.take()`` first thing in ``apply()``, then
(optionally) the activation statistics and the forward origin written to optimizer
variables. Configurations, alternated round by round so machine noise hits all alike:

* ``no tap``: the tap is not installed (stock step).
* ``tap, records taken, no statistics``: installed and recording, ``take()`` called,
  nothing computed from the records: wrapping ``call`` adds Python at trace time only.
* ``statistics every 100 steps``: ``activation_stats`` and ``forward_origin`` inside an
  ``ops.cond`` on the step counter (what a monitor at ``update_freq=100`` asks for).
* ``statistics every step``: the same without the cond.

Prints each configuration's median step time and its ratio to ``no tap``: the median
over rounds of the per-round ratio, and the ratio of the best rounds (robust to other
processes on a shared machine, which slow some rounds down).

Usage:
    python bench/bench_activations.py [--model mlp|deep|all] [--steps 40] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

from kmix.optimizer.tap import ActivationTap
from kmix.record import activations

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_optimizer import BATCH, deep, mlp  # noqa: E402  (the same models, one definition)


class TapOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """Keras's loss-scale optimizer, plus the tap's records taken and reduced in apply."""

    def __init__(self, *args, mode: str = "none", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode
        self.tap: ActivationTap | None = None

    def apply(self, grads, trainable_variables=None):
        records = self.tap.take() if self.tap is not None else []
        super().apply(grads, trainable_variables)  # builds on the first call
        if self.mode in ("none", "take") or not records:
            return
        if not hasattr(self, "activation_state"):
            self.activation_state = self.add_variable(
                (len(activations.ActivationStats._fields), len(records)),
                name="activation_state",
                initializer="zeros",
            )
            self.origin_state = self.add_variable((), name="origin", initializer="zeros")

        def write() -> None:
            stats = activations.activation_stats([r.outputs for r in records])
            origin = activations.forward_origin(
                [r.inputs for r in records], [r.outputs for r in records]
            )
            self.activation_state.assign(ops.stack(list(stats)))
            self.origin_state.assign(ops.cast(origin.layer_index, "float32"))

        if self.mode == "every":
            write()
        else:
            ops.cond(ops.equal(self.iterations % 100, 0), write, lambda: None)


CONFIGS = {
    "no tap": "none",
    "tap, records taken, no statistics": "take",
    "statistics every 100 steps": "every100",
    "statistics every step": "every",
}


class StepTimer(keras.callbacks.Callback):
    """Wall time between consecutive batch ends (one value per step after the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def build(make_model, mode: str) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    keras.utils.set_random_seed(0)
    model, x = make_model()
    y = np.random.randint(0, 10, (BATCH,))
    optimizer = TapOptimizer(keras.optimizers.Adam(), mode=mode)
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    if mode != "none":
        optimizer.tap = ActivationTap(model).install()
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)  # trace and warm up
    return model, x, y


def measure(model: keras.Model, x: np.ndarray, y: np.ndarray, steps: int) -> float:
    timer = StepTimer()
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    model.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    return statistics.median(timer.times)


def run(name: str, make_model, steps: int, rounds: int) -> None:
    keras.config.set_dtype_policy("mixed_float16")
    built = {label: build(make_model, mode) for label, mode in CONFIGS.items()}
    times: dict[str, list[float]] = {label: [] for label in CONFIGS}
    for _ in range(rounds):
        for label, (model, x, y) in built.items():
            times[label].append(measure(model, x, y, steps))
    base = times["no tap"]
    print(f"\n{name}: batch {BATCH}, mixed_float16, {rounds} rounds x {steps} steps")
    print("| configuration | median step (ms) | ratio, median of rounds | ratio, best rounds |")
    print("|---|---|---|---|")
    for label, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        best = min(values) / min(base)
        print(f"| {label} | {1000 * statistics.median(values):.2f} | {ratio:.3f} | {best:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "deep", "all"], default="all")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    models = {"MLP 784-1024-1024-10": mlp, "40 x Dense(16)": deep}
    for name, make_model in models.items():
        if args.model in ("all", make_model.__name__):
            run(name, make_model, args.steps, args.rounds)


if __name__ == "__main__":
    main()
