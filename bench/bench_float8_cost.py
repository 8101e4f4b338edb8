"""What float8 monitoring costs on healthy steps (issue 35): the same monitor with and
without it, side by side in one process, alternated round by round.

Two copies of one float8 MLP (``model.quantize("float8")`` over ``mixed_float16``, the
model of ``bench_float8.py``), each compiled with ``kmix.LossScaleOptimizer`` and watched
by ``MixedPrecisionMonitor(update_freq=N)``:

- float8 on: kmix as shipped: the fused saturation check in every step, the output
  gradients following the loss scale, and the monitor writing ``kmix/fp8_*`` at each read;
- float8 off: the same optimizer with its float8 state never built (no check, no record,
  no rescale: ``opt.float8.build`` is a no-op here) and the monitor's float8 part
  switched off (``monitor._float8.write`` is a no-op).

Each round fits both once more on the same batches (ABBA order); the time counted runs
from the end of batch ``--skip`` to the end of the last, so reads and writes inside it are
counted, train begin and end are not.

Healthy steps (the default): Adam's learning rate is 0 and every batch is one batch, so
each step runs every op of a training step while no amax moves. The batch is the first
whose steady state saturates nothing (:func:`steady_batch`; where no batch is, the same
search with the kernels' largest |values| made powers of two, :func:`steady_model`):
delayed scaling's margin of 0 puts a steady amax at its limit, and float32's rounding of
Keras's scale clips some amaxes by a hair at every step, which is a saturation, so not a
healthy step. Steadiness is judged on a short fit: the script prints
the saturated steps of the timed fits; growth is every 2000 steps. With ``--training``
the model learns (Adam 1e-3, fresh batches): delayed scaling then clips a tensor whenever
its amax exceeds every earlier one, which on this toy is most steps, and each such step
runs the step record's full branch (the cost of a saturated step, not of a healthy one).

Usage:
    python bench/bench_float8_cost.py [--steps 300] [--rounds 6] [--update-freq 100]
        [--width 128] [--training]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from bench_float8 import BATCH, data, model  # noqa: E402

import kmix  # noqa: E402
from kmix.float8 import float8_tensors  # noqa: E402


class Clock(keras.callbacks.Callback):
    """Seconds per step from the end of batch ``skip`` to the end of the last batch."""

    def __init__(self, skip: int) -> None:
        super().__init__()
        self.skip = skip
        self.per_step: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.skip:
            self._start = time.perf_counter()
        self._last, self._batches = time.perf_counter(), batch

    def on_train_end(self, logs=None):
        self.per_step.append((self._last - self._start) / (self._batches - self.skip))


KINDS = ("float8 on", "float8 off", "step only")
"""``step only``: the optimizer's float8 check on, the monitor's float8 part off (where
the cost sits)."""


def steady_model(width: int, powers_of_two: bool = True) -> keras.Model:
    """``model(width)``, with each float8 layer's kernel scaled so its largest |value| is a
    power of two where ``powers_of_two``: Keras's scale set from such an amax gives back a
    limit equal to it (the kernel, fixed at learning rate 0, then never clips by a
    rounding)."""
    m = model(width)
    if not powers_of_two:
        return m
    for layer in m.layers:
        if hasattr(layer, "kernel_amax_history"):
            kernel = keras.ops.convert_to_numpy(layer.kernel)
            top = float(np.max(np.abs(kernel)))
            layer.kernel.assign(kernel * np.float32(2.0 ** round(np.log2(top)) / top))
    return m


def contender(kind: str, update_freq: int, width: int, learning_rate: float, powers: bool):
    m = steady_model(width, powers)
    inner = keras.optimizers.Adam(learning_rate)
    opt = kmix.LossScaleOptimizer(inner, dynamic_growth_steps=2000)
    if kind == "float8 off":
        opt.float8.build = lambda *args, **kwargs: None  # no check, no record, no rescale
    m.compile(optimizer=opt, loss="mse")
    monitor = kmix.callbacks.MixedPrecisionMonitor(
        tempfile.mkdtemp(), update_freq=update_freq, verbose=0
    )
    if kind != "float8 on":
        monitor._float8.write = lambda *args, **kwargs: None
    return m, monitor


def steady_batch(x, y, width: int, tries: int = 20) -> tuple[int, bool]:
    """The first batch of ``x, y`` on which, repeated at learning rate 0, no float8 tensor
    saturates after an 8-step warm-up (12 steps tried), nor will once the warm-up's amaxes
    leave the history: each tensor's steady amax is at or under the limit of the scale
    Keras sets from it (``1 / (max / amax) * max`` in float32).

    Returns:
        ``(batch, powers)``: the batch, and whether the kernels need :func:`steady_model`'s
        powers of two (tried only where no batch is steady without).

    Raises:
        SystemExit: none of the first ``tries`` batches is steady.
    """
    for powers, b in [(p, b) for p in (False, True) for b in range(tries)]:
        rows = slice(b * BATCH, (b + 1) * BATCH)
        xb, yb = np.tile(x[rows], (12, 1)), np.tile(y[rows], (12, 1))
        m = steady_model(width, powers)
        opt = kmix.LossScaleOptimizer(keras.optimizers.Adam(0.0), dynamic_growth_steps=2000)
        m.compile(optimizer=opt, loss="mse")
        m.fit(xb, yb, batch_size=BATCH, verbose=0, shuffle=False)
        values = [keras.ops.convert_to_numpy(v) for v in m.trainable_variables]
        f32 = np.float32
        steady = [
            (f32(values[t.history_index][0]), f32(t.format_max))
            for t in float8_tensors(m.trainable_variables)
        ]
        at_limit = all(f32(1) / (fmax / amax) * fmax >= amax for amax, fmax in steady)
        if at_limit and not opt.float8_saturations(since_step=8):
            return b, powers
    raise SystemExit(f"bench_float8_cost: none of the first {tries} batches is steady")


def one_copy(args: argparse.Namespace, x, y, learning_rate: float, powers: bool) -> None:
    """Float8 monitoring on and off in one model copy (no copy-to-copy noise), by round.

    Off hides the optimizer's float8 record (``active`` is False: no check, no record, no
    rescale; its variables stay) and the monitor's float8 write, and retraces the train
    step; on gives both back and retraces again. The retrace falls in the untimed batches.
    """
    m, monitor = contender("float8 on", args.update_freq, args.width, learning_rate, powers)
    m.fit(x[: 4 * BATCH], y[: 4 * BATCH], batch_size=BATCH, verbose=0, callbacks=[monitor])
    state, write = m.optimizer.float8, monitor._float8.write
    record, clocks = state.record, {"float8 on": Clock(args.skip), "float8 off": Clock(args.skip)}
    for r in range(args.rounds):
        for kind in list(clocks) if r % 2 == 0 else list(clocks)[::-1]:
            on = kind == "float8 on"
            state.record = record if on else None
            monitor._float8.write = write if on else (lambda *a, **k: None)
            m.make_train_function(force=True)
            m.fit(
                x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[monitor, clocks[kind]]
            )
    on, off = (clocks[k].per_step for k in clocks)
    print(f"one copy, width {args.width}, {args.steps} steps a fit, {args.rounds} rounds")
    for kind, times in clocks.items():
        joined = " ".join(f"{t * 1e3:.2f}" for t in times.per_step)
        print(f"  {kind:<10}: {joined} ms; median {statistics.median(times.per_step) * 1e3:.3f}")
    print(
        f"float8 on / off: x{statistics.median(on) / statistics.median(off):.3f} by medians, "
        f"x{statistics.median([a / b for a, b in zip(on, off, strict=True)]):.3f} per round"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--update-freq", type=int, default=100)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--width", type=int, default=128, help="the hidden layers' width")
    parser.add_argument(
        "--training", action="store_true", help="learn (saturating steps), not healthy steps"
    )
    parser.add_argument(
        "--one-copy", action="store_true", help="one model, float8 monitoring toggled by round"
    )
    args = parser.parse_args()
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(args.steps)
    powers = False  # the kernels as built
    if not args.training:  # one steady batch again and again: no amax moves
        b, powers = steady_batch(x, y, args.width)
        rows = slice(b * BATCH, (b + 1) * BATCH)
        x, y = np.tile(x[rows], (args.steps, 1)), np.tile(y[rows], (args.steps, 1))
        kernels = ", kernels' max made powers of two" if powers else ""
        print(f"healthy steps: batch {b} repeated, Adam at learning rate 0{kernels}")
    learning_rate = 1e-3 if args.training else 0.0
    if args.one_copy:
        one_copy(args, x, y, learning_rate, powers)
        return
    runs = {}
    for kind in KINDS:
        m, monitor = contender(kind, args.update_freq, args.width, learning_rate, powers)
        m.fit(x[: 4 * BATCH], y[: 4 * BATCH], batch_size=BATCH, verbose=0, callbacks=[monitor])
        runs[kind] = (m, monitor, Clock(args.skip))
    assert not runs["float8 off"][0].optimizer.float8.active
    assert runs["float8 on"][0].optimizer.float8.active
    warmed = {kind: runs[kind][0].optimizer.read_state() for kind in KINDS}
    for r in range(args.rounds):
        for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
            m, monitor, clock = runs[kind]
            m.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[monitor, clock])
    median = {kind: statistics.median(runs[kind][2].per_step) for kind in KINDS}
    print(
        f"backend {keras.backend.backend()}, width {args.width}, {args.steps} steps a fit, "
        f"{args.rounds} rounds, {'training' if args.training else 'healthy steps'}"
    )
    for kind in ("float8 on", "step only"):  # what the timed fits' steps were
        opt, since = runs[kind][0].optimizer, warmed[kind]
        saturated = {s.step for s in opt.float8_saturations(since_step=since.attempted_steps)}
        state = opt.read_state()
        print(
            f"  {kind:<10}: {len(saturated)} of {state.attempted_steps - since.attempted_steps}"
            f" steps of the timed fits saturated a float8 tensor"
            f"{f' (steps {sorted(saturated)})' if 0 < len(saturated) <= 10 else ''}, "
            f"{state.skipped_steps - since.skipped_steps} skipped"
        )
    for kind in KINDS:
        times = " ".join(f"{t * 1e3:.2f}" for t in runs[kind][2].per_step)
        print(f"  {kind:<10}: {times} ms; median {median[kind] * 1e3:.3f}")
    off = median["float8 off"]
    print(
        f"median ratio to float8 off: float8 on x{median['float8 on'] / off:.3f}, "
        f"step only x{median['step only'] / off:.3f}"
    )


if __name__ == "__main__":
    main()
