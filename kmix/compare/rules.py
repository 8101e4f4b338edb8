"""The rules of ``kmix compare``: pure functions over measured numbers and the table.

No TensorFlow, no Keras, no clock: :mod:`kmix.compare.comparison` measures, these decide. The
recommendation (:func:`recommend`) is a function of the rows and the noise floor
alone, so it can be checked on a hand-made table::

    candidates = rows that trained every step (not stopped, not out of memory),
                 whose final loss is finite and not above float32's by more than
                 float32's own run-to-run spread (a lower loss is no departure to
                 worry about; without a measured spread a higher loss is shown, not
                 judged), and whose float16 range is safe (no forward overflow,
                 activation headroom >= 1 bit, skip rate <= 5%)
    fastest    = the candidate with the shortest median step
    recommend  = among the candidates whose time is within the noise floor of the
                 fastest's, the simplest: float32, then mixed_bfloat16 (no loss
                 scaling), then mixed_float16
    if float32 is out of memory and a mixed policy fits, the fastest that fits,
    with the reason "float32 does not fit in device memory"

A row left out for its loss also names what kmix's optimizer saw: the layer where a
forward overflow started (and its fix), or the steps it skipped.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from kmix.compare.values import (
    MEASURED,
    OUT_OF_MEMORY,
    STOPPED_SLOW,
    PolicyRow,
    Recommendation,
)

__all__ = [
    "HEADROOM_SAFE_BITS",
    "SIMPLICITY",
    "SKIP_RATE_SAFE",
    "SLOW_BUDGET_FLOOR_S",
    "SLOW_FACTOR",
    "final_loss",
    "loss_spread",
    "loss_spread_note",
    "native_compute",
    "noise_floor",
    "recommend",
    "relative_difference",
    "safety_problem",
    "slow_budget_s",
    "slow_cause",
    "step_stats",
    "within_noise",
]

HEADROOM_SAFE_BITS = 1.0
"""Activation headroom below this many bits is unsafe (kmix.report's warning level)."""
SKIP_RATE_SAFE = 0.05
"""A skip rate above this share of steps is unsafe (kmix.report's warning level)."""
SLOW_FACTOR = 10.0
"""A policy slower than float32 by this factor is stopped once its budget is spent."""
SLOW_BUDGET_FLOOR_S = 30.0
"""The least time budget of a policy, in seconds: short runs are never cut short."""
SIMPLICITY = ("float32", "mixed_bfloat16", "mixed_float16")
"""Of policies equally fast, the first here is recommended: fewer things to go wrong."""


def step_stats(times: Sequence[float]) -> tuple[float, float] | None:
    """The median step time and its interquartile range.

    Args:
        times: step times in seconds.

    Returns:
        ``(median, interquartile range)``, or None without times.
    """
    if not times:
        return None
    if len(times) < 2:
        return float(times[0]), 0.0
    quartiles = statistics.quantiles(times, n=4, method="inclusive")
    return statistics.median(times), quartiles[2] - quartiles[0]


def relative_difference(time_s: float, reference_s: float) -> float:
    """``|time / reference - 1|``: how far a step time is from a reference, relatively."""
    return abs(time_s / reference_s - 1.0)


def noise_floor(ratios: Sequence[float], overall: float | None = None) -> float | None:
    """The noise floor: how far float32's step time strayed from itself, relatively.

    The largest difference of any round (and of all steps pooled): a speed-up is
    measurable only beyond what float32 did against itself on this machine in the same
    rounds. On a busy machine one disturbed round sets it, and the comparison says that
    differences below it cannot be told apart here (conservative: a speed-up is never
    claimed that float32's own turns did not exceed).

    Args:
        ratios: per round, the median step time of float32's second model over that
            of float32's first (same steps, timed in the same round).
        overall: the same ratio over all rounds' steps; None to use the rounds alone.

    Returns:
        ``max(|overall - 1|, max_r |ratio_r - 1|)``, or None without rounds.
    """
    if not ratios:
        return None
    worst = max(abs(ratio - 1.0) for ratio in ratios)
    return worst if overall is None else max(abs(overall - 1.0), worst)


def within_noise(time_s: float, float32_s: float, floor: float | None) -> bool | None:
    """Whether a step time is "no measurable difference" from float32's.

    Args:
        time_s: the policy's median step time.
        float32_s: float32's median step time.
        floor: the noise floor (:func:`noise_floor`); None when not measured.

    Returns:
        True when the relative difference is inside the floor; None without a floor.
    """
    if floor is None:
        return None
    return relative_difference(time_s, float32_s) <= floor


def final_loss(curve: Sequence[float]) -> float | None:
    """The final loss: the mean of the finite losses of the last tenth of the steps.

    kmix's optimizer skips every step whose loss is not finite, and a skipped step
    never happened: it is left out of the mean, one skipped step, not a diverged run
    (:func:`safety_problem` judges the skip rate).

    Args:
        curve: each step's own loss.

    Returns:
        The mean over the last ``max(1, len(curve) // 10)`` steps' finite losses; None
        when none is finite (every one was skipped: the run no longer trains).
    """
    tail = [v for v in curve[-max(1, len(curve) // 10) :] if math.isfinite(v)]
    if not tail:
        return None
    return sum(tail) / len(tail)


def loss_spread(float32_loss: float | None, repeat_loss: float | None) -> float | None:
    """float32's run-to-run spread of the final loss, or None where it was not measured.

    The repeat is float32 again from another seed, its data in another order; if it
    ends at float32's very loss, neither changed the loss, and a spread of zero
    measures nothing: it is unknown.

    Args:
        float32_loss: float32's final loss.
        repeat_loss: the repeat's final loss.

    Returns:
        ``|float32_loss - repeat_loss|``, or None when either is None or they are equal.
    """
    if float32_loss is None or repeat_loss is None or float32_loss == repeat_loss:
        return None
    return abs(float32_loss - repeat_loss)


def loss_spread_note(float32_loss: float | None, repeat_loss: float | None) -> str:
    """Why :func:`loss_spread` is None, in words (its arguments); "" when measured."""
    if float32_loss is None:
        return "float32's final loss is not finite"
    if repeat_loss is None:
        return "float32's second run has no finite final loss"
    if float32_loss == repeat_loss:
        return (
            "float32's second run, from another seed with the data in another order, ended "
            "at the same final loss: neither changed the loss (a build_model that seeds "
            "itself, data of one batch), and a spread of zero measures nothing"
        )
    return ""


def slow_budget_s(float32_s: float) -> float:
    """The time a policy may take before it is stopped as pathologically slow.

    Args:
        float32_s: the time float32 takes (or is projected to take) for the same steps.

    Returns:
        ``max(SLOW_BUDGET_FLOOR_S, SLOW_FACTOR * float32_s)`` seconds.
    """
    return max(SLOW_BUDGET_FLOOR_S, SLOW_FACTOR * float32_s)


def slow_cause(
    policy: str, cpu_flags: Sequence[str], accelerators: bool, onednn: bool
) -> str | None:
    """The cause kmix can name for a policy that is slow on this machine, if any.

    Args:
        policy: the Keras policy name.
        cpu_flags: the CPU flags of ``kmix.hardware()``.
        accelerators: whether a GPU or TPU trains the model.
        onednn: whether TensorFlow's oneDNN optimizations were on
            (``TF_ENABLE_ONEDNN_OPTS`` not set to 0 when TensorFlow was imported).

    Returns:
        The cause and what to do, or None when kmix cannot name one.
    """
    dtype = policy.removeprefix("mixed_")
    if accelerators or dtype == "float32":
        return None
    if dtype == "float16" and onednn:
        return (
            "TensorFlow's oneDNN float16 kernels on this CPU (TF_ENABLE_ONEDNN_OPTS is "
            "on); set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported and compare again"
        )
    native, why = native_compute(policy, cpu_flags, ())
    if native is False:
        return why
    if dtype == "bfloat16" and not onednn:
        return (
            "oneDNN is off (TF_ENABLE_ONEDNN_OPTS=0), so TensorFlow's own kernels compute "
            "bfloat16 without the CPU's bfloat16 instructions; unset it and compare again"
        )
    return None


def native_compute(
    policy: str, cpu_flags: Sequence[str], gpu_capabilities: Sequence[tuple[int, int] | None]
) -> tuple[bool | None, str]:
    """Whether the hardware that trains computes the policy's dtype natively.

    Args:
        policy: the Keras policy name.
        cpu_flags: the CPU flags of ``kmix.hardware()``.
        gpu_capabilities: the compute capability of each GPU (None if unknown); empty
            when the CPU trains.

    Returns:
        ``(native, why)``: native is None when unknown.
    """
    dtype = policy.removeprefix("mixed_")
    if dtype in ("float32", "float64"):
        return True, f"{dtype} is every device's own arithmetic"
    if gpu_capabilities:
        known = [cc for cc in gpu_capabilities if cc is not None]
        if len(known) < len(gpu_capabilities):
            return None, "a GPU reports no compute capability"
        needed = (7, 0) if dtype == "float16" else (8, 0)
        lowest = min(known)
        word = "has" if lowest >= needed else "lacks"
        return lowest >= needed, (
            f"the GPU (compute capability {lowest[0]}.{lowest[1]}) {word} {dtype} tensor "
            f"cores, which start at {needed[0]}.{needed[1]}"
        )
    wanted = {"float16": ("avx512_fp16",), "bfloat16": ("amx_bf16", "avx512_bf16")}[dtype]
    have = [flag for flag in wanted if flag in cpu_flags]
    if have:
        return True, f"the CPU has {have[0].upper()}, which computes {dtype}"
    return False, (
        f"the CPU has no {' or '.join(f.upper() for f in wanted)}: it computes {dtype} by "
        "converting to and from float32"
    )


def safety_problem(row: PolicyRow) -> str | None:
    """What makes a policy's numbers unsafe for this model, in words, or None.

    Args:
        row: the policy's row.

    Returns:
        A sentence naming the layer or the measurement, or None when it is safe.
    """
    if row.overflow_layers:
        return (
            f"layer {row.overflow_layers[0]!r} overflows {row.compute_dtype} in the forward "
            "pass (a non-finite loss no loss scale can fix)"
        )
    if row.min_headroom_bits is not None and row.min_headroom_bits < HEADROOM_SAFE_BITS:
        where = f"layer {row.tightest_layer!r}" if row.tightest_layer else "a layer"
        return (
            f"{where} comes within {row.min_headroom_bits:.1f} bits of {row.compute_dtype}'s "
            f"largest value (safe: {HEADROOM_SAFE_BITS:.0f} bit or more)"
        )
    trained = max(row.steps, 1)
    if row.skipped_steps / trained > SKIP_RATE_SAFE:
        return (
            f"{row.skipped_steps} of {row.steps} steps were skipped (safe: at most "
            f"{SKIP_RATE_SAFE:.0%})"
        )
    return None


def _fix_words(row: PolicyRow) -> str:
    """How to keep a policy whose layer overflows: the autopilot or a float32 scope."""
    layer = (row.overflow_layers or (row.tightest_layer,))[0]
    target = f"layer {layer!r}" if layer else "the layer"
    return (
        f"train with kmix.callbacks.PrecisionAutopilot (it moves {target} to float32 "
        "when it overflows) or build that layer inside kmix.policy_scope('float32')"
    )


def _loss_judgement(row: PolicyRow, reference: PolicyRow) -> str:
    """What was found of a candidate's loss against float32's, in words that hold."""
    if row.loss_ok is True:
        if row.loss_departure is not None and row.loss_departure <= 0:
            return "its final loss is no higher than float32's"
        return "its loss stays within float32's run-to-run spread"
    if row.loss_departure is None:
        return "its loss was not compared: float32's final loss is not finite"
    return (
        f"its final loss {_number(row.final_loss)} is {row.loss_departure:.3g} above "
        f"float32's {_number(reference.final_loss)}, not judged: float32's run-to-run "
        "spread is unknown"
    )


def _loss_words(row: PolicyRow, reference: PolicyRow, spread: float | None) -> str:
    if row.final_loss is None:
        return (
            "its loss is not finite over the last tenth of the steps (float32's final loss: "
            f"{_number(reference.final_loss)})"
        )
    spread_words = "not measured" if spread is None else f"{spread:.4g}"
    return (
        f"its final loss {_number(row.final_loss)} departs from float32's "
        f"{_number(reference.final_loss)}: higher by {_number(row.loss_departure)}, more than "
        f"float32's own run-to-run spread ({spread_words})"
    )


def _number(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.4g}"


def _speed_words(row: PolicyRow) -> str:
    if row.speedup is None:
        return "not timed"
    if row.policy == "float32":
        return "the reference"
    if row.within_noise:
        return f"×{row.speedup:.2f}, no measurable difference from float32"
    if row.speedup < 1:
        return f"×{row.speedup:.2f}, slower than float32"
    return f"×{row.speedup:.2f} float32's speed"


def recommend(
    rows: Sequence[PolicyRow], floor: float | None, loss_spread: float | None = None
) -> Recommendation:
    """The policy to use, with its reasons: a pure function of the table.

    See the module docstring for the rule.

    Args:
        rows: the table; must hold a float32 row.
        floor: the noise floor (relative); None counts every difference as measurable.
        loss_spread: float32's run-to-run spread of the final loss, for the words.

    Returns:
        The :class:`Recommendation`: the deciding reason first, then why each other
        policy was not chosen.

    Raises:
        ValueError: no row is float32.
    """
    reference = next((row for row in rows if row.policy == "float32"), None)
    if reference is None:
        raise ValueError("recommend needs a float32 row: speed-ups and losses are against it")
    left_out = {row.policy: why for row in rows if (why := _left_out(row, reference, loss_spread))}
    candidates = [row for row in rows if row.policy not in left_out and row.step_time_s is not None]
    if reference.status == OUT_OF_MEMORY:
        fitting = [row for row in candidates if row is not reference]
        if not fitting:
            head = (
                "float32 does not fit in device memory and no other policy trained safely: "
                "use a smaller batch or model"
            )
            return Recommendation("float32", (head, *_others(rows, None, left_out, ())))
        best = min(fitting, key=_time)
        head = (
            f"{best.policy}: float32 does not fit in device memory, {best.policy} does "
            f"({_memory_words(best)}), and it is the fastest policy that fits and stays safe"
        )
        return Recommendation(best.policy, (head, *_others(rows, best, left_out, ())))
    if not candidates:
        head = "float32: no policy trained every step safely; float32 is the reference"
        return Recommendation("float32", (head, *_others(rows, reference, left_out, ())))
    fastest = min(candidates, key=_time)
    tied = [
        row
        for row in candidates
        if row is fastest
        or (floor is not None and relative_difference(_time(row), _time(fastest)) <= floor)
    ]
    chosen = min(tied, key=_simplicity)
    head = _choice_words(chosen, fastest, tied, floor, reference)
    return Recommendation(chosen.policy, (head, *_others(rows, chosen, left_out, tied)))


def _left_out(row: PolicyRow, reference: PolicyRow, spread: float | None) -> str | None:
    """Why a row cannot be recommended, or None when it can."""
    if row.status == STOPPED_SLOW:
        return f"{row.policy} is pathologically slow here: {row.note}"
    if row.status == OUT_OF_MEMORY:
        return f"{row.policy} does not fit in device memory"
    problem = safety_problem(row)
    if row.loss_ok is False:
        why = _loss_words(row, reference, spread)
        if problem is not None:  # the cause kmix saw, and its fix
            return f"{row.policy} is left out: {why}; {problem}; {_fix_words(row)}"
        if row.skipped_steps:  # what kmix's optimizer saw
            why += (
                f"; {row.skipped_steps} of {row.steps} steps were skipped (a non-finite loss "
                "or gradients: those batches did not train)"
            )
        return f"{row.policy} is left out: {why}"
    if problem is not None:
        return f"{row.policy} is left out: {problem}; {_fix_words(row)}"
    return None


def _others(
    rows: Sequence[PolicyRow],
    chosen: PolicyRow | None,
    left_out: dict[str, str],
    tied: Sequence[PolicyRow],
) -> list[str]:
    """Why each other policy was not chosen; a faster one left out for its range first."""
    faster, rest = [], []
    for row in rows:
        if row is chosen or row in tied:
            continue
        why = left_out.get(row.policy)
        if why is None:
            rest.append(f"{row.policy}: {_speed_words(row)}")
        elif (
            chosen is not None
            and row.status == MEASURED
            and row.step_time_s is not None
            and _time(row) < _time(chosen)
            and not row.within_noise
            and row.loss_ok is not False
        ):
            faster.append(
                f"{row.policy} would be faster ({_speed_words(row)}) but " + why.split(": ", 1)[1]
            )
        else:
            rest.append(why)
    return faster + rest


def _time(row: PolicyRow) -> float:
    return math.inf if row.step_time_s is None else row.step_time_s


def _simplicity(row: PolicyRow) -> int:
    return SIMPLICITY.index(row.policy) if row.policy in SIMPLICITY else len(SIMPLICITY)


def _memory_words(row: PolicyRow) -> str:
    if row.peak_memory_bytes is None:
        return "peak memory not measured"
    return f"peak {row.peak_memory_bytes / 2**20:.0f} MiB"


def _choice_words(
    chosen: PolicyRow,
    fastest: PolicyRow,
    tied: Sequence[PolicyRow],
    floor: float | None,
    reference: PolicyRow,
) -> str:
    floor_words = "not measured" if floor is None else f"±{floor:.1%}"
    if chosen.policy == "float32" and len(tied) > 1:
        others = "; ".join(f"{row.policy} {_speed_words(row)}" for row in tied if row is not chosen)
        return (
            f"float32: no policy is measurably faster (noise floor {floor_words}; {others}); "
            "float32 needs no loss scaling and keeps full precision"
        )
    if chosen.policy == "float32":
        return (
            f"float32: it is the fastest policy that trains safely here (noise floor {floor_words})"
        )
    head = f"{chosen.policy}: {_speed_words(chosen)} (noise floor {floor_words})"
    if chosen is not fastest:
        head += (
            f"; {fastest.policy} was faster by less than the noise floor, and {chosen.policy} "
            "is simpler (bfloat16 needs no loss scaling)"
        )
    return head + f"; {_loss_judgement(chosen, reference)}; its range is safe"
