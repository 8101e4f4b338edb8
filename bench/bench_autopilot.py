"""Issue 22's "Must show": a model whose float16 activations outgrow 65504 as it trains.

Trains :mod:`growing_model` (a learned weighted sum of squares whose ``energy`` layer's
float16 output passes 65504 after some tens of steps: the loss asks for it) side by side,
from the same seed, on the same generated data, in the same order:

* ``stock``: stock Keras ``mixed_float16`` with ``keras.mixed_precision.LossScaleOptimizer``.
* ``guard``: kmix's optimizer + ``MixedPrecisionMonitor`` + ``LossScaleGuard``, no autopilot.
* ``reactive``: the same + ``PrecisionAutopilot(proactive=False)``.
* ``proactive``: the same + ``PrecisionAutopilot()`` (``proactive=True``, the default).
* ``float32``: the model in float32 (plain Adam), once per ``--seeds`` seed, for float32's
  run-to-run spread of the final loss (the float16 runs use the first seed).

Prints a markdown table: the last epoch's mean training loss, the loss on held-out data,
skipped steps, the moves (layer@step), the share of the estimated multiply-adds still in
float16 at the end, the time of each rebuild, and the fit's total time; then what each run
said (the stock scale's fall, the guard's diagnosis, the autopilot's moves and reasons).

A rebuild's time is the wall time of the first step after a move minus the run's median
step time (the time from the end of the step that moved to the end of the next one,
measured by a batch-end timer placed before the autopilot in the callbacks: the move,
the new train function's trace and the step itself).

Usage:
    python bench/bench_autopilot.py [--epochs 16] [--seeds 0,1,2] [--config stock,...] [--lr]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import growing_model  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmix  # noqa: E402
from kmix.precision_plan import float16_share, layer_costs  # noqa: E402

HELD_OUT = 512


class StepRecorder(keras.callbacks.Callback):
    """Per step (attempted, counted from 1): the wall time since the previous step's end,
    the epoch's running mean loss and, for the stock optimizer, its loss scale."""

    def __init__(self, read_stock_scale: bool = False) -> None:
        super().__init__()
        self.read_stock_scale = read_stock_scale
        self.seconds: list[float] = []  # seconds[k - 1]: step k (the first: from train begin)
        self.losses: list[float] = []
        self.scales: list[float] = []

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.last = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now
        self.losses.append(float((logs or {}).get("loss", math.nan)))
        if self.read_stock_scale:
            self.scales.append(float(self.model.optimizer.dynamic_scale.numpy()))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.last = time.perf_counter()  # the next step's time leaves the epoch's end out


@dataclasses.dataclass
class Result:
    name: str
    train_loss: float
    held_out_loss: float
    steps: int
    skipped: int
    moves: list[kmix.PrecisionMove]
    share: float | None
    rebuild_s: list[float]
    total_s: float
    median_step_ms: float
    notes: list[str]


@dataclasses.dataclass(frozen=True)
class Config:
    title: str
    policy: str
    autopilot: bool | None  # None: no autopilot; else its `proactive`
    kmix: bool


CONFIGS: dict[str, Config] = {
    "stock": Config("stock Keras `mixed_float16`", "mixed_float16", None, False),
    "guard": Config("kmix + guard, no autopilot", "mixed_float16", None, True),
    "reactive": Config("kmix + autopilot `proactive=False`", "mixed_float16", False, True),
    "proactive": Config("kmix + autopilot `proactive=True`", "mixed_float16", True, True),
    "float32": Config("float32", "float32", None, False),
}


def first_nonfinite(losses: list[float]) -> int | None:
    """The first step whose epoch running mean is non-finite: the first non-finite loss
    (the mean was finite before it, within the epoch)."""
    return next((k for k, v in enumerate(losses, 1) if not math.isfinite(v)), None)


