"""Which precision for *this* model on *this* machine: ``kmix.compare_policies``.

Measures float32, mixed_float16 and mixed_bfloat16 (or the policies given) side by
side on the user's model and data, and recommends one, with reasons that follow from
the table (:func:`kmix.compare.rules.recommend`).

How it measures (in one process; the input from arrays is a ``tf.data.Dataset`` on
TensorFlow, ``kmix.backend.dataset_from_arrays``, and the same batches without TensorFlow
on JAX and torch, :class:`kmix.compare.batches.ArrayBatches`):

* every policy's model is built under its policy, compiled with the user's loss and
  :class:`kmix.LossScaleOptimizer`, and logged by
  :class:`kmix.callbacks.MixedPrecisionMonitor` to ``LOGDIR/<policy>/train`` (so
  TensorBoard overlays their curves; a temporary directory when ``logdir`` is None);
* a second float32 model from another seed, ``float32_repeat``, trains beside them on
  the same data in another order (what a ``build_model`` that seeds itself cannot fix):
  its step times against float32's are the noise floor, its final loss against
  float32's the loss spread (:func:`kmix.compare.rules.loss_spread`: unknown, not zero,
  when the repeat ends at float32's very loss);
* every step's loss is the step's own (:mod:`kmix.compare.step_loss`), not Keras's
  running mean, so a step skipped for a non-finite loss is one non-finite point;
* after a short warm-up, the models take turns in rounds (ABBA order); a policy that
  spends more than :data:`kmix.compare.rules.SLOW_FACTOR` times float32's time (and
  at least 30 s) is stopped and reported as pathologically slow, with its cause where
  kmix can name it;
* peak memory comes from a separate process per policy that builds and trains only
  that policy (:mod:`kmix.compare.memory`): device memory where TensorFlow reports
  it (GPU), else the process's peak resident memory. It needs ``build_model`` to be
  importable by name; otherwise the row says why it was not measured.

Example:
    >>> import kmix
    >>> comparison = kmix.compare_policies(build_model, (x, y), steps=200)  # doctest: +SKIP
    >>> print(comparison.to_markdown())                                     # doctest: +SKIP
    >>> comparison.recommendation.policy                                    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from kmix._checks import NotFloat16Note
from kmix.compare import rules
from kmix.compare.rounds import (
    Budget,
    Entry,
    Progress,
    build_entry,
    make_dataset,
    round_plan,
    train,
    warm_up,
)
from kmix.compare.values import (
    MEASURED,
    OUT_OF_MEMORY,
    STOPPED_SLOW,
    CompareError,
    PolicyComparison,
    PolicyRow,
)

__all__ = [
    "COMPARABLE",
    "DEFAULT_POLICIES",
    "REPEAT",
    "CompareError",
    "PolicyComparison",
    "PolicyRow",
    "Progress",
    "compare_policies",
    "logdir_problem",
    "write_comparison",
]

DEFAULT_POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
COMPARABLE = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")
"""The policies ``compare_policies`` accepts."""
REPEAT = "float32_repeat"
"""The run name of float32's second model, whose times give the noise floor (it sorts
after ``float32``, so TensorBoard lists float32's own run first)."""
TIMING = (
    "in one process, median of the step times between the ends of consecutive steps "
    "(monitor reads included, the first step of each turn left out); the policies take "
    "turns in rounds, in ABBA order"
)


