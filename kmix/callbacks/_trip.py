"""The guard's trip rules: pure functions over the values its reads recorded.

:class:`kmix.callbacks.LossScaleGuard` reads its source, keeps ``(step, skipped)``
points, and asks these functions whether a rule is met and when to read next. Nothing
here reads an optimizer, a model or a clock, so each rule is tested against a
plain-Python reference without ``fit``.

The rules, each checked at a read:

* ``nonfinite_loss``: the loss has been non-finite ``patience`` steps in a row;
* ``overflow_at_floor``: ``patience`` skipped steps in a row, and the scale is at or
  below its floor;
* ``skip_rate``: more than ``max_skip_rate`` of a window of ``window`` steps were
  skipped (windows ending from ``window`` steps into the ``fit`` on).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

NONFINITE_LOSS = "nonfinite_loss"
OVERFLOW_AT_FLOOR = "overflow_at_floor"
SKIP_RATE = "skip_rate"
TRIP_REASONS = (NONFINITE_LOSS, OVERFLOW_AT_FLOOR, SKIP_RATE)
"""The values of ``LossScaleGuard.reason`` and ``LossScaleGuardError.reason``."""


class Point(NamedTuple):
    """The skipped count at one step (a plain ``(step, skipped)`` tuple works too).

    Attributes:
        step: an attempted optimizer step.
        skipped: steps skipped up to and including it.
    """

    step: int
    skipped: int


class Streaks(NamedTuple):
    """Bad steps in a row, up to a read.

    Attributes:
        loss: consecutive steps whose loss was non-finite.
        skips: consecutive skipped steps.
    """

    loss: int = 0
    skips: int = 0


@dataclasses.dataclass(frozen=True)
class Rules:
    """The guard's settings that the rules read.

    Attributes:
        patience: consecutive bad steps before a streak rule trips, >= 1.
        max_skip_rate: the share of a window's steps that may be skipped, in (0, 1].
        window: steps in a skip-rate window, >= 1.
    """

    patience: int
    max_skip_rate: float
    window: int


@dataclasses.dataclass(frozen=True)
class NonfiniteLoss:
    """``nonfinite_loss`` met at a read.

    Attributes:
        step: the step read.
        streak: consecutive non-finite losses up to it (>= patience).
    """

    reason: ClassVar[str] = NONFINITE_LOSS
    step: int
    streak: int


@dataclasses.dataclass(frozen=True)
class OverflowAtFloor:
    """``overflow_at_floor`` met at a read.

    Attributes:
        step: the step read.
        streak: consecutive skipped steps up to it (>= patience).
        loss_scale: the scale read.
        floor: the floor it is at or below.
    """

    reason: ClassVar[str] = OVERFLOW_AT_FLOOR
    step: int
    streak: int
    loss_scale: float
    floor: float


@dataclasses.dataclass(frozen=True)
class SkipRate:
    """``skip_rate`` met at a read.

    Attributes:
        step: the step read.
        end: the last step of the span over the rate (``step`` for the last steps).
        steps: how many steps the span has (``window``, or more for a span judged
            where single windows could not be counted).
        skipped: how many of them were skipped.
    """

    reason: ClassVar[str] = SKIP_RATE
    step: int
    end: int
    steps: int
    skipped: int


Trip = NonfiniteLoss | OverflowAtFloor | SkipRate
"""A rule met: what the diagnosis says."""


def is_nonfinite(value: Any) -> bool:
    """Whether a logged value (a float, NumPy or tensor scalar) is NaN or infinite.

    Args:
        value: the value, e.g. ``logs["loss"]``; None or a non-number counts as finite.

    Returns:
        True only for a number that is NaN or +-Inf.
    """
    try:
        return not math.isfinite(float(np.asarray(value)))
    except (TypeError, ValueError):
        return False


def inferred_streaks(
    streaks: Streaks, steps: int, new_skips: int, *, loss_nonfinite: bool, scales_loss: bool
) -> Streaks:
    """Streaks where the source does not count them (stock Keras, no loss scaling).

    Every step since the last read is taken as skipped when all were, and as having a
    non-finite loss when the logged loss is non-finite and (with loss scaling) every
    step was skipped: a stock optimizer applies a step whose loss was finite.

    Args:
        streaks: the streaks at the last read.
        steps: steps attempted since the last read.
        new_skips: steps skipped since the last read.
        loss_nonfinite: the logged loss is NaN/Inf.
        scales_loss: the optimizer has a loss scale.

    Returns:
        The streaks at this read; each is 0 or grows by ``steps``.
    """
    all_skipped = scales_loss and new_skips == steps
    bad_loss = loss_nonfinite and (not scales_loss or all_skipped)
    return Streaks(
        loss=streaks.loss + steps if bad_loss else 0,
        skips=streaks.skips + steps if all_skipped else 0,
    )


def streak_trip(
    step: int, streaks: Streaks, *, patience: int, loss_scale: float | None, floor: float | None
) -> NonfiniteLoss | OverflowAtFloor | None:
    """The streak rule met at a read, ``nonfinite_loss`` first.

    Args:
        step: the step read.
        streaks: the streaks up to it.
        patience: the guard's ``patience``.
        loss_scale: the scale read; None when not read (the floor rule needs it only
            once the skip streak reaches ``patience``).
        floor: the scale's floor; None without loss scaling (the floor rule is off).

    Returns:
        The trip, or None. E.g. ``streak_trip(9, Streaks(0, 4), patience=4,
        loss_scale=1.0, floor=1.0)`` is ``OverflowAtFloor(9, 4, 1.0, 1.0)``.
    """
    if streaks.loss >= patience:
        return NonfiniteLoss(step, streaks.loss)
    if (
        floor is not None
        and streaks.skips >= patience
        and loss_scale is not None
        and loss_scale <= floor
    ):
        return OverflowAtFloor(step, streaks.skips, loss_scale, floor)
    return None


def skip_points(
    skip_steps: Sequence[int],
    skipped_steps: int,
    *,
    lost: bool,
    attempted_steps: int,
    exact_from: int,
) -> tuple[list[Point], int]:
    """Points at the skipped steps that the events recorded since the last read hold.

    The skipped count at each is counted back from the total read, so it is exact even
    when the event ring no longer holds the oldest of them; then the points are exact
    only from the first skip it still holds on.

    Args:
        skip_steps: the steps of the skip events recorded since the last read and still
            held, in order.
        skipped_steps: the total skipped count read now.
        lost: the ring dropped some of the events since the last read.
        attempted_steps: the step read now.
        exact_from: the first step whose skipped count the points give exactly, so far.

    Returns:
        ``(points, exact_from)``: a point per skip, and the updated first exact step
        (the first kept skip after a loss; the read's step when no skip was kept).
    """
    first = skipped_steps - len(skip_steps)
    points = [Point(step, first + i) for i, step in enumerate(skip_steps, start=1)]
    if lost:
        exact_from = skip_steps[0] if skip_steps else attempted_steps
    return points, exact_from


def first_possible_trip(
    points: Sequence[tuple[int, int]],
    loss_streak: int,
    skip_streak: int,
    *,
    patience: int,
    max_skip_rate: float,
    window: int,
    rate_from: int,
) -> int:
    """The first step after the last read at which a rule could trip, whatever comes.

    Each step adds at most one to each streak and to the skipped count. So
    ``nonfinite_loss`` cannot trip before ``patience - loss_streak`` more steps,
    ``overflow_at_floor`` before ``patience - skip_streak`` (or the next step, when
    only the scale's floor is missing), and ``skip_rate`` at step ``t`` counts at most
    the skips already made after ``t - window`` plus one per step still to come in
    the window.

    Args:
        points: ``(step, skipped)`` pairs in step order, the last one the read just
            made, such that the skipped count at any step ``u`` from the first point on
            is at least that of the last point at or before ``u`` (exact where every
            skip has its point).
        loss_streak: consecutive non-finite losses at the last point.
        skip_streak: consecutive skipped steps at the last point.
        patience: the guard's ``patience``.
        max_skip_rate: the guard's ``max_skip_rate``.
        window: the guard's ``window``.
        rate_from: the first step at which ``skip_rate`` applies (the steps attempted
            before the fit + ``window``: once ``window`` steps of the fit have run).

    Returns:
        A step after the last point's. E.g. no streaks and a skip rate far from
        ``max_skip_rate``, ``patience=20``: the last point's step + 20.
    """
    step, skipped = points[-1]
    streaks = min(step + patience - loss_streak, step + max(patience - skip_streak, 1))
    if max_skip_rate >= 1.0:  # no share of skipped steps exceeds 1
        return streaks
    steps = [p for p, _ in points]
    # Returns within window + 1 steps: a whole window of skips exceeds any rate below 1.
    for t in range(max(step + 1, rate_from), streaks):
        before = points[max(bisect.bisect_right(steps, t - window) - 1, 0)][1]
        if (skipped - before + min(t - step, window)) / window > max_skip_rate:
            return t
    return streaks


def first_window_over(
    points: Sequence[tuple[int, int]],
    first: int,
    last: int,
    *,
    window: int,
    max_skip_rate: float,
    exact_from: int | None,
) -> tuple[int, int] | None:
    """The first window of ``window`` steps ending in ``[first, last]`` that skipped
    more than ``max_skip_rate`` of its steps, among those the points count exactly.

    The skipped count at step ``u`` is the last point's at or before ``u``; it is exact
    from ``exact_from`` on (every later skip has its point). A window's count only
    grows at a point, so the first window over the rate ends at ``first`` or at a point.

    Args:
        points: ``(step, skipped)`` pairs in step order.
        first: the earliest window end to check.
        last: the latest window end to check.
        window: the guard's ``window``.
        max_skip_rate: the guard's ``max_skip_rate``.
        exact_from: the first step whose skipped count the points give exactly;
            None when no step's is (they are reads some steps apart).

    Returns:
        ``(end, skipped)``: the window's last step and the steps it skipped; None when
        no exactly counted window is over the rate.
    """
    if exact_from is None:
        return None
    steps = [p for p, _ in points]
    start = max(first, exact_from + window, steps[0] + window)
    if start > last:
        return None
    for end in [start] + [p for p in steps if start < p <= last]:
        at = points[bisect.bisect_right(steps, end) - 1][1]
        before = points[bisect.bisect_right(steps, end - window) - 1][1]
        if (at - before) / window > max_skip_rate:
            return end, at - before
    return None


def skip_rate_trip(
    points: Sequence[tuple[int, int]], first: int, rules: Rules, *, exact_from: int | None
) -> SkipRate | None:
    """The skip-rate rule over the windows ending from ``first`` to the last point.

    Each window is counted exactly where the points are (:func:`first_window_over`).
    The windows they do not count exactly (reads of a stock optimizer; skips an event
    ring lost between reads) are judged together by the share skipped since the last
    point before the unknown steps and at least ``window`` steps back: a span longer
    than ``window`` can exceed the rate where no single window does.

    Args:
        points: ``(step, skipped)`` pairs in step order, the last one the read just
            made, with one at or before ``first - window`` (or the first point of the
            fit, when ``first`` is ``window`` steps into it).
        first: the earliest window end to check (the step after the last read's, and
            not before ``window`` steps into the fit).
        rules: the guard's settings.
        exact_from: the first step whose skipped count the points give exactly; None
            when no step's is.

    Returns:
        The trip at the last point's step, or None (also when ``first`` is after it).
        E.g. points ``[(0, 0), (10, 6)]``, ``first=10``, window 5, rate 0.5, not exact:
        ``SkipRate(step=10, end=10, steps=10, skipped=6)``.
    """
    step, skipped = points[-1]
    if first > step:
        return None
    window, rate = rules.window, rules.max_skip_rate
    over = first_window_over(
        points, first, step, window=window, max_skip_rate=rate, exact_from=exact_from
    )
    if over is not None:
        return SkipRate(step, end=over[0], steps=window, skipped=over[1])
    last = step - window
    if exact_from is not None:
        if first - window >= exact_from:
            return None  # every window was counted exactly
        last = min(last, exact_from - 1)
    start, counted = points[bisect.bisect_right([p for p, _ in points], last) - 1]
    if (skipped - counted) / (step - start) > rate:
        return SkipRate(step, end=step, steps=step - start, skipped=skipped - counted)
    return None


def kept_from(points: Sequence[tuple[int, int]], step: int, window: int) -> int:
    """How many of the oldest points the next read's windows no longer need.

    The next read checks windows ending after ``step``, which start after
    ``step + 1 - window``: the last point at or before that start is kept, and every
    later one.

    Args:
        points: ``(step, skipped)`` pairs in step order.
        step: the step read now.
        window: the guard's ``window``.

    Returns:
        The number of leading points to drop (the last point is always kept).
    """
    drop = 0
    while drop + 1 < len(points) and points[drop + 1][0] <= step + 1 - window:
        drop += 1
    return drop


def steps_to_next_read(
    step: int,
    trip: int,
    *,
    health_every: int,
    event_capacity: int,
    steps_per_execution: int,
    check_freq: int,
) -> int:
    """Steps from ``step`` to the next read of a source that records every event.

    The next read comes at the first of: the first step a rule could trip
    (:func:`first_possible_trip`), the next health measurement (each is read before
    the next replaces it), and before the event ring could overflow; never sooner
    than ``check_freq`` steps on.

    Args:
        step: the step read now.
        trip: the first step a rule could trip.
        health_every: steps between health measurements (0: none).
        event_capacity: events the ring keeps.
        steps_per_execution: the model's; Keras calls back once per execution, so a
            read comes up to ``steps_per_execution - 1`` steps after it was asked for.
        check_freq: the guard's ``check_freq``.

    Returns:
        The steps, >= ``check_freq``. E.g. step 10, trip 30, health every 100, a ring
        of 128, one step per execution, ``check_freq=1``: 20.
    """
    health = step + health_every - step % health_every if health_every > 0 else trip
    late = max(steps_per_execution - 1, 0)
    ring = step + max(event_capacity - late, 1)
    return max(check_freq, min(trip, health, ring) - step)
