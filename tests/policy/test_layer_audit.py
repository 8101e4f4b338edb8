"""Tests for kmix.audit: the per-layer table and each finding, triggered or not."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import kmix
from kmix import audit as audit_module
from kmix.policy.layer_audit import AuditReport, Finding, LayerRow, audit, keras_own


def mlp(hidden=8, out=4, inputs=16, out_dtype=None, activation=None):
    """A tiny functional MLP: x -> hidden -> out, in the global policy."""
    x = keras.Input((inputs,), name="x")
    h = keras.layers.Dense(hidden, name="hidden")(x)
    y = keras.layers.Dense(out, activation=activation, dtype=out_dtype, name="out")(h)
    return keras.Model(x, y, name="mlp")


class RawSum(keras.layers.Layer):
    """A custom layer that opts out of autocasting and reduces its input."""

    def __init__(self, **kwargs):
        super().__init__(autocast=False, **kwargs)

    def call(self, x):
        return keras.ops.sum(x, axis=-1, keepdims=True)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.block = keras.Sequential([keras.layers.Dense(8)], name="block")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block(x))


def findings(model, message_part=""):
    """The (severity, layer) of the findings whose message contains message_part."""
    return [(f.severity, f.layer) for f in audit(model).findings if message_part in f.message]


# --- the table ---------------------------------------------------------------


def test_rows_of_a_functional_model():
    keras.config.set_dtype_policy("mixed_float16")
    model = mlp(out_dtype="float32")
    report = audit(model)
    assert report.model == "mlp"
    assert report.policy == "mixed_float16"
    assert report.rows == (
        LayerRow("x", "InputLayer", "-", "float32", "float32", 0),
        LayerRow("hidden", "Dense", "float16", "float32", "float16", 136),
        LayerRow("out", "Dense", "float32", "float32", "float32", 36),
    )
    layers = {layer.name: layer for layer in model.layers}
    assert [row.params for row in report.rows] == [
        layers[name].count_params() for name in ("x", "hidden", "out")
    ]


def test_rows_of_a_sequential_model_nested_in_a_functional_one():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="d1")], name="inner")
    x = keras.Input((4,), name="x")
    model = keras.Model(x, keras.layers.Dense(2, name="d2")(inner(x)))
    assert audit(model).rows == (
        LayerRow("x", "InputLayer", "-", "float32", "float32", 0),
        LayerRow("inner", "Sequential", "float32", "float32", "float32", 40),
        LayerRow("inner/input_layer", "InputLayer", "-", "float32", "float32", 0),
        LayerRow("inner/d1", "Dense", "float32", "float32", "float32", 40),
        LayerRow("d2", "Dense", "float32", "float32", "float32", 18),
    )


@pytest.mark.parametrize("lazy", [False, True])
def test_rows_of_a_sequential_model_share_one_prefix(lazy):
    """Issue 32: Keras gives no path to a layer built when it is made (pooling, dropout,
    activation, the input) and "sequential/conv2d" to the others; kmix names the former
    as Keras names their siblings, so no row lacks the prefix the others have."""
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential(
        ([] if lazy else [keras.Input((8, 8, 1))])
        + [
            keras.layers.Conv2D(4, 3, name="conv", padding="same"),
            keras.layers.MaxPooling2D(name="pool"),
            keras.layers.Dropout(0.1, name="drop"),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(2, name="head", dtype="float32"),
        ],
        name="seq",
    )
    if lazy:
        model(np.zeros((1, 8, 8, 1), "float32"))
    assert model.get_layer("pool").path is None  # Keras's: built when made
    assert [row.path for row in audit(model).rows] == [
        "seq/input_layer",  # a lazy Sequential makes its input on its first call
        "seq/conv",
        "seq/pool",
        "seq/drop",
        "seq/flat",
        "seq/head",
    ]


def test_rows_of_a_subclassed_model_report_unknown_outputs():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = Subclassed()
    model(np.zeros((1, 4), "float32"))
    assert audit(model).rows == (
        LayerRow("sub/block", "Sequential", "bfloat16", "float32", "?", 40),
        # A Sequential model builds a graph of its own on its first call.
        LayerRow("sub/block/input_layer", "InputLayer", "-", "float32", "bfloat16", 0),
        LayerRow("sub/block/dense", "Dense", "bfloat16", "float32", "bfloat16", 40),
        LayerRow("sub/head", "Dense", "bfloat16", "float32", "?", 18),
    )


def test_layers_with_the_same_path_each_get_a_row():
    class Twins(keras.Model):
        def __init__(self):
            super().__init__(name="twins")
            self.a = keras.layers.Dense(2, name="twin")
            self.b = keras.layers.Dense(2, name="twin")

        def call(self, x):
            return self.b(self.a(x))

    model = Twins()
    model(np.zeros((1, 2), "float32"))
    assert [(row.path, row.params) for row in audit(model).rows] == [
        ("twins/twin", 6),
        ("twins/twin~2", 6),  # one name twice in one model: numbered, each row its own
    ]


def test_unbuilt_models_get_a_clear_message():
    with pytest.raises(ValueError, match=r"not built yet.*model.build\(input_shape\)"):
        audit(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="'sub' is not built yet"):
        audit(Subclassed())


def test_audit_rejects_what_is_not_a_model():
    with pytest.raises(TypeError, match="expects a keras.Model; received model="):
        audit(keras.layers.Dense(2))


# --- findings: each one triggered, and not -----------------------------------


def test_half_precision_outputs():
    keras.config.set_dtype_policy("mixed_float16")
    assert findings(mlp(), "the model outputs float16") == [("warning", "out")]
    assert findings(mlp(out_dtype="float32"), "the model outputs") == []
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert findings(mlp(), "the model outputs bfloat16") == [("warning", "out")]


def test_half_precision_variables():
    keras.config.set_dtype_policy("float16")
    model = mlp(out_dtype="float32")
    [finding] = [f for f in audit(model).findings if "are stored in" in f.message]
    assert finding.layer == "hidden"
    assert finding.message.startswith("variables kernel, bias are stored in float16")
    keras.config.set_dtype_policy("mixed_float16")
    assert findings(mlp(), "stored in") == []


def test_float16_without_a_loss_scale_optimizer():
    # A per-layer float16 policy: Keras does not wrap the optimizer.
    x = keras.Input((8,))
    y = keras.layers.Dense(8, dtype="mixed_float16", name="fp16")(x)
    model = keras.Model(x, keras.layers.Dense(8, name="fp32")(y))
    assert findings(model, "loss scaling could not be checked") == [("info", "")]
    model.compile(optimizer="sgd", loss="mse")
    assert findings(model, "does not scale the loss") == [("error", "")]
    model.compile(
        optimizer=keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()),
        loss="mse",
    )
    assert findings(model, "scale the loss") == []


def test_float16_with_the_global_policy_is_wrapped_by_keras():
    keras.config.set_dtype_policy("mixed_float16")
    model = mlp(out_dtype="float32")
    model.compile(optimizer="sgd", loss="mse")
    assert findings(model, "scale the loss") == []


def test_bfloat16_needs_no_loss_scaling():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = mlp(out_dtype="float32")
    assert findings(model, "loss scaling") == []
    model.compile(optimizer="sgd", loss="mse")
    assert findings(model, "scale the loss") == []


def test_fragile_softmax_in_half_precision():
    keras.config.set_dtype_policy("mixed_float16")
    x = keras.Input((8,))
    y = keras.layers.Softmax(name="softmax", dtype="float32")(
        keras.layers.Softmax(name="half_softmax")(x)
    )
    model = keras.Model(x, y)
    assert findings(model, "softmax computed in float16") == [("warning", "half_softmax")]
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert findings(mlp(activation="softmax"), "softmax computed") == [("warning", "out")]
    assert findings(mlp(activation="softmax", out_dtype="float32"), "softmax") == []


def test_fragile_layer_with_autocast_off():
    keras.config.set_dtype_policy("mixed_float16")
    x = keras.Input((8,))
    model = keras.Model(x, RawSum(name="raw_sum", dtype="float32")(RawSum(name="raw")(x)))
    assert findings(model, "autocast=False") == [("warning", "raw")]


# --- Keras's own layers choose their precision on purpose: no false findings ---


class RawLayerNorm(keras.layers.LayerNormalization):
    """A user's LayerNormalization whose own call reduces in the compute dtype."""

    def call(self, x):
        mean = keras.ops.mean(x, axis=-1, keepdims=True)
        return x - mean