def compare_policies(
    build_model: Callable[[], Any],
    data: Any,
    policies: Sequence[str] = DEFAULT_POLICIES,
    steps: int = 200,
    logdir: str | None = None,
    *,
    rounds: int = 4,
    batch_size: int = 32,
    loss: Any = None,
    seed: int = 0,
    measure_memory: bool = True,
    progress: Callable[[Progress], None] | None = None,
) -> PolicyComparison:
    """Trains the model under each policy, side by side, and compares them.

    Args:
        build_model: a function that builds the model under the current global dtype
            policy and returns it, compiled (its loss is kept, its optimizer wrapped in
            :class:`kmix.LossScaleOptimizer`) or not (then ``loss`` is needed).
        data: a batched ``tf.data.Dataset`` of ``(x, y)`` or a tuple ``(x, y)`` of
            arrays (batched with ``batch_size``). Repeated as needed.
        policies: the policies to compare; must include ``"float32"``, the reference.
        steps: training steps per policy (warm-up included), >= 2 * rounds + 1.
        logdir: where each policy's TensorBoard run (``LOGDIR/<policy>/train``) and the
            comparison record go; None keeps nothing.
        rounds: turns each policy takes.
        batch_size: examples per step for ``(x, y)`` data.
        loss: the loss for an uncompiled model.
        seed: the random seed each model is built with (``float32_repeat``: seed + 1,
            its data in another order: examples permuted, or a dataset's batches
            shuffled, with seed + 1; see :func:`kmix.compare.rounds.make_dataset`).
        measure_memory: measure peak memory in a process per policy.
        progress: called after every step with a :class:`Progress`.

    Returns:
        The :class:`PolicyComparison`. Keras's session is cleared before each model is
        built (so every model's layers have the same names); the global dtype policy
        is the same afterwards as before.

    Raises:
        CompareError: a bad argument, a log dir that is not new or empty, a function
            that returns no model, data that does not fit the model, or a run of several
            processes (``keras.distribution``: kmix compare is a single-process tool);
            the message names it and says what to do.
    """
    policies = _check_arguments(policies, steps, rounds, batch_size)
    from kmix.backend import check_single_process

    check_single_process("kmix compare", CompareError)
    if logdir is not None and (problem := logdir_problem(logdir, "logdir")):
        raise CompareError(problem)
    import keras

    from kmix.compare.memory import measure_peaks
    from kmix.policy import hardware

    detected = hardware()
    dataset, examples = make_dataset(data, batch_size)
    reordered, _ = make_dataset(data, batch_size, order_seed=seed + 1)  # float32_repeat's
    warmup = max(1, min(2, steps - 2 * rounds))  # untimed: the train function is traced
    plan = round_plan(steps, rounds, warmup)
    with contextlib.ExitStack() as stack:
        previous = keras.config.dtype_policy()  # clear_session resets it before each build
        stack.callback(keras.config.set_dtype_policy, previous)
        root = logdir if logdir is not None else stack.enter_context(tempfile.TemporaryDirectory())
        what = getattr(build_model, "__qualname__", None) or repr(build_model)
        entries = _build_all(build_model, policies, seed, loss, root, dataset, reordered, what)
        first = entries[0]
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", category=NotFloat16Note)  # the table says it

        def budget(entry: Entry) -> Budget | None:
            if entry.policy == "float32" or first.wall_s == 0:  # float32_repeat: the floor
                return None
            step_s = first.wall_s / max(first.steps, 1)
            return Budget(rules.slow_budget_s(step_s * steps), step_s)

        for entry in entries:
            if entry is first:
                _first_fit(first, dataset, warmup, rounds, what, progress)
            else:
                warm_up(entry, dataset, warmup, rounds, budget(entry), progress)
        train(entries, dataset, plan, budget, progress)
        logs = {entry.name: _read_run(os.path.join(root, entry.name)) for entry in entries}
    skip = {e.policy: "stopped as too slow" for e in entries if e.stopped}
    peaks = measure_peaks(
        build_model, data, policies, batch_size, loss, seed, measure_memory, skip=skip
    )
    comparison = _table(entries, logs, peaks, detected, steps, rounds, examples)
    comparison = dataclasses.replace(comparison, model=f"{what} (model {comparison.model!r})")
    if logdir is not None:
        write_comparison(logdir, comparison)
    return comparison


