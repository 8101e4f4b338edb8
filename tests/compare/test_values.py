"""kmix.compare.values: the record keeps why the loss spread is unknown; old records read."""

from __future__ import annotations

from test_text import unknown_spread

from kmix.compare.values import comparison_from_dict


def test_the_loss_spread_note_round_trips_and_an_older_record_reads_without_it():
    data = unknown_spread().to_dict()
    assert data["loss_spread"] is None
    assert data["loss_spread_note"].startswith("float32's second run, from another seed")
    assert comparison_from_dict(data) == unknown_spread()
    older = {key: value for key, value in data.items() if key != "loss_spread_note"}
    assert comparison_from_dict(older).loss_spread_note == ""
    assert "Loss spread: unknown (not measured)" in comparison_from_dict(older).to_markdown()
