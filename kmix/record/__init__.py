"""The step record: what a kmix optimizer remembers of every step, as pure values.

Everything here is a pure function over typed values (``keras.ops`` for what runs in the
compiled step, NumPy for what a host read decodes); no module asks which backend it runs
on, none assigns a variable. The folder's parts:

- :mod:`~kmix.record.scaling`: the dynamic loss-scale rule (:class:`ScaleConfig`).
- :mod:`~kmix.record.step_record`: the packed counters, the event ring and their decoding.
- :mod:`~kmix.record.health` and :mod:`~kmix.record.grouped`: gradient statistics.
- :mod:`~kmix.record.activations`: activation statistics and the forward origin over the
  calls the optimizer's tap recorded (:class:`TappedCall`).
- :mod:`~kmix.record.step`: one attempted step applied to the whole record
  (:func:`advance_record`), the one step every backend runs.
- :mod:`~kmix.record.host_read`: :class:`Snapshot`, what a host read returns.

Code outside this folder imports these names from ``kmix.record``.
"""

from kmix.record.activations import (
    ACTIVATION_CAPACITY,
    ACTIVATION_FIELDS,
    FLOAT8_INPUTS_FIELD,
    STORED_FIELDS,
    LayerCall,
    TappedCall,
    measure_forward,
    measure_origin,
    no_origin,
)
from kmix.record.health import NUM_EXPONENT_BINS, nonfinite_flags
from kmix.record.host_read import HOST_OPS, Snapshot, snapshot
from kmix.record.scaling import ScaleConfig
from kmix.record.step import FIELDS as RECORD_FIELDS
from kmix.record.step import RecordValues, Statistics, advance_record, first_flagged, record_step
from kmix.record.step_record import (
    EVENT_FLOAT_FIELDS,
    EVENT_INT_FIELDS,
    HEALTH_FIELDS,
    INT64_MAX,
    NO_SOURCE,
    QUIET_DELTA,
    Counters,
    NonfiniteSource,
    RecordedEvent,
    decode_events,
    due_now,
    initial_counters,
    is_quiet,
)

__all__ = [
    "ACTIVATION_CAPACITY",
    "ACTIVATION_FIELDS",
    "FLOAT8_INPUTS_FIELD",
    "STORED_FIELDS",
    "EVENT_FLOAT_FIELDS",
    "EVENT_INT_FIELDS",
    "HEALTH_FIELDS",
    "HOST_OPS",
    "INT64_MAX",
    "NO_SOURCE",
    "NUM_EXPONENT_BINS",
    "QUIET_DELTA",
    "RECORD_FIELDS",
    "Counters",
    "LayerCall",
    "NonfiniteSource",
    "RecordValues",
    "RecordedEvent",
    "ScaleConfig",
    "Snapshot",
    "Statistics",
    "TappedCall",
    "advance_record",
    "decode_events",
    "due_now",
    "first_flagged",
    "initial_counters",
    "is_quiet",
    "measure_forward",
    "measure_origin",
    "no_origin",
    "nonfinite_flags",
    "record_step",
    "snapshot",
]
