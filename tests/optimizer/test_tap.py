"""The tap's own pieces (kmix/optimizer/tap.py); the tap's recording is tested with the
activation statistics it feeds (tests/record/test_activations.py)."""

from __future__ import annotations

import keras
import pytest


@pytest.mark.jax
@pytest.mark.torch
def test_tensors_in_walks_structures_as_keras_tree_flatten_does():
    """The tap's own walk (every step on torch) finds keras.tree.flatten's tensors, in order."""
    from kmix.optimizer.tap import tensors_in

    x, y = keras.ops.ones((2,)), keras.ops.zeros((3,))
    for value in [
        ((x,), {}),
        ((x, [y, None, 3]), {"mask": y, "training": True}),
        {"b": x, "a": (y, x)},
        (x, {"k": (y,), "j": None}),
        "text",
    ]:
        expected = [t for t in keras.tree.flatten(value) if keras.ops.is_tensor(t)]
        got = tensors_in(value)
        assert [id(t) for t in got] == [id(t) for t in expected], value
