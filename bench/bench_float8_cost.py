"""What float8 monitoring costs on healthy steps (issue 35): kmix with and without it on one
model, side by side in one process, with the method's own noise floor measured alongside.

One float8 MLP (``model.quantize("float8")`` over ``mixed_float16``, the model of
``bench_float8.py``), compiled with ``kmix.LossScaleOptimizer`` and watched by
``MixedPrecisionMonitor(update_freq=N)``. Its train step is traced ``--traces`` times for
each contender and every trace is kept:

- float8 on: kmix as shipped: the fused saturation check in every step, the output
  gradients following the loss scale, and the monitor writing ``kmix/fp8_*`` at each read;
- float8 off: the same optimizer with its float8 record hidden (``active`` is False: no
  check, no record, no rescale; the variables stay) and the monitor's float8 write a no-op.

Each round fits once per trace, in a rotating order: on, off, and off again (the off step's
own traces: what two identical contenders differ by on this machine). Two traces of one
step can differ by several per cent in direct calls, a difference that stays with the
trace, so one trace per contender measures its traces' luck as much as the cost: each
contender's step time in a round is the geometric mean over its traces. A fit runs
``--skip`` untimed steps, then ``N`` timed ones, so each timed window holds exactly one
monitor read. Each round's ratio to off is paired (neighbours in time share the machine's
slow drifts); the verdict is their median with a 95 % bootstrap interval that draws both
the traces (each contender's, with replacement) and the rounds, so the traces' spread is
in it: met where the interval's top is at most the goal, missed where its bottom is above
it, else not decided at this run's noise (run more rounds or traces). By parts, from the
same run: the monitor's float8
write (timed at each read) and the step's op count with and without
(``count_step_ops.count``: the ops every step runs, and those only a branch runs).

With ``--dose K`` a fourth contender makes the step's float8 part K times: the check in
every step (:func:`dosed`) and the float8 write in the step record's full branch, which
runs at the steps the monitor's statistics are due (:func:`written`), each copy writing a
record of its own. So a copy brings what float8 monitoring brings to a step: the check's
ops, the branch's ops, and the two more variables that the step may assign (a step compiled
with XLA touches each such variable at every execution, taken branch or not: about 10 us a
variable on a 2-core CPU, measured with ``tf.function(jit_compile=True)``). Its difference
to float8 on is K - 1 copies, so one copy's cost comes with the traces' luck divided by
K - 1 (:func:`per_copy`). The cost by parts is that share scaled up to the ops the float8
part adds outside branches (each costing what a copy's ops cost on average), plus the
monitor's float8 write, with its own 95 % interval and verdict. Under ``--jit-compile``
XLA may merge the copies' slices of one amax history (one float each), which a copy then
does not pay again.

Healthy steps (the default): Adam's learning rate is 0 and every batch is one batch, so
each step runs every op of a training step while no amax moves. The batch is the first
whose steady state saturates nothing (:func:`steady_batch`; where no batch is, the same
search with the kernels' largest |values| made powers of two, :func:`steady_model`):
delayed scaling's margin of 0 puts a steady amax at its limit, and float32's rounding of
Keras's scale clips some amaxes by a hair at every step, which is a saturation, so not a
healthy step. The script prints the saturated steps of the timed fits; growth is every
2000 steps. With ``--training`` the model learns (Adam 1e-3, fresh batches): delayed
scaling then clips a tensor whenever its amax exceeds every earlier one, which on this toy
is most steps, and each such step runs the step record's full branch (the cost of a
saturated step, not of a healthy one).

Usage:
    python bench/bench_float8_cost.py [--rounds 100] [--traces 3] [--dose 33]
        [--update-freq 100] [--skip 10] [--width 128] [--training] [--jit-compile]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from bench_float8 import BATCH, data, model  # noqa: E402

import kmix  # noqa: E402
import kmix.float8.state  # noqa: E402
from kmix.float8 import Float8State, float8_tensors  # noqa: E402
from kmix.float8.saturation import StoredRecord, check_step  # noqa: E402

GOAL = 1.03
"""Float8 monitoring's cost on healthy steps, at most (issue 35)."""


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


