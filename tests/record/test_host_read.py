"""kmix.record.host_read: what a host read of the step record returns."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kmix.record import step_record as record
from kmix.record.host_read import snapshot


def test_snapshot_leaves_out_what_was_not_measured():
    nan = float("nan")
    never = snapshot(1024.0, list(record.initial_counters(1)), [nan] * len(record.HEALTH_FIELDS))
    assert never.health == {} and never["loss_scale"] == 1024.0 and never.loss_finite is True
    values = dict.fromkeys(record.HEALTH_FIELDS, 0.5) | {"float16_elements": 0.0}
    float32_model = snapshot(1.0, list(record.initial_counters(1)), list(values.values()))
    assert set(float32_model.health) == {"grad_norm", "nonfinite_elements", "float16_elements"}


def test_a_snapshot_reads_one_field_by_name_and_says_how_to_read_all():
    state = snapshot(8.0, list(record.initial_counters(1)), None)
    assert (state["loss_scale"], state["attempted_steps"]) == (8.0, 0)
    assert math.isnan(state["grad_norm"])  # a health field not measured
    with pytest.raises(KeyError):
        state["no_such_field"]
    for read_all in (list, dict, lambda s: s.items(), lambda s: s.keys(), lambda s: s.values()):
        with pytest.raises(TypeError, match=r"dataclasses\.asdict\(snapshot\)"):
            read_all(state)
    assert dataclasses.asdict(state)["loss_scale"] == 8.0
