"""MixedPrecisionMonitor: loss scale, scale events and gradient health in TensorBoard."""

from __future__ import annotations

import math
import os

import numpy as np

from kmix import backend as _backend
from kmix import tags
from kmix._checks import WarnOnce, check_choice, check_int
from kmix.callbacks._base import StepCallback
from kmix.callbacks._batch import SummaryBatch
from kmix.callbacks._float8 import Float8Monitor
from kmix.callbacks._forecast import HeadroomForecast, headroom_series
from kmix.callbacks._layout import layout
from kmix.callbacks._monitor_begin import (
    absence_notes,
    check_log_dir,
    policy_record,
    policy_text,
)
from kmix.callbacks._prior_runs import another_run_warning, begins_in, resumed_run
from kmix.precision_plan import Float16Share, PrecisionMove, float16_share, layer_costs
from kmix.record import Snapshot

_OWNER = "kmix.callbacks.MixedPrecisionMonitor"

_HEALTH_TAGS = {  # key of Snapshot.health -> tag
    "grad_norm": tags.GRAD_NORM,
    "headroom_bits": tags.OVERFLOW_HEADROOM_BITS,
    "underflow_fraction": tags.UNDERFLOW_FRACTION,
    "zero_fraction": tags.ZERO_FRACTION,
    "subnormal_fraction": tags.SUBNORMAL_FRACTION,
    "max_abs_scaled": tags.MAX_ABS_SCALED_GRAD,
    "nonfinite_elements": tags.NONFINITE_ELEMENTS,
}
_ACTIVATION_TAGS = {  # statistic of Source.per_layer -> tag prefix
    "max_abs": tags.ACTIVATION_MAX_ABS,
    "headroom_bits": tags.ACTIVATION_HEADROOM_BITS,
    "nonfinite_fraction": tags.ACTIVATION_NONFINITE_FRACTION,
    "underflow_fraction": tags.ACTIVATION_UNDERFLOW_FRACTION,
}
_PER_VARIABLE_TAGS = {  # statistic of Source.per_variable -> tag prefix
    "underflow_fraction": tags.UNDERFLOW_BY_VARIABLE,
    "subnormal_fraction": tags.SUBNORMAL_BY_VARIABLE,
}


