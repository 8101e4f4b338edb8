"""The guard's trip rules (kmix.callbacks._trip), against plain-Python references, without fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kmix import KmixDeprecationWarning
from kmix.callbacks import _source, _trip
from kmix.callbacks._trip import (
    NonfiniteLoss,
    OverflowAtFloor,
    Point,
    Rules,
    SkipRate,
    Streaks,
    first_possible_trip,
    first_window_over,
    inferred_streaks,
    is_nonfinite,
    kept_from,
    skip_points,
    skip_rate_trip,
    steps_to_next_read,
    streak_trip,
)


def test_the_guard_module_keeps_its_public_names():
    from kmix.callbacks import guard

    assert guard.first_possible_trip is first_possible_trip
    assert guard.first_window_over is first_window_over
    with pytest.warns(KmixDeprecationWarning, match="STOCK_MIN_SCALE is deprecated"):
        assert guard.STOCK_MIN_SCALE is _source.STOCK_MIN_SCALE == 1.0
    assert _trip.TRIP_REASONS == ("nonfinite_loss", "overflow_at_floor", "skip_rate")


def test_first_possible_trip_is_where_a_run_of_bad_steps_would_trip():
    """Against plain Python: every step after the read skipped with a NaN loss."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        patience, window = int(rng.integers(1, 8)), int(rng.integers(1, 15))
        rate = float(rng.choice([0.2, 0.5, 0.9, 1.0]))
        step = int(rng.integers(0, 30))
        skips = list(rng.random(step) < rng.random())
        skip_streak = next((i for i, s in enumerate(reversed(skips)) if not s), step)
        loss_streak = int(rng.integers(0, min(skip_streak, patience - 1) + 1))
        skip_streak = min(skip_streak, patience - 1 + int(rng.integers(0, 2)))
        points = [(0, 0)] + [(k + 1, sum(skips[: k + 1])) for k in range(step) if skips[k]]
        points.append((step, sum(skips)))
        expected, bad = None, skips[:]
        while expected is None:
            bad.append(True)
            t, d = len(bad), len(bad) - step
            rated = t >= window and sum(bad[t - window : t]) / window > rate
            if loss_streak + d >= patience or skip_streak + d >= patience or rated:
                expected = t
        found = first_possible_trip(
            points,
            loss_streak,
            skip_streak,
            patience=patience,
            max_skip_rate=rate,
            window=window,
            rate_from=window,
        )
        assert found == expected, (points, loss_streak, skip_streak, patience, window, rate)


def test_first_window_over_is_the_first_window_plain_python_finds_over_the_rate():
    """Against plain Python on random skips: a point at some reads and at every skip from
    ``exact_from`` on (a point is there, as the guard's read or first kept skip)."""
    rng = np.random.default_rng(1)
    found_some = 0
    for _ in range(300):
        n, window = int(rng.integers(5, 40)), int(rng.integers(1, 10))
        rate = float(rng.choice([0.2, 0.5, 0.8]))
        skips = [False] + list(rng.random(n) < rng.random())  # skips[u]: step u skipped
        exact_from = int(rng.integers(0, n + 1))
        reads = {0, exact_from, n} | {int(r) for r in rng.integers(0, n + 1, 3)}
        marks = sorted(reads | {u for u in range(exact_from, n + 1) if skips[u]})
        points = [(u, sum(skips[: u + 1])) for u in marks]
        first = int(rng.integers(0, n + 1))
        expected = next(
            (
                (end, sum(skips[end - window + 1 : end + 1]))
                for end in range(max(first, exact_from + window), n + 1)
                if sum(skips[end - window + 1 : end + 1]) / window > rate
            ),
            None,
        )
        found = first_window_over(
            points, first, n, window=window, max_skip_rate=rate, exact_from=exact_from
        )
        assert found == expected, (skips, points, first, window, rate, exact_from)
        found_some += expected is not None
    assert 50 < found_some < 250  # both answers were tested often
    assert (
        first_window_over([(0, 0), (9, 9)], 1, 9, window=3, max_skip_rate=0.5, exact_from=None)
        is None
    )


