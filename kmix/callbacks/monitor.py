"""MixedPrecisionMonitor: loss scale, scale events and gradient health in TensorBoard."""

from __future__ import annotations

import os
import warnings
from typing import Any

import keras
import numpy as np

from kmix import tags
from kmix._checks import check_int
from kmix.callbacks._base import KERAS, KMIX, StepCallback

_OWNER = "kmix.callbacks.MixedPrecisionMonitor"

_HEALTH_TAGS = {  # tag -> key of read_state()
    tags.GRAD_NORM: "grad_norm",
    tags.OVERFLOW_HEADROOM_BITS: "headroom_bits",
    tags.UNDERFLOW_FRACTION: "underflow_fraction",
    tags.MAX_ABS_SCALED_GRAD: "max_abs_scaled",
    tags.NONFINITE_ELEMENTS: "nonfinite_elements",
}

_STOCK_NOTE = (
    "The model uses the stock `keras.mixed_precision.LossScaleOptimizer`: kmix logs "
    "its loss scale and the skipped steps it can infer (steps seen minus steps "
    "applied), at each read only. Gradient health, exponent histograms and the "
    "exact step and variable of every overflow need `kmix.LossScaleOptimizer`: "
    "compile with `kmix.LossScaleOptimizer.from_keras(optimizer)`."
)


def _check_log_dir(log_dir: Any) -> str:
    """Returns ``log_dir`` as a string if it is a path a writer could use.

    Raises:
        TypeError: ``log_dir`` is not a string or path.
        ValueError: it is empty, or it or one of its parents is a file, or the
            nearest existing parent is not writable.
    """
    if not isinstance(log_dir, str | os.PathLike):
        raise TypeError(
            f"Invalid `log_dir` for {_OWNER}: log_dir={log_dir!r} of type "
            f"{type(log_dir).__name__}. `log_dir` must be a directory path (str or "
            "os.PathLike), e.g. 'runs/exp1'."
        )
    path = os.fspath(log_dir)
    if not path.strip():
        raise ValueError(
            f"Invalid `log_dir` for {_OWNER}: log_dir={log_dir!r}. `log_dir` must be "
            "a non-empty directory path, e.g. 'runs/exp1'."
        )
    if "://" in path:  # gs://, s3://...: left to TensorFlow's file systems
        return path
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(
            f"Invalid `log_dir` for {_OWNER}: log_dir={log_dir!r}, but {parent!r} is a "
            "file, not a directory. Pass a directory path that does not go through a file."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"Invalid `log_dir` for {_OWNER}: log_dir={log_dir!r}, but {parent!r} is not "
            "writable. Pass a directory you can write to."
        )
    return path


def _layer_table(model: Any) -> str:
    """A per-layer dtype table: kmix.audit's when available, else a plain one."""
    try:
        from kmix.audit import audit

        return audit(model).to_markdown()
    except Exception:  # audit missing or unable to read this model: plain table
        rows = ["| layer | class | compute | variables |", "|---|---|---|---|"]
        for layer in model._flatten_layers(include_self=False):
            policy = layer.dtype_policy
            rows.append(
                f"| {layer.name} | {type(layer).__name__} | {policy.compute_dtype} "
                f"| {policy.variable_dtype} |"
            )
        return "\n".join(rows)


