"""What the monitor writes at train begin: the policy, its record, the notes; and its log dir check.

Pure over the model and the source (:mod:`kmix.callbacks._source`); the monitor writes.
"""

from __future__ import annotations

import os
from typing import Any

import keras

from kmix import tags
from kmix._checks import KmixWarning, NotFloat16Note
from kmix._layers import walk_layers
from kmix.backend import processes_and_devices
from kmix.callbacks._source import Source
from kmix.float8 import inputs_scale_of

_OWNER = "kmix.callbacks.MixedPrecisionMonitor"

STOCK_NOTE = (
    "The model uses the stock `keras.mixed_precision.LossScaleOptimizer`: kmix logs "
    "its loss scale and the skipped steps it can infer (steps seen minus steps "
    "applied), at each read only. Gradient health, exponent histograms and the "
    "exact step and variable of every overflow need kmix's optimizer: compile with "
    "`kmix.LossScaleOptimizer(keras.optimizers.Adam())` (or the name, e.g. "
    "`kmix.LossScaleOptimizer('adam')`)."
)
NOT_FLOAT16_NOTE = (
    "The model computes in {dtype}, not float16: float16's range does not apply, so "
    "overflow headroom, underflow and max |scaled gradient| are not written (nothing "
    "measured them). The loss scale, events and gradient norm are."
)


def check_log_dir(log_dir: Any) -> str:
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


def layer_table(model: Any) -> str:
    """A per-layer dtype table: kmix.audit's when available, else a plain one."""
    try:
        from kmix.policy import audit

        return audit(model).to_markdown()
    except Exception:  # audit missing or unable to read this model: plain table
        rows = ["| layer | class | compute | variables |", "|---|---|---|---|"]
        for _, layer in walk_layers(model):
            policy = layer.dtype_policy
            rows.append(
                f"| {layer.name} | {type(layer).__name__} | {policy.compute_dtype} "
                f"| {policy.variable_dtype} |"
            )
        return "\n".join(rows)


def policy_record(
    model: Any,
    source: Source,
    update_freq: int,
    histogram_freq: int,
    loss_scale: float | None,
    run_id: str | None,
) -> tags.PolicyRecord:
    """The structured policy record written at train begin (``kmix/policy_record``)."""
    from kmix._layers import variable_compute_dtypes
    from kmix.policy import audit

    min_scale, max_scale = source.scale_bounds or (None, None)
    processes, devices = processes_and_devices() or (None, None)
    dtypes = variable_compute_dtypes(model)
    try:  # as in _layer_table: an audit unable to read this model is left out
        found = tuple(audit(model).findings)  # tags.AuditFinding values
    except Exception:
        found = None
    return tags.PolicyRecord(
        global_policy=keras.config.dtype_policy().name,
        model_name=model.name,
        model_policy=model.dtype_policy.name,
        compute_dtype=model.dtype_policy.compute_dtype,
        variable_dtype=model.dtype_policy.variable_dtype,
        loss_scaling=source.kind,
        min_scale=min_scale,
        max_scale=max_scale,
        update_freq=update_freq,
        histogram_freq=histogram_freq,
        loss_scale=loss_scale if source.scales_loss else None,
        variable_dtypes={v.path: dtypes[id(v)] for v in getattr(model, "trainable_weights", [])},
        audit_findings=found,
        run_id=run_id,
        processes=processes,
        devices=devices,
        float8_follows_loss_scale=getattr(
            getattr(source.optimizer, "float8", None), "follows_loss_scale", None
        ),
    )


def policy_text(model: Any, source: Source, record: tags.PolicyRecord, scale: float) -> str:
    """The policy and per-layer dtype table in markdown (``kmix/policy``)."""
    scaling = source.describe()
    if record.min_scale is not None and record.max_scale is not None:
        scaling += f" (scale {scale:.9g}, range [{record.min_scale:.9g}, {record.max_scale:.9g}])"
    return (
        f"Global dtype policy `{record.global_policy}`; model `{record.model_name}` "
        f"policy `{record.model_policy}`; loss scaling: {scaling}."
        f"\n\n{layer_table(model)}"
    )


def absence_notes(model: Any, source: Source) -> list[tuple[str, type[KmixWarning]]]:
    """Why some charts will be absent: ``(note, warning category)``, one per reason (the
    monitor writes each and warns once)."""
    notes = _scaling_notes(model, source)
    float8 = float8_inputs_note(model, source)
    return notes if float8 is None else [*notes, float8]


def _scaling_notes(model: Any, source: Source) -> list[tuple[str, type[KmixWarning]]]:
    """Loss scaling's and float16's absences: the stock optimizer, none, another dtype."""
    dtype = model.dtype_policy.compute_dtype
    if source.scales_loss and not source.records_events:  # the stock Keras optimizer
        return [(STOCK_NOTE, KmixWarning)]
    if not source.scales_loss:
        why = (
            "The model computes in float16 but its optimizer does not scale the loss: "
            "small gradients underflow to zero. Compile with "
            "`kmix.LossScaleOptimizer(optimizer)`."
            if dtype == "float16"
            else f"The model computes in {dtype}, which does not need loss scaling."
        )
        return [
            (
                "No loss-scale optimizer, so there is no loss scale, skipped step or "
                f"gradient health to log. {why}",
                KmixWarning,
            )
        ]
    if dtype != "float16":
        return [(NOT_FLOAT16_NOTE.format(dtype=dtype), NotFloat16Note)]
    return []


def float8_inputs_note(model: Any, source: Source) -> tuple[str, type[KmixWarning]] | None:
    """Why ``kmix/fp8_underflow_fraction/<layer>/inputs`` is absent for some float8 layers,
    or None: kmix's optimizer measures it in the step, through its forward tap, which
    covers layers computing in float16."""
    found = [(p, layer) for p, layer in walk_layers(model) if inputs_scale_of(layer) is not None]
    if source.records_events:
        unmeasured = [
            (path, layer.compute_dtype) for path, layer in found if layer.compute_dtype != "float16"
        ]
        why = "kmix measures a float8 layer's inputs in the step through its forward tap, "
        why += "which covers layers computing in float16; these compute in "
        why += ", ".join(sorted({dtype for _, dtype in unmeasured}))
        category: type[KmixWarning] = NotFloat16Note
    else:
        unmeasured = [(path, None) for path, _ in found]
        why = "kmix's optimizer (`kmix.LossScaleOptimizer`) measures a float8 layer's inputs "
        why += "in the step"
        category = KmixWarning
    if not unmeasured:
        return None
    names = ", ".join(f"`{path}`" for path, _ in unmeasured)
    return (
        f"{tags.FP8_UNDERFLOW_FRACTION}<layer>/inputs is not written for {names}: {why}. "
        "Their kernels' underflow, the scales, headroom and staleness are written.",
        category,
    )
