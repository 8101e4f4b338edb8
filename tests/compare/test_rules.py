"""kmix.compare.rules on hand-made curves and tables: skipped steps, the loss spread.

A skipped step's loss is not finite (kmix's optimizer skips every step whose loss is
not), and a skipped step never happened: it is one skipped step, not a diverged run.
A run-to-run spread of zero measures nothing: no loss is judged against it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from kmix.compare import rules
from kmix.compare.values import MEASURED, PolicyRow

MS = 1e-3
NAN = math.nan


def row(policy: str, ms: float, **changes) -> PolicyRow:
    """A measured row of 200 steps at ``ms`` per step, float32 at 10 ms the reference."""
    base = PolicyRow(
        policy=policy,
        status=MEASURED,
        steps=200,
        step_time_s=ms * MS,
        speedup=10.0 / ms,
        final_loss=0.5,
        loss_departure=None if policy == "float32" else 0.0,
        loss_ok=None if policy == "float32" else True,
        min_headroom_bits=6.0 if "float16" in policy else None,
    )
    return dataclasses.replace(base, **changes)


# ------------------------------------------------------------ the final loss
def test_a_skipped_steps_loss_is_left_out_of_the_final_loss():
    # 20 steps: the last tenth is the last two; the 19th was skipped (its loss NaN)
    assert rules.final_loss([1.0] * 18 + [NAN, 0.5]) == 0.5
    assert rules.final_loss([1.0] * 18 + [0.25, math.inf]) == 0.25
    # the curve: a forward overflow at the first step, then training went on
    assert rules.final_loss([NAN, 0.714, 2.065, 0.5]) == 0.5
    assert rules.final_loss([NAN] + [0.75] * 29 + [NAN, 0.5, 0.25]) == pytest.approx(0.375)


def test_no_final_loss_when_every_step_of_the_last_tenth_was_skipped():
    assert rules.final_loss([1.0] * 18 + [NAN, math.inf]) is None
    assert rules.final_loss([0.5, NAN]) is None
    assert rules.final_loss([NAN] * 5) is None


# ------------------------------------------------------------ the loss spread
def test_a_loss_spread_of_zero_is_unknown_not_zero():
    assert rules.loss_spread(0.5, 0.5) is None  # the repeat trained identically
    assert rules.loss_spread(0.5, 0.53) == pytest.approx(0.03)
    assert rules.loss_spread(0.53, 0.5) == pytest.approx(0.03)
    assert rules.loss_spread(None, 0.5) is None
    assert rules.loss_spread(0.5, None) is None


def test_a_loss_not_judged_for_want_of_a_spread_is_kept_and_the_words_say_so():
    """bfloat16's loss +0.3 % from float32's, and no spread to judge it by: not rejected."""
    table = [
        row("float32", 10, final_loss=0.5),
        row("mixed_bfloat16", 5, final_loss=0.5015, loss_departure=0.0015, loss_ok=None),
    ]
    advice = rules.recommend(table, floor=0.05, loss_spread=None)
    assert advice.policy == "mixed_bfloat16"
    assert advice.reasons[0] == (
        "mixed_bfloat16: ×2.00 float32's speed (noise floor ±5.0%); its final loss 0.5015 is "
        "0.0015 above float32's 0.5, not judged: float32's run-to-run spread is unknown; "
        "its range is safe"
    )
    lower = dataclasses.replace(table[1], final_loss=0.499, loss_departure=-0.001, loss_ok=True)
    assert rules.recommend([table[0], lower], floor=0.05).reasons[0] == (
        "mixed_bfloat16: ×2.00 float32's speed (noise floor ±5.0%); its final loss is no "
        "higher than float32's; its range is safe"
    )


def test_a_loss_within_a_measured_spread_says_so():
    table = [
        row("float32", 10, final_loss=0.5),
        row("mixed_bfloat16", 5, final_loss=0.501, loss_departure=0.001, loss_ok=True),
    ]
    advice = rules.recommend(table, floor=0.05, loss_spread=0.004)
    assert advice.reasons[0] == (
        "mixed_bfloat16: ×2.00 float32's speed (noise floor ±5.0%); its loss stays within "
        "float32's run-to-run spread; its range is safe"
    )


# ------------------------------------------------------------ the cause, named
def test_a_loss_left_out_names_the_overflowing_layer_and_its_fix():
    table = [
        row("float32", 10, final_loss=0.30),
        row(
            "mixed_float16",
            5,
            final_loss=None,
            loss_departure=None,
            loss_ok=False,
            skipped_steps=20,
            overflow_layers=("block_1/wide",),
        ),
    ]
    advice = rules.recommend(table, floor=0.05)
    assert advice.policy == "float32"
    assert advice.reasons[1] == (
        "mixed_float16 is left out: its loss is not finite over the last tenth of the steps "
        "(float32's final loss: 0.3); layer 'block_1/wide' overflows float16 in the forward "
        "pass (a non-finite loss no loss scale can fix); train with "
        "kmix.callbacks.PrecisionAutopilot (it moves layer 'block_1/wide' to float32 when it "
        "overflows) or build that layer inside kmix.policy_scope('float32')"
    )


def test_a_departing_loss_names_the_skipped_steps():
    table = [
        row("float32", 10, final_loss=0.30),
        row(
            "mixed_float16", 5, final_loss=0.45, loss_departure=0.15, loss_ok=False, skipped_steps=3
        ),
    ]
    advice = rules.recommend(table, floor=0.05, loss_spread=0.01)
    assert advice.reasons[1] == (
        "mixed_float16 is left out: its final loss 0.45 departs from float32's 0.3: higher by "
        "0.15, more than float32's own run-to-run spread (0.01); 3 of 200 steps were skipped "
        "(a non-finite loss or gradients: those batches did not train)"
    )
