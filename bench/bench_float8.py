"""Float8 training seen and kept safe (issue 35): stock Keras vs kmix, following off and on.

Trains one small MLP with float8 Dense layers (``model.quantize("float8")`` over
``mixed_float16``) from one seed, three ways, on the same batches:

- stock: Keras's ``LossScaleOptimizer``;
- kmix off: ``kmix.LossScaleOptimizer(float8_follows_loss_scale=False)``;
- kmix on: ``kmix.LossScaleOptimizer()`` (the output gradients' float8 scales follow the
  loss scale).

Every ``--backoff-every`` batches, ``--backoff-burst`` batches in a row get targets x1e8:
their scaled loss's gradient overflows float16 in all three runs alike (a skipped step and
a loss-scale backoff each; 0 turns this off).

Saturated tensor-steps are counted by one NumPy replay of Keras's variables for all three
(amax after the step > scale before it x format max), so stock Keras is measured the same
way; also the output-gradient saturations in the two steps after each growth. Output
gradients flushed to zero are counted for every float8 layer in the step (TensorFlow;
tests/float8/flush.py ``InStepFlushes``: Keras's own E5M2 quantize-dequantize wrapped, its
non-zero values that came out 0 counted per layer, each step's max checked against Keras's
recorded amax), and the last layer's again by an independent NumPy replay
(``OutputGradFlushes``: its output gradient under "mse", quantized to E5M2 at the scale the
step used), which must agree step by step: the applied steps where some layer had values
flushed, how many values, and the steps per layer. On another backend only the last
layer's replay counts. The final loss is the trained model's MSE on the inputs with their
true targets. Then the monitor's cost: kmix on with and without ``MixedPrecisionMonitor``
(which reads float8 every ``--update-freq`` steps), alternated round by round.

Usage:
    python bench/bench_float8.py [--steps 300] [--growth 40] [--backoff-every 200]
        [--backoff-burst 18] [--rounds 3]

The defaults overflow steps 200-217: the loss scale, 2**18 by then (four growths and one
skipped step of the MLP's own), backs off to 1 (kmix's lowest; stock Keras has none, so a
longer burst would part them). A backoff only
halves the output gradients, and E5M2's smallest subnormal is 2**-16 x the scale, i.e.
about 2**-32.8 x the amax the scale was set from: in this MLP, values flush only once the
loss scale has fallen some 2**18 under the amax history's maximum (``--backoff-every 100
--backoff-burst 1``, a few single backoffs, flushes nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "float8"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from flush import (  # noqa: E402
    FlushStep,
    InStepFlushes,
    OutputGradFlushes,
    amax_mismatches,
    steps_with_flushes,
)
from replay import Replay  # noqa: E402

import kmix  # noqa: E402

BATCH = 64
# x the targets of an overflowing batch: the scaled "mse" gradient overflows float16 at any
# loss scale >= 1 (kmix's lowest).
OVERFLOW_TARGETS = 1e8


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


def overflow_batches(steps: int, every: int, burst: int = 1) -> list[int]:
    """The batches (from 0) made to overflow: ``burst`` in a row every ``every`` batches.

    Args:
        steps: the number of batches.
        every: the period, in batches (0: none overflow).
        burst: how many consecutive batches overflow, from batch ``k * every - 1``.

    Returns:
        The batch indices, ascending, below ``steps``.
    """
    if every <= 0:
        return []
    starts = range(every - 1, steps, every)
    return sorted({b for s in starts for b in range(s, min(s + burst, steps))})


def data(steps: int, overflow: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """A noisy linear map 32 -> 10 in ``steps`` batches, seed 0.

    Args:
        steps: the number of batches of ``BATCH`` rows.
        overflow: batches (from 0) whose targets are multiplied by ``OVERFLOW_TARGETS``.

    Returns:
        ``(x, y)``, float32.
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * BATCH, 32)).astype("float32")
    w = rng.standard_normal((32, 10)).astype("float32")
    y = (x @ w + 0.1 * rng.standard_normal((steps * BATCH, 10))).astype("float32")
    for b in overflow:
        y[b * BATCH : (b + 1) * BATCH] *= np.float32(OVERFLOW_TARGETS)
    return x, y


def final_loss(m: keras.Model, steps: int) -> float:
    """The trained model's MSE on the ``steps`` batches' inputs with their true targets.

    Args:
        m: the fitted model.
        steps: the number of batches it was fitted on.

    Returns:
        The loss, float.
    """
    x, y = data(steps)
    return float(m.evaluate(x, y, batch_size=BATCH, verbose=0))


def optimizer(kind: str, growth: int):
    inner = keras.optimizers.Adam(1e-3)
    if kind == "stock":
        return keras.mixed_precision.LossScaleOptimizer(inner, dynamic_growth_steps=growth)
    return kmix.LossScaleOptimizer(
        inner, dynamic_growth_steps=growth, float8_follows_loss_scale=kind == "kmix on"
    )


