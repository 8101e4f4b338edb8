"""Keras float8 layers, seen and kept safe: saturation checks, counters, rescaling, reads.

Keras quantizes a float8 layer's inputs, kernel and output gradient with delayed scales
and clips what exceeds them, silently. :class:`Float8State` (kept by
:class:`kmix.LossScaleOptimizer`) checks each tensor's amax against its scale in the step,
counts the saturated steps, keeps a ring of episodes, and multiplies the output gradients'
float8 scales by the loss scale's changes; :func:`read_health` describes each tensor at a
read, from any model's variables.
"""

from __future__ import annotations

from kmix.float8.health import read_health
from kmix.float8.reads import Float8Health, decode_saturations, lost_episodes, tensor_health
from kmix.float8.saturation import (
    EPISODE_FLOAT_FIELDS,
    EPISODE_INT_FIELDS,
    FIELDS,
    TENSOR_FIELDS,
    Float8Record,
    StepCheck,
    StoredRecord,
    advance_float8,
    check_step,
    inputs_underflow,
    kept_where_zero,
    record_shapes,
    rescaled,
    stored,
    stored_shapes,
    unstored,
    worst_of_replicas,
)
from kmix.float8.state import Float8Reads, Float8State, attempted_step
from kmix.float8.tensors import (
    FORMAT_MAX,
    FORMAT_TINY,
    FORMATS,
    TENSORS,
    Float8Tensor,
    float8_tensors,
    inputs_scale_of,
    layer_of,
)

__all__ = [
    "EPISODE_FLOAT_FIELDS",
    "EPISODE_INT_FIELDS",
    "FIELDS",
    "FORMATS",
    "FORMAT_MAX",
    "FORMAT_TINY",
    "TENSORS",
    "TENSOR_FIELDS",
    "Float8Health",
    "Float8Reads",
    "Float8Record",
    "Float8State",
    "Float8Tensor",
    "StepCheck",
    "StoredRecord",
    "advance_float8",
    "attempted_step",
    "check_step",
    "decode_saturations",
    "float8_tensors",
    "inputs_scale_of",
    "inputs_underflow",
    "kept_where_zero",
    "layer_of",
    "lost_episodes",
    "read_health",
    "record_shapes",
    "rescaled",
    "stored",
    "stored_shapes",
    "tensor_health",
    "unstored",
    "worst_of_replicas",
]
