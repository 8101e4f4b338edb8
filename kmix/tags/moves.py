"""Precision moves in the TensorBoard contract: the markdown line and the structured record.

Part of :mod:`kmix.tags`, which re-exports every public name here. Each move of
:class:`kmix.callbacks.PrecisionAutopilot` is written at its step twice, like scale
events: a markdown line under ``kmix/precision_moves`` (:func:`format_precision_move`,
the one wording of a move wherever one is shown) and a JSON record under
``kmix/precision_move_record``, which readers read. Nothing here imports TensorFlow or
Keras.
"""

from __future__ import annotations

import dataclasses

from kmix.precision_plan import PrecisionMove
from kmix.tags.records import json_object

PRECISION_MOVES = "kmix/precision_moves"
"""One markdown line per layer moved out of float16 (:func:`format_precision_move`)."""
PRECISION_MOVE_RECORD = "kmix/precision_move_record"
"""Each move as JSON (:func:`format_precision_move_record`), at its step."""
FLOAT16_SHARE = "kmix/float16_share"
"""Share of the model's estimated multiply-adds computed in float16: at train begin and
after every move."""


@dataclasses.dataclass(frozen=True)
class MoveRecord:
    """A move as read back from ``kmix/precision_move_record``.

    Attributes:
        move: the move.
        run_id: the run that wrote it (None in a record without one).
        float16_share: the share computed in float16 after it, None if not estimated.
    """

    move: PrecisionMove
    run_id: str | None
    float16_share: float | None


def format_precision_move(move: PrecisionMove) -> str:
    """The move as one markdown line, e.g.

    ``**moved** `block_3/ffn_out` (Dense) `mixed_float16` → `float32` at step 412:
    forward overflow at step 412``.
    """
    return (
        f"**moved** `{move.layer}` ({move.layer_class}) `{move.from_policy}` → "
        f"`{move.to_policy}` at step {move.step}: {move.reason}"
    )


def format_precision_move_record(
    move: PrecisionMove, run_id: str | None, float16_share: float | None
) -> str:
    """The move as a JSON record (its fields, ``run_id`` and ``float16_share``)."""
    import json

    data = move.to_dict() | {"run_id": run_id, "float16_share": float16_share}
    return json.dumps(data | {"type": "precision_move"}, sort_keys=True)


def parse_precision_move_record(text: str) -> MoveRecord | None:
    """Reads :func:`format_precision_move_record`'s text; None if it is not such a record."""
    data = json_object(text)
    if data is None or data.get("type") != "precision_move":
        return None
    try:
        move = PrecisionMove.from_dict(data)
    except ValueError:
        return None
    share = data.get("float16_share")
    return MoveRecord(
        move,
        data.get("run_id") if isinstance(data.get("run_id"), str) else None,
        float(share) if isinstance(share, int | float) else None,
    )
