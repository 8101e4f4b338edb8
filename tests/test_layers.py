"""kmix._layers: one walk over a model's nested layers, each named by a path of its own."""

from __future__ import annotations

import keras
import numpy as np

from kmix import _layers
from kmix.optimizer.tap import ActivationTap
from kmix.precision_plan import layers_by_path


def two_towers(c_b: float = 1.0) -> tuple[keras.Model, keras.Model, keras.Model]:
    """Two towers made by one helper function: each has a Dense named "proj", built outside
    any model's scope, so Keras gives both the path "proj"."""

    def tower(name: str, c: float) -> keras.Model:
        x = keras.Input((3,))
        proj = keras.layers.Dense(4, kernel_initializer=keras.initializers.Constant(c), name="proj")
        return keras.Model(x, proj(x), name=name)

    inputs = keras.Input((3,))
    a, b = tower("tower_a", 1.0), tower("tower_b", c_b)
    outputs = keras.layers.Add(name="sum")([a(inputs), b(inputs)])
    return keras.Model(inputs, outputs, name="net"), a, b


def test_two_layers_with_one_keras_path_get_paths_through_their_towers():
    model, a, b = two_towers()
    assert a.layers[1].path == b.layers[1].path == "proj"  # what Keras says of both
    walked = dict(_layers.walk_layers(model))
    assert walked["net/tower_a/proj"] is a.layers[1]
    assert walked["net/tower_b/proj"] is b.layers[1]
    assert "proj" not in walked
    assert len(walked) == len({id(layer) for layer in walked.values()})  # one path a layer
    found = layers_by_path(model)
    assert "proj" not in found  # ambiguous: names no layer
    assert found["net/tower_b/proj"] is b.layers[1]


def test_unique_keras_paths_are_kept():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="d")], name="seq")
    # the input, which Keras gives no path, is named as its sibling: seq/input_layer
    assert [path for path, _ in _layers.walk_layers(model)] == ["seq/input_layer", "seq/d"]
    assert model.layers[0].path == "seq/d"  # Keras's own path, kept


def test_one_name_twice_in_one_model_is_numbered():
    class Twins(keras.Model):
        def __init__(self):
            super().__init__(name="twins")
            self.a, self.b = keras.layers.Dense(2, name="twin"), keras.layers.Dense(2, name="twin")

        def call(self, x):
            return self.b(self.a(x))

    model = Twins()
    model(np.zeros((1, 2), "float32"))
    assert [(path, layer) for path, layer in _layers.walk_layers(model)] == [
        ("twins/twin", model.a),
        ("twins/twin~2", model.b),
    ]


def test_the_tap_names_each_tower_s_layer_by_its_own_path():
    keras.config.set_dtype_policy("mixed_float16")  # the tap instruments float16 layers
    model, _, _ = two_towers()
    tap = ActivationTap(model).install()
    assert tap.paths == ["net/tower_a/proj", "net/tower_b/proj", "sum"]
    with tap.recording():
        model(np.ones((2, 3), "float32"))
    names = [call.path for call in tap.take()]
    assert names == ["net/tower_a/proj", "net/tower_b/proj", "sum"]  # never "proj#2"
