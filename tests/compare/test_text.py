"""kmix.compare.text: an unknown loss spread is said, and a loss not judged is marked."""

from __future__ import annotations

from kmix.compare import rules
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
