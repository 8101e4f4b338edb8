"""The training side of ``kmix compare``: build each policy's model, time it in rounds.

Thin glue over Keras: every policy's model is built under its policy (after
``keras.utils.clear_session()``, which resets the global policy, so the policy is set
after it and every model's layers get the same names), compiled with the user's loss
and :class:`kmix.LossScaleOptimizer`, and trained with ``fit`` in turns: a round gives
each model its share of the steps, in ABBA order (forward, then backward), so a load
that drifts during the comparison falls on every policy alike. What the numbers mean
is decided in :mod:`kmix.compare.rules`.

Each step's loss is the step's own (:mod:`kmix.compare.step_loss`), not Keras's
running mean; a model whose own ``train_step`` does not use the loss tracker falls back
to the running means (see :class:`Entry`).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kmix._checks import SpeedWarning
from kmix.compare.values import CompareError

__all__ = [
    "SHUFFLE_BATCHES",
    "Budget",
    "Entry",
    "Progress",
    "Trained",
    "build_entry",
    "losses_from_means",
    "make_dataset",
    "round_plan",
    "train",
    "warm_up",
]


SHUFFLE_BATCHES = 16
"""The shuffle buffer, in batches, of a dataset given in another order (``order_seed``)."""


class Progress(NamedTuple):
    """Where a comparison is: shown while it runs.

    Attributes:
        run: the run's name (a policy, or ``float32_repeat`` for the noise floor).
        round: the round, from 1 (0 while warming up).
        rounds: how many rounds.
        step: steps done in this turn.
        steps: steps of this turn.
        step_time_s: the latest step's time; None before the second step of a turn.
    """

    run: str
    round: int
    rounds: int
    step: int
    steps: int
    step_time_s: float | None


class Budget(NamedTuple):
    """The time a model may spend in ``fit`` in all, and what it was set from.

    Attributes:
        seconds: the time (:func:`kmix.compare.rules.slow_budget_s`).
        float32_step_s: float32's time in ``fit`` per step, warm-up included.
    """

    seconds: float
    float32_step_s: float


@dataclasses.dataclass
class Entry:
    """One model in the comparison and what was measured of it so far.

    Attributes:
        name: the run's name (its log dir under the comparison's).
        policy: its dtype policy.
        model: the compiled model.
        callbacks: callbacks of every ``fit`` (the monitor).
        times: step times, per round (the first step of a turn is left out).
        losses: every trained step's own loss, in order: the value the step gave
            the loss tracker, ``step_loss`` (exact; non-finite where the step was
            skipped for it). Without ``step_loss``, or when the model's own
            ``train_step`` does not use the loss tracker, recovered from ``logs["loss"]``
            taken as Keras's running mean ``m_k`` of the ``fit``'s first k steps:
            ``k m_k - (k - 1) m_(k-1)`` (within k rounding errors of the mean;
            non-finite from a non-finite step to the end of that ``fit``).
        wall_s: time spent in ``fit``, warm-up included.
        stopped: why it was stopped, or "" (its run's end record says it too:
            :data:`kmix.tags.STOPPED_BY_COMPARE`).
        out_of_memory: the device's error, when the model did not fit.
        step_loss: the model's :class:`kmix.compare.step_loss.StepLoss`, or None.
        dataset: the run's own repeated dataset (float32's repeat: the data in another
            order), or None for the one given to :func:`warm_up` and :func:`train`.
    """

    name: str
    policy: str
    model: Any
    callbacks: list[Any]
    times: list[list[float]] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    stopped: str = ""
    out_of_memory: str = ""
    step_loss: Any = None
    dataset: Any = None

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
    def active(self) -> bool:
        return not self.stopped and not self.out_of_memory


class Trained(NamedTuple):
    """A model built for the comparison.

    Attributes:
        model: the compiled ``keras.Model``.
        loss: the loss it was compiled with.
    """

    model: Any
    loss: Any


def round_plan(steps: int, rounds: int, warmup: int) -> list[int]:
    """Steps per round, after ``warmup`` steps that are trained but not timed.

    Args:
        steps: steps per policy in all, warm-up included.
        rounds: rounds.
        warmup: untimed steps first (the train function's tracing).

    Returns:
        ``rounds`` step counts summing to ``steps - warmup``, the larger first.
    """
    left = steps - warmup
    return [left // rounds + (1 if index < left % rounds else 0) for index in range(rounds)]


def make_dataset(
    data: Any, batch_size: int, order_seed: int | None = None
) -> tuple[Any, int | None]:
    """The comparison's input: a repeated, batched ``tf.data.Dataset`` of ``(x, y)``.

    From arrays, where Keras's backend is not TensorFlow, the same batches as an
    :class:`kmix.compare.batches.ArrayBatches` (no TensorFlow imported for them).

    Args:
        data: ``(x, y)`` arrays (batched here, the remainder dropped so every step
            has ``batch_size`` examples) or a batched ``tf.data.Dataset``.
        batch_size: examples per step for arrays.
        order_seed: None keeps the data's order. Otherwise the order is another, the
            same for every iteration of the returned dataset: arrays' examples are
            permuted once, by ``numpy.random.default_rng(order_seed).permutation``,
            before batching; a dataset's batches are shuffled within a buffer of
            :data:`SHUFFLE_BATCHES` batches, with ``order_seed`` as the shuffle's seed,
            once: every pass and every iterator (each turn's ``skip``) see that order.

    Returns:
        ``(dataset, examples per step)``; None when a dataset's first batch has no
        leading dimension.

    Raises:
        CompareError: ``data`` is neither, or has fewer examples than one batch.
    """
    import keras

    from kmix import backend

    if backend.is_dataset(data):
        first = next(iter(data.take(1)), None)
        if first is None:
            raise CompareError("data is an empty tf.data.Dataset: give one with (x, y) batches")
        leading = keras.tree.flatten(first)[0].shape
        if order_seed is not None:
            data = data.shuffle(SHUFFLE_BATCHES, seed=order_seed, reshuffle_each_iteration=False)
        return data.repeat(), (int(leading[0]) if leading.rank and leading[0] else None)
    if not isinstance(data, tuple | list) or len(data) != 2:
        raise CompareError(
            f"data must be a tf.data.Dataset of (x, y) batches or a tuple (x, y) of arrays; "
            f"got {type(data).__name__}"
            + (f" of length {len(data)}" if isinstance(data, tuple | list) else "")
        )
    x, y = data
    lengths = {len(a) for a in keras.tree.flatten((x, y))}
    if len(lengths) > 1:
        raise CompareError(
            f"data's arrays differ in length ({', '.join(map(str, sorted(lengths)))} rows): "
            "give x and y with one example per row each, the same number of rows"
        )
    count = len(keras.tree.flatten(x)[0])
    if count < batch_size:
        raise CompareError(
            f"data has {count} examples, fewer than one batch of batch_size={batch_size}: "
            "give more examples or a smaller batch_size"
        )
    if order_seed is not None:
        import numpy as np

        order = np.random.default_rng(order_seed).permutation(count)
        x, y = keras.tree.map_structure(lambda a: np.take(np.asarray(a), order, axis=0), (x, y))
    if not backend.USES_TENSORFLOW:
        from kmix.compare.batches import ArrayBatches

        return ArrayBatches(x, y, batch_size), batch_size
    return backend.dataset_from_arrays(x, y, batch_size).cache().repeat(), batch_size


def build_entry(
    build_model: Callable[[], Any], policy: str, seed: int, loss: Any, what: str
) -> Trained:
    """Builds and compiles one model under ``policy``.

    Args:
        build_model: the user's function; returns a compiled or uncompiled model.
        policy: the Keras policy name to build it under.
        seed: the random seed set before building.
        loss: the loss for an uncompiled model (a compiled one keeps its own).
        what: how to name ``build_model`` in errors.

    Returns:
        The model, compiled with its loss and :class:`kmix.LossScaleOptimizer`.

    Raises:
        CompareError: ``build_model`` returned no Keras model, or an uncompiled one
            without a ``loss``.
    """
    import keras

    import kmix
    from kmix import backend

    keras.utils.clear_session()  # resets the global policy: set it after
    backend.set_random_seed(seed)  # Keras's, without importing TensorFlow where it is not used
    with warnings.catch_warnings():  # kmix.use's note on float16's speed: measured here
        warnings.filterwarnings("ignore", category=SpeedWarning)
        with kmix.policy_scope(policy):
            model = build_model()
    if not isinstance(model, keras.Model):
        raise CompareError(
            f"{what} returned {type(model).__name__} ({_short(model)}), not a keras.Model: "
            "return the model, compiled or not"
        )
    optimizer = getattr(model, "optimizer", None)
    compiled_loss = getattr(model, "loss", None) if getattr(model, "compiled", False) else None
    loss = compiled_loss if compiled_loss is not None else loss
    if loss is None:
        raise CompareError(
            f"{what} returned an uncompiled model and no loss was given: compile it with its "
            "loss in the function, or pass loss= (kmix compare --loss NAME)"
        )
    if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if optimizer is None:
        inner: Any = keras.optimizers.Adam()
    else:
        inner = type(optimizer).from_config(optimizer.get_config())
    model.compile(optimizer=kmix.LossScaleOptimizer(inner), loss=loss)
    return Trained(model, loss)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def losses_from_means(means: Sequence[float]) -> list[float]:
    """Each step's loss from Keras's running means over a ``fit``'s steps.

    Args:
        means: ``m_1 .. m_n``, the mean loss of the ``fit``'s first k steps after step k.

    Returns:
        ``l_k = k m_k - (k - 1) m_(k-1)`` (``l_1 = m_1``): within k rounding errors of
        the mean, and non-finite from the first non-finite step on.
    """
    return [k * m - (k - 1) * means[k - 2] if k > 1 else m for k, m in enumerate(means, 1)]


class _Turn:
    """A Keras callback for one ``fit``: step times, per-step losses, budget, progress."""

    def __init__(
        self,
        entry: Entry,
        where: tuple[int, int],
        steps: int,
        budget: Budget | None,
        progress: Callable[[Progress], None] | None,
    ) -> None:
        import keras

        self.callback = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: self.step_end(batch, logs or {})
        )
        self.entry, self.where, self.steps, self.budget = entry, where, steps, budget
        self.progress = progress
        self.last: float | None = None
        self.logged: list[float] = []  # logs["loss"]: own losses, or Keras's running means
        self.times: list[float] = []

    def step_end(self, batch: int, logs: dict[str, Any]) -> None:
        now = time.perf_counter()
        self.logged.append(float(logs.get("loss", math.nan)))
        count = batch + 1
        latest = None
        if batch and self.last is not None:
            latest = now - self.last
            self.times.append(latest)
        self.last = now
        spent = self.entry.wall_s + (now - self.started)
        if self.budget is not None and spent > self.budget.seconds:
            self.stop(spent, self.entry.steps + count)
        if self.progress is not None:
            self.progress(Progress(self.entry.name, *self.where, count, self.steps, latest))

    def stop(self, spent: float, steps: int) -> None:
        """Stops the model as too slow: its monitor's run ends with the reason, as the
        guard ends a run, before Keras's ``on_train_end`` would call it completed."""
        from kmix import tags
        from kmix._runs import end_run
        from kmix.compare.text import slow_stop_words

        budget, model = self.budget, self.callback.model
        self.entry.stopped = f"stopped after {spent:.0f} s (budget {budget.seconds:.0f} s)"
        words = slow_stop_words(steps, spent, budget.float32_step_s, budget.seconds)
        end_run(model, tags.STOPPED_BY_COMPARE, words)
        model.stop_training = True

    def fit(self, dataset: Any) -> None:
        """Trains ``self.steps`` steps of ``dataset``, adding to the entry's record."""
        self.started = time.perf_counter()
        try:
            self.entry.model.fit(
                dataset.take(self.steps),
                epochs=1,
                verbose=0,
                shuffle=False,
                callbacks=[*self.entry.callbacks, self.callback],
            )
        except Exception as error:
            if type(error).__name__ != "ResourceExhaustedError":
                raise
            self.entry.out_of_memory = str(error).splitlines()[0][:200]
        finally:
            self.entry.wall_s += time.perf_counter() - self.started
            self.entry.losses += self.losses()

    def losses(self) -> list[float]:
        """The fit's per-step losses: each step's own, else recovered from the means."""
        step_loss = self.entry.step_loss
        if step_loss is not None and step_loss.updated():
            return self.logged
        return losses_from_means(self.logged)


def warm_up(
    entry: Entry,
    dataset: Any,
    steps: int,
    rounds: int,
    budget: Budget | None,
    progress: Callable[[Progress], None] | None = None,
) -> None:
    """Trains ``steps`` untimed steps: the train function is traced here, not in a round.

    Args:
        entry: the model.
        dataset: the repeated dataset of :func:`make_dataset` (unless the entry has its own).
        steps: warm-up steps.
        rounds: rounds to come (for the progress line).
        budget: the time the entry may spend in ``fit`` in all, or None.
        progress: called after every step with a :class:`Progress`.
    """
    _Turn(entry, (0, rounds), steps, budget, progress).fit(_data(entry, dataset))


def train(
    entries: Sequence[Entry],
    dataset: Any,
    plan: Sequence[int],
    budget: Callable[[Entry], Budget | None],
    progress: Callable[[Progress], None] | None = None,
) -> None:
    """Trains the models in rounds, in ABBA order (forward, backward, forward, ...).

    Args:
        entries: the models, warmed up.
        dataset: the repeated dataset of :func:`make_dataset` (for the entries without
            their own); each turn continues where the model's previous turn ended.
        plan: steps per round (:func:`round_plan`).
        budget: an entry -> the time it may spend in ``fit`` in all, or None. One
            that spends more is stopped, its run ended as
            :data:`kmix.tags.STOPPED_BY_COMPARE`.
        progress: called after every step with a :class:`Progress`.
    """
    for index, steps in enumerate(plan):
        order = entries if index % 2 == 0 else list(reversed(entries))
        for entry in order:
            if not entry.active:
                continue
            turn = _Turn(entry, (index + 1, len(plan)), steps, budget(entry), progress)
            turn.fit(_data(entry, dataset).skip(entry.steps))
            entry.times.append(turn.times)


def _data(entry: Entry, dataset: Any) -> Any:
    return dataset if entry.dataset is None else entry.dataset