def test_skip_rate_over_exact_points_is_the_first_window_over_the_rate():
    """Every skip has its point from the fit's start: each window ending since the last
    read is counted, and the first one over the rate trips (plain Python: sums)."""
    rng = np.random.default_rng(2)
    tripped = 0
    for _ in range(300):
        n, window = int(rng.integers(5, 40)), int(rng.integers(1, 10))
        rate = float(rng.choice([0.2, 0.5, 0.8]))
        skips = [False] + list(rng.random(n) < rng.random())
        previous = int(rng.integers(0, n))  # the last read
        points = [(0, 0)] + [(u, sum(skips[: u + 1])) for u in range(1, n + 1) if skips[u]]
        points.append((n, sum(skips)))
        first = max(previous + 1, window)
        expected = next(
            (
                SkipRate(n, end, window, sum(skips[end - window + 1 : end + 1]))
                for end in range(first, n + 1)
                if sum(skips[end - window + 1 : end + 1]) / window > rate
            ),
            None,
        )
        found = skip_rate_trip(points, first, Rules(50, rate, window), exact_from=0)
        assert found == expected, (skips, previous, window, rate)
        tripped += expected is not None
    assert 50 < tripped < 250


def test_skip_rate_between_reads_is_the_share_since_a_read_a_window_back():
    """Reads only (the stock optimizer): the span from the last read at least ``window``
    steps back to now is judged as a whole (plain Python: sums of the skips)."""
    rng = np.random.default_rng(3)
    tripped = 0
    for _ in range(300):
        n, window = int(rng.integers(5, 40)), int(rng.integers(1, 10))
        rate = float(rng.choice([0.2, 0.5, 0.8]))
        skips = [False] + list(rng.random(n) < rng.random())
        reads = sorted({0, n} | {int(r) for r in rng.integers(1, n, 4)})
        points = [(u, sum(skips[: u + 1])) for u in reads]
        first = max(reads[-2] + 1, window)
        start = max(r for r in reads if r <= n - window) if n - window >= 0 else 0
        share = sum(skips[start + 1 :]) / (n - start)
        expected = SkipRate(n, n, n - start, sum(skips[start + 1 :])) if share > rate else None
        if first > n:
            expected = None
        found = skip_rate_trip(points, first, Rules(50, rate, window), exact_from=None)
        assert found == expected, (skips, reads, window, rate)
        tripped += expected is not None
    assert 30 < tripped < 270