def watched(
    update_freq: int, width: int, learning_rate: float, powers: bool, jit_compile: bool = False
):
    """The float8 model compiled with kmix's optimizer, and the monitor that watches it."""
    m = steady_model(width, powers)
    opt = kmix.LossScaleOptimizer(keras.optimizers.Adam(learning_rate), dynamic_growth_steps=2000)
    m.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    monitor = kmix.callbacks.MixedPrecisionMonitor(
        tempfile.mkdtemp(), update_freq=update_freq, verbose=0
    )
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


class Contenders:
    """Float8 monitoring on and off on one model: ``traces`` traced train steps for each
    contender (on, off, off again), switched by fit.

    Off hides the optimizer's float8 record (``active`` is False while its step is traced
    and while it runs) and makes the monitor's float8 write a no-op; on gives both back.
    The monitor's float8 write is timed at each read.
    """

    def __init__(self, m: keras.Model, monitor, x, y, traces: int, kinds: dict[str, int]) -> None:
        self.model, self.monitor, self.kinds = m, monitor, kinds
        m.fit(x[: 4 * BATCH], y[: 4 * BATCH], batch_size=BATCH, verbose=0)  # builds the optimizer
        self.record, write = m.optimizer.float8.record, monitor._float8.write
        if self.record is None:
            raise SystemExit("bench_float8_cost: the optimizer keeps no float8 record")
        self.writes: list[float] = []
        self.spares = spare_records(self.record, max(kinds.values()) - 1)

        def timed_write(*args, **kwargs):
            start = time.perf_counter()
            write(*args, **kwargs)
            self.writes.append(time.perf_counter() - start)

        self._write = timed_write
        self.steps = {}
        self.keys = [(kind, k) for k in range(traces) for kind in kinds]
        for key in self.keys:  # each traced by a short fit of its own, contenders interleaved
            self.switch(key)
            m.make_train_function(force=True)
            m.fit(x[: 4 * BATCH], y[: 4 * BATCH], batch_size=BATCH, verbose=0, callbacks=[monitor])
            self.steps[key] = m.train_function
        self.switch(("float8 on", 0))

    def switch(self, key: tuple[str, int]) -> None:
        """To ``(contender, trace)`` (its own traced train step, once all are traced)."""
        copies = self.kinds[key[0]]
        on = copies > 0
        kmix.float8.state.check_step = dosed(copies) if copies > 1 else check_step
        Float8State.write_after = written(copies, self.spares) if copies > 1 else WRITE_AFTER
        self.model.optimizer.float8.record = self.record if on else None
        self.monitor._float8.write = self._write if on else (lambda *args, **kwargs: None)
        if key in self.steps:
            self.model.train_function = self.steps[key]

    def op_counts(self, x, y) -> dict[str, tuple[int, int, int]] | None:
        """TensorFlow: :func:`count_step_ops.count` of the train step of each contender."""
        if keras.backend.backend() != "tensorflow":
            return None
        import tensorflow as tf
        from count_step_ops import count

        spec = tuple(tf.TensorSpec((BATCH, *a.shape[1:]), a.dtype) for a in (x, y))
        counts = {}
        for kind in self.kinds:
            self.switch((kind, 0))
            traced = tf.function(self.model.train_step).get_concrete_function(spec)
            counts[kind] = count(traced.graph.as_graph_def())
        self.switch(("float8 on", 0))
        return counts


CONTENDERS = {"float8 on": 1, "float8 off": 0, "off again": 0}
"""Contender -> copies of the float8 check in its step (0: float8 monitoring off); "off
again" is the off step traced again (the noise floor)."""


