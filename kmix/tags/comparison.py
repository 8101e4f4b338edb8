"""The comparison record of ``kmix compare``: written and read back here, one format.

Part of :mod:`kmix.tags`, which re-exports every public name here. ``kmix compare
--logdir DIR`` writes its :class:`kmix.PolicyComparison` as one JSON object twice, in
this one format: the file ``DIR/kmix-compare.json`` (what ``kmix report DIR`` reads)
and the text tag ``kmix/comparison`` of the TensorBoard run ``DIR/comparison`` (what
the Mixed Precision tab reads through TensorBoard's data provider). Nothing here
imports TensorFlow or Keras.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = [
    "COMPARISON",
    "COMPARISON_FILE",
    "COMPARISON_RECORD",
    "COMPARISON_RUN",
    "format_comparison",
    "parse_comparison",
    "read_comparison_file",
]

COMPARISON = "kmix/comparison"
"""Text tag of the comparison record, in the run :data:`COMPARISON_RUN`."""
COMPARISON_RUN = "comparison"
"""The TensorBoard run (subdirectory of the log dir) that holds the record."""
COMPARISON_FILE = "kmix-compare.json"
"""The record as a file in the log dir."""
COMPARISON_RECORD = "policy_comparison"
"""The record's ``record`` key: what kind of record it is."""


def format_comparison(data: dict[str, Any]) -> str:
    """The record's text: ``PolicyComparison.to_dict()`` as one JSON object.

    Args:
        data: the comparison's dict (JSON-ready: no non-finite floats).

    Returns:
        The JSON text, keys sorted, with ``"record": "policy_comparison"``.
    """
    return json.dumps(data | {"record": COMPARISON_RECORD}, sort_keys=True, allow_nan=False)


def parse_comparison(text: str) -> dict[str, Any] | None:
    """The comparison's dict from a record's text; None if the text is no such record.

    Args:
        text: a record's text.

    Returns:
        The dict (``kmix.compare.comparison_from_dict`` rebuilds the value), or None.
    """
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("record") != COMPARISON_RECORD:
        return None
    return {key: value for key, value in data.items() if key != "record"}


def read_comparison_file(logdir: str) -> dict[str, Any] | None:
    """The comparison record in ``logdir``, None if it holds none (or not one kmix wrote).

    Args:
        logdir: a log dir given to ``kmix compare --logdir``.

    Returns:
        The comparison's dict, or None.
    """
    try:
        with open(os.path.join(logdir, COMPARISON_FILE), encoding="utf-8") as file:
            return parse_comparison(file.read())
    except (OSError, UnicodeDecodeError):
        return None
