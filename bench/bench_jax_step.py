"""Issue 24: kmix's compiled train step on JAX against stock Keras's, called directly.

``bench_backends.py`` times ``model.fit``. On the 82-variable stack a step takes about 2 ms,
and on the shared 2-core VM a round of ``fit`` varies by ±30–60 %, which hides a few
per cent. This script leaves ``fit``'s loop out: each configuration's train step is
jitted as ``fit`` jits it (the state donated) and called back to back on one batch; the
configurations take turns in many short rounds (ABBA), and a ratio is the median over
rounds of the CPU time per call (all threads, ``time.process_time``) against stock's in
the same round. Wall time per call is kept too. Each step's temporary memory, as XLA
compiled it (``memory_analysis().temp_size_in_bytes``), is printed against stock's.

Configurations (one model copy each, same seed and weights, ``mixed_float16``):

* ``stock``, ``stock_again``: ``keras.mixed_precision.LossScaleOptimizer(Adam)``; the
  second copy gives this run's noise floor.
* ``kmix``: ``kmix.LossScaleOptimizer(Adam)``, the step ``fit`` runs without callbacks.
* ``kmix_quiet``: the same with ``MixedPrecisionMonitor``'s tap, the step ``fit`` runs
  where statistics are not due (99 steps in 100 at its default ``update_freq=100``).
* ``kmix_measuring``: the step it runs where they are due (1 in 100), which measures its
  own forward pass.

Models: those of ``bench_backends.py`` (``mlp``, ``transformer``, ``stack82``).

Usage (the backend must be JAX):
    KERAS_BACKEND=jax python bench/bench_jax_step.py [--model mlp|transformer|stack82|all]
        [--rounds 40] [--calls 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_backends as bench_jax  # noqa: E402  (it refuses another backend, in one line)
import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from bench_matrix import CLASSES, kmix_optimizer, stock_optimizer  # noqa: E402

import kmix  # noqa: E402
from kmix.optimizer import jax_train_function as _jax_train_function

CONFIGS = ("stock", "stock_again", "kmix", "kmix_quiet", "kmix_measuring")


def jitted_step(make_model: Any, config: str, log_dir: str) -> tuple[Any, tuple, tuple]:
    """``(jitted step, state, batch)`` of one model copy in ``config``, traced and run once."""
    keras.utils.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model, x = make_model()
    y = np.random.randint(0, CLASSES, (len(x),)).astype("int32")
    stock = config.startswith("stock")
    model.compile(
        optimizer=stock_optimizer() if stock else kmix_optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # builds; kmix wraps the step
    step = model.train_step
    if config in ("kmix_quiet", "kmix_measuring"):
        monitor = kmix.callbacks.MixedPrecisionMonitor(log_dir, verbose=0)
        monitor.set_model(model)
        monitor.on_train_begin()  # taps the model, as during fit
        measuring = config == "kmix_measuring"
        step = _jax_train_function._variant(model.optimizer, model.train_step, measuring)
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    data = (jax.numpy.asarray(x), jax.numpy.asarray(y))
    jitted = jax.jit(step, donate_argnums=0)
    _, state = jitted(state, data)
    jax.block_until_ready(state)
    return jitted, state, data


def bench(name: str, rounds: int, calls: int, root: str) -> None:
    title, make_model, _ = bench_jax.MODELS[name]
    runs = {c: list(jitted_step(make_model, c, os.path.join(root, name, c))) for c in CONFIGS}
    memory = {
        c: jitted.lower(state, data).compile().memory_analysis().temp_size_in_bytes
        for c, (jitted, state, data) in runs.items()
    }
    cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
    wall: dict[str, list[float]] = {c: [] for c in CONFIGS}
    load = os.getloadavg()[0]
    for r in range(rounds):
        for c in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            jitted, state, data = runs[c]
            started_cpu, started = time.process_time(), time.perf_counter()
            for _ in range(calls):
                _, state = jitted(state, data)
            jax.block_until_ready(state)
            cpu[c].append((time.process_time() - started_cpu) / calls)
            wall[c].append((time.perf_counter() - started) / calls)
            runs[c][1] = state
    print(f"\n### {title}\n")
    print(
        f"{rounds} rounds x {calls} calls (ABBA); load {load:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after\n"
    )
    print(
        "| configuration | CPU µs/call | ratio, CPU time | wall µs/call | ratio, wall "
        "| temporary memory (MB) | ≤ 1.05× (CPU) |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in CONFIGS:
        ratio_cpu = statistics.median(a / b for a, b in zip(cpu[c], cpu["stock"], strict=True))
        ratio_wall = statistics.median(a / b for a, b in zip(wall[c], wall["stock"], strict=True))
        verdict = "" if c == "stock" else ("yes" if ratio_cpu <= bench_jax.BOUND else "no")
        print(
            f"| {c} | {statistics.median(cpu[c]) * 1e6:.0f} | {ratio_cpu:.3f}× | "
            f"{statistics.median(wall[c]) * 1e6:.0f} | {ratio_wall:.3f}× | "
            f"{memory[c] / 1e6:.2f} | {verdict} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*bench_jax.MODELS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=40, help="rounds (ABBA), default 40")
    parser.add_argument("--calls", type=int, default=50, help="calls per round, default 50")
    args = parser.parse_args()
    for flag in ("rounds", "calls"):
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag}: expected an integer >= 1, got {getattr(args, flag)}")
    print(
        f"kmix's step on JAX: jax {jax.__version__}, Keras {keras.__version__}, kmix "
        f"{kmix.__version__} ({bench_jax.kmix_source()}), {os.cpu_count()} CPUs"
    )
    with tempfile.TemporaryDirectory(prefix="kmix_bench_jax_step_") as root:
        for name in bench_jax.MODELS:
            if args.model in ("all", name):
                bench(name, args.rounds, args.calls, root)


if __name__ == "__main__":
    main()
