"""What a host read of float8 state says: pure Python and NumPy over values already read.

:func:`tensor_health` describes one float8 tensor from what its variables held at the read
(the scale the next step uses, the amax history's entry 0, the latest step's amax, and its
maximum; :func:`kmix.float8.health.read_health` reads them); :func:`decode_saturations`
turns the ring of episodes into :class:`kmix.tags.Float8Saturation` entries.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from kmix.float8.saturation import EPISODE_FLOAT_FIELDS, EPISODE_INT_FIELDS
from kmix.float8.tensors import Float8Tensor
from kmix.tags import Float8Saturation

__all__ = ["Float8Health", "decode_saturations", "lost_episodes", "tensor_health"]


@dataclasses.dataclass(frozen=True)
class Float8Health:
    """One float8 tensor at a read.

    Attributes:
        layer: the layer's path.
        tensor: ``"inputs"``, ``"kernel"`` or ``"outputs_grad"``.
        scale: the delayed scale in force (what the next step divides by).
        amax: the latest step's amax (history entry 0); 0 before the first step.
        headroom_bits: log2(scale x format max / amax); None before the first step.
        staleness_bits: log2(history max / amax); None before the first step.
        saturated_steps: steps at which it was clipped (kmix's optimizer counts them;
            None without it).
        underflow_fraction: share of its non-zero values that flush to zero: for the
            kernel at the scale in force (from its values at the read); for the inputs at
            the scale of the latest step that measured statistics (the forward tap's, in
            the step); None where not measured (the output gradient; inputs without the
            tap).
    """

    layer: str
    tensor: str
    scale: float
    amax: float
    headroom_bits: float | None
    staleness_bits: float | None
    saturated_steps: int | None = None
    underflow_fraction: float | None = None


def _bits(numerator: float, denominator: float) -> float | None:
    if not (denominator > 0 and numerator > 0 and math.isfinite(numerator / denominator)):
        return None
    return math.log2(numerator / denominator)


def tensor_health(
    tensor: Float8Tensor,
    scale: float,
    amax: float,
    peak: float,
    saturated_steps: int | None = None,
    kernel_underflow: float | None = None,
    inputs_underflow: float | None = None,
) -> Float8Health:
    """One tensor's :class:`Float8Health` from what its variables hold.

    Args:
        tensor: which tensor.
        scale: its ``<tensor>_scale`` value.
        amax: its ``<tensor>_amax_history``'s newest entry (entry 0).
        peak: that history's maximum.
        saturated_steps: the optimizer's count, or None.
        kernel_underflow: the kernel's underflow at the read (only for
            ``tensor == "kernel"``: :func:`kmix.float8.health.kernel_underflows`), or None.
        inputs_underflow: the inputs' underflow the step measured (only for
            ``tensor == "inputs"``), or None.

    Returns:
        Its :class:`Float8Health` (headroom and staleness None where ``amax`` is 0).
    """
    scale, amax = float(scale), float(amax)
    underflow = {"inputs": inputs_underflow, "kernel": kernel_underflow}.get(tensor.tensor)
    return Float8Health(
        layer=tensor.layer,
        tensor=tensor.tensor,
        scale=scale,
        amax=amax,
        headroom_bits=_bits(scale * tensor.format_max, amax),
        staleness_bits=_bits(float(peak), amax),
        saturated_steps=saturated_steps,
        underflow_fraction=underflow,
    )


def decode_saturations(
    tensors: Sequence[Float8Tensor],
    episode_count: int,
    episode_ints: np.ndarray,
    episode_floats: np.ndarray,
    per_step: bool = True,
    since_step: int = 0,
) -> list[Float8Saturation]:
    """The saturations the ring of episodes still holds, in step order.

    Args:
        tensors: the float8 tensors (the ring's ``tensor`` column indexes them).
        episode_count: episodes started so far.
        episode_ints: the ring's integers (:data:`EPISODE_INT_FIELDS`).
        episode_floats: the ring's floats (:data:`EPISODE_FLOAT_FIELDS`).
        per_step: one entry per saturated tensor-step (amax and limit as measured at
            an episode's first and last step, NaN between); False: one per episode,
            with ``steps`` its length and the first step's amax and limit.
        since_step: only steps after this one (episodes that end after it).

    Returns:
        The :class:`kmix.tags.Float8Saturation` entries, by step, then layer order.
    """
    ints = np.asarray(episode_ints)
    floats = np.asarray(episode_floats, "float64")
    capacity = ints.shape[0]
    col = {name: i for i, name in enumerate(EPISODE_INT_FIELDS)}
    fcol = {name: i for i, name in enumerate(EPISODE_FLOAT_FIELDS)}
    found: list[tuple[int, int, Float8Saturation]] = []
    for episode in range(max(1, episode_count - capacity + 1), episode_count + 1):
        row_ints, row_floats = ints[(episode - 1) % capacity], floats[(episode - 1) % capacity]
        if int(row_ints[col["episode"]]) != episode:
            continue
        first, steps = int(row_ints[col["step"]]), int(row_ints[col["steps"]])
        index = int(row_ints[col["tensor"]])
        t = tensors[index]
        if first + steps - 1 <= since_step:
            continue
        if not per_step:
            entry = Float8Saturation(
                first,
                t.layer,
                t.tensor,
                float(row_floats[fcol["amax"]]),
                float(row_floats[fcol["limit"]]),
                steps,
            )
            found.append((first, index, entry))
            continue
        for step in range(max(first, since_step + 1), first + steps):
            if step == first:
                amax, limit = row_floats[fcol["amax"]], row_floats[fcol["limit"]]
            elif step == first + steps - 1:
                amax, limit = row_floats[fcol["last_amax"]], row_floats[fcol["last_limit"]]
            else:
                amax = limit = math.nan
            found.append(
                (step, index, Float8Saturation(step, t.layer, t.tensor, float(amax), float(limit)))
            )
    found.sort(key=lambda item: (item[0], item[1]))
    return [entry for _, _, entry in found]


def lost_episodes(episode_count: int, capacity: int, seen: int) -> int:
    """Episodes started after ``seen`` that the ring no longer holds (overwritten).

    The ring keeps episodes ``episode_count - capacity + 1 .. episode_count``; those
    numbered ``seen + 1`` up to ``episode_count - capacity`` were never read.

    Args:
        episode_count: episodes started so far.
        capacity: the ring's rows.
        seen: the episode count at the previous read.
    """
    return max(0, episode_count - capacity - seen)