def dosed(copies: int):
    """A :func:`check_step` whose step makes the check ``copies`` times (a dose-response
    contender): the first as shipped, each other over the float8 tensors in another order
    (distinct stacks, so no graph optimizer merges them; the same ops and sizes as the
    check), its ``any`` or-ed into the first's ``saturated``. Every copy gives the same
    verdict, so the step records what the shipped step does."""

    def check(tensors, grads, values, applies):
        if math.factorial(len(tensors)) < copies:
            raise SystemExit(
                f"bench_float8_cost: {len(tensors)} float8 tensors: under {copies} orders"
            )
        first = check_step(tensors, grads, values, applies)
        saturated = first.saturated
        for order in itertools.islice(itertools.permutations(range(len(tensors))), 1, copies):
            again = check_step([tensors[i] for i in order], grads, values, applies)
            saturated = keras.ops.logical_or(saturated, keras.ops.any(again.saturated))
        return first._replace(saturated=saturated)

    return check


WRITE_AFTER = Float8State.write_after
"""The float8 write in the step record's full branch, as shipped."""


def written(copies: int, records: Sequence[StoredRecord]):
    """:meth:`Float8State.write_after` made ``copies`` times in the branch: the first as
    shipped, each other into a record of its own (``records``, at least ``copies - 1``)
    with a loss-scale change of 1 (the same ops; the output gradients' state rescaled
    once), so each copy counts the step's saturations as the shipped record does."""

    def write_after(self, check, packed, old_scale, new_scale):
        WRITE_AFTER(self, check, packed, old_scale, new_scale)
        shipped = self.record
        try:
            for record in records[: copies - 1]:
                self.record = record
                WRITE_AFTER(self, check, packed, new_scale, new_scale)
        finally:
            self.record = shipped

    return write_after


def spare_records(record: StoredRecord, count: int) -> list[StoredRecord]:
    """``count`` records of ``record``'s shapes and dtypes, zero (the dosed copies' own)."""
    return [
        StoredRecord(
            *(
                keras.Variable(np.zeros(v.shape, v.dtype), dtype=v.dtype, trainable=False)
                for v in record
            )
        )
        for _ in range(count)
    ]