def transformer_block(head_dtype="float32", head_activation="softmax"):
    """Embedding -> MultiHeadAttention -> Add & LayerNorm -> Dense FFN -> Add & LayerNorm."""
    layers = keras.layers
    tokens = keras.Input((16,), dtype="int32", name="tokens")
    x = layers.Embedding(1000, 64, name="embed")(tokens)
    x = layers.LayerNormalization(name="norm1")(
        layers.Add()([x, layers.MultiHeadAttention(4, 16, name="attention")(x, x)])
    )
    ffn = layers.Dense(64, name="ffn2")(layers.Dense(128, activation="relu", name="ffn1")(x))
    x = layers.LayerNormalization(name="norm2")(layers.Add()([x, ffn]))
    x = layers.GlobalAveragePooling1D()(x)
    y = layers.Dense(8, activation=head_activation, dtype=head_dtype, name="head")(x)
    model = keras.Model(tokens, y, name="transformer")
    model.compile(optimizer=kmix.LossScaleOptimizer("adam"), loss="mse")
    return model


def resnet_block():
    """Conv -> BatchNorm -> ReLU -> Conv -> BatchNorm, a residual Add, a float32 head."""
    layers = keras.layers
    x0 = keras.Input((8, 8, 16))
    x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(16, 3, padding="same")(x0)))
    x = layers.BatchNormalization()(layers.Conv2D(16, 3, padding="same")(x))
    x = layers.GlobalAveragePooling2D()(layers.ReLU()(layers.Add()([x, x0])))
    model = keras.Model(x0, layers.Dense(8, dtype="float32")(x), name="resnet")
    model.compile(optimizer=kmix.LossScaleOptimizer("adam"), loss="mse")
    return model


