"""Issue 13's cost matrix: kmix against stock Keras mixed precision, five models, one process.

For each model below, trains one copy per configuration in ``mixed_float16`` (Adam,
random data, one batch repeated through ``tf.data``) and alternates the configurations
round by round, so that machine noise hits all of them alike. Prints one markdown table
per model: each configuration's mean step time, its ratio to stock Keras, and issue
13's target with whether this run met it.

Models (batch sizes chosen so that a CPU step takes 2-300 ms):

* ``mlp``: 784-1024-1024-10, batch 256 (``bench_optimizer.mlp``).
* ``cnn16``: the "16x16 CNN", conv32-pool-conv64-GAP-dense on 16x16x3, batch 256.
* ``rescnn``: residual CNN with BatchNormalization, a conv stem and 3 residual blocks
  of 32 channels on 16x16x3, batch 32.
* ``transformer``: small Transformer encoder on integer tokens (vocabulary 1000,
  sequence 32, width 64, 4 heads): Embedding, then blocks of MultiHeadAttention,
  LayerNormalization and a Dense feed-forward, a final LayerNormalization, pooled,
  Dense(10); 4 blocks so that it has about 70 variables (69), as issue 11 asks
  (2 blocks would have 37), batch 32.
* ``deep``: 41 x Dense(16), 82 variables, batch 256 (``bench_optimizer.deep``).

Configurations (``stock`` always runs: the ratios are to it):

* ``stock``: ``keras.mixed_precision.LossScaleOptimizer(Adam)``, no callbacks.
* ``optimizer``: ``kmix.LossScaleOptimizer(Adam)``, no callbacks.
* ``monitor``: + ``kmix.callbacks.MixedPrecisionMonitor(tmpdir, verbose=0)`` (defaults).
* ``everything``: + the monitor with ``histogram_freq=100`` and
  ``kmix.callbacks.LossScaleGuard(verbose=0)`` (defaults otherwise: check every step).
* ``monitor_histograms`` and ``monitor_guard``: the two halves of ``everything``, to
  tell their costs apart (only with ``--config``).
* ``autopilot``: ``monitor`` + ``kmix.callbacks.PrecisionAutopilot()`` (proactive: it
  asks for statistics every 100 steps, its default, as the monitor does);
  ``autopilot_reactive``: with ``proactive=False``
  (issue 22: ratio to ``monitor`` ≤ 1.01×; only with ``--config``).

``--jit`` compiles every configuration with ``jit_compile=True`` (default: off, Keras's
default on CPU).

Timing: each model copy is warmed up first (``fit`` for 3 epochs of one batch, with its
configuration's callbacks, so everything is traced). Each round then fits ``--steps``
steps per configuration; the round's step time is the MEAN time between batch ends over
the fit, first to last, so the monitor's read every 100 steps (and the histograms'
write) is paid, not hidden by a median. The ratio is the median over rounds of (the
configuration's round time / stock's round time in the same round). The step-time
column is the median over rounds of the round times. Callbacks get fresh instances for
every fit (the same log directory per model and configuration).

Note: the timer is itself a callback with a batch hook and without ``async_safe``, so
Keras dispatches batch hooks synchronously in every configuration, stock included;
all configurations pay that alike, and it is what a user with any such callback gets.

``--copies N`` builds N model copies per configuration that take turns round by round: a
copy can stay a few percent faster or slower than an identical one for a whole run
(memory placement), which the median over rounds of one copy cannot remove.

Ratios mean something only on an otherwise idle machine: the 1-minute load average is
printed before and after each model; judge on a quiet machine, twice (issue 13).

Usage:
    python bench/bench_matrix.py [--model mlp,cnn16,rescnn,transformer,deep]
        [--config optimizer,monitor,everything] [--steps 300] [--rounds 5] [--jit]
        [--copies 1]

e.g. ``python bench/bench_matrix.py`` (everything, a long run) or
``python bench/bench_matrix.py --model deep --jit --steps 300 --rounds 5``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from bench_optimizer import deep, mlp  # noqa: E402

import kmix  # noqa: E402

CLASSES = 10


def cnn16() -> tuple[keras.Model, np.ndarray]:
    """The "16x16 CNN": two convolutions on 16x16x3 inputs."""
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(CLASSES, dtype="float32"),
        ]
    )
    return model, np.random.rand(256, 16, 16, 3).astype("float32")


def rescnn(blocks: int = 3, width: int = 32) -> tuple[keras.Model, np.ndarray]:
    """Residual CNN with BatchNormalization: conv stem, ``blocks`` residual blocks."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    for _ in range(blocks):
        y = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.ReLU()(y)
        y = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
        y = keras.layers.BatchNormalization()(y)
        x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(CLASSES, dtype="float32")(x)
    model = keras.Model(inputs, outputs)
    return model, np.random.rand(32, 16, 16, 3).astype("float32")


