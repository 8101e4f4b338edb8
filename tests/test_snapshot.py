"""kmix.snapshot: what a host read of the step record returns."""

from __future__ import annotations

from kmix import record
from kmix.snapshot import snapshot


def test_snapshot_leaves_out_what_was_not_measured():
    nan = float("nan")
    never = snapshot(
        1024.0, list(record.initial_counters(1)), [nan] * len(record.HEALTH_FIELDS)
    )
    assert never.health == {} and never["loss_scale"] == 1024.0 and never.loss_finite is True
    values = dict.fromkeys(record.HEALTH_FIELDS, 0.5) | {"float16_elements": 0.0}
    float32_model = snapshot(1.0, list(record.initial_counters(1)), list(values.values()))
    assert set(float32_model.health) == {"grad_norm", "nonfinite_elements", "float16_elements"}