def round_ratios(times: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Each round's ratio of two contenders' step times, each the geometric mean over its
    traces.

    Args:
        times: seconds a step, ``(traces, rounds)``, of the contender measured.
        base: the same of the contender it is divided by.

    Returns:
        ``(rounds,)`` ratios.
    """
    return np.exp(np.log(times).mean(axis=0) - np.log(base).mean(axis=0))


def bootstrap(statistic, times: list[np.ndarray], draws: int = 2000) -> tuple[float, float, float]:
    """``(value, low, high)``: ``statistic(*times)`` and its 95 % bootstrap interval, each
    draw taking the rounds (the same for all, so rounds stay paired) and each contender's
    traces with replacement (so the traces' own spread widens it).

    Args:
        statistic: ``(traces, rounds)`` arrays, one per contender -> a number.
        times: seconds a step, ``(traces, rounds)``, one array per contender.
        draws: the bootstrap's draws.
    """
    rng = np.random.default_rng(0)
    (traces, rounds), values = times[0].shape, []
    for _ in range(draws):
        picked = rng.integers(rounds, size=rounds)
        drawn = [t[rng.integers(traces, size=traces)][:, picked] for t in times]
        values.append(statistic(*drawn))
    values.sort()
    mid = float(statistic(*times))
    return mid, float(values[int(0.025 * draws)]), float(values[int(0.975 * draws) - 1])


def interval(times: np.ndarray, base: np.ndarray) -> tuple[float, float, float]:
    """The median over rounds of :func:`round_ratios` and its 95 % interval (:func:`bootstrap`)."""
    return bootstrap(lambda t, b: np.median(round_ratios(t, b)), [times, base])


def per_copy(dosed: np.ndarray, on: np.ndarray, off: np.ndarray, copies: int):
    """One copy of the step's float8 part's cost as a share of the off step, from the dose-response:
    the median over rounds of ``(dosed - on) / off / (copies - 1)`` (each contender's
    time in a round the geometric mean over its traces), and its 95 % interval."""
    return bootstrap(
        lambda d, o, b: np.median((round_ratios(d, b) - round_ratios(o, b)) / (copies - 1)),
        [dosed, on, off],
    )


MIN_ROUNDS = 20
"""Rounds below which no verdict is given (a bootstrap of a few values says little)."""


def verdict(low: float, high: float, rounds: int, goal: float = GOAL) -> str:
    """Met, missed, or not decided, from the 95 % interval of the ratio over ``rounds``."""
    if rounds < MIN_ROUNDS:
        return f"not decided: {rounds} rounds, under {MIN_ROUNDS}"
    if high <= goal:
        return f"met (the interval's top is at most {goal})"
    if low > goal:
        return f"missed (the interval's bottom is above {goal})"
    return f"not decided at this noise (the interval holds {goal}): run more rounds or traces"


def run(args: argparse.Namespace, x, y, learning_rate: float, powers: bool) -> None:
    """The rounds, then the verdicts (side by side, and by parts with the dose-response)."""
    m, monitor = watched(args.update_freq, args.width, learning_rate, powers, args.jit_compile)
    kinds = dict(CONTENDERS, **({f"float8 x{args.dose}": args.dose} if args.dose > 1 else {}))
    contenders = Contenders(m, monitor, x, y, args.traces, kinds)
    keys = contenders.keys
    clocks = {key: Clock(args.skip) for key in keys}
    first_step = m.optimizer.read_state().attempted_steps
    for r in range(args.rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            contenders.switch(key)
            m.fit(
                x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[monitor, clocks[key]]
            )
    contenders.switch(("float8 on", 0))
    saturated = {s.step for s in m.optimizer.float8_saturations(since_step=first_step)}
    state = m.optimizer.read_state()
    print(
        f"backend {keras.backend.backend()}, width {args.width}, "
        f"{'training' if args.training else 'healthy steps'}, "
        f"jit_compile {args.jit_compile}, {args.rounds} rounds of {args.traces} traces per "
        f"contender, {args.skip} + {args.update_freq} steps a fit, update_freq {args.update_freq}"
    )
    print(
        f"  {len(saturated)} of {state.attempted_steps - first_step} steps saturated a float8 "
        f"tensor{f' (steps {sorted(saturated)})' if 0 < len(saturated) <= 10 else ''}, "
        f"{state.skipped_steps} skipped in all"
    )
    times = {
        kind: np.array([clocks[(kind, k)].per_step for k in range(args.traces)]) for kind in kinds
    }
    off = times["float8 off"]
    for kind, per_trace in times.items():
        medians = ", ".join(f"{t * 1e3:.3f}" for t in np.median(per_trace, axis=1))
        line = f"  {kind:<10}: median ms a step by trace {medians}"
        if kind != "float8 off":
            mid, low, high = interval(per_trace, off)
            line += f"; to off, by round: x{mid:.4f} (95 % interval {low:.4f}-{high:.4f})"
            if kind == "float8 on":
                decided = verdict(low, high, args.rounds)
        print(line)
    print(f"float8 monitoring's cost side by side, goal <= x{GOAL}: {decided}")
    write = statistics.median(contenders.writes) / args.update_freq / float(np.median(off))
    print(
        f"by parts: the monitor's float8 write {statistics.median(contenders.writes) * 1e3:.2f}"
        f" ms a read (median of {len(contenders.writes)}), {write:.2%} of a step at "
        f"update_freq {args.update_freq}"
    )
    counts = contenders.op_counts(x, y)
    if counts:
        (on_out, on_ifs, on_in), (off_out, off_ifs, off_in) = (
            counts["float8 on"],
            counts["float8 off"],
        )
        print(
            f"          the step's ops outside branches {on_out} on, {off_out} off "
            f"(+{on_out - off_out}); conditionals {on_ifs} / {off_ifs}; "
            f"ops inside branches {on_in} / {off_in}"
        )
    if args.dose > 1:
        by_parts(args, times, counts, write)


def by_parts(args: argparse.Namespace, times: dict, counts: dict | None, write: float) -> None:
    """The dose-response: one copy of the float8 part's cost from the step with ``--dose``
    copies against the shipped one (the traces' luck divided by ``dose - 1``), scaled up to
    the ops the float8 part adds to the step (where counted: every op costing what a copy's
    ops cost on average), plus the monitor's float8 write; its verdict."""
    kind = f"float8 x{args.dose}"
    share, low, high = per_copy(times[kind], times["float8 on"], times["float8 off"], args.dose)
    scale = 1.0
    if counts:
        copy_ops = (counts[kind][0] - counts["float8 on"][0]) / (args.dose - 1)
        added = counts["float8 on"][0] - counts["float8 off"][0]
        scale = max(1.0, added / copy_ops)
        inside = (counts[kind][2] - counts["float8 on"][2]) / (args.dose - 1)
        print(
            f"          the step's ops with the float8 part x{args.dose}: {counts[kind][0]} "
            f"outside branches ({copy_ops:.1f} a copy; the float8 part adds {added}: "
            f"x{scale:.2f} a copy), {counts[kind][2]} inside ({inside:.1f} a copy; "
            f"float8 adds {counts['float8 on'][2] - counts['float8 off'][2]})"
        )
    print(
        f"          one copy of the float8 part: {share:+.3%} of a step (95 % interval "
        f"{low:+.3%} to {high:+.3%}), from {args.dose} copies against 1"
    )
    total = (1 + share * scale + write, 1 + low * scale + write, 1 + high * scale + write)
    decided = verdict(total[1], total[2], args.rounds)
    print(
        f"float8 monitoring's cost by parts (a copy x{scale:.2f} + the monitor's write): "
        f"x{total[0]:.4f} (95 % interval {total[1]:.4f}-{total[2]:.4f}), goal <= x{GOAL}: "
        f"{decided}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument(
        "--traces", type=int, default=3, help="traced train steps per contender (>= 1)"
    )
    parser.add_argument("--update-freq", type=int, default=100)
    parser.add_argument(
        "--dose",
        type=int,
        default=0,
        help="a contender making the step's float8 part this many times (> 1): the cost by parts",
    )
    parser.add_argument("--skip", type=int, default=10, help="untimed steps at each fit's start")
    parser.add_argument("--width", type=int, default=128, help="the hidden layers' width")
    parser.add_argument(
        "--training", action="store_true", help="learn (saturating steps), not healthy steps"
    )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="compile the step with XLA (Keras's 'auto' on a GPU; on a CPU it picks no XLA)",
    )
    args = parser.parse_args()
    if args.dose > 1 and (args.training or keras.backend.backend() != "tensorflow"):
        parser.error("--dose: healthy steps on TensorFlow only (not with --training)")
    keras.mixed_precision.set_global_policy("mixed_float16")
    steps = args.skip + args.update_freq
    x, y = data(steps)
    powers = False  # the kernels as built
    if not args.training:  # one steady batch again and again: no amax moves
        b, powers = steady_batch(x, y, args.width)
        rows = slice(b * BATCH, (b + 1) * BATCH)
        x, y = np.tile(x[rows], (steps, 1)), np.tile(y[rows], (steps, 1))
        kernels = ", kernels' max made powers of two" if powers else ""
        print(f"healthy steps: batch {b} repeated, Adam at learning rate 0{kernels}")
    run(args, x, y, 1e-3 if args.training else 0.0, powers)


if __name__ == "__main__":
    main()
