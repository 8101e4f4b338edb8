"""Which precision for *this* model on *this* machine: ``kmix.compare_policies``.

- :mod:`~kmix.compare.comparison`: :func:`compare_policies`, the measurement as a whole.
- :mod:`~kmix.compare.rounds`: each policy's model built and timed in ABBA rounds.
- :mod:`~kmix.compare.step_loss`: each step's own loss (not Keras's running mean).
- :mod:`~kmix.compare.memory`: peak memory from a process per policy.
- :mod:`~kmix.compare.sizes`: memory computed from a built model.
- :mod:`~kmix.compare.values`: the typed table (:class:`PolicyRow`, :class:`PolicyComparison`).
- :mod:`~kmix.compare.rules`: the recommendation, pure rules over the table.
- :mod:`~kmix.compare.text`: the table in words.

Importing this folder loads no TensorFlow; :func:`compare_policies` imports it when it
trains. Code outside this folder imports these names from ``kmix.compare``.
"""

from kmix.compare.comparison import (
    COMPARABLE,
    DEFAULT_POLICIES,
    compare_policies,
    logdir_problem,
)
from kmix.compare.values import (
    CompareError,
    PolicyComparison,
    PolicyRow,
    Recommendation,
    comparison_from_dict,
)

__all__ = [
    "COMPARABLE",
    "DEFAULT_POLICIES",
    "CompareError",
    "PolicyComparison",
    "PolicyRow",
    "Recommendation",
    "compare_policies",
    "comparison_from_dict",
    "logdir_problem",
]
