"""kmix's optimizer, and with the monitor, against stock Keras on the JAX or torch backend.

Side by side in one process, on Keras's JAX backend (``KERAS_BACKEND=jax``, the default)
or its torch backend (``KERAS_BACKEND=torch``), for each model below, one model
copy per configuration (same seed, same weights), all in ``mixed_float16``:

* ``stock``: ``keras.mixed_precision.LossScaleOptimizer(Adam)``, no callbacks.
* ``stock_again``: the same again, a second copy: the noise floor of this run.
* ``kmix``: ``kmix.LossScaleOptimizer(Adam)``, no callbacks.
* ``kmix_monitor``: ``kmix.LossScaleOptimizer(Adam)`` +
  ``kmix.callbacks.MixedPrecisionMonitor(logdir, verbose=0)`` (defaults otherwise). Where
  a configuration fails, its row says why and the other configurations run on.

Models (the builders of ``bench_matrix.py`` and ``bench_optimizer.py``, imported):

* ``mlp``: 784-1024-1024-10, batch 256.
* ``transformer``: bench_matrix's Transformer encoder (4 blocks of MultiHeadAttention,
  LayerNormalization and a Dense feed-forward; width 64, sequence 32, 69 variables), batch 32,
  built with ``scores=True``: Keras 3.15's JAX backend cannot compile MultiHeadAttention's
  fused ``dot_product_attention`` on a CPU in float16 (stock Keras fails too), so the layer
  takes its einsum path.
* ``stack82``: 41 x Dense(16), 82 variables, batch 256 (the worst case: tiny steps, many
  variables).

Timing: ``model.fit`` on in-memory NumPy arrays (one random batch repeated), ``jit_compile``
left at Keras's default (on for JAX, off for torch: eager steps; the script checks it),
``steps_per_execution=1``. Each copy is traced and warmed up by one untimed fit of a round's
length. A round fits ``--steps`` + 1 batches per configuration, and the round's step time is
the median time between batch ends (``bench_optimizer.StepTimer``), so ``--steps``
intervals; the mean of those intervals is also kept (it includes the monitor's statistics
step and read every ``update_freq=100`` optimizer steps when a round is that long), and so
is the median CPU time of the process per step (``time.process_time``: all threads, not the
time spent waiting for a core). The first step of each fit (where a callback's retrace would
compile) is not timed: what is measured is the steady state. The configurations take turns
in ABBA order (forward in even rounds, backward in odd ones), so drift hits all alike. A
ratio is the median over rounds of (the configuration's round time / stock's round time in
the same round); the noise floor is ``stock_again``'s ratio, and its widest round (max
|round ratio - 1|), for the wall time and for the CPU time.

Ratios mean something only on a quiet machine: the 1-minute load average is printed
before and after each model.

``--calls`` counts instead of timing: each configuration's Python function calls per step
of one fit (``cProfile``), deterministic where times are noisy. On torch, whose steps are
eager, that is where kmix's overhead over stock Keras lies.

Usage (the backend must be JAX or torch; the script says so in one line otherwise):
    KERAS_BACKEND=jax python bench/bench_backends.py [--model mlp|transformer|stack82|all]
        [--rounds 4] [--steps N] [--calls]
    KERAS_BACKEND=torch python bench/bench_backends.py ...

``--steps`` defaults to each model's own count (mlp 10, transformer 10, stack82 100:
a few hundred ms per round on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

BACKEND = os.environ.setdefault("KERAS_BACKEND", "jax")
if BACKEND not in ("jax", "torch"):
    sys.exit(
        f"bench_backends.py measures Keras's JAX or torch backend, but KERAS_BACKEND={BACKEND}: "
        "run it as KERAS_BACKEND=jax (or torch) python bench/bench_backends.py"
    )
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import keras
except ImportError as error:
    sys.exit(f"bench_backends.py: Keras could not load its {BACKEND} backend ({error})")
if keras.backend.backend() != BACKEND:
    sys.exit(
        f"bench_backends.py: Keras loaded the {keras.backend.backend()} backend, not "
        f"{BACKEND} (was keras imported before KERAS_BACKEND was set?)"
    )

import bench_matrix  # noqa: E402
import numpy as np  # noqa: E402
from bench_matrix import (  # noqa: E402  (the same builders and optimizers, one definition)
    CLASSES,
    kmix_optimizer,
    monitor,
    no_callbacks,
    reason,
    stock_optimizer,
)
from bench_optimizer import StepTimer  # noqa: E402

import kmix  # noqa: E402

BOUND = 1.05
"""The bound on kmix's ratio to stock Keras (issue 24 on JAX, issue 33 on torch)."""

JIT = BACKEND == "jax"
"""Keras's default ``jit_compile`` on this backend (what the models must run with)."""

# name -> (title, model factory, default steps per round)
MODELS: dict[str, tuple[str, Callable, int]] = {
    "mlp": (*bench_matrix.MODELS["mlp"], 10),
    "transformer": (
        bench_matrix.MODELS["transformer"][0] + ", attention scores kept (einsum path)",
        functools.partial(bench_matrix.transformer, scores=True),
        10,
    ),
    "stack82": (*bench_matrix.MODELS["deep"], 100),
}