def transformer(
    blocks: int = 4,
    vocab: int = 1000,
    seq: int = 32,
    width: int = 64,
    heads: int = 4,
    scores: bool = False,
) -> tuple[keras.Model, np.ndarray]:
    """Small Transformer encoder on integer tokens; 16 variables per block (69 at 4).

    ``scores=True`` has MultiHeadAttention return its attention scores too (dropped): the
    layer then takes its explicit einsum path instead of ``ops.dot_product_attention``,
    which Keras 3.15's JAX backend cannot compile on a CPU in float16 ("The precision
    'F16_F16_F32' is not supported by dot_general on CPU"); same variables, same math.
    """
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, width)(tokens)
    for _ in range(blocks):
        attention_layer = keras.layers.MultiHeadAttention(heads, width // heads)
        if scores:
            attention, _ = attention_layer(x, x, return_attention_scores=True)
        else:
            attention = attention_layer(x, x)
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attention]))
        ffn = keras.layers.Dense(2 * width, activation="relu")(x)
        ffn = keras.layers.Dense(width)(ffn)
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, ffn]))
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(CLASSES, dtype="float32")(x)
    model = keras.Model(tokens, outputs)
    return model, np.random.randint(0, vocab, (32, seq)).astype("int32")


# name -> (title, model factory)
MODELS: dict[str, tuple[str, Callable[[], tuple[keras.Model, np.ndarray]]]] = {
    "mlp": ("MLP 784-1024-1024-10", mlp),
    "cnn16": ("CNN 16x16x3, conv32-conv64", cnn16),
    "rescnn": ("Residual CNN with BatchNormalization, 3 blocks, 16x16x3", rescnn),
    "transformer": ("Transformer encoder, 4 blocks, width 64, sequence 32", transformer),
    "deep": ("41 x Dense(16), 82 variables", deep),
}


def stock_optimizer() -> keras.Optimizer:
    return keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())


def kmix_optimizer() -> keras.Optimizer:
    return kmix.LossScaleOptimizer(keras.optimizers.Adam())


def no_callbacks(log_dir: str) -> list:
    return []


def monitor(log_dir: str) -> list:
    return [kmix.callbacks.MixedPrecisionMonitor(log_dir, verbose=0)]


def autopilot(log_dir: str) -> list:
    return monitor(log_dir) + [kmix.callbacks.PrecisionAutopilot()]


def autopilot_reactive(log_dir: str) -> list:
    return monitor(log_dir) + [kmix.callbacks.PrecisionAutopilot(proactive=False)]


def monitor_histograms(log_dir: str) -> list:
    return [kmix.callbacks.MixedPrecisionMonitor(log_dir, histogram_freq=100, verbose=0)]


def monitor_guard(log_dir: str) -> list:
    return [
        kmix.callbacks.MixedPrecisionMonitor(log_dir, verbose=0),
        kmix.callbacks.LossScaleGuard(verbose=0),
    ]


def everything(log_dir: str) -> list:
    return [
        kmix.callbacks.MixedPrecisionMonitor(log_dir, histogram_freq=100, verbose=0),
        kmix.callbacks.LossScaleGuard(verbose=0),
    ]