def embedding_model():
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(64, 8, name="embed"),
            keras.layers.GroupNormalization(groups=2, name="group_norm"),
            keras.layers.Flatten(),
            keras.layers.Dense(8, dtype="float32"),
        ]
    )
    model.compile(optimizer=kmix.LossScaleOptimizer("adam"), loss="mse")
    return model


@pytest.mark.parametrize("build", [transformer_block, resnet_block, embedding_model])
def test_keras_layers_that_choose_their_precision_get_no_findings(build):
    keras.config.set_dtype_policy("mixed_float16")
    model = build()
    computes = {row.class_name: row.compute_dtype for row in audit(model).rows}
    assert "float16" in computes.values()  # the model does compute in float16
    assert audit(model).findings == ()


def test_keras_own_layer_or_not():
    keras.config.set_dtype_policy("mixed_float16")
    assert keras_own(keras.layers.LayerNormalization())
    assert keras_own(keras.layers.Embedding(4, 2))
    assert not keras_own(RawLayerNorm())
    assert not keras_own(RawSum())


def test_real_findings_in_a_transformer_are_kept():
    keras.config.set_dtype_policy("mixed_float16")
    # A float16 softmax head: the output and the softmax are both findings.
    assert findings(transformer_block(head_dtype=None)) == [
        ("warning", "head"),
        ("warning", "head"),
    ]
    [message] = [f.message for f in audit(transformer_block(head_dtype=None)).findings][1:]
    assert message == (
        "softmax computed in float16: probabilities keep only about 3 significant digits "
        "and those below 6e-8 round to 0, so a loss or log computed from them is inexact"
    )
    # A user's layer that turns autocast off and reduces in float16 is still flagged,
    # also when it subclasses Keras's LayerNormalization.
    x = keras.Input((8,))
    model = keras.Model(x, keras.layers.Dense(2, dtype="float32")(RawLayerNorm(name="raw_ln")(x)))
    assert findings(model, "autocast=False") == [("warning", "raw_ln")]


@pytest.fixture
def a100(monkeypatch):
    """This machine as one with a tensor-core GPU (compute capability 8.0)."""
    from kmix.policy import machine

    gpu = machine.GPU("/physical_device:GPU:0", "NVIDIA A100", (8, 0))
    detected = machine.Hardware(devices=(gpu.device,), gpus=(gpu,), tpus=())
    monkeypatch.setattr(machine, "hardware", lambda: detected)