# name -> (description, optimizer factory, callbacks factory taking a log directory)
CONFIGS: dict[str, tuple[str, Callable, Callable[[str], list]]] = {
    "stock": ("stock `keras.mixed_precision.LossScaleOptimizer`", stock_optimizer, no_callbacks),
    "stock_again": ("stock again (second copy: the noise floor)", stock_optimizer, no_callbacks),
    "kmix": ("`kmix.LossScaleOptimizer`", kmix_optimizer, no_callbacks),
    "kmix_monitor": (
        "`kmix.LossScaleOptimizer` + `MixedPrecisionMonitor`",
        kmix_optimizer,
        monitor,
    ),
}


def why_not(error: Exception) -> str:
    """The table's words for a configuration that did not run."""
    return f"FAILED: {reason(error)}"


METRICS = ("median", "mean", "cpu")
"""A round's wall time between batch ends (median, mean) and CPU time (median) per step."""


class CpuStepTimer(StepTimer):
    """``bench_optimizer.StepTimer``, plus the process's CPU time between batch ends.

    CPU time (all threads of the process, XLA's included) does not count time spent waiting
    for a core that another process holds: on a shared machine it is the quieter measure
    of work done, though not of time (work moved off the critical path is still counted).
    """

    def __init__(self) -> None:
        super().__init__()
        self.cpu_times: list[float] = []
        self._cpu_last: float | None = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        now = time.process_time()
        if self._cpu_last is not None:
            self.cpu_times.append(now - self._cpu_last)
        self._cpu_last = now
        super().on_train_batch_end(batch, logs)


def repeated_batch(
    make_model: Callable, steps: int
) -> tuple[keras.Model, np.ndarray, np.ndarray, int]:
    """A model from seed 0 and its one batch repeated ``steps + 1`` times (``steps + 1``
    batch ends: ``steps`` intervals): ``(model, x, y, batch size)``."""
    keras.utils.set_random_seed(0)
    model, x = make_model()
    y = np.random.randint(0, CLASSES, (len(x),)).astype("int32")
    return model, np.concatenate([x] * (steps + 1)), np.concatenate([y] * (steps + 1)), len(x)


