"""kmix.compare.text: an unknown loss spread is said, and a loss not judged is marked."""

from __future__ import annotations

from kmix.compare import rules
from kmix.compare.text import slow_stop_words
from kmix.compare.values import PolicyComparison, PolicyRow, Recommendation


def unknown_spread() -> PolicyComparison:
    rows = (
        PolicyRow("float32", steps=20, final_loss=0.5),
        PolicyRow("mixed_bfloat16", steps=20, final_loss=0.5015, loss_departure=0.0015),
    )
    return PolicyComparison(
        rows=rows,
        noise_floor=0.03,
        noise_ratios=(1.01, 0.97),
        loss_spread=rules.loss_spread(0.5, 0.5),
        loss_spread_note=rules.loss_spread_note(0.5, 0.5),
        recommendation=Recommendation("mixed_bfloat16", ("mixed_bfloat16: ...",)),
        steps=20,
        rounds=2,
        batch_size=32,
        timing="in one process",
    )


def test_an_unknown_loss_spread_is_said_with_its_reason():
    text = unknown_spread().to_markdown()
    assert (
        "Loss spread: unknown (float32's second run, from another seed with the data in "
        "another order, ended at the same final loss: neither changed the loss (a build_model "
        "that seeds itself, data of one batch), and a spread of zero measures nothing); a "
        "final loss higher than float32's is shown, marked 'not judged'."
    ) in text
    assert "| 0.5015 (Δ +0.0015, not judged) |" in text


def test_a_policy_stopped_as_too_slow_is_told_its_speed_against_float32s():
    """What the stopped run's end record says (``kmix report`` shows it): its speed as a
    speed-up against float32's, as the table's column writes it, and the budget."""
    words = slow_stop_words(steps=12, seconds=31.0, float32_step_s=0.05, budget_s=30.0)
    # float32 would take 12 * 0.05 = 0.6 s for as many steps: 0.6 / 31 = x0.019
    assert words == (
        "too slow (×0.019 of float32's speed): 12 steps took 31.0 s in fit, float32 0.6 s "
        "for as many; its budget was 30 s"
    )
    assert slow_stop_words(1, 2.0, 1.0, 1.0) == (
        "too slow (×0.5 of float32's speed): 1 step took 2.0 s in fit, float32 1.0 s for as "
        "many; its budget was 1 s"
    )
