"""Float8 training seen and kept safe (issue 35): stock Keras vs kmix, following off and on.

Trains one small MLP with float8 Dense layers (``model.quantize("float8")`` over
``mixed_float16``) from one seed, three ways, on the same batches:

- stock: Keras's ``LossScaleOptimizer``;
- kmix off: ``kmix.LossScaleOptimizer(float8_follows_loss_scale=False)``;
- kmix on: ``kmix.LossScaleOptimizer()`` (the output gradients' float8 scales follow the
  loss scale).

Saturated tensor-steps are counted by one NumPy replay of Keras's variables for all three
(amax after the step > scale before it x format max), so stock Keras is measured the same
way; also the output-gradient saturations in the two steps after each growth, and the
final loss. Then the monitor's cost: kmix on with and without ``MixedPrecisionMonitor``
(which reads float8 every ``--update-freq`` steps), alternated round by round.

Usage:
    python bench/bench_float8.py [--steps 400] [--growth 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "float8"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from replay import Replay  # noqa: E402

import kmix  # noqa: E402

BATCH = 64


def model(width: int = 128, float8: bool = True) -> keras.Model:
    """The MLP 32-width-width-10 from seed 0, quantized to float8 unless ``float8`` is False
    (the same initial weights either way: the float16 and float32 references)."""
    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    if float8:
        m.quantize("float8")
    return m


def data(steps: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * BATCH, 32)).astype("float32")
    w = rng.standard_normal((32, 10)).astype("float32")
    return x, (x @ w + 0.1 * rng.standard_normal((steps * BATCH, 10))).astype("float32")


def optimizer(kind: str, growth: int):
    inner = keras.optimizers.Adam(1e-3)
    if kind == "stock":
        return keras.mixed_precision.LossScaleOptimizer(inner, dynamic_growth_steps=growth)
    return kmix.LossScaleOptimizer(
        inner, dynamic_growth_steps=growth, float8_follows_loss_scale=kind == "kmix on"
    )


def saturation_run(kind: str, steps: int, growth: int) -> dict:
    m = model()
    m.compile(optimizer=optimizer(kind, growth), loss="mse")
    replay = Replay()
    replay.rescaled = kind == "kmix on"
    x, y = data(steps)
    history = m.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[replay])
    saturated = replay.saturated()
    scales = [before["loss_scale"] for before, _ in replay.steps]
    growths = [i for i in range(1, len(scales)) if scales[i] > scales[i - 1]]  # 0-based
    after = {g + 1 for g in growths} | {g + 2 for g in growths}  # steps from 1
    return {
        "saturated tensor-steps": len(saturated),
        "output-grad saturations after growths": sum(
            1 for s, _, t in saturated if t == "outputs_grad" and s in after
        ),
        "growths": len(growths),
        "final loss": float(history.history["loss"][-1]),
    }


def timed(with_monitor: bool, steps: int, growth: int, update_freq: int) -> float:
    m = model()
    m.compile(optimizer=optimizer("kmix on", growth), loss="mse")
    x, y = data(steps)
    callbacks = []
    if with_monitor:
        callbacks = [
            kmix.callbacks.MixedPrecisionMonitor(tempfile.mkdtemp(), update_freq=update_freq)
        ]
    m.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, verbose=0, callbacks=callbacks)
    start = time.perf_counter()
    m.fit(x, y, batch_size=BATCH, verbose=0, callbacks=callbacks)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--growth", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--update-freq", type=int, default=100)
    args = parser.parse_args()
    keras.mixed_precision.set_global_policy("mixed_float16")
    print(f"backend {keras.backend.backend()}, {args.steps} steps, growth every {args.growth}")
    print(
        "| run | saturated tensor-steps | output-grad saturations after growths | growths |", end=""
    )
    print(" final loss |")
    print("|---|---|---|---|---|")
    for kind in ("stock", "kmix off", "kmix on"):
        r = saturation_run(kind, args.steps, args.growth)
        print(
            f"| {kind} | {r['saturated tensor-steps']} | "
            f"{r['output-grad saturations after growths']} | {r['growths']} | "
            f"{r['final loss']:.5f} |"
        )
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for with_monitor in (False, True):
            times[with_monitor].append(timed(with_monitor, 100, args.growth, args.update_freq))
    base, mon = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"\nstep time, kmix on: without monitor {base * 1e3:.2f} ms, with the monitor "
        f"(float8 read every {args.update_freq} steps) {mon * 1e3:.2f} ms: x{mon / base:.3f}"
    )


if __name__ == "__main__":
    main()