def _layout() -> Any:
    """The custom-scalars layout that groups the kmix charts."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    def chart(title: str, *patterns: str) -> Any:
        return layout_pb2.Chart(
            title=title, multiline=layout_pb2.MultilineChartContent(tag=list(patterns))
        )

    def exact(tag: str) -> str:
        return f"^{tag}$"

    return layout_pb2.Layout(
        category=[
            layout_pb2.Category(
                title="kmix: loss scale",
                chart=[
                    chart("loss scale", exact(tags.LOSS_SCALE)),
                    chart("skipped steps", exact(tags.SKIPPED_STEPS)),
                    chart("skip rate", exact(tags.SKIP_RATE)),
                    chart("loss finite (1 = yes)", exact(tags.LOSS_FINITE)),
                ],
            ),
            layout_pb2.Category(
                title="kmix: gradient health",
                chart=[
                    chart("gradient norm (unscaled)", exact(tags.GRAD_NORM)),
                    chart("overflow headroom (bits)", exact(tags.OVERFLOW_HEADROOM_BITS)),
                    chart("max |scaled gradient|", exact(tags.MAX_ABS_SCALED_GRAD)),
                    chart(
                        "underflow fraction",
                        exact(tags.UNDERFLOW_FRACTION),
                        f"^{tags.UNDERFLOW_BY_VARIABLE}.*",
                    ),
                    chart("non-finite elements", exact(tags.NONFINITE_ELEMENTS)),
                ],
            ),
        ]
    )


class MixedPrecisionMonitor(StepCallback):
    """Writes loss scale, every scale event and gradient health to TensorBoard.

    Every ``update_freq`` optimizer steps it reads the optimizer once (the only
    host sync it adds) and writes to ``<log_dir>/train``:

    * ``kmix/loss_scale``, ``kmix/skipped_steps``, ``kmix/skip_rate`` (skipped ÷
      attempted since the previous read) and ``kmix/loss_finite``;
    * the gradient health of the step the optimizer last measured
      (``kmix/grad_norm``, ``kmix/overflow_headroom_bits``,
      ``kmix/underflow_fraction``, ``kmix/max_abs_scaled_grad``,
      ``kmix/nonfinite_elements``, and per variable under
      ``kmix/underflow_fraction_by_variable/<path>``);
    * every scale event since the previous read, at its exact step: a
      ``kmix/events`` text line naming the first non-finite variable, and
      ``kmix/loss_scale`` points before and after the change. If the optimizer's
      event ring overflowed between two reads, a ``kmix/events`` line says how
      many events were lost;
    * with ``histogram_freq=N``, per-variable histograms of the scaled gradients'
      base-2 exponents every N steps under ``kmix/grad_exponent/<path>``, one
      bin per power of two from ``2**-40`` to ``2**17`` plus bins for zero and
      inf/NaN (float16 holds ``2**-24`` to 65504).

    At train begin it writes the dtype policy and a per-layer dtype table under
    ``kmix/policy`` and a Custom Scalars layout. Steps are the optimizer's
    attempted steps, skipped ones included, counted from 1. The file is flushed
    after every read, at epoch end and at train end, so an interrupted ``fit``
    leaves everything up to the last read on disk.

    With ``kmix.LossScaleOptimizer`` it sets the optimizer's ``health_every`` to
    ``update_freq`` and ``histogram_every`` to ``histogram_freq`` during ``fit``
    (restored afterwards). With the stock Keras optimizer it logs the scale and
    inferred skipped steps and warns once; without loss scaling it logs the
    policy and a note saying why the rest is missing.

    Example:
        >>> model.fit(x, y, callbacks=[                     # doctest: +SKIP
        ...     kmix.callbacks.MixedPrecisionMonitor("runs/exp1")])

    Args:
        log_dir: directory of the TensorBoard run (the Keras TensorBoard callback
            may share it).
        update_freq: read the optimizer every this many optimizer steps, >= 1.
            Events are exact whatever its value.
        histogram_freq: write exponent histograms every this many steps; 0 (the
            default) switches them off. Needs ``kmix.LossScaleOptimizer``. If it is
            below ``update_freq``, the optimizer is read every ``histogram_freq``
            steps. With ``steps_per_execution=k``, use multiples of ``k``.
        verbose: 1 prints the ``tensorboard --logdir`` command at train begin; 0 is quiet.

    Raises:
        TypeError: ``log_dir`` is not a path.
        ValueError: ``log_dir`` cannot be written, a frequency is not a valid
            integer, or ``verbose`` is not 0 or 1; at train begin, the model is
            not compiled or the log directory cannot be created.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        update_freq: int = 100,
        histogram_freq: int = 0,
        verbose: int = 1,
    ) -> None:
        update_freq = check_int(_OWNER, "update_freq", update_freq, 1)
        histogram_freq = check_int(_OWNER, "histogram_freq", histogram_freq, 0)
        # The optimizer holds one histogram for histogram_freq steps: read before it goes.
        super().__init__(every=min(update_freq, histogram_freq or update_freq))
        self.log_dir = _check_log_dir(log_dir)
        self.update_freq = update_freq
        self.histogram_freq = histogram_freq
        if verbose not in (0, 1):
            raise ValueError(
                f"Invalid `verbose` for {_OWNER}: verbose={verbose!r}. `verbose` must be 0 or 1."
            )
        self.verbose = int(verbose)
        self._writer: Any = None
        self._warned = False
        self._restore: list[tuple[Any, str, int]] = []  # (optimizer, setting, value)

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs: dict | None = None) -> None:
        """Validates, configures the optimizer, opens the writer, writes the policy.

        Raises:
            ValueError: the model is not compiled or ``log_dir`` cannot be created.
        """
        import tensorflow as tf

        super().on_train_begin(logs)
        train_dir = os.path.join(self.log_dir, tags.TRAIN_DIR)
        try:
            tf.io.gfile.makedirs(train_dir)
        except (OSError, tf.errors.OpError) as error:
            raise ValueError(
                f"{_OWNER} cannot create its log directory {train_dir!r} "
                f"(log_dir={self.log_dir!r}): {error}. Pass a directory you can write to."
            ) from error
        self._close()  # and undo the settings of a fit that was interrupted
        self._writer = tf.summary.create_file_writer(train_dir)
        if self._kind == KMIX:
            opt = self._optimizer
            self._restore = [(opt, "health_every", opt.health_every)]
            opt.health_every = self.update_freq
            opt.watch_float16_layers(self.model)
            if self.histogram_freq:
                self._restore.append((opt, "histogram_every", opt.histogram_every))
                opt.histogram_every = self.histogram_freq
        elif self._kind == KERAS and not self._warned:
            self._warned = True
            warnings.warn(_STOCK_NOTE, stacklevel=2)
        state = self._read_state()
        self._last_state = state
        self._event_index = state.get("event_count", 0)
        self._health_step = state.get("health_step", 0)
        self._histogram_step = state.get("histogram_step", 0)
        self._scale_step = state["attempted_steps"]
        with self._writer.as_default():
            self._write_begin(state)
        self._writer.flush()
        if self.verbose:
            print(
                f"kmix: TensorBoard logs in {self.log_dir}; "
                f"view them with: tensorboard --logdir {self.log_dir}"
            )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Reads what is unread, so every event is written, and flushes."""
        if self._writer is not None and self._unread_steps:
            self._read(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        """Reads what is unread, restores the optimizer's settings and closes the file."""
        if self._writer is None:
            return
        if self._unread_steps:
            self._read(logs)
        self._close()

    # --------------------------------------------------------------- writing
    def _close(self) -> None:
        """Gives the optimizer its own settings back and closes the file."""
        for optimizer, name, value in self._restore:
            setattr(optimizer, name, value)
        self._restore = []
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write_begin(self, state: dict) -> None:
        import tensorflow as tf
        from tensorboard.plugins.custom_scalar import summary as custom_scalar

        step = state["attempted_steps"]
        tf.summary.text(tags.POLICY, self._policy_text(state), step=step)
        note = self._missing_note()
        if note:
            tf.summary.text(tags.NOTES, note, step=step)
        tf.summary.experimental.write_raw_pb(
            custom_scalar.pb(_layout()).SerializeToString(), step=step
        )

    def _policy_text(self, state: dict) -> str:
        model = self.model
        if self._kind == KMIX:
            config = self._optimizer.get_config()
            scaling = (
                f"`kmix.LossScaleOptimizer` (scale {state['loss_scale']:.9g}, range "
                f"[{config['min_scale']:.9g}, {config['max_scale']:.9g}])"
            )
        elif self._kind == KERAS:
            scaling = "the stock `keras.mixed_precision.LossScaleOptimizer`"
        else:
            scaling = f"none (`{type(self._optimizer).__name__}`)"
        return (
            f"Global dtype policy `{keras.config.dtype_policy().name}`; model "
            f"`{model.name}` policy `{model.dtype_policy.name}`; loss scaling: {scaling}."
            f"\n\n{_layer_table(model)}"
        )

    def _missing_note(self) -> str | None:
        if self._kind == KERAS:
            return _STOCK_NOTE
        if self._kind is not None:
            return None
        if self.model.dtype_policy.compute_dtype == "float16":
            why = (
                "The model computes in float16 but its optimizer does not scale the "
                "loss: small gradients underflow to zero. Compile with "
                "`kmix.LossScaleOptimizer(optimizer)`."
            )
        else:
            why = (
                f"The model computes in {self.model.dtype_policy.compute_dtype}, "
                "which does not need loss scaling."
            )
        return (
            f"No loss-scale optimizer, so there is no loss scale, skipped step or "
            f"gradient health to log. {why}"
        )

    def _on_read(self, logs: dict) -> None:
        import tensorflow as tf

        if self._kind is None:
            return
        state = self._read_state()
        step = state["attempted_steps"]
        scale_points: dict[int, float] = {}
        skipped_points: dict[int, int] = {}
        with self._writer.as_default():
            if self._kind == KMIX:
                self._drain_events(state, scale_points, skipped_points)
                self._write_health(state)
                self._write_histograms(state["histogram_step"])
                tf.summary.scalar(tags.LOSS_FINITE, float(state["loss_finite"]), step=step)
            if step > self._scale_step:
                scale_points[step] = state["loss_scale"]
                skipped_points[step] = state["skipped_steps"]
                attempted = step - self._last_state["attempted_steps"]
                skipped = state["skipped_steps"] - self._last_state["skipped_steps"]
                tf.summary.scalar(tags.SKIP_RATE, skipped / max(attempted, 1), step=step)
            for tag, points in (
                (tags.LOSS_SCALE, scale_points),
                (tags.SKIPPED_STEPS, skipped_points),
            ):
                for point_step in sorted(points):
                    tf.summary.scalar(tag, points[point_step], step=point_step)
        self._scale_step = max(self._scale_step, step)
        self._last_state = state
        self._writer.flush()

    def _drain_events(
        self, state: dict, scale_points: dict[int, float], skipped_points: dict[int, int]
    ) -> None:
        """Writes every event since the last read, and the scale around each."""
        import tensorflow as tf

        since = self._event_index
        if state["event_count"] == since:  # nothing new: spare the ring's transfers
            return
        events = self._optimizer.scale_events(since)
        lost = state["event_count"] - since - len(events)
        if lost > 0:
            tf.summary.text(
                tags.EVENTS,
                f"**{lost} scale events lost** between steps "
                f"{self._last_state['attempted_steps']} and {state['attempted_steps']}: "
                f"more happened between two reads than the optimizer's event ring holds "
                f"(event_capacity={self._optimizer.event_capacity}). Lower `update_freq` "
                "or raise `event_capacity` of kmix.LossScaleOptimizer.",
                step=events[0].step if events else state["attempted_steps"],
            )
        skipped = self._last_state["skipped_steps"]
        for event in events:
            if event.step - 1 > self._scale_step:
                scale_points.setdefault(event.step - 1, event.old_scale)
            scale_points[event.step] = event.new_scale
            if event.kind in tags.SKIP_KINDS and lost <= 0:
                skipped += 1
                skipped_points[event.step] = skipped
            tf.summary.text(tags.EVENTS, tags.format_event(event), step=event.step)
        self._event_index = state["event_count"]

    def _write_health(self, state: dict) -> None:
        import tensorflow as tf

        step = state["health_step"]
        if step <= self._health_step:
            return
        self._health_step = step
        for tag, key in _HEALTH_TAGS.items():
            tf.summary.scalar(tag, state[key], step=step)
        for path, value in self._optimizer.underflow_by_variable().items():
            tf.summary.scalar(tags.UNDERFLOW_BY_VARIABLE + path, value, step=step)

    def _write_histograms(self, step: int) -> None:
        import tensorflow as tf
        from tensorboard.plugins.histogram import metadata

        if step <= self._histogram_step:
            return
        self._histogram_step = step
        edges = np.asarray(tags.exponent_bucket_edges(), dtype=np.float64)
        for path, counts in self._optimizer.exponent_histograms_by_variable().items():
            tf.summary.write(
                tags.GRAD_EXPONENT + path,
                np.column_stack([edges, np.asarray(counts, np.float64)]),
                step=step,
                metadata=metadata.create_summary_metadata(
                    display_name=tags.GRAD_EXPONENT + path,
                    description=(
                        "log2 of |scaled gradient|, one bin per power of two; float16 "
                        f"holds 2**{tags.FLOAT16_MIN_SUBNORMAL_EXPONENT} to 65504 "
                        f"(2**{tags.FLOAT16_MAX_EXPONENT + 1}); zero is drawn at "
                        f"{tags.EXPONENT_MIN - 2}, inf/NaN at {tags.EXPONENT_MAX + 2}."
                    ),
                ),
            )