class MixedPrecisionMonitor(StepCallback):
    """Writes loss scale, every scale event and gradient health to TensorBoard.

    Every ``update_freq`` optimizer steps it reads the optimizer once (the only
    host sync it adds) and writes to ``<log_dir>/train``:

    * ``kmix/loss_scale``, ``kmix/skipped_steps``, ``kmix/skip_rate`` (skipped ÷
      attempted since the previous read) and ``kmix/loss_finite``;
    * the gradient health of the step the optimizer last measured
      (``kmix/grad_norm``, ``kmix/overflow_headroom_bits``,
      ``kmix/underflow_fraction`` = ``kmix/zero_fraction`` +
      ``kmix/subnormal_fraction``, ``kmix/max_abs_scaled_grad``,
      ``kmix/nonfinite_elements``, and per variable under
      ``kmix/underflow_fraction_by_variable/<path>`` and
      ``kmix/subnormal_fraction_by_variable/<path>``). Float16 range statistics
      are written only for a model that computes in float16; what was not
      measured is not written, and a ``kmix/notes`` line says why, once;
    * every scale event since the previous read, at its exact step: a
      ``kmix/events`` line naming the first non-finite variable, ``kmix/loss_scale``
      points before and after the change, and the gradient health measured at
      every skipped step. If the optimizer's event ring overflowed between two
      reads, a ``kmix/events`` note says how many events were lost;
    * with ``histogram_freq=N``, per-variable histograms of the scaled gradients'
      base-2 exponents every N steps under ``kmix/grad_exponent/<path>``.

    At train begin it writes the policy and a per-layer dtype table under
    ``kmix/policy`` (markdown), the same as structured data under
    ``kmix/policy_record``, and a Custom Scalars layout. Every structured record
    names the run (``run_id``): a ``fit`` whose optimizer continues the steps of the
    latest run in ``log_dir`` (a second ``fit``, ``BackupAndRestore``) resumes it;
    any other ``fit`` starts a new run, and warns once when ``log_dir`` already
    holds a kmix run (:mod:`kmix.callbacks._prior_runs`). When the run ends —
    ``fit`` returning, ``LossScaleGuard`` stopping or raising, an exception or
    Ctrl-C (see :mod:`kmix.callbacks._base`) — it writes every event recorded up
    to the last executed step and a ``kmix/run_end`` record saying why. Steps are
    the optimizer's attempted steps, skipped ones included, counted from 1.

    With ``kmix.LossScaleOptimizer`` it requests health statistics every
    ``update_freq`` steps and histograms every ``histogram_freq`` steps during
    ``fit`` (requests of several monitors compose, and are withdrawn at the end).
    With the stock Keras optimizer it logs the scale and inferred skipped steps and
    warns once; without loss scaling it logs the policy and a note saying why the
    rest is missing. Float8 layers' health (``kmix/fp8_*``) is written at every read
    whatever the optimizer: with kmix's optimizer with saturation counts and episodes,
    with any other from the layers' variables alone.

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
        verbose: 1 prints the ``tensorboard --logdir`` command at train begin, the first
            forward overflow of each layer, and headroom forecasts; 0 is quiet.

    Raises:
        TypeError: ``log_dir`` is not a path.
        ValueError: ``log_dir`` cannot be written, a frequency is not a valid
            integer, or ``verbose`` is not 0 or 1; at train begin, the model is
            not compiled or the log directory cannot be created.

    Attributes:
        run_id: the id of the run this monitor writes (None before train begin, and
            when it resumes a run written before run ids).
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
        self.log_dir = check_log_dir(log_dir)
        self.update_freq = update_freq
        self.histogram_freq = histogram_freq
        self.verbose = int(check_choice(_OWNER, "verbose", verbose, {0: "quiet", 1: "print"}))
        self._writer: tags.EventWriter | None = None
        self._said = WarnOnce()  # notes and warnings, each said once per monitor
        self._share_noted = False
        self._forecast = HeadroomForecast()
        self._batch = SummaryBatch(tags.description)  # one write per step per read
        self._float8 = Float8Monitor()  # float8 layers' health and saturation episodes
        self._ending = False  # finish() is reading: the fit ends
        self._told_origins: set[str] = set()  # layers a forward overflow was printed for
        self._share_written = False  # kmix/float16_share, once the model has weights
        self.run_id: str | None = None  # set at train begin
        self._heads: dict = {}  # event file -> the train begin at its head (_prior_runs)

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs: dict | None = None) -> None:
        """Validates, requests statistics, opens the writer, writes the policy.

        Raises:
            ValueError: the model is not compiled or ``log_dir`` cannot be created.
        """
        self.finish(tags.INTERRUPTED, "a new fit began before the previous one ended")
        super().on_train_begin(logs)
        # JAX, several processes: one program, one writer. Every process agrees whether
        # process 0 could create its directory before anything else that is collective
        # (a variable's assignment checks its value across processes), in the same order.
        if not _backend.is_first_process():
            if not _backend.all_processes_agree(True):  # process 0 failed: fail with it
                raise ValueError(
                    f"{_OWNER}: process 0 could not create its log directory under "
                    f"log_dir={self.log_dir!r} (its error says why), so this process stops "
                    "too rather than wait for it in the first step."
                )
            self._source.request_statistics(self, self.update_freq, self.histogram_freq)
            return
        train_dir = os.path.join(self.log_dir, tags.TRAIN_DIR)
        try:
            tags.makedirs(train_dir)
        except OSError as error:
            self.finish(tags.EXCEPTION, str(error))
            _backend.all_processes_agree(False)  # the other processes stop too
            raise ValueError(
                f"{_OWNER} cannot create its log directory {train_dir!r} "
                f"(log_dir={self.log_dir!r}): {error}. Pass a directory you can write to."
            ) from error
        _backend.all_processes_agree(True)
        source = self._source
        # First: a source that cannot measure refuses here, before this fit's file exists.
        source.request_statistics(self, self.update_freq, self.histogram_freq)
        prior = begins_in(train_dir, self._heads)  # before this fit's file exists
        state = self._read_state()
        resumed = resumed_run(prior, state.attempted_steps)
        self.run_id = tags.new_run_id() if resumed is None else resumed.run_id
        self._last_state = state
        self._event_index = state.event_count
        self._float8.begin(source.optimizer)
        self._health_step = state.health_step
        self._histogram_step = state.histogram_step
        self._scale_step = state.attempted_steps
        self._writer = tags.EventWriter(train_dir)  # finish() can end the run now
        notes = absence_notes(self.model, self._source)
        for note, category in notes:
            self._said(note, category)
        if resumed is None and prior:
            self._said(another_run_warning(self.log_dir, prior, state.attempted_steps))
        self._write_begin(state, [note for note, _ in notes])
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

    def finish(self, reason: str, message: str, logs: dict | None = None) -> None:
        """Writes every recorded event and how the run ended, then closes the file.

        Args:
            reason: why the run ended (``kmix.tags.RUN_END_REASONS``).
            message: what happened, in words.
            logs: the latest logs, if any.
        """
        try:
            if self._writer is not None:
                self._ending = True  # float8 episodes still open are written now
                try:
                    self._read(logs)
                finally:
                    self._ending = False
                step = self._last_state.attempted_steps
                self._writer.text(
                    tags.RUN_END,
                    tags.format_run_end(tags.RunEnd(step, reason, message, self.run_id)),
                    step=step,
                )
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self._source.release_statistics(self)
        super().finish(reason, message, logs)

    # --------------------------------------------------------------- writing
    def _write_begin(self, state: Snapshot, notes: list[str]) -> None:
        step = state.attempted_steps
        writer = self._writer
        model, source = self.model, self._source
        record = policy_record(  # first: a run's points are those written after it
            model, source, self.update_freq, self.histogram_freq, state.loss_scale, self.run_id
        )
        writer.text(tags.POLICY_RECORD, tags.format_policy_record(record), step=step)
        writer.text(tags.POLICY, policy_text(model, source, record, state.loss_scale), step=step)
        for note in notes:
            writer.text(tags.NOTES, note, step=step)
        writer.layout(layout(), step=step)
        self._share_written = False  # a lazily built model has no weights to weigh yet
        self._write_share(float16_share(layer_costs(model)), step)

    def _write_share(self, share: Float16Share, step: int) -> None:
        """``kmix/float16_share`` at ``step``; where some layers are weighed by parameters,
        a note says which, once."""
        if share.share is None:
            return
        self._share_written = True
        self._writer.scalar(
            tags.FLOAT16_SHARE,
            share.share,
            step=step,
            description=tags.description(tags.FLOAT16_SHARE),
        )
        if share.by_parameters and not self._share_noted:
            self._share_noted = True
            self._writer.text(tags.NOTES, f"kmix/float16_share: {share.words()}.", step=step)

    def write_precision_moves(self, moves: list[PrecisionMove], share: Float16Share) -> None:
        """Writes layers moved out of float16 at their steps (PrecisionAutopilot calls this):
        a ``kmix/precision_moves`` line and record each, and ``kmix/float16_share`` after.

        Args:
            moves: the moves just made.
            share: the model's float16 share after them.
        """
        writer = self._writer
        if writer is None or not moves:
            return
        for move in moves:
            writer.text(tags.PRECISION_MOVES, tags.format_precision_move(move), step=move.step)
            record = tags.format_precision_move_record(move, self.run_id, share.share)
            writer.text(tags.PRECISION_MOVE_RECORD, record, step=move.step)
            if self.verbose:
                print(f"kmix: {tags.format_precision_move(move)}")
        self._write_share(share, moves[-1].step)
        writer.flush()

    def _on_read(self, logs: dict) -> None:
        source = self._source
        if self._writer is None:
            return
        if not source.scales_loss:  # float8 layers are read from their variables alone
            step = self._read_state().attempted_steps
            self._float8.write(
                source.optimizer, self.model, self._writer, self._batch, step, self.run_id
            )  # no episodes without kmix's optimizer: nothing is open
            self._batch.write(self._writer)
            self._writer.flush()
            return
        state = self._read_state()
        step = state.attempted_steps
        scale_points: dict[int, float] = {}
        skipped_points: dict[int, int] = {}
        if source.records_events:
            self._drain_events(state, scale_points, skipped_points)
        if not self._share_written:  # built by the first step
            self._write_share(float16_share(layer_costs(self.model)), step)
        if source.measures_health:
            self._write_health(state)
            self._write_histograms(state.histogram_step)
        if source.knows_loss and state.loss_finite is not None:
            self._scalar(tags.LOSS_FINITE, float(state.loss_finite), step)
        if step > self._scale_step:
            scale_points[step] = state.loss_scale
            skipped_points[step] = state.skipped_steps
            attempted = step - self._last_state.attempted_steps
            skipped = state.skipped_steps - self._last_state.skipped_steps
            self._scalar(tags.SKIP_RATE, skipped / max(attempted, 1), step)
        for tag, points in (
            (tags.LOSS_SCALE, scale_points),
            (tags.SKIPPED_STEPS, skipped_points),
        ):
            for point_step in sorted(points):
                self._scalar(tag, points[point_step], point_step)
        for point_step in sorted(scale_points):
            if scale_points[point_step] > 0:
                self._scalar(tags.LOSS_SCALE_LOG2, math.log2(scale_points[point_step]), point_step)
        model = self.model
        self._float8.write(
            source.optimizer, model, self._writer, self._batch, step, self.run_id, self._ending
        )
        self._batch.write(self._writer)
        self._scale_step = max(self._scale_step, step)
        self._last_state = state
        self._writer.flush()

    def _drain_events(
        self, state: Snapshot, scale_points: dict[int, float], skipped_points: dict[int, int]
    ) -> None:
        """Writes every event since the last read, the scale around each, and skip health."""
        since = self._event_index
        if state.event_count == since:  # nothing new: spare the ring's transfers
            return
        recorded = self._source.events(since)
        lost = state.event_count - since - len(recorded)
        if lost > 0:
            note = tags.EventsLost(
                count=lost,
                after_step=self._last_state.attempted_steps,
                upto_step=state.attempted_steps,
                capacity=self._source.event_capacity,
            )
            first_step = recorded[0].event.step if recorded else state.attempted_steps
            self._writer.text(tags.EVENTS, tags.format_events_lost(note), step=first_step)
            record = tags.format_event_record(note, self.run_id)
            self._writer.text(tags.EVENT_RECORD, record, step=first_step)
        skipped = self._last_state.skipped_steps
        for event, measured in recorded:
            if event.step - 1 > self._scale_step:
                scale_points.setdefault(event.step - 1, event.old_scale)
            scale_points[event.step] = event.new_scale
            if event.kind in tags.SKIP_KINDS:
                if lost <= 0:
                    skipped += 1
                    skipped_points[event.step] = skipped
                self._write_health_values(measured, event.step)
            self._writer.text(tags.EVENTS, tags.format_event(event), step=event.step)
            record = tags.format_event_record(event, self.run_id)
            self._writer.text(tags.EVENT_RECORD, record, step=event.step)
            origin = event.origin
            if self.verbose and origin is not None and origin.layer not in self._told_origins:
                self._told_origins.add(origin.layer)
                print(f"kmix: {tags.format_event(event)}")
        self._event_index = state.event_count

    def _scalar(self, tag: str, value: float, step: int) -> None:
        """Adds one scalar point, with the tag's description, to this read's batch."""
        self._batch.scalar(tag, value, step)

    def _write_health_values(self, health: dict[str, float], step: int) -> None:

        for key, tag in _HEALTH_TAGS.items():
            if key in health:
                self._scalar(tag, health[key], step)

    def _write_health(self, state: Snapshot) -> None:
        step = state.health_step
        if step <= self._health_step or not state.health:
            return
        self._health_step = step
        self._write_health_values(state.health, step)
        if "underflow_fraction" in state.health:  # float16 variables were measured
            for statistic, values in self._source.per_variable().items():
                for path, value in values.items():
                    self._scalar(_PER_VARIABLE_TAGS[statistic] + path, value, step)
        layers = self._source.per_layer()
        for path, values in layers.items():
            for statistic, prefix in _ACTIVATION_TAGS.items():
                if statistic in values:  # headroom: float16 outputs only
                    self._scalar(prefix + path, values[statistic], step)
        headroom = [
            values["headroom_bits"] for values in layers.values() if "headroom_bits" in values
        ]
        if headroom:
            self._scalar(tags.MIN_ACTIVATION_HEADROOM_BITS, min(headroom), step)
        for message in self._forecast.add(step, headroom_series(state.health, layers)):
            self._writer.text(tags.NOTES, message, step=step)
            if self.verbose:
                print(f"kmix: {message}")

    def _write_histograms(self, step: int) -> None:
        if step <= self._histogram_step:
            return
        self._histogram_step = step
        edges = np.asarray(tags.exponent_bucket_edges(), dtype=np.float64)
        for path, counts in self._source.histograms().items():
            self._batch.histogram(
                tags.GRAD_EXPONENT + path,
                np.column_stack([edges, np.asarray(counts, np.float64)]),
                step,
            )
