"""Speed measured, not claimed: the values, rules and words of kmix's speed probe.

One probe answers "is float16 fast here?" for every kmix tool: ``kmix doctor`` times a
matmul and a convolution, each forward and backward as training runs them, in float32,
float16 and bfloat16 on the CPU (about a second); ``kmix.use("mixed_float16")`` times the
same in float32 and float16 once per process on machines without a GPU or TPU, and
``kmix demo`` in a fresh process before TensorFlow starts; each judges with
:func:`float16_cpu_finding` (the slowest op decides: training runs them all);
``kmix/policy/timing.py`` takes the times with the Keras backend's own library (the only
part that touches TensorFlow, JAX or torch: TensorFlow's CPU kernels in a ``tf.function``,
on Keras's JAX backend XLA's, jit-compiled, on its torch backend torch's own, eager) and
this module judges them, pure functions over typed
values (:class:`Timing`, :class:`SpeedMeasurement`, :class:`Ratio`). A cell that could
not be timed is absent from ``timings`` and explained in ``missing``; no number stands in
for it.

A cell's time is the median of its rounds' times, a round's time being its fastest call
(the one other jobs on a shared machine disturbed least; the cells take turns in
rounds, so a burst of load from other jobs hits every dtype alike); float32's own spread
between rounds is the noise floor a ratio is judged against (:func:`verdict`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

OPS = ("matmul", "conv2d")
"""The ops timed, in the order shown."""

BACKENDS = ("tensorflow", "jax", "torch")
"""Whose kernels are timed: TensorFlow's, on Keras's JAX backend XLA's through JAX, or on
its torch backend torch's own (eager, as Keras's torch backend runs them by default)."""

DTYPES = ("float32", "float16", "bfloat16")
"""The dtypes timed; float32 is the reference of every ratio."""

SHAPES = {
    "matmul": "128x512 @ 512x512, forward and backward",
    "conv2d": "8x32x32x32 (NHWC), 3x3 kernel, 32 filters, forward and backward",
}
"""The size of each op, as printed: each is timed as training runs it."""


PATHOLOGICAL = 10.0
"""A half-precision op this many times float32's time or more is not emulation's cost but a
broken path (oneDNN's float16 kernels on Xeons with AVX512_FP16 measured 300-400x)."""

WORTH_A_WARNING = 1.2
"""``kmix.use`` warns when float16 measured slower than float32 beyond the noise and at least
this many times float32's time: a few percent (1.04x measured on the 2-core AMD EPYC) is
stated in the choice's reason, not warned about."""

ONEDNN_FLOAT16_FLAGS = ("amx_fp16", "avx512_fp16")
"""CPU flags on which oneDNN takes its own float16 path (elsewhere TensorFlow 2.21 falls
back to Eigen's kernels: "oneDNN supports DT_HALF only on platforms with AVX-512 ...")."""


ONEDNN_FIX = (
    "set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported "
    "(e.g. TF_ENABLE_ONEDNN_OPTS=0 python train.py), which turns oneDNN's CPU kernels off"
)
"""The known fix for oneDNN's slow float16 path, in words."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """One cell's measured time.

    Attributes:
        op: ``"matmul"`` or ``"conv2d"``.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        seconds: each round's time, in seconds: the fastest of its calls.
    """

    op: str
    dtype: str
    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median of the rounds' times, in seconds."""
        return statistics.median(self.seconds)


@dataclasses.dataclass(frozen=True)
class Missing:
    """A cell that could not be timed, and why.

    Attributes:
        op: the op, as in :class:`Timing`.
        dtype: the dtype.
        why: the reason, e.g. the error TensorFlow raised.
    """

    op: str
    dtype: str
    why: str


@dataclasses.dataclass(frozen=True)
class SpeedMeasurement:
    """What :func:`measure` timed on this machine's CPU.

    Attributes:
        timings: one :class:`Timing` per cell that was timed.
        missing: one :class:`Missing` per cell that could not be.
        onednn: whether TensorFlow's oneDNN CPU kernels were on; None when unknown, and
            always None when ``backend`` is not ``"tensorflow"`` (this oneDNN switch is
            TensorFlow's).
        onednn_setting: ``TF_ENABLE_ONEDNN_OPTS`` as it was set, None when unset; always
            None when ``backend`` is not ``"tensorflow"``.
        seconds: the wall time the measurement took, in seconds.
        backend: whose kernels were timed, one of :data:`BACKENDS`.
        onednn_float16_cpu: whether the CPU has a flag of :data:`ONEDNN_FLOAT16_FLAGS`,
            on which oneDNN runs float16 itself (elsewhere TensorFlow falls back to
            Eigen's float16 kernels, and oneDNN is not what makes float16 slow); None
            when not known.
    """

    timings: tuple[Timing, ...] = ()
    missing: tuple[Missing, ...] = ()
    onednn: bool | None = None
    onednn_setting: str | None = None
    seconds: float = 0.0
    backend: str = "tensorflow"
    onednn_float16_cpu: bool | None = None

    def timing(self, op: str, dtype: str) -> Timing | None:
        """The timing of one cell, or None when it was not timed."""
        return next((t for t in self.timings if (t.op, t.dtype) == (op, dtype)), None)

    def to_dict(self) -> dict[str, Any]:
        """Returns the value as plain dicts, lists and numbers, ready for JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> SpeedMeasurement:
        """Reads back what :meth:`to_dict` wrote.

        Args:
            value: a dict as from :meth:`to_dict` (e.g. parsed from JSON).

        Returns:
            The measurement.

        Raises:
            KeyError, TypeError: ``value`` is not what :meth:`to_dict` writes.
        """
        return cls(
            timings=tuple(
                Timing(t["op"], t["dtype"], tuple(map(float, t["seconds"])))
                for t in value["timings"]
            ),
            missing=tuple(Missing(m["op"], m["dtype"], m["why"]) for m in value["missing"]),
            onednn=value["onednn"],
            onednn_setting=value["onednn_setting"],
            seconds=float(value["seconds"]),
            backend=str(value["backend"]),
            onednn_float16_cpu=value.get("onednn_float16_cpu"),
        )


@dataclasses.dataclass(frozen=True)
class Ratio:
    """A half-precision op's time over float32's for the same op, and how to read it.

    Attributes:
        op: the op.
        dtype: the half-precision dtype.
        ratio: the dtype's median time over float32's (2.0: twice as long).
        noise: float32's own noise, its relative spread between rounds (see
            :func:`relative_spread`); None when float32 was timed in fewer than two rounds.
        rounds: the rounds of the half-precision cell.
    """

    op: str
    dtype: str
    ratio: float
    noise: float | None
    rounds: int

    @property
    def verdict(self) -> str:
        """``"pathological"``, ``"slower"``, ``"faster"`` or ``"same"`` (see :func:`verdict`)."""
        return verdict(self.ratio, self.noise)


def relative_spread(seconds: Sequence[float]) -> float | None:
    """The noise of a cell's rounds: their spread relative to their median.

    Rule: ``(max - min) / median`` of the round times, with the fastest and the slowest
    round left out when there are 4 or more (one round that another job disturbed
    throughout does not set the noise floor alone).

    Args:
        seconds: each round's time.

    Returns:
        The relative spread (0.1: the rounds differ by 10% of the median), or None for
        fewer than two rounds.
    """
    if len(seconds) < 2:
        return None
    ordered = sorted(seconds)
    if len(ordered) >= 4:
        ordered = ordered[1:-1]
    return (ordered[-1] - ordered[0]) / statistics.median(seconds)


def verdict(ratio: float, noise: float | None) -> str:
    """Judges a time ratio against float32 by the noise floor.

    Rule::

        ratio >= PATHOLOGICAL          -> "pathological"
        noise unknown                  -> "slower" if ratio > 1 else "faster" if < 1
        ratio > 1 + noise              -> "slower"
        ratio < 1 / (1 + noise)        -> "faster"
        otherwise                      -> "same"   (no measurable difference)

    Args:
        ratio: the half-precision time over float32's.
        noise: float32's relative spread between rounds, or None.

    Returns:
        The verdict.
    """
    if ratio >= PATHOLOGICAL:
        return "pathological"
    bound = 1.0 + (noise or 0.0)
    if ratio > bound:
        return "slower"
    if ratio < 1.0 / bound:
        return "faster"
    return "same"


def speed_ratios(measured: SpeedMeasurement) -> tuple[Ratio, ...]:
    """Every half-precision cell's time over float32's for the same op.

    Args:
        measured: the measurement.

    Returns:
        One :class:`Ratio` per timed half-precision cell whose op was timed in float32
        too, in the order of :data:`OPS` and :data:`DTYPES`.
    """
    ratios = []
    for op in OPS:
        reference = measured.timing(op, "float32")
        for dtype in DTYPES[1:]:
            timed = measured.timing(op, dtype)
            if reference is None or timed is None:
                continue
            ratios.append(
                Ratio(
                    op,
                    dtype,
                    timed.median / reference.median,
                    relative_spread(reference.seconds),
                    len(timed.seconds),
                )
            )
    return tuple(ratios)


def describe(ratio: Ratio) -> str:
    """One ratio in words, e.g. ``"float16 matmul: 3.41x float32's time (slower)"``.

    Args:
        ratio: the ratio.

    Returns:
        The text, without a full stop.
    """
    head = f"{ratio.dtype} {ratio.op}: {format_ratio(ratio.ratio)} float32's time"
    noise = "" if ratio.noise is None else f"float32's own noise {ratio.noise:.0%}"
    if ratio.verdict == "pathological":
        return f"{head}, pathologically slow"
    if ratio.verdict == "same":
        return f"{head}, no measurable difference ({noise})"
    return f"{head} ({ratio.verdict}{'; ' + noise if noise else ''})"


def onednn_fix_applies(measured: SpeedMeasurement) -> bool:
    """Whether float16 is pathologically slow with oneDNN on: :data:`ONEDNN_FIX` applies.

    Args:
        measured: the measurement.

    Returns:
        True when TensorFlow's kernels were timed with oneDNN on, on a CPU where oneDNN
        runs float16 itself (or one not known), and a float16 op took
        :data:`PATHOLOGICAL` times float32's time or more (never for JAX's or torch's
        kernels: ``TF_ENABLE_ONEDNN_OPTS`` is read by TensorFlow only).
    """
    return (
        measured.backend == "tensorflow"
        and measured.onednn is True
        and measured.onednn_float16_cpu is not False
        and any(
            r.dtype == "float16" and r.verdict == "pathological" for r in speed_ratios(measured)
        )
    )


def measurement_lines(measured: SpeedMeasurement) -> list[str]:
    """The times, ratios and what could not be measured, one line each (no indent).

    Args:
        measured: the measurement.

    Returns:
        The lines: each op's times per dtype, then each ratio, then each missing cell.
    """
    lines = []
    for op in OPS:
        cells = [t for t in measured.timings if t.op == op]
        if cells:
            times = ", ".join(f"{t.dtype} {format_seconds(t.median)}" for t in cells)
            rounds = sorted({len(t.seconds) for t in cells})
            lines.append(
                f"{op} {SHAPES[op]}: {times} a call (median of {'/'.join(map(str, rounds))} rounds)"
            )
    lines += [describe(ratio) for ratio in speed_ratios(measured)]
    lines += [f"{m.dtype} {m.op}: not measured: {m.why}" for m in measured.missing]
    return lines


def doctor_lines(
    measured: SpeedMeasurement,
    recheck: SpeedMeasurement | None = None,
    recheck_error: str | None = None,
) -> list[str]:
    """The ``speed on this CPU`` section of ``kmix doctor``, one line each (no indent).

    Args:
        measured: what was timed in this process.
        recheck: the same ops timed in a fresh process with ``TF_ENABLE_ONEDNN_OPTS=0``,
            when :func:`onednn_fix_applies` (None when not run).
        recheck_error: why the recheck could not be made, when it failed.

    Returns:
        The lines: whose kernels were timed (TensorFlow's: with the oneDNN state), the
        measurement, and the known fix with its measured effect where one applies.
    """
    lines = [f"{kernels_timed(measured)}; measured in {measured.seconds:.1f} s"]
    lines += measurement_lines(measured)
    ratios = speed_ratios(measured)
    if onednn_fix_applies(measured):
        lines.append(f"fix: oneDNN's float16 path is slow here: {ONEDNN_FIX}")
        if recheck is not None:
            lines.append(
                f"measured with TF_ENABLE_ONEDNN_OPTS=0 in a fresh process "
                f"({recheck.seconds:.1f} s):"
            )
            lines += [f"  {line}" for line in measurement_lines(recheck)]
            lines += _effect_lines(measured, recheck)
        elif recheck_error:
            lines.append(f"its effect was not measured: {recheck_error}")
    elif any(r.verdict == "pathological" for r in ratios):
        lines.append(
            "no fix kmix knows for the pathologically slow dtype: use a policy that avoids it "
            "(kmix compare measures each policy on your model)"
        )
    return lines


def kernels_timed(measured: SpeedMeasurement) -> str:
    """Whose kernels were timed, in words (TensorFlow's: with oneDNN's state).

    Args:
        measured: the measurement.

    Returns:
        E.g. ``"oneDNN CPU kernels: off (TF_ENABLE_ONEDNN_OPTS '0')"`` for TensorFlow, or
        ``"XLA's CPU kernels (JAX, jit-compiled), as Keras's jax backend runs them"``, or
        ``"torch's CPU kernels (eager), as Keras's torch backend runs them"``.
    """
    if measured.backend == "jax":
        return "XLA's CPU kernels (JAX, jit-compiled), as Keras's jax backend runs them"
    if measured.backend == "torch":
        return "torch's CPU kernels (eager), as Keras's torch backend runs them"
    onednn = {True: "on", False: "off", None: "unknown"}[measured.onednn]
    setting = "unset" if measured.onednn_setting is None else repr(measured.onednn_setting)
    return f"oneDNN CPU kernels: {onednn} (TF_ENABLE_ONEDNN_OPTS {setting})"


def _effect_lines(before: SpeedMeasurement, after: SpeedMeasurement) -> list[str]:
    """Each float16 op's time before and after oneDNN was turned off, e.g.
    ``effect: float16 matmul 400 ms -> 0.746 ms a call (400x -> 1.04x float32's time)``."""
    lines = []
    ratios_after = {r.op: r for r in speed_ratios(after) if r.dtype == "float16"}
    for ratio in speed_ratios(before):
        then, now = before.timing(ratio.op, "float16"), after.timing(ratio.op, "float16")
        if ratio.dtype != "float16" or ratio.op not in ratios_after or not then or not now:
            continue
        ratio_after = ratios_after[ratio.op].ratio
        lines.append(
            f"effect: float16 {ratio.op} {format_seconds(then.median)} -> "
            f"{format_seconds(now.median)} a call ({format_ratio(ratio.ratio)} -> "
            f"{format_ratio(ratio_after)} float32's time)"
        )
    return lines


def deciding_ratio(measured: SpeedMeasurement, dtype: str = "float16") -> Ratio | None:
    """The ratio that answers "is ``dtype`` fast here?": the slowest op's.

    A training step runs every op; one op pathologically slow in a dtype makes its steps
    slow, however fast the others are.

    Args:
        measured: the measurement.
        dtype: the half-precision dtype.

    Returns:
        The largest of ``dtype``'s ratios, or None when none was measured.
    """
    ratios = [r for r in speed_ratios(measured) if r.dtype == dtype]
    return max(ratios, key=lambda r: r.ratio, default=None)


def float16_cpu_finding(measured: SpeedMeasurement) -> tuple[str, bool]:
    """Whether float16 is fast on this CPU, in words: the one answer every kmix tool gives
    (``kmix.use``, ``kmix doctor``, ``kmix demo``) on a machine without a GPU or TPU.

    Args:
        measured: a measurement holding float32 and float16 (every op, forward and
            backward).

    Returns:
        ``(sentence, slow)``: the deciding ratio (:func:`deciding_ratio`) in words (or
        why it is not known), and whether float16 measured slower than float32 beyond
        the noise floor and by :data:`WORTH_A_WARNING` or more.
    """
    ratio = deciding_ratio(measured)
    if ratio is None:
        why = "; ".join(f"{m.dtype} {m.op}: {m.why}" for m in measured.missing)
        return f"float16's speed on this CPU was not measured ({why or 'no timing'})", False
    noise = "" if ratio.noise is None else f"; float32's own noise {ratio.noise:.0%}"
    sentence = (
        f"no GPU or TPU was found, and on this CPU a float16 {ratio.op} ({SHAPES[ratio.op]}) "
        f"measured {format_ratio(ratio.ratio)} float32's time "
        f"(median of {ratio.rounds} rounds{noise})"
    )
    if ratio.verdict == "pathological" and onednn_fix_applies(measured):
        sentence += f"; oneDNN's float16 path is slow here: {ONEDNN_FIX}"
    slow = ratio.verdict == "pathological" or (
        ratio.verdict == "slower" and ratio.ratio >= WORTH_A_WARNING
    )
    return sentence, slow


def format_ratio(ratio: float) -> str:
    """A ratio to three significant digits: ``3.41x``, ``19.5x``, ``412x`` (whole from 100)."""
    if ratio < 10:
        return f"{ratio:.2f}x"
    return f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def format_seconds(seconds: float) -> str:
    """A call's time, three significant digits: ``0.471 ms``, ``152 ms``, ``1.52 s``."""
    value, unit = (seconds * 1e3, "ms") if seconds < 1 else (seconds, "s")
    return f"{value:.0f} {unit}" if value >= 100 else f"{value:#.3g} {unit}"
