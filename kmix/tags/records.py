"""The structured records of the TensorBoard contract: JSON text beside the markdown.

Part of :mod:`kmix.tags`, which re-exports every public name here; import them from
there. A record is a frozen dataclass written as one JSON object (one key per field)
and read back tolerantly: keys added by later versions are ignored, and a text that
is not such a record reads as None. Nothing here imports TensorFlow or Keras.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any

LOSS_SCALINGS = ("kmix", "keras", "none")
"""What scales the loss: kmix's optimizer, Keras's stock one, or nothing."""


def record_json(record: Any, drop_none: tuple[str, ...] = (), **extra: Any) -> str:
    """Writes a dataclass record as one line of JSON, keys sorted.

    Args:
        record: a dataclass instance (nested dataclasses become objects).
        drop_none: fields left out when they are None (fields added later, which
            records that do not know them never held).
        **extra: keys written beside the record's fields (e.g. a record type).

    Returns:
        The JSON text (non-finite floats as ``Infinity``/``NaN``, as Python's
        ``json`` writes and reads them).
    """
    fields = dataclasses.asdict(record)
    for name in drop_none:
        if fields.get(name, 0) is None:
            del fields[name]
    return json.dumps(fields | extra, sort_keys=True)


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object a text holds, None if it holds no object.

    Args:
        text: the text of a record.

    Returns:
        The object's keys and values, or None.
    """
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def record_fields(data: dict[str, Any] | None, cls: type) -> dict[str, Any] | None:
    """The values of ``cls``'s fields in a JSON object; other keys are ignored.

    Args:
        data: a JSON object, or None.
        cls: a dataclass.

    Returns:
        Field name -> value for every field of ``cls`` the object holds; None if it
        lacks a field that has no default.
    """
    if data is None:
        return None
    fields = {}
    for field in dataclasses.fields(cls):
        if field.name in data:
            fields[field.name] = data[field.name]
        elif field.default is dataclasses.MISSING:
            return None
    return fields


@dataclasses.dataclass(frozen=True)
class AuditFinding:
    """Something ``kmix.audit`` found, where, and how to fix it (the audit's ``Finding``).

    Defined here, with the formats, so that the policy record holds the audit's own
    values and readers need neither Keras nor TensorFlow.

    Attributes:
        severity: ``"error"`` (training is likely wrong), ``"warning"`` (numerically
            fragile) or ``"info"`` (speed, or what could not be checked).
        layer: the layer's path; ``""`` for the model as a whole.
        message: what is wrong.
        fix: what to do about it.
    """

    severity: str
    layer: str
    message: str
    fix: str

    def __str__(self) -> str:
        where = f" {self.layer}:" if self.layer else ""
        return f"[{self.severity}]{where} {self.message}\n    fix: {self.fix}"


@dataclasses.dataclass(frozen=True)
class PolicyRecord:
    """What a run was configured with, written once at train begin.

    Attributes:
        global_policy: ``keras.config.dtype_policy().name``.
        model_name: the model's name.
        model_policy: the model's dtype policy name, e.g. ``"mixed_float16"``.
        compute_dtype: the model's compute dtype, e.g. ``"float16"``.
        variable_dtype: the model's variable dtype, e.g. ``"float32"``.
        loss_scaling: one of :data:`LOSS_SCALINGS`.
        min_scale: the lowest loss scale allowed; None unless ``loss_scaling`` is
            ``"kmix"``.
        max_scale: the highest; None unless ``loss_scaling`` is ``"kmix"``.
        update_freq: the monitor's ``update_freq``.
        histogram_freq: the monitor's ``histogram_freq`` (0: no histograms).
        loss_scale: the loss scale when the record was written (train begin); None
            without loss scaling, and in logs written before this field.
        variable_dtypes: trainable variable path -> compute dtype of the layer that
            holds it (float16's range applies to ``"float16"`` ones only); None when
            not recorded.
        audit_findings: what ``kmix.audit`` found on the model at train begin; None
            when the audit could not run or was not recorded.
        run_id: the run this train begin belongs to (:func:`new_run_id`); a resumed
            run writes its id again. None in logs written before run ids (kmix 0.1.0
            and earlier): such logs read as one run.
        processes: how many processes ran the training step (``keras.distribution`` on
            JAX; process 0 writes); None where not known (TensorFlow) and in logs
            written before this field.
        devices: how many devices the step ran on, all processes together; None as
            ``processes``.
        float8_follows_loss_scale: kmix's optimizer's ``float8_follows_loss_scale``; None
            without kmix's optimizer and in logs written before this field.
    """

    global_policy: str
    model_name: str
    model_policy: str
    compute_dtype: str
    variable_dtype: str
    loss_scaling: str
    min_scale: float | None
    max_scale: float | None
    update_freq: int
    histogram_freq: int
    loss_scale: float | None = None
    variable_dtypes: dict[str, str] | None = None
    audit_findings: tuple[AuditFinding, ...] | None = None
    run_id: str | None = None
    processes: int | None = None
    devices: int | None = None
    float8_follows_loss_scale: bool | None = None