# name -> (description, optimizer factory, callbacks factory taking a log directory)
CONFIGS: dict[str, tuple[str, Callable[[], keras.Optimizer], Callable[[str], list]]] = {
    "stock": ("stock Keras mixed precision, no callbacks", stock_optimizer, no_callbacks),
    "stock_again": (
        "stock Keras again (a second model: the noise floor of this run)",
        stock_optimizer,
        no_callbacks,
    ),
    "optimizer": ("kmix optimizer alone, no callbacks", kmix_optimizer, no_callbacks),
    "monitor": ("kmix optimizer + MixedPrecisionMonitor (defaults)", kmix_optimizer, monitor),
    "autopilot": (
        "kmix optimizer + monitor (defaults) + PrecisionAutopilot (defaults: proactive)",
        kmix_optimizer,
        autopilot,
    ),
    "autopilot_reactive": (
        "kmix optimizer + monitor (defaults) + PrecisionAutopilot(proactive=False)",
        kmix_optimizer,
        autopilot_reactive,
    ),
    "monitor_histograms": (
        "kmix optimizer + monitor (histogram_freq=100), no guard (a part of everything)",
        kmix_optimizer,
        monitor_histograms,
    ),
    "monitor_guard": (
        "kmix optimizer + monitor (defaults) + LossScaleGuard (a part of everything)",
        kmix_optimizer,
        monitor_guard,
    ),
    "everything": (
        "kmix optimizer + monitor (histogram_freq=100) + LossScaleGuard",
        kmix_optimizer,
        everything,
    ),
}


DEFAULT_CONFIGS = ["stock_again", "optimizer", "monitor", "everything"]
"""What runs without ``--config``: issue 13's configurations and the noise floor."""


def target(model: str, config: str, jit: bool) -> float | None:
    """Issue 13's bound on the ratio to stock, or None where it sets none."""
    if config in ("stock", "stock_again") or config not in DEFAULT_CONFIGS:
        return None
    if jit:
        return 1.02
    if model == "deep":
        return {"optimizer": 1.05, "everything": 1.10}.get(config)
    return {"optimizer": 1.02, "monitor": 1.03, "everything": 1.05}.get(config)


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


class Run:
    """One model copy in one configuration, built, compiled and warmed up."""

    def __init__(self, make_model: Callable, config: str, log_dir: str, jit: bool) -> None:
        _, make_optimizer, self.make_callbacks = CONFIGS[config]
        self.log_dir = log_dir
        import tensorflow as tf  # here, not at the top: bench_backends.py imports the builders

        keras.utils.set_random_seed(0)
        self.model, x = make_model()
        y = np.random.randint(0, CLASSES, (len(x),))
        self.data = tf.data.Dataset.from_tensors((x, y)).repeat()
        self.model.compile(
            optimizer=make_optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit,
        )
        self.batch = len(x)
        self.fit(steps=1, epochs=3)  # trace and warm up, with the callbacks

    def fit(self, steps: int, epochs: int = 1, timer: StepTimer | None = None) -> None:
        callbacks = self.make_callbacks(self.log_dir)
        self.model.fit(
            self.data,
            steps_per_epoch=steps,
            epochs=epochs,
            verbose=0,
            shuffle=False,
            callbacks=callbacks + ([timer] if timer else []),
        )

    def measure(self, steps: int) -> float:
        timer = StepTimer()
        self.fit(steps, timer=timer)
        return timer.mean


def reason(error: Exception) -> str:
    """One line saying why a configuration failed (TensorFlow's message, not its preamble)."""
    skip = ("Graph execution error", "Detected at node", "<stack traces")
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    line = next((ln for ln in lines if not ln.startswith(skip)), "")
    return f"{type(error).__name__}: {line[:160]}"


