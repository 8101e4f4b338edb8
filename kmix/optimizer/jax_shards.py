"""Which shard of the batch held a skipped step's first non-finite values, on JAX.

Under ``keras.distribution`` the step is one program over every device (and process):
the gradients it sees are already summed over the shards, so the step alone cannot say
whose data overflowed. A skipped step (and only a skipped step: a branch of a
``lax.cond``) computes each shard's own share of the scaled loss and its gradients,
the shards side by side (``jax.vmap`` over the batch split as the distribution splits
it), and flags the shards where either is non-finite::

    per shard s (rows of the batch on device s of the batch axis):
        g_s = grad(scale * loss(rows of s) / shards)   # the share device s computes
        flag_s = loss or g_s non-finite
    source = (process holding the first flagged shard, that shard), or unknown

Every process computes the same flags from the same global values, so every process
records the same source. The shards' values are computed apart from the step's, so an
overflow that only the sum of the shards makes is flagged on none (unknown).
"""

from __future__ import annotations

from typing import Any

import jax
import keras
import numpy as np
from keras import ops

from kmix import record

__all__ = ["shard_layout", "shard_source"]


def shard_layout(batch_shape: tuple[int, ...]) -> np.ndarray | None:
    """The process of each shard of a batch of ``batch_shape`` under the distribution.

    Args:
        batch_shape: the shape of one input array of the global batch.

    Returns:
        One int per shard of the batch axis, in the order of the batch's rows: the
        process holding it (-1 with one process: only the shard is worth naming); None
        without a distribution, with one shard, or with a batch it does not split evenly.
    """
    distribution = keras.distribution.distribution()
    if distribution is None or not batch_shape or batch_shape[0] is None:
        return None
    layout = distribution.get_data_layout(batch_shape)
    sharding = getattr(layout, "backend_layout", layout)
    if not hasattr(sharding, "devices_indices_map"):
        return None
    shards: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(batch_shape)).items():
        start = index[0].start or 0
        shards.setdefault(start, set()).add(device.process_index)
    if len(shards) < 2 or batch_shape[0] % len(shards):
        return None
    several = jax.process_count() > 1
    return np.asarray([min(shards[s]) if several else -1 for s in sorted(shards)], "int32")


def shard_source(model: Any, state: tuple, data: Any, scale: Any, skipped: Any) -> Any:
    """``(process, replica)`` of a skipped step's first non-finite shard, as a tensor pair.

    Args:
        model: the model, traced inside ``fit``'s step.
        state: the step's state as it came in (trainable, non-trainable, optimizer,
            metrics values).
        data: the step's batch.
        scale: the loss scale the step used.
        skipped: boolean scalar: the step was skipped (the shards are computed only then).

    Returns:
        A :class:`kmix.record.NonfiniteSource` (-1 where unknown), or None when the batch
        is not split into shards (one device).
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    first = keras.tree.flatten(x)[0]
    processes = shard_layout(tuple(first.shape))
    if processes is None:
        return None
    shards = len(processes)
    trainable, non_trainable, _, metrics = state

    def split(t: Any) -> Any:
        return None if t is None else ops.reshape(t, (shards, -1, *t.shape[1:]))

    def flag(xs: Any, ys: Any, ws: Any) -> Any:
        def scaled_loss(values: list) -> Any:
            kwargs = {"training": True} if model._call_has_training_arg else {}
            y_pred, _, losses = model.stateless_call(
                values, non_trainable, xs, return_losses=True, **kwargs
            )
            model._losses_override = list(losses)  # as Keras's compute_loss_and_updates
            try:
                loss, _ = model.stateless_compute_loss(
                    values, non_trainable, metrics, xs, ys, y_pred, ws, training=True
                )
            finally:
                model._losses_override = []
            return ops.cast(loss, "float32") * scale / shards

        loss, grads = jax.value_and_grad(scaled_loss)(list(trainable))
        flags = [ops.any(ops.logical_not(ops.isfinite(g))) for g in grads if g is not None]
        return ops.any(ops.stack([ops.logical_not(ops.isfinite(loss)), *flags]))

    def find() -> Any:
        split_data = keras.tree.map_structure(split, (x, y, sample_weight))
        flags = jax.vmap(flag)(*split_data)
        replica = record.first_flagged(ops.cast(flags, "int32"))
        process = ops.where(replica >= 0, ops.take(processes, ops.maximum(replica, 0)), -1)
        return ops.stack([ops.cast(process, "int32"), ops.cast(replica, "int32")])

    def unknown() -> Any:
        return ops.convert_to_tensor(np.asarray([-1, -1], "int32"))

    found = ops.cond(skipped, find, unknown)
    return record.NonfiniteSource(found[0], found[1])