class Run:
    """One model copy in one configuration: built, compiled, traced and warmed up."""

    def __init__(self, make_model: Callable, config: str, log_dir: str, steps: int) -> None:
        _, make_optimizer, self.make_callbacks = CONFIGS[config]
        self.log_dir = log_dir
        self.model, self.x, self.y, self.batch = repeated_batch(make_model, steps)
        self.model.compile(
            optimizer=make_optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=1,
        )
        self.measure()  # trace and warm up, with the configuration's callbacks

    def fit(self, *extra: keras.callbacks.Callback) -> None:
        """One epoch over the round's batches, with the configuration's callbacks and ``extra``."""
        self.model.fit(
            self.x,
            self.y,
            batch_size=self.batch,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[*self.make_callbacks(self.log_dir), *extra],
        )

    def measure(self) -> dict[str, float]:
        """One round: each of :data:`METRICS` over its steps, in seconds."""
        timer = CpuStepTimer()
        self.fit(timer)
        return {
            "median": statistics.median(timer.times),
            "mean": statistics.fmean(timer.times),
            "cpu": statistics.median(timer.cpu_times),
        }

    def calls_per_step(self) -> float:
        """Python function calls per step of one fit, counted by ``cProfile`` (deterministic:
        the eager step's Python, where a torch step's overhead is, without the noise of time)."""
        profile = cProfile.Profile()
        profile.enable()
        self.fit()
        profile.disable()
        return pstats.Stats(profile).total_calls / (len(self.x) // self.batch)


def count_calls(name: str, steps: int, root: str) -> None:
    """``--calls``: each configuration's Python calls per step, and the ratio to stock's."""
    title, make_model, _ = MODELS[name]
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")  # after clear_session, which resets it
    counts = {
        config: Run(make_model, config, os.path.join(root, name, config), steps).calls_per_step()
        for config in CONFIGS
    }
    print(f"\n### {title}: Python calls per step ({steps + 1} steps, one fit each)\n")
    print("| configuration | calls per step | ratio to stock |\n|---|---|---|")
    for config, (label, _, _) in CONFIGS.items():
        print(f"| {label} | {counts[config]:,.0f} | {counts[config] / counts['stock']:.3f}× |")


def ratios(times: list[float], base: list[float]) -> list[float]:
    return [t / b for t, b in zip(times, base, strict=True)]


def verdict(ratio: float, floor: float) -> str:
    if ratio <= BOUND:
        return "yes"
    if ratio - 1 <= floor:
        return f"not shown (over {BOUND:.2f}×, inside the noise floor ±{100 * floor:.1f}%)"
    return "no"


def bench(name: str, steps: int, rounds: int, root: str) -> None:
    title, make_model, _ = MODELS[name]
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")  # after clear_session, which resets it
    load_before = os.getloadavg()[0]
    runs: dict[str, Run] = {}
    failed: dict[str, str] = {}
    for config in CONFIGS:
        try:
            runs[config] = Run(make_model, config, os.path.join(root, name, config), steps)
        except Exception as error:  # said in the table; the other configurations run on
            failed[config] = why_not(error)
    if "stock" not in runs:
        print(f"\n### {title}\n\nstock Keras did not run, nothing to compare: {failed['stock']}")
        return
    stock = runs["stock"]
    policy = next(layer for layer in stock.model.layers if layer.weights).dtype_policy.name
    if policy != "mixed_float16" or stock.model.jit_compile is not JIT:
        sys.exit(
            f"bench_backends.py: expected mixed_float16 and jit_compile={JIT}, got {policy}, "
            f"jit_compile={stock.model.jit_compile}"
        )

    times: dict[str, dict[str, list[float]]] = {c: {m: [] for m in METRICS} for c in runs}
    for round_index in range(rounds):
        order = list(runs) if round_index % 2 == 0 else list(reversed(runs))  # ABBA
        for config in order:
            if config not in runs:
                continue
            try:
                measured = runs[config].measure()
            except Exception as error:
                failed[config] = why_not(error)
                del runs[config], times[config]
                if config == "stock":
                    print(f"\n### {title}\n\nstock Keras failed: {failed[config]}")
                    return
                continue
            for metric, value in measured.items():
                times[config][metric].append(value)
    load_after = os.getloadavg()[0]

    def per_round(config: str, metric: str = "median") -> list[float]:
        return ratios(times[config][metric], times["stock"][metric])

    def floor_of(metric: str) -> float:
        if "stock_again" not in times:
            return float("nan")
        return max(abs(r - 1) for r in per_round("stock_again", metric))

    floor = floor_of("median")
    print(
        f"\n### {title}\n\nbatch {stock.batch}, {len(stock.model.trainable_variables)} "
        f"trainable variables, {policy}, jit_compile={stock.model.jit_compile}, "
        f"steps_per_execution=1, {rounds} rounds x {steps} steps (ABBA); load "
        f"{load_before:.2f} before, {load_after:.2f} after; noise floor (stock again / stock, "
        f"widest round): ±{100 * floor:.1f}% wall, ±{100 * floor_of('cpu'):.1f}% CPU\n"
    )
    print(
        "| configuration | median step (ms) | ratio to stock | per-round ratios "
        f"| ratio, mean step | CPU ms/step | ratio, CPU time | ≤ {BOUND:.2f}× |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for config, (label, _, _) in CONFIGS.items():
        if config in failed:
            print(f"| {label} | – | – | – | – | – | – | {failed[config]} |")
            continue
        rounds_ratios = per_round(config)
        ratio = statistics.median(rounds_ratios)
        judged = {"stock": "", "stock_again": "(noise floor)"}.get(config, verdict(ratio, floor))
        print(
            f"| {label} | {1000 * statistics.median(times[config]['median']):.2f} "
            f"| {ratio:.3f}× | {', '.join(f'{r:.3f}' for r in rounds_ratios)} "
            f"| {statistics.median(per_round(config, 'mean')):.3f}× "
            f"| {1000 * statistics.median(times[config]['cpu']):.2f} "
            f"| {statistics.median(per_round(config, 'cpu')):.3f}× | {judged} |",
            flush=True,
        )


def kmix_source() -> str:
    """The commit of the kmix imported, and whether its kmix/ differed from that commit."""
    package = os.path.dirname(os.path.abspath(kmix.__file__))
    try:
        git = ["git", "-C", package]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "."], capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"from {package}, not a git checkout"
    return f"at {head}" + (" with uncommitted changes in kmix/" if dirty else "")


def library_version() -> str:
    """The backend library's version and devices."""
    if BACKEND == "jax":
        import jax

        return f"jax {jax.__version__}, devices {[str(d) for d in jax.devices()]}"
    import torch

    threads, cuda = torch.get_num_threads(), torch.cuda.is_available()
    return f"torch {torch.__version__}, {threads} threads, CUDA {cuda}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=4, help="rounds (ABBA), default 4")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per round and configuration (default: "
        + ", ".join(f"{n} {m[2]}" for n, m in MODELS.items())
        + ")",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="count Python calls per step (cProfile) instead of timing: deterministic",
    )
    args = parser.parse_args()
    for flag in ("rounds", "steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"argument --{flag}: expected an integer >= 1, got {value}")
    print(
        f"kmix bench on {BACKEND}: {library_version()}, Keras {keras.__version__}, kmix "
        f"{kmix.__version__} ({kmix_source()}), {os.cpu_count()} CPUs"
    )
    root = tempfile.mkdtemp(prefix=f"kmix_bench_{BACKEND}_")
    try:
        for name, (_, _, default_steps) in MODELS.items():
            if args.model in ("all", name):
                run = count_calls if args.calls else bench
                run(name, args.steps or default_steps, *([] if args.calls else [args.rounds]), root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