def bench(
    name: str, configs: list[str], steps: int, rounds: int, jit: bool, root: str, copies: int = 1
) -> None:
    title, make_model = MODELS[name]
    load_before = os.getloadavg()[0]
    runs: dict[str, list[Run]] = {}
    failed: dict[str, str] = {}
    for config in configs:
        try:
            runs[config] = [
                Run(make_model, config, os.path.join(root, name, config, str(copy)), jit)
                for copy in range(copies)
            ]
        except Exception as error:  # reported in the table; the other configurations run on
            failed[config] = reason(error)
            if config == "stock":
                print(f"\n### {title}\n\nstock Keras failed, nothing to compare: {failed[config]}")
                return
    times: dict[str, list[float]] = {c: [] for c in runs}
    for round_index in range(rounds):
        for config, copies_of_config in list(runs.items()):
            run = copies_of_config[round_index % len(copies_of_config)]  # copies take turns
            try:
                times[config].append(run.measure(steps))
            except Exception as error:
                failed[config] = reason(error)
                del runs[config], times[config]
                if config == "stock":
                    print(f"\n### {title}\n\nstock Keras failed: {failed[config]}")
                    return
    load_after = os.getloadavg()[0]

    stock = runs["stock"][0]
    print(
        f"\n### {title}\n\nbatch {stock.batch}, "
        f"{len(stock.model.trainable_variables)} trainable variables, mixed_float16, "
        f"jit_compile={jit}, {rounds} rounds x {steps} steps, {copies} model copies per "
        f"configuration; "
        f"load {load_before:.2f} before, {load_after:.2f} after\n"
    )
    print("| configuration | mean step (ms) | ratio to stock | target | met |")
    print("|---|---|---|---|---|")
    base = times["stock"]
    for config in configs:
        bound = target(name, config, jit)
        goal = f"≤ {bound:.2f}×" if bound is not None else ""
        if config not in ("stock", "stock_again") and bound is None:
            goal = "(none set)"
        if config in failed:
            print(f"| {CONFIGS[config][0]} | – | – | {goal} | FAILED: {failed[config]} |")
            continue
        values = times[config]
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        met = "" if bound is None else ("yes" if ratio <= bound else "no")
        print(
            f"| {CONFIGS[config][0]} | {1000 * statistics.median(values):.2f} "
            f"| {ratio:.3f}× | {goal} | {met} |",
            flush=True,
        )
    for config in ("autopilot", "autopilot_reactive"):
        if config in times and "monitor" in times:
            pairs = zip(times[config], times["monitor"], strict=True)
            ratio = statistics.median(a / m for a, m in pairs)
            print(f"\n{config} / monitor, median over rounds: {ratio:.3f}× (issue 22: ≤ 1.01×)")


def names(value: str, known: dict) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        type=lambda v: names(v, MODELS),
        default=list(MODELS),
        help=f"comma-separated, from {','.join(MODELS)} (default: all)",
    )
    parser.add_argument(
        "--config",
        type=lambda v: names(v, CONFIGS),
        default=DEFAULT_CONFIGS,
        help=f"comma-separated, from {','.join(CONFIGS)} (default: "
        f"{','.join(DEFAULT_CONFIGS)}; stock always runs)",
    )
    parser.add_argument("--steps", type=int, default=300, help="steps per round and config")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jit", action="store_true", help="compile with jit_compile=True")
    parser.add_argument(
        "--copies", type=int, default=1, help="model copies per configuration, taking turns"
    )
    args = parser.parse_args()
    if args.copies < 1:
        parser.error(f"argument --copies: expected an integer >= 1, got {args.copies}")
    configs = ["stock"] + [c for c in CONFIGS if c in args.config and c != "stock"]

    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_float16")
    print(
        f"kmix bench matrix: TF {tf.__version__}, Keras {keras.__version__}, "
        f"{os.cpu_count()} CPUs, --steps {args.steps} --rounds {args.rounds}"
        + (" --jit" if args.jit else "")
    )
    root = tempfile.mkdtemp(prefix="kmix_matrix_")
    try:
        for name in MODELS:
            if name in args.model:
                bench(name, configs, args.steps, args.rounds, args.jit, root, args.copies)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
