"""Sources (kmix.callbacks._source): which optimizer gets which, and what each says it reads."""

from __future__ import annotations

import subprocess
import sys

import keras
import pytest
from fake_optimizer import FakeRecorder, built_stock

import kmix
from kmix.callbacks._source import (
    STOCK_MIN_SCALE,
    KerasSource,
    KmixSource,
    RecordingOptimizer,
    Source,
    source_for,
)


class Partial:
    """Has every read of kmix's optimizer but one (``watch``)."""

    config = FakeRecorder().config
    event_capacity = 4
    health_every = 1

    def read_state(self, counters_only=False): ...
    def recorded_events(self, since=0): ...
    def request_statistics(self, owner, health_every, histogram_every): ...
    def release_statistics(self, owner): ...
    def underflow_by_variable(self): ...
    def subnormal_by_variable(self): ...
    def exponent_histograms_by_variable(self): ...
    def activations_by_layer(self): ...


@pytest.mark.jax
@pytest.mark.torch
def test_kmix_optimizer_is_recognised_by_what_it_offers():
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), min_scale=2, max_scale=2**20)
    assert isinstance(optimizer, RecordingOptimizer)
    source = source_for(optimizer)
    assert type(source) is KmixSource
    assert (source.kind, source.floor_scale, source.scale_bounds) == ("kmix", 2.0, (2.0, 2.0**20))
    assert source.event_capacity == optimizer.event_capacity == 128
    assert source.describe() == "`kmix.LossScaleOptimizer`"
    assert type(source_for(FakeRecorder())) is KmixSource  # anything with the same reads


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("built", [False, True])
def test_the_stock_loss_scale_optimizer_is_not_taken_for_kmix(built):
    stock = keras.mixed_precision.LossScaleOptimizer
    optimizer = built_stock(4.0) if built else stock(keras.optimizers.SGD(0.0))
    assert not isinstance(optimizer, RecordingOptimizer)
    source = source_for(optimizer)
    assert type(source) is KerasSource
    assert (source.kind, source.scales_loss, source.records_events) == ("keras", True, False)
    assert (source.floor_scale, source.scale_bounds) == (STOCK_MIN_SCALE, None)
    assert source.event_capacity == 0 and source.health_every == 0
    assert source.describe() == "the stock `keras.mixed_precision.LossScaleOptimizer`"


@pytest.mark.jax
@pytest.mark.torch
def test_without_loss_scaling_a_plain_source_counts_steps_only():
    source = source_for(keras.optimizers.SGD(0.01))
    assert type(source) is Source
    assert (source.kind, source.scales_loss, source.floor_scale, source.scale_bounds) == (
        "none",
        False,
        None,
        None,
    )
    assert source.describe() == "none (`SGD`)" and source.optimizer_name == "SGD"
    state = source.read(7)
    assert (state.loss_scale, state.attempted_steps, state.skipped_steps) == (None, 7, 0)
    assert source.events(0) == [] and source.per_variable() == {} and source.per_layer() == {}


@pytest.mark.jax
@pytest.mark.torch
def test_an_optimizer_missing_one_read_is_not_taken_for_kmix():
    assert not isinstance(Partial(), RecordingOptimizer)
    assert type(source_for(Partial())) is Source


@pytest.mark.jax
@pytest.mark.torch
def test_kmix_source_reads_through_the_optimizers_public_reads():
    optimizer = FakeRecorder(event_capacity=2)
    for kind in (None, "skip", "nan", "skip"):
        optimizer.step(kind)
    source = source_for(optimizer)
    state = source.read(4, counters_only=True)
    assert (state.attempted_steps, state.skipped_steps, state.loss_scale) == (4, 3, None)
    assert [r.event.step for r in source.events(1)] == [3, 4]  # the ring keeps two
    source.request_statistics(source, 6, 0)
    assert source.health_every == 2  # gcd(100, 6)
    source.release_statistics(source)
    assert source.health_every == 100


@pytest.mark.slow
def test_importing_the_callbacks_does_not_import_the_optimizer():
    """The callbacks recognise kmix's optimizer without importing it (no import cycle)."""
    script = (
        "import sys, kmix.callbacks; "
        "assert 'kmix.optimizer.loss_scale_optimizer' not in sys.modules, "
        "sorted(m for m in sys.modules if 'kmix' in m)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