def format_policy_record(record: PolicyRecord) -> str:
    """Formats a :class:`PolicyRecord` as the JSON text of ``kmix/policy_record``.

    Args:
        record: the record.

    Returns:
        A JSON object with one key per field (scales may be ``Infinity``, as
        Python's ``json`` writes it).
    """
    return record_json(record)


def parse_policy_record(text: str) -> PolicyRecord | None:
    """Reads the text written by :func:`format_policy_record`.

    Args:
        text: the ``kmix/policy_record`` text.

    Returns:
        The :class:`PolicyRecord`; None if the text is not such a record (keys
        added by later versions are ignored). Fields added after kmix 0.1.0
        (``loss_scale``, ``variable_dtypes``, ``audit_findings``, ``run_id``,
        ``processes``, ``devices``, ``float8_follows_loss_scale``) read as None when
        missing or malformed.
    """
    fields = record_fields(json_object(text), PolicyRecord)
    if fields is None:
        return None
    if "run_id" in fields:
        fields["run_id"] = _run_id(fields["run_id"])
    for name in ("min_scale", "max_scale", "loss_scale"):
        if fields.get(name) is not None:
            fields[name] = _float_or_none(fields[name])
    if "variable_dtypes" in fields:
        fields["variable_dtypes"] = _variable_dtypes(fields["variable_dtypes"])
    if "audit_findings" in fields:
        fields["audit_findings"] = _audit_findings(fields["audit_findings"])
    for name in ("processes", "devices"):
        if name in fields:
            fields[name] = _count_or_none(fields[name])
    if "float8_follows_loss_scale" in fields:
        follows = fields["float8_follows_loss_scale"]
        fields["float8_follows_loss_scale"] = follows if isinstance(follows, bool) else None
    return PolicyRecord(**fields)


def _count_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def new_run_id(now: float | None = None) -> str:
    """A new run id: the local start time and six random hex digits.

    Args:
        now: the start time in seconds since the epoch; None: now.

    Returns:
        E.g. ``"20250314-093000-4f1c2a"``: readable, sortable by start time, and
        different for two runs started in the same second.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(3)}"


def parse_run_id(text: str) -> str | None:
    """The run id a structured record holds (policy record, event record, run end).

    Args:
        text: the JSON text of any kmix record.

    Returns:
        Its ``run_id``; None when the text is no record or holds none (records
        written before run ids).
    """
    data = json_object(text)
    return None if data is None else _run_id(data.get("run_id"))


def _run_id(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _float_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _variable_dtypes(value: Any) -> dict[str, str] | None:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        return None
    return dict(value)


def _audit_findings(value: Any) -> tuple[AuditFinding, ...] | None:
    if not isinstance(value, list):
        return None
    found = []
    for item in value:
        fields = record_fields(item if isinstance(item, dict) else None, AuditFinding)
        if fields is None or not all(isinstance(v, str) for v in fields.values()):
            return None
        found.append(AuditFinding(**fields))
    return tuple(found)


COMPLETED = "completed"
STOPPED_BY_GUARD = "stopped_by_guard"
GUARD_RAISED = "guard_raised"
EXCEPTION = "exception"
INTERRUPTED = "interrupted"
STOPPED_BY_COMPARE = "stopped_by_compare"
RUN_END_REASONS = (
    COMPLETED,
    STOPPED_BY_GUARD,
    GUARD_RAISED,
    EXCEPTION,
    INTERRUPTED,
    STOPPED_BY_COMPARE,
)
"""Why ``fit`` ended: it ran all its steps; ``LossScaleGuard`` stopped it or raised;
another exception; ``KeyboardInterrupt``; ``kmix compare`` stopped a policy too slow to
finish (its message says how slow, in one line). The only spelling of these reasons;
a reader meets reasons it does not know (from a later kmix) as words to show."""


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """How a run ended, written once when ``fit`` ends (whatever ends it).

    Attributes:
        step: the last attempted optimizer step.
        reason: one of :data:`RUN_END_REASONS`.
        message: the diagnosis or exception message, "" when there is none.
        run_id: the run that ended (:attr:`PolicyRecord.run_id`); None in logs
            written before run ids.
    """

    step: int
    reason: str
    message: str
    run_id: str | None = None


def format_run_end(run_end: RunEnd) -> str:
    """Formats a :class:`RunEnd` as the JSON text of ``kmix/run_end``.

    Args:
        run_end: how the run ended.

    Returns:
        A JSON object with the keys ``step``, ``reason``, ``message`` and ``run_id``.
    """
    return record_json(run_end)


def parse_run_end(text: str) -> RunEnd | None:
    """Reads the text written by :func:`format_run_end`.

    Args:
        text: the ``kmix/run_end`` text.

    Returns:
        The :class:`RunEnd`; None if the text is not such a record (``run_id`` reads
        as None when missing).
    """
    fields = record_fields(json_object(text), RunEnd)
    if fields is None or not isinstance(fields["step"], int):
        return None
    return RunEnd(
        step=fields["step"],
        reason=str(fields["reason"]),
        message=str(fields["message"]),
        run_id=_run_id(fields.get("run_id")),
    )