@pytest.mark.parametrize(
    ("points", "exact_from", "window", "rate", "expected"),
    [
        # Skips at 1-6, read at 10, window 5, rate 0.5. A ring of 4 kept the skips at 3-6,
        # each counted back from the total: the window (3, 8] has 3 skips.
        ([(0, 0), (3, 3), (4, 4), (5, 5), (6, 6), (10, 6)], 3, 5, 0.5, SkipRate(10, 8, 5, 3)),
        # A ring of 2 kept 5 and 6: only (5, 10] is exact (1 skip); the span since the
        # start, 6 of 10, trips.
        ([(0, 0), (5, 5), (6, 6), (10, 6)], 5, 5, 0.5, SkipRate(10, 10, 10, 6)),
        # Skips at 1, 2, 3 and 6 and a ring that kept only the skip at 6: 4 of 10.
        ([(0, 0), (6, 4), (10, 4)], 6, 5, 0.5, None),
        # Skips at 1-4 of 8, window 4, rate 0.4, read at 8: the window ending at 4.
        ([(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (8, 4)], 0, 4, 0.4, SkipRate(8, 4, 4, 4)),
    ],
)
def test_skip_rate_trip_in_the_guards_cases(points, exact_from, window, rate, expected):
    first = max(points[0][0] + 1, window)
    assert skip_rate_trip(points, first, Rules(50, rate, window), exact_from=exact_from) == expected


def test_skip_rate_trip_checks_nothing_before_its_first_window_end():
    assert skip_rate_trip([(0, 0), (3, 3)], 4, Rules(5, 0.1, 4), exact_from=0) is None


@pytest.mark.parametrize(
    ("streaks", "steps", "new_skips", "nonfinite", "scales", "expected"),
    [
        (Streaks(), 3, 3, True, True, Streaks(3, 3)),  # every step skipped, NaN loss
        (Streaks(2, 2), 3, 3, False, True, Streaks(0, 5)),  # skipped, the loss finite
        (Streaks(2, 2), 3, 2, True, True, Streaks(0, 0)),  # a step applied: no streak
        (Streaks(4, 0), 2, 0, True, False, Streaks(6, 0)),  # no loss scaling: loss only
        (Streaks(4, 0), 2, 0, False, False, Streaks(0, 0)),
    ],
)
def test_inferred_streaks_grow_while_every_step_since_the_read_is_bad(
    streaks, steps, new_skips, nonfinite, scales, expected
):
    found = inferred_streaks(
        streaks, steps, new_skips, loss_nonfinite=nonfinite, scales_loss=scales
    )
    assert found == expected


@pytest.mark.parametrize(
    ("streaks", "scale", "floor", "expected"),
    [
        (Streaks(5, 5), 1.0, 1.0, NonfiniteLoss(9, 5)),  # the loss rule comes first
        (Streaks(4, 5), 1.0, 1.0, OverflowAtFloor(9, 5, 1.0, 1.0)),
        (Streaks(4, 5), 0.5, 1.0, OverflowAtFloor(9, 5, 0.5, 1.0)),  # stock: below 1.0
        (Streaks(4, 5), 2.0, 1.0, None),  # above the floor: the scale can still fall
        (Streaks(4, 5), None, 1.0, None),  # the scale was not read
        (Streaks(4, 5), None, None, None),  # no loss scaling: no floor rule
        (Streaks(4, 4), 1.0, 1.0, None),  # one short of patience
    ],
)
def test_streak_trip(streaks, scale, floor, expected):
    assert streak_trip(9, streaks, patience=5, loss_scale=scale, floor=floor) == expected


def test_skip_points_count_back_from_the_total_and_say_from_where_they_are_exact():
    assert skip_points([3, 5], 7, lost=False, attempted_steps=9, exact_from=0) == (
        [Point(3, 6), Point(5, 7)],
        0,
    )
    assert skip_points([3, 5], 7, lost=True, attempted_steps=9, exact_from=0) == (
        [Point(3, 6), Point(5, 7)],
        3,
    )
    assert skip_points([], 7, lost=True, attempted_steps=9, exact_from=0) == ([], 9)


def test_kept_from_keeps_the_last_point_a_window_back_and_every_later_one():
    points = [(0, 0), (3, 1), (5, 2), (9, 3), (12, 3)]
    assert kept_from(points, 12, 4) == 3  # the next windows start after 9
    assert kept_from(points, 12, 20) == 0
    assert kept_from(points, 12, 1) == 4  # the last point is always kept
    assert kept_from([(4, 0)], 4, 1) == 0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, 20),  # the rules: 30 - 10
        ({"health_every": 4}, 2),  # the health measured at 12
        ({"event_capacity": 3}, 3),  # before a fourth event could push the first out
        ({"event_capacity": 3, "steps_per_execution": 2}, 2),  # a read comes up to 1 late
        ({"event_capacity": 1, "steps_per_execution": 8}, 1),
        ({"health_every": 0, "check_freq": 25}, 25),  # never sooner than check_freq
    ],
)
def test_steps_to_next_read(kwargs, expected):
    settings = {
        "health_every": 100,
        "event_capacity": 128,
        "steps_per_execution": 1,
        "check_freq": 1,
        **kwargs,
    }
    assert steps_to_next_read(10, 30, **settings) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (math.nan, True),
        (math.inf, True),
        (np.float32(-np.inf), True),
        (np.array(np.nan), True),
        (1.5, False),
        (np.float16(3.0), False),
        (None, False),
        ("loss", False),
    ],
)
def test_is_nonfinite(value, expected):
    assert is_nonfinite(value) is expected
