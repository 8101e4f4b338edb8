"""The words of ``kmix compare``: the table as markdown, and its progress lines.

Pure and light: ``kmix compare``, ``kmix report`` and the TensorBoard tab show a
comparison through :func:`comparison_markdown`. An unmeasured value is shown as
``–`` and its absence is explained once, below the table.
"""

from __future__ import annotations

import math
from typing import Any

from kmix._words import plural

# The values (kmix.compare.values) call this module, so it does not import them back:
# a PolicyRow or PolicyComparison is typed Any here.
PolicyRow = PolicyComparison = Any

__all__ = ["BUSY_FLOOR", "comparison_markdown", "format_bytes", "row_cells", "slow_stop_words"]

BUSY_FLOOR = 0.2
"""A noise floor above this says the machine was busy: the table says so."""

HEADER = (
    "policy",
    "status",
    "step (median ± IQR)",
    "examples/s",
    "speed-up",
    "peak memory (+ over start)",
    "weights",
    "activations/step",
    "final loss (Δ float32)",
    "skipped",
    "headroom: activations / gradients (bits)",
    "native",
)
NOT_MEASURED = "–"


def format_bytes(count: int | None) -> str:
    """``12.3 MiB``; :data:`NOT_MEASURED` for None."""
    if count is None:
        return NOT_MEASURED
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _ms(seconds: float | None) -> str:
    return NOT_MEASURED if seconds is None else f"{seconds * 1e3:.3g} ms"


def _bits(value: float | None) -> str:
    return NOT_MEASURED if value is None else f"{value:.1f}"


def _peak(row: PolicyRow) -> str:
    text = format_bytes(row.peak_memory_bytes)
    if row.peak_memory_bytes is not None and row.memory_baseline_bytes is not None:
        text += f" (+{format_bytes(max(0, row.peak_memory_bytes - row.memory_baseline_bytes))})"
    return text


def row_cells(row: PolicyRow) -> list[str]:
    """One row of the table, as cell texts in the order of :data:`HEADER`."""
    step = NOT_MEASURED
    if row.step_time_s is not None:
        step = f"{_ms(row.step_time_s)} ± {_ms(row.step_time_iqr_s)}"
    if row.speedup is None:
        speed = NOT_MEASURED
    elif row.policy == "float32":
        speed = "×1 (reference)"
    else:
        speed = f"×{row.speedup:.2f}" + (" (within noise)" if row.within_noise else "")
    loss = NOT_MEASURED if row.final_loss is None else f"{row.final_loss:.4g}"
    if row.loss_departure is not None:
        verdict = {False: ", departs", None: ", not judged"}.get(row.loss_ok, "")
        loss += f" (Δ {row.loss_departure:+.2g}{verdict})"
    headroom = f"{_bits(row.min_headroom_bits)} / {_bits(row.min_grad_headroom_bits)}"
    if row.tightest_layer and row.min_headroom_bits is not None:
        headroom += f" ({row.tightest_layer})"
    native = {True: "yes", False: "no", None: "unknown"}[row.native]
    return [
        row.policy,
        row.status if row.steps else f"{row.status} (0 steps)",
        step,
        NOT_MEASURED if row.examples_per_s is None else f"{row.examples_per_s:,.0f}",
        speed,
        _peak(row),
        format_bytes(row.weights_bytes),
        format_bytes(row.activation_bytes),
        loss,
        f"{row.skipped_steps} of {row.steps}",
        headroom,
        native,
    ]


def comparison_markdown(comparison: PolicyComparison) -> str:
    """The comparison as markdown: table, noise floor, notes, recommendation.

    Args:
        comparison: the comparison.

    Returns:
        The text, lines joined by newlines.
    """
    lines = [
        f"## kmix compare: {comparison.model or 'model'}, {comparison.steps} steps per policy "
        f"in {comparison.rounds} rounds"
        + (f", batch {comparison.batch_size}" if comparison.batch_size else ""),
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row_cells(row)) + " |" for row in comparison.rows]
    lines.append("")
    if comparison.noise_floor is None:
        lines.append("Noise floor: not measured (float32 was timed against itself in no round).")
    else:
        ratios = ", ".join(f"{ratio:.3f}" for ratio in comparison.noise_ratios)
        lines.append(
            f"Noise floor: ±{comparison.noise_floor:.1%} (float32 against itself, the largest "
            f"difference of any round; per round: {ratios}); a speed-up inside it is no "
            "measurable difference."
        )
        if comparison.noise_floor > BUSY_FLOOR:
            lines.append(
                "The machine was busy or uneven: differences smaller than the floor cannot be "
                "told apart here. Run again when it is quieter, or with more --steps (longer "
                "turns)."
            )
    if comparison.loss_spread is not None:
        lines.append(
            f"Loss spread: {comparison.loss_spread:.3g} (float32's final loss, run again from "
            "another seed, its data in another order); a policy whose final loss is higher by "
            "more is marked 'departs'."
        )
    else:
        why = comparison.loss_spread_note or "not measured"
        lines.append(
            f"Loss spread: unknown ({why}); a final loss higher than float32's is shown, "
            "marked 'not judged'."
        )
    lines.append(f"Timing: {comparison.timing}")
    lines += _notes(comparison)
    recommendation = comparison.recommendation
    lines += ["", f"**Recommendation: {recommendation.policy}**", ""]
    lines += [f"- {reason}" for reason in recommendation.reasons]
    return "\n".join(lines)


def _notes(comparison: PolicyComparison) -> list[str]:
    """Each distinct memory, headroom and status note once, naming its policies."""
    notes: dict[str, list[str]] = {}
    for row in comparison.rows:
        if row.memory_note:
            notes.setdefault(f"Peak memory: {row.memory_note}", []).append(row.policy)
        if row.native_note:
            notes.setdefault(f"Native: {row.native_note}", []).append(row.policy)
        if row.note:
            notes.setdefault(row.note, []).append(row.policy)
        if row.min_headroom_bits is None and row.compute_dtype != "float16":
            notes.setdefault(
                "Headroom: float16's range does not apply (not a float16 policy).", []
            ).append(row.policy)
    return [f"- {', '.join(policies)}: {text}" for text, policies in notes.items()]


def slow_stop_words(steps: int, seconds: float, float32_step_s: float, budget_s: float) -> str:
    """Why a policy was stopped as too slow, in one line: its stopped run's end record.

    Args:
        steps: the steps it trained before it was stopped.
        seconds: the time it spent in ``fit`` for them (warm-up included).
        float32_step_s: float32's time in ``fit`` per step (warm-up included), the
            time its budget was set from.
        budget_s: its budget (:func:`kmix.compare.rules.slow_budget_s`).

    Returns:
        E.g. ``"too slow (×0.019 of float32's speed): 12 steps took 31.0 s in fit,
        float32 0.6 s for as many; its budget was 30 s"``: the speed as the table's
        speed-up writes it (float32's time for as many steps ÷ the policy's), to two
        significant digits.
    """
    float32_s = float32_step_s * steps
    speed = float32_s / seconds if seconds > 0 else math.inf
    return (
        f"too slow (×{speed:.2g} of float32's speed): {plural(steps, 'step')} took "
        f"{seconds:.1f} s in fit, float32 {float32_s:.1f} s for as many; its budget was "
        f"{budget_s:.0f} s"
    )