def test_tensor_core_alignment(a100):
    keras.config.set_dtype_policy("mixed_float16")
    model = mlp(hidden=12, inputs=20, out=8, out_dtype="float32")
    [finding] = [f for f in audit(model).findings if "multiple of 8" in f.message]
    assert finding == Finding(  # 20 input features come with the data: not the author's
        "info",
        "hidden",
        "not a multiple of 8: units=12; float16 matrix multiplies cannot use tensor cores fully",
        finding.fix,
    )
    inner = mlp(hidden=12, inputs=16, out=4)  # out: 12 input features, 4 classes (the task's)
    assert [f.message for f in audit(inner).findings if "multiple of 8" in f.message] == [
        "not a multiple of 8: units=12; float16 matrix multiplies cannot use tensor cores fully",
        "not a multiple of 8: input features=12; float16 matrix multiplies cannot use tensor "
        "cores fully",
    ]
    x = keras.Input((6, 6, 1))  # one channel, fed by the data: nothing to say
    conv = keras.Model(x, keras.layers.Conv2D(8, 3, name="conv")(x))
    assert findings(conv, "multiple of 8") == []
    keras.config.set_dtype_policy("float32")
    assert findings(mlp(hidden=12, inputs=20), "multiple of 8") == []


def test_no_tensor_core_advice_without_tensor_cores():
    keras.config.set_dtype_policy("mixed_float16")  # this machine: no GPU
    assert findings(mlp(hidden=12, inputs=20, out=8, out_dtype="float32"), "multiple of 8") == []


@pytest.mark.filterwarnings("ignore:`build\\(\\)` was called on layer 'sub'")
def test_unbuilt_layers():
    model = Subclassed()
    model.unused = keras.layers.Dense(3, name="unused")
    model(np.zeros((1, 4), "float32"))
    assert findings(model, "not built") == [("info", "sub/unused")]  # as sub/head is named
    assert [row.params for row in audit(model).rows if row.path == "sub/unused"] == [0]
    assert findings(mlp(), "not built") == []


def test_a_clean_model_has_no_findings():
    keras.config.set_dtype_policy("mixed_float16")
    model = mlp(out_dtype="float32")
    model.compile(optimizer="adam", loss="mse")
    assert audit(model).findings == ()


# --- output formats ----------------------------------------------------------


def test_str_to_markdown_and_to_dict():
    keras.config.set_dtype_policy("mixed_float16")
    model = mlp(out=4)
    model.compile(optimizer="sgd", loss="mse")
    report = audit(model)
    assert [(f.severity, f.layer) for f in report.findings] == [("warning", "out")]
    text = str(report)
    assert text.splitlines()[:5] == [
        "kmix audit of 'mlp' (global policy 'mixed_float16')",
        "path    class       compute  variables  output   params",
        "x       InputLayer  -        float32    float32  0",
        "hidden  Dense       float16  float32    float16  136",
        "out     Dense       float16  float32    float16  36",
    ]
    assert "\n[warning] out: the model outputs float16" in text
    assert '\n    fix: give the last layer dtype="float32"' in text

    markdown = report.to_markdown()
    assert "| path | class | compute | variables | output | params |" in markdown
    assert "| hidden | Dense | float16 | float32 | float16 | 136 |" in markdown
    assert "- **warning** `out`: the model outputs float16" in markdown

    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["rows"][1] == {
        "path": "hidden",
        "class_name": "Dense",
        "compute_dtype": "float16",
        "variable_dtype": "float32",
        "output_dtype": "float16",
        "params": 136,
    }
    assert data["findings"][0]["severity"] == "warning"


def test_a_report_without_findings_says_so():
    report = AuditReport("m", "float32", (), ())
    assert str(report).endswith("\nNo findings.")
    assert report.to_markdown().endswith("\nNo findings.")


def test_errors_come_first():
    x = keras.Input((8,))
    y = keras.layers.Dense(8, dtype="float16", name="fp16")(x)
    model = keras.Model(x, keras.layers.Dense(3, name="fp32")(y))
    model.compile(optimizer="sgd", loss="mse")
    severities = [f.severity for f in audit(model).findings]
    assert severities == sorted(severities, key=["error", "warning", "info"].index)
    assert severities[0] == "error"


def test_public_names():
    keras.config.set_dtype_policy("mixed_float16")
    model = mlp()
    # `import kmix.audit` binds the module to kmix.audit; calling it works.
    assert kmix.audit(model) == audit(model)
    assert audit_module(model) == audit(model)
    assert kmix.AuditReport is AuditReport


def test_tensor_cores_are_not_looked_for_on_another_backend(monkeypatch):
    """Detecting GPUs there would import TensorFlow for this question alone."""
    from kmix.policy import layer_audit, machine

    def no(*args):
        raise AssertionError("hardware() called")

    monkeypatch.setattr(machine, "keras_backend", lambda: "torch")
    monkeypatch.setattr(machine, "hardware", no)
    assert layer_audit._tensor_cores() is False