class Figures(NamedTuple):
    """One run's figures (a row of the bench's table)."""

    saturated: int  # saturated tensor-steps
    outputs_grad: int  # of them, output gradients
    after_growths: int  # output-gradient saturations in the two steps after a growth
    growths: int
    backoffs: int
    flushed_steps: int  # applied steps where some layer's output gradient lost values
    flushed_values: int  # non-zero output-gradient values flushed to zero, in all
    flushed_by_layer: str  # "steps/steps/..." per float8 layer, first to last
    amax_mismatches: int  # applied layer-steps where a flush count's max |g| != Keras's amax
    replay_disagrees: bool  # the in-step count of the last layer != its NumPy replay
    loss: float  # final loss


def saturation_run(kind: str, steps: int, growth: int, overflow: Sequence[int]) -> Figures:
    """Fits the float8 MLP one epoch under ``kind`` and replays its float8 variables.

    Args:
        kind: "stock", "kmix off" or "kmix on".
        steps: the number of batches.
        growth: the loss scale's growth period, in good steps.
        overflow: the batches (from 0) made to overflow.

    Returns:
        The run's figures.
    """
    m = model()
    m.compile(optimizer=optimizer(kind, growth), loss="mse")
    replay = Replay()
    replay.rescaled = kind == "kmix on"
    x, y = data(steps, overflow)
    flushes = OutputGradFlushes(x, y, BATCH, rescaled=kind == "kmix on")
    callbacks = [replay, flushes]
    if keras.backend.backend() == "tensorflow":
        callbacks.append(InStepFlushes(rescaled=kind == "kmix on"))
    m.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=callbacks)
    by_layer = callbacks[2].steps if len(callbacks) > 2 else {"last": flushes.steps}
    saturated = replay.saturated()
    scales = [before["loss_scale"] for before, _ in replay.steps] + [
        replay.steps[-1][1]["loss_scale"]
    ]
    growths = [i for i in range(1, len(scales)) if scales[i] > scales[i - 1]]  # 0-based
    after = {g + 1 for g in growths} | {g + 2 for g in growths}  # steps from 1
    flushed_steps, flushed_values = steps_with_flushes(any_layer(list(by_layer.values())))
    return Figures(
        saturated=len(saturated),
        outputs_grad=sum(1 for _, _, t in saturated if t == "outputs_grad"),
        after_growths=sum(1 for s, _, t in saturated if t == "outputs_grad" and s in after),
        growths=len(growths),
        backoffs=sum(1 for i in range(1, len(scales)) if scales[i] < scales[i - 1]),
        flushed_steps=flushed_steps,
        flushed_values=flushed_values,
        flushed_by_layer="/".join(str(steps_with_flushes(s)[0]) for s in by_layer.values()),
        amax_mismatches=sum(amax_mismatches(s) for s in [flushes.steps, *by_layer.values()]),
        replay_disagrees=[s.flushed for s in flushes.steps]
        != [s.flushed for s in list(by_layer.values())[-1]],
        loss=final_loss(m, steps),
    )


def any_layer(layers: list[list[FlushStep]]) -> list[FlushStep]:
    """One :class:`FlushStep` per step: the values flushed in all layers together."""
    return [
        steps[0]._replace(flushed=sum(s.flushed for s in steps))
        for steps in zip(*layers, strict=True)
    ]


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
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--growth", type=int, default=40)
    parser.add_argument("--backoff-every", type=int, default=200)
    parser.add_argument("--backoff-burst", type=int, default=18)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--update-freq", type=int, default=100)
    args = parser.parse_args()
    keras.mixed_precision.set_global_policy("mixed_float16")
    overflow = overflow_batches(args.steps, args.backoff_every, args.backoff_burst)
    print(
        f"backend {keras.backend.backend()}, {args.steps} steps, growth every {args.growth}, "
        f"overflowing batches (from 1) {[b + 1 for b in overflow]}"
    )
    print(
        "| run | saturated tensor-steps | of them output gradients "
        "| output-grad saturations after growths | growths "
        "| backoffs | steps with outputs flushed | values flushed "
        "| of the steps, per layer | final loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind in ("stock", "kmix off", "kmix on"):
        r = saturation_run(kind, args.steps, args.growth, overflow)
        print(
            f"| {kind} | {r.saturated} | {r.outputs_grad} | {r.after_growths} | {r.growths} | "
            f"{r.backoffs} | {r.flushed_steps} | {r.flushed_values} | {r.flushed_by_layer} "
            f"| {r.loss:.5f} |"
        )
        if r.amax_mismatches:
            print(f"  ! a flush count's max |g| != Keras's amax at {r.amax_mismatches} steps")
        if r.replay_disagrees:
            print("  ! the last layer's in-step flush count != its NumPy replay")
    if args.rounds <= 0:
        return
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
