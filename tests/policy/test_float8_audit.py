"""kmix.audit on float8 models: the float8 layers listed, layers that cannot be float8 (only
Dense and EinsumDense can) and Dense layers left out; nothing said without float8."""

from __future__ import annotations

import keras

import kmix


def model(float8: bool = True) -> keras.Model:
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(2, 3, name="conv")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(4, name="ffn")(x)
    x = keras.layers.EinsumDense("ab,bc->ac", output_shape=4, name="proj")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    m = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    if float8:
        m.get_layer("ffn").quantize("float8")
        m.get_layer("proj").quantize("float8")
    return m


def test_float8_layers_and_layers_that_cannot_be_are_listed():
    found = [(f.severity, f.message) for f in kmix.audit(model()).findings]
    assert found == [
        (
            "info",
            "2 float8 layers: `ffn`, `proj`. Keras clips their inputs, kernels and output "
            "gradients to their delayed scales, silently.",
        ),
        (
            "info",
            "cannot be float8 (Keras quantizes only Dense and EinsumDense to float8): "
            "`conv`, `bn`; they compute in their own dtype policy.",
        ),
        ("info", "not float8, though they could be: `head`."),
    ]


def test_nothing_is_said_of_float8_without_a_float8_layer():
    assert not [f for f in kmix.audit(model(float8=False)).findings if "float8" in f.message]


class Gated(keras.layers.Dense):
    """A Dense subclass: Keras's Dense.quantize refuses it (type(self) is not Dense)."""


def test_a_dense_subclass_cannot_be_float8_and_is_told_why():
    inputs = keras.Input((8,))
    x = keras.layers.Dense(4, name="ffn")(inputs)
    m = keras.Model(inputs, Gated(2, name="gated")(x))
    m.get_layer("ffn").quantize("float8")
    found = [f.message for f in kmix.audit(m).findings]
    assert found[1:] == [
        "cannot be float8 (subclasses of Dense or EinsumDense: Keras's quantize accepts "
        "only those classes themselves): `gated`; they compute in their own dtype policy."
    ]