def write_comparison(logdir: str, comparison: PolicyComparison) -> None:
    """Writes the comparison record to ``logdir``: its file and its TensorBoard run.

    Args:
        logdir: the comparison's log dir.
        comparison: the comparison.
    """
    from kmix import tags
    from kmix.tags import EventWriter

    text = tags.format_comparison(comparison.to_dict())
    os.makedirs(logdir, exist_ok=True)
    with open(os.path.join(logdir, tags.COMPARISON_FILE), "w", encoding="utf-8") as file:
        file.write(text + "\n")
    with EventWriter(os.path.join(logdir, tags.COMPARISON_RUN)) as writer:
        writer.text(tags.COMPARISON, text, step=0, description="kmix compare's table (JSON)")


def logdir_problem(logdir: str, name: str) -> str | None:
    """Why a log dir cannot take a comparison, or None: it must be new or empty.

    Args:
        logdir: the directory.
        name: how to name it in the message (``--logdir`` or ``logdir``).

    Returns:
        A one-line message naming it and what to do, or None.
    """
    if not str(logdir).strip():
        return f"{name} '' is empty: give a directory, e.g. runs/compare"
    if os.path.isfile(logdir):
        return f"{name} {logdir} is a file: give a new or empty directory"
    if os.path.isdir(logdir) and os.listdir(logdir):
        return (
            f"{name} {logdir} is not empty: give a new or empty directory (kmix never "
            "deletes what it did not write)"
        )
    return None


