"""How many workers (processes) a tf.distribute strategy spans."""

from __future__ import annotations

from typing import Any


def worker_count(strategy: Any) -> int:
    """Returns the number of tasks in the strategy's cluster; 1 without a cluster.

    Args:
        strategy: a ``tf.distribute`` strategy (MultiWorkerMirroredStrategy has a
            cluster resolver; single-process strategies have none or an empty one).
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    tasks = resolver.cluster_spec().as_dict().values()
    return max(sum(len(t) for t in tasks), 1)