def run(
    name: str,
    title: str,
    config: Config,
    seed: int,
    data: tuple,
    epochs: int,
    lr: float,
    log_dir: str,
) -> Result:
    (x, y), (x_test, y_test) = data
    keras.utils.clear_session()
    keras.config.set_dtype_policy(config.policy)
    keras.utils.set_random_seed(seed)
    model = growing_model.build_model()
    adam = keras.optimizers.Adam(lr)
    if config.kmix:
        optimizer = kmix.LossScaleOptimizer(adam)
    elif config.policy == "mixed_float16":
        optimizer = keras.mixed_precision.LossScaleOptimizer(adam)
    else:
        optimizer = adam
    growing_model.compile_model(model, optimizer)
    recorder = StepRecorder(read_stock_scale=name == "stock")
    # First: a step's time then holds the other callbacks' work after the step before
    # (a move and its retrace fall in the step after the move).
    callbacks: list = [recorder]
    autopilot = guard = None
    if config.autopilot is not None:
        autopilot = kmix.callbacks.PrecisionAutopilot(proactive=config.autopilot)
        callbacks.append(autopilot)
    if config.kmix:
        guard = kmix.callbacks.LossScaleGuard(verbose=0)
        callbacks += [kmix.callbacks.MixedPrecisionMonitor(log_dir, verbose=0), guard]
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kmix.use's float16-on-CPU warning and the like
        history = model.fit(
            x,
            y,
            batch_size=growing_model.BATCH,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    total = time.perf_counter() - start
    held_out = float(model.evaluate(x_test, y_test, batch_size=HELD_OUT, verbose=0))
    steps = len(recorder.seconds)
    median = statistics.median(recorder.seconds[1:])
    notes = []
    if config.kmix:
        skipped = int(optimizer.skipped_steps)
    elif config.policy == "mixed_float16":
        skipped = steps - int(optimizer.iterations.numpy())  # stock: skipped steps don't count
    else:
        skipped = 0
    moves = list(autopilot.moves) if autopilot else []
    share = autopilot.float16_share.share if autopilot else float16_share(layer_costs(model)).share
    rebuild = [
        recorder.seconds[m.step] - median for m in moves if m.step < steps
    ]  # seconds[m.step]: step m.step + 1
    bad = first_nonfinite(recorder.losses)
    if bad is not None:
        notes.append(f"first non-finite loss at step {bad}")
    if name == "stock":
        scales = recorder.scales
        notes.append(f"loss scale {scales[0]:g} after step 1, {scales[-1]:g} at the end")
        zero = next((k for k, s in enumerate(scales, 1) if s == 0.0), None)
        if zero is not None:
            notes.append(f"the scale reached 0 at step {zero}")
        nonfinite = sum(1 for k in range(1, steps) if recorder.scales[k] < recorder.scales[k - 1])
        notes.append(f"{nonfinite} scale halvings")
        weights = [v.numpy() for v in model.trainable_variables]
        finite = all(np.isfinite(w).all() for w in weights)
        notes.append("weights all finite" if finite else "weights contain NaN/inf")
    if guard is not None and guard.diagnosis is not None:
        notes.append(f"the guard stopped at step {guard.step} ({guard.reason}): {guard.diagnosis}")
    for move in moves:
        notes.append(f"moved `{move.layer}` at step {move.step}: {move.reason}")
    if steps < epochs * math.ceil(len(x) / growing_model.BATCH):
        notes.append(f"stopped after {steps} steps")
    return Result(
        name=title,
        train_loss=float(history.history["loss"][-1]),
        held_out_loss=held_out,
        steps=steps,
        skipped=skipped,
        moves=moves,
        share=share,
        rebuild_s=rebuild,
        total_s=total,
        median_step_ms=1000 * median,
        notes=notes,
    )


def table(results: list[Result]) -> str:
    lines = [
        "| run | last epoch loss | held-out loss | steps | skipped | moves (layer@step) "
        "| float16 share at end | rebuild (s) | median step (ms) | total (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        moves = ", ".join(f"`{m.layer}`@{m.step}" for m in r.moves) or "–"
        share = "–" if r.share is None else f"{100 * r.share:.1f}%"
        rebuild = ", ".join(f"{s:.2f}" for s in r.rebuild_s) or "–"
        lines.append(
            f"| {r.name} | {r.train_loss:.4g} | {r.held_out_loss:.4g} | {r.steps} | {r.skipped} "
            f"| {moves} | {share} | {rebuild} | {r.median_step_ms:.2f} | {r.total_s:.1f} |"
        )
    return "\n".join(lines)


def verdict(results: list[Result]) -> list[str]:
    """Each autopilot run's losses against float32's run-to-run spread over the seeds: the
    gap to the float32 run from the same seed, and the float32 runs' range."""
    f32 = [r for r in results if r.name.startswith("float32")]
    if len(f32) < 2:
        return []
    lines = []
    for field in ("train_loss", "held_out_loss"):
        values = [getattr(r, field) for r in f32]
        low, high = min(values), max(values)
        same_seed = values[0]
        lines.append(
            f"float32 {field.replace('_', ' ')}: {low:.4g} .. {high:.4g} over the seeds "
            f"(spread {high - low:.3g}); the first seed's {same_seed:.4g}"
        )
        for r in results:
            if r.name.startswith("kmix + autopilot"):
                value = getattr(r, field)
                gap = value - same_seed
                inside = low <= value <= high or abs(gap) <= high - low
                lines.append(
                    f"  {r.name}: {value:.4g}, {gap:+.3g} from float32 with the same seed: "
                    + ("within" if inside else "OUTSIDE")
                    + " float32's spread"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=16, help="epochs of 32 steps (default 16)")
    parser.add_argument("--seeds", default="0,1,2", help="float32's seeds; the first for all")
    parser.add_argument(
        "--lr",
        type=float,
        default=growing_model.learning_rate(),
        help=f"Adam's learning rate (default {growing_model.learning_rate()})",
    )
    parser.add_argument(
        "--config",
        default=",".join(CONFIGS),
        help=f"comma-separated, from {','.join(CONFIGS)} (default: all)",
    )
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = [c.strip() for c in args.config.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        parser.error(f"argument --config: unknown {unknown}; choose from {', '.join(CONFIGS)}")

    x, y = growing_model.make_data(2048 + HELD_OUT)
    data = ((x[:-HELD_OUT], y[:-HELD_OUT]), (x[-HELD_OUT:], y[-HELD_OUT:]))
    print(
        f"kmix bench_autopilot: TF {tf.__version__}, Keras {keras.__version__}, "
        f"{os.cpu_count()} CPUs, --epochs {args.epochs} ({args.epochs * 32} steps of "
        f"{growing_model.BATCH}), Adam({args.lr:g}), seed {seeds[0]}, float32 seeds {args.seeds}; "
        f"load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    root = tempfile.mkdtemp(prefix="kmix_autopilot_")
    results = []
    start = time.perf_counter()
    try:
        for name in chosen:
            config = CONFIGS[name]
            for seed in seeds if name == "float32" else seeds[:1]:
                title = f"{config.title}, seed {seed}" if name == "float32" else config.title
                log_dir = os.path.join(root, f"{name}-{seed}")
                results.append(run(name, title, config, seed, data, args.epochs, args.lr, log_dir))
                print(f"  ran {title} ({results[-1].total_s:.1f} s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{table(results)}\n")
    for r in results:
        for note in r.notes:
            print(f"- {r.name}: {note}")
    print("\n" + "\n".join(verdict(results)))
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