def _check_arguments(
    policies: Sequence[str], steps: int, rounds: int, batch_size: int
) -> tuple[str, ...]:
    """The policies as a tuple, after checking every argument.

    Raises:
        CompareError: a policy is unknown or repeated, float32 is missing, or
            ``steps``, ``rounds`` or ``batch_size`` is not a positive integer that fits.
    """
    if isinstance(policies, str):
        policies = (policies,)
    policies = tuple(policies)
    unknown = [p for p in policies if p not in COMPARABLE]
    if unknown or len(set(policies)) != len(policies):
        raise CompareError(
            f"Invalid policies={list(policies)!r}: each once, from {', '.join(COMPARABLE)}"
        )
    if "float32" not in policies:
        raise CompareError(
            f"Invalid policies={list(policies)!r}: include 'float32', the reference of every "
            "speed-up and loss"
        )
    for name, value, least in (("rounds", rounds, 1), ("batch_size", batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise CompareError(f"Invalid {name}={value!r}: use an integer >= {least}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2 * rounds + 1:
        raise CompareError(
            f"Invalid steps={steps!r}: use an integer >= 2 * rounds + 1 = {2 * rounds + 1} "
            "(a warm-up step, then two steps a round: the first of each turn is not timed)"
        )
    return ("float32", *(p for p in policies if p != "float32"))


def _build_all(
    build_model: Callable[[], Any],
    policies: Sequence[str],
    seed: int,
    loss: Any,
    root: str,
    dataset: Any,
    reordered: Any,
    what: str,
) -> list[Entry]:
    """Builds every run's model (float32 first, then float32_repeat) with its monitor.

    Each model's loss tracker keeps the step's own loss
    (:func:`kmix.compare.step_loss.watch_step_loss`); float32_repeat trains on
    ``reordered``, the data in another order.
    """
    from kmix.callbacks import MixedPrecisionMonitor
    from kmix.compare.step_loss import watch_step_loss

    runs = [("float32", "float32", seed), (REPEAT, "float32", seed + 1)]
    runs += [(p, p, seed) for p in policies if p != "float32"]
    entries = []
    for name, policy, run_seed in runs:
        built = build_entry(build_model, policy, run_seed, loss, what)
        if not entries:
            _check_shapes(built.model, dataset, what)
        monitor = MixedPrecisionMonitor(os.path.join(root, name), update_freq=10, verbose=0)
        step_loss = watch_step_loss(built.model)
        own = reordered if name == REPEAT else None
        entries.append(
            Entry(name, policy, built.model, [monitor], step_loss=step_loss, dataset=own)
        )
    return entries


def _check_shapes(model: Any, dataset: Any, what: str) -> None:
    """Raises CompareError when the data's first batch does not fit the model's inputs."""
    import keras

    x, _ = next(iter(dataset.take(1)))
    try:  # a model built lazily (no Input) has no inputs yet: its first fit will tell
        expected = [tuple(t.shape) for t in model.inputs or []]
    except (AttributeError, ValueError):
        return
    got = [tuple(t.shape) for t in keras.tree.flatten(x)]
    if len(expected) != 1 or len(got) != 1:  # several inputs: left to the first fit
        return
    (e,), (g,) = expected, got
    if len(e) != len(g) or not all(a is None or a == b for a, b in zip(e, g, strict=True)):
        raise CompareError(
            f"the data's x batches have shape {', '.join(map(str, got))} but the model of "
            f"{what} expects {', '.join(map(str, expected))} (None: any size): give data "
            "whose x matches the model's inputs"
        )


def _first_fit(
    entry: Entry,
    dataset: Any,
    warmup: int,
    rounds: int,
    what: str,
    progress: Callable[[Progress], None] | None,
) -> None:
    """float32's warm-up; data the model cannot take becomes a one-line CompareError."""
    try:
        warm_up(entry, dataset, warmup, rounds, None, progress)
    except (ValueError, TypeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CompareError(
            f"the model of {what} cannot train on the data: {first[:300]}; check that the "
            "data's (x, y) match the model's inputs and loss"
        ) from error


def _read_run(path: str) -> Any:
    """The run's :class:`kmix.report.Summary`, None if nothing was logged."""
    from kmix import report

    try:
        return report.summarize(report.read_log(path))
    except report.ReportError:
        return None


def _table(
    entries: Sequence[Entry],
    logs: dict[str, Any],
    peaks: dict[str, Any],
    detected: Any,
    steps: int,
    rounds: int,
    examples: int | None,
) -> PolicyComparison:
    """The comparison from what was measured: the rows, the noise floor, the advice."""
    float32, repeat = entries[0], entries[1]
    ratios = []
    for ours, theirs in zip(float32.times, repeat.times, strict=False):
        a, b = rules.step_stats(ours), rules.step_stats(theirs)
        if a and b:
            ratios.append(b[0] / a[0])
    repeat_stats = rules.step_stats([t for turn in repeat.times for t in turn])
    f32_stats = rules.step_stats([t for turn in float32.times for t in turn])
    overall = repeat_stats[0] / f32_stats[0] if repeat_stats and f32_stats else None
    floor = rules.noise_floor(ratios, overall)
    f32_loss, repeat_loss = rules.final_loss(float32.losses), rules.final_loss(repeat.losses)
    spread = rules.loss_spread(f32_loss, repeat_loss)
    from kmix import backend

    # oneDNN's float16 path is TensorFlow's kernels' (not those of JAX or torch)
    onednn = backend.USES_TENSORFLOW and os.environ.get(
        "TF_ENABLE_ONEDNN_OPTS", "1"
    ).lower() not in ("0", "false")
    accelerators = bool(detected.gpus or detected.tpus)
    rows = []
    for entry in entries:
        if entry.name == REPEAT:
            continue
        row = _row(entry, logs.get(entry.name), peaks.get(entry.policy), examples)
        row = _compare_to_float32(row, f32_stats, f32_loss, spread, floor)
        native, why = rules.native_compute(
            entry.policy, detected.cpu_flags, [g.compute_capability for g in detected.gpus]
        )
        note = row.note
        if entry.stopped:
            cause = rules.slow_cause(entry.policy, detected.cpu_flags, accelerators, onednn)
            note = f"{entry.stopped}; cause: {cause or 'kmix cannot name one'}"
        rows.append(_replace(row, native=native, native_note=why, note=note))
    rows_t = tuple(rows)
    recommendation = rules.recommend(rows_t, floor, spread)
    return PolicyComparison(
        rows=rows_t,
        noise_floor=floor,
        noise_ratios=tuple(ratios),
        loss_spread=spread,
        loss_spread_note=rules.loss_spread_note(f32_loss, repeat_loss),
        recommendation=recommendation,
        steps=steps,
        rounds=rounds,
        batch_size=examples,
        timing=TIMING,
        hardware=detected.to_dict(),
        model=str(getattr(float32.model, "name", "")),
    )


def _replace(row: PolicyRow, **changes: Any) -> PolicyRow:
    return dataclasses.replace(row, **changes)


def _row(entry: Entry, summary: Any, peak: Any, examples: int | None) -> PolicyRow:
    """One policy's row from its measurements (speed-up and loss departure come later)."""
    from kmix.compare.sizes import activation_bytes, weights_bytes

    times = [t for turn in entry.times for t in turn]
    stats = rules.step_stats(times)
    status = MEASURED
    if entry.stopped:
        status = STOPPED_SLOW
    elif entry.out_of_memory or (peak is not None and peak.out_of_memory):
        status = OUT_OF_MEMORY
    headroom = _headroom(summary, entry.policy)
    return PolicyRow(
        policy=entry.policy,
        status=status,
        steps=entry.steps,
        step_time_s=None if stats is None else stats[0],
        step_time_iqr_s=None if stats is None else stats[1],
        examples_per_s=None if stats is None or not examples else examples / stats[0],
        peak_memory_bytes=None if peak is None else peak.bytes,
        memory_baseline_bytes=None if peak is None else peak.baseline,
        memory_note="not measured" if peak is None else peak.note,
        weights_bytes=weights_bytes(entry.model),
        activation_bytes=activation_bytes(entry.model, examples),
        loss_curve=tuple(entry.losses),
        final_loss=rules.final_loss(entry.losses),
        skipped_steps=int(entry.model.optimizer.skipped_steps),
        **headroom,
    )


def _headroom(summary: Any, policy: str) -> dict[str, Any]:
    """Activation and gradient headroom, the tightest layer and forward overflows."""
    if summary is None or policy.removeprefix("mixed_") != "float16":
        return {}
    trend = summary.min_activation_headroom
    layers = {name: t.min for name, t in summary.activation_headroom.items() if t.min is not None}
    grad = summary.trends.get("overflow_headroom_bits")
    origins = []
    for event in summary.events:
        if event.origin is not None and event.origin.layer not in origins:
            origins.append(event.origin.layer)
    return {
        "min_headroom_bits": None if trend is None else trend.min,
        "min_grad_headroom_bits": None if grad is None else grad.min,
        "tightest_layer": min(layers, key=layers.__getitem__) if layers else None,
        "overflow_layers": tuple(origins),
    }


def _compare_to_float32(
    row: PolicyRow,
    f32_stats: tuple[float, float] | None,
    f32_loss: float | None,
    spread: float | None,
    floor: float | None,
) -> PolicyRow:
    """Adds the speed-up, whether it is within noise, and the loss departure.

    The loss is judged as :func:`kmix.compare.rules.recommend` says: not finite is not
    ok; lower than or equal to float32's is ok; higher is ok within the spread, and not
    judged (None) where the spread is unknown.
    """
    changes: dict[str, Any] = {}
    if f32_stats is not None and row.step_time_s is not None:
        changes["speedup"] = f32_stats[0] / row.step_time_s
        if row.policy != "float32":
            changes["within_noise"] = rules.within_noise(row.step_time_s, f32_stats[0], floor)
    if row.policy != "float32" and f32_loss is not None:
        if row.final_loss is None:
            changes["loss_ok"] = False
        else:
            departure = row.final_loss - f32_loss  # positive: a higher loss
            changes["loss_departure"] = departure
            if departure <= 0:
                changes["loss_ok"] = True
            else:
                changes["loss_ok"] = None if spread is None else departure <= spread
    return _replace(row, **changes)
