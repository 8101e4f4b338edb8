"""Which dtype policy, on this machine, for this model: choice, hardware, speed, audit.

- :mod:`~kmix.policy.choice`: :func:`use`, :func:`policy_scope`, ``auto``'s rule.
- :mod:`~kmix.policy.machine`: what kmix detects about this machine (:func:`hardware`).
- :mod:`~kmix.policy.speed`: the speed probe's values, rules and words (pure).
- :mod:`~kmix.policy.timing`: the probe's timing with the Keras backend's own library.
- :mod:`~kmix.policy.demo_check`: what ``kmix demo`` measures of the policy's speed.
- :mod:`~kmix.policy.layer_audit`: :func:`audit`, a model's per-layer dtype table.

Importing this folder loads neither Keras nor TensorFlow. Code outside this folder
imports these names from ``kmix.policy``.
"""

from kmix.policy.choice import (
    AUTO_IS_NOT_MEASURED,
    POLICY_NAMES,
    PolicyChoice,
    choose_auto,
    float16_slow_reason,
    policy_scope,
    use,
)
from kmix.policy.demo_check import avoid_slow_float16_path, step_line
from kmix.policy.layer_audit import AuditReport, audit
from kmix.policy.machine import GPU, Hardware, hardware
from kmix.policy.speed import doctor_lines, onednn_fix_applies
from kmix.policy.timing import measure, measure_in_subprocess

__all__ = [
    "AUTO_IS_NOT_MEASURED",
    "GPU",
    "POLICY_NAMES",
    "AuditReport",
    "Hardware",
    "PolicyChoice",
    "audit",
    "avoid_slow_float16_path",
    "choose_auto",
    "doctor_lines",
    "float16_slow_reason",
    "hardware",
    "measure",
    "measure_in_subprocess",
    "onednn_fix_applies",
    "step_line",
    "policy_scope",
    "use",
]
