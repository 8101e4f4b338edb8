"""kmix.LossScaleOptimizer in model.fit on Keras's JAX or torch backend; prints what it saw as JSON.

Run by tests/optimizer/test_jax_step.py in a subprocess (the test process has TensorFlow's
Keras loaded), with ``KERAS_BACKEND`` set (``jax`` when not): ``python backend_fit.py fit
DIR`` or, on JAX, ``python backend_fit.py data_parallel DIR`` (the latter with
``XLA_FLAGS=--xla_force_host_platform_device_count=2``). What only JAX has (its retraced
step, the pass run again) is observed on JAX only. Nothing here
decides what is right: the test compares the observations with its own reference.

The model: ``x -> direct -> + <- out <- hidden <- x``, Dense layers with constant kernels,
everything but ``hidden`` (float16) in float32; two Identity layers after ``direct`` make
Keras list its variables first. SGD with momentum (the inner optimizer has state).
Batches of 2 rows: ``ok`` (ones), ``forward`` (a NaN input row: the loss is NaN, every
gradient NaN, the first variable first), ``gradient`` (a target of 1e5: the float32 loss
is finite, its gradient overflows float16 in ``hidden``, the third variable).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")
JAX = os.environ["KERAS_BACKEND"] == "jax"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kmix  # noqa: E402

KINDS = ["ok", "ok", "forward", "ok", *["gradient"] * 4, *["ok"] * 8]
"""Step k of the fit trains on batch KINDS[k - 1] (the test's reference reads the same list)."""
SETTINGS = {
    "initial_scale": 64.0,
    "dynamic_growth_steps": 2,
    "min_scale": 16.0,
    "max_scale": 128.0,
}
BATCH = 2


def host(value: Any) -> np.ndarray:
    """A tensor's value as a NumPy array (a torch tensor that requires grad included)."""
    return np.array(keras.ops.convert_to_numpy(value))


def batch(kind: str, rows: int = BATCH, bad_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.ones((rows, 4), "float32"), np.ones((rows, 1), "float32")
    if kind == "forward":
        x[bad_row] = np.nan
    elif kind == "gradient":
        y[bad_row] = 1e5
    return x, y


def build() -> tuple[keras.Model, kmix.LossScaleOptimizer]:
    keras.mixed_precision.set_global_policy("mixed_float16")
    constant = keras.initializers.Constant(0.5)
    inputs = keras.Input((4,))
    direct = keras.layers.Dense(1, dtype="float32", kernel_initializer=constant, name="direct")
    hidden = keras.layers.Dense(3, kernel_initializer=constant, name="hidden")  # float16
    out = keras.layers.Dense(1, dtype="float32", kernel_initializer=constant, name="out")

    def later(tensor: keras.KerasTensor) -> keras.KerasTensor:
        return keras.layers.Identity(dtype="float32")(tensor)

    model = keras.Model(
        inputs,
        keras.layers.Add(dtype="float32")([later(later(direct(inputs))), out(hidden(inputs))]),
    )
    inner = keras.optimizers.SGD(1e-3, momentum=0.9)
    optimizer = kmix.LossScaleOptimizer(inner, **SETTINGS)
    model.compile(optimizer=optimizer, loss="mse")
    return model, optimizer


def state_of(model: keras.Model, optimizer: kmix.LossScaleOptimizer) -> list[np.ndarray]:
    """Weights, then the inner optimizer's variables (momentum, iterations)."""
    return [np.array(w) for w in model.get_weights()] + [
        host(v.value) for v in optimizer.inner_optimizer.variables
    ]


def same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True)
    )


class Observe(keras.callbacks.Callback):
    """After each batch: a raw read of the scale variable, then the optimizer's own read.

    Keras 3.15 purges the variables' values during a JAX fit and drops their initializers
    once initialized, so the raw read raises (TypeError) instead of giving the initial value.
    """

    def __init__(self, optimizer: kmix.LossScaleOptimizer) -> None:
        super().__init__()
        self.optimizer_ = optimizer
        self.raw, self.scales, self.attempted = [], [], []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        try:  # purged during fit: what reading the variable itself gives
            self.raw.append(float(host(self.optimizer_.recorder.scale.value)))
        except Exception as error:  # noqa: BLE001  (recorded, the test reads it)
            self.raw.append(type(error).__name__)
        state = self.optimizer_.read_state()  # syncs the model first
        self.scales.append(state.loss_scale)
        self.attempted.append(state.attempted_steps)


def events(optimizer: kmix.LossScaleOptimizer) -> list[dict]:
    return [
        {
            "step": e.step,
            "kind": e.kind,
            "old_scale": e.old_scale,
            "new_scale": e.new_scale,
            "variable": e.variable,
            "loss_finite": e.loss_finite,
            "origin": None if e.origin is None else dataclasses.asdict(e.origin),
            "source": None if e.source is None else dataclasses.asdict(e.source),
        }
        for e in optimizer.scale_events()
    ]


def fit_scenario(directory: str) -> dict:
    watched_run = watched(directory)  # first: Keras's own saving imports TensorFlow
    model, optimizer = build()
    data = [batch(kind) for kind in KINDS]
    x = np.concatenate([d[0] for d in data])
    y = np.concatenate([d[1] for d in data])
    observe = Observe(optimizer)
    model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0, callbacks=[observe])
    state = optimizer.read_state()
    result = {
        "tensorflow_imported": "tensorflow" in sys.modules,
        "variables": optimizer.variable_paths(),
        "raw_scale_reads": observe.raw,
        "scales": observe.scales,
        "attempted": observe.attempted,
        "state": dataclasses.asdict(state),
        "events": events(optimizer),
        "counter_dtype": str(host(optimizer.recorder.counters.value).dtype),
    }
    # A skipped step, alone: weights and the inner optimizer's state keep every bit.
    skips = {}
    for kind in ("gradient", "forward"):
        before = state_of(model, optimizer)
        scale_before = optimizer.loss_scale
        model.fit(*batch(kind), batch_size=BATCH, epochs=1, verbose=0)
        skips[kind] = {
            "unchanged": same_bits(before, state_of(model, optimizer)),
            "scale_before": scale_before,
            "scale_after": optimizer.loss_scale,
        }
    before = state_of(model, optimizer)
    model.fit(*batch("ok"), batch_size=BATCH, epochs=1, verbose=0)
    skips["ok_changes_weights"] = not same_bits(before, state_of(model, optimizer))
    result["skips"] = skips
    # Save and load: the scale, the counters and the events come back.
    path = os.path.join(directory, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    result["saved"] = {
        "state": dataclasses.asdict(optimizer.read_state()),
        "events": events(optimizer),
    }
    result["loaded"] = {
        "type": type(loaded.optimizer).__name__,
        "state": dataclasses.asdict(loaded.optimizer.read_state()),
        "events": events(loaded.optimizer),
    }
    result["watched"] = watched_run
    result["custom_loop"] = custom_loop()
    result["forward_state"] = forward_state()
    result["measured_again"] = measured_again()  # clears Keras's session
    if JAX:
        result["retraces"] = retraces(directory)
        result["origin_again"] = origin_again(directory)  # clears Keras's session
    result["lazy_origin"] = lazy_origin()  # last: it clears Keras's session
    return result


def custom_loop() -> dict:
    """``optimizer.apply`` outside fit: an inf gradient skips, a finite one applies."""
    model, optimizer = build()
    optimizer.build(model.trainable_variables)
    before = [host(v.value) for v in model.trainable_variables]
    optimizer.apply([np.full(v.shape, np.inf, "float32") for v in model.trainable_variables])
    after_skip = [host(v.value) for v in model.trainable_variables]
    skipped = dataclasses.asdict(optimizer.read_state())
    optimizer.apply([np.ones(v.shape, "float32") for v in model.trainable_variables])
    return {
        "skip_unchanged": same_bits(before, after_skip),
        "skipped": skipped,
        "applied": dataclasses.asdict(optimizer.read_state()),
        "applied_changes_weights": not same_bits(
            before, [host(v.value) for v in model.trainable_variables]
        ),
        "events": events(optimizer),
    }


class CountCalls(keras.layers.Layer):
    """Counts its training calls in an integer variable (state a skip does not give back)."""

    def build(self, input_shape: tuple) -> None:
        self.calls = self.add_weight(shape=(), dtype="int32", trainable=False, name="calls")

    def call(self, inputs: Any, training: bool = False) -> Any:
        if training:
            self.calls.assign_add(1)
        return inputs


def forward_state() -> dict:
    """BatchNormalization's statistics across a skipped step, and an integer counter's."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(),
            CountCalls(),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(optimizer=kmix.LossScaleOptimizer("sgd"), loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(*batch("ok"), verbose=0)
    said = [str(w.message) for w in caught if "kmix" in str(w.message)]

    def values() -> list[np.ndarray]:
        return [host(v.value) for v in model.non_trainable_variables if "float" in v.dtype]

    def calls() -> int:
        return int(host(model.layers[2].calls.value))

    before, calls_before = values(), calls()
    model.fit(*batch("forward"), verbose=0)
    kept, calls_after = same_bits(before, values()), calls()
    model.fit(*batch("ok"), verbose=0)
    return {
        "warnings": said,
        "paths": [v.path for v in model.non_trainable_variables],
        "skip_keeps_float_state": kept,
        "ok_changes_float_state": not same_bits(before, values()),
        "integer_calls": [calls_before, calls_after, calls()],
        "skipped_steps": model.optimizer.skipped_steps,
    }


def watched(directory: str) -> dict:
    """kmix's callbacks on JAX: monitor, guard and autopilot over a cast overflow.

    ``x -> wide (float16) -> norm (BatchNormalization, float16) -> top (float32)``; batch
    3 of each epoch has rows of 90000 (past float16's 65504): ``wide``'s input cast
    overflows, the autopilot moves ``wide``; in the next epoch ``wide`` (float32 now)
    gives ``norm`` 4 * 90000, whose cast overflows: ``norm`` moves too.
    """
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((4,))
    ones = keras.initializers.Constant(1.0)
    hidden = keras.layers.Dense(8, kernel_initializer=ones, name="wide")(inputs)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    outputs = keras.layers.Dense(1, dtype="float32", name="top")(hidden)
    model = keras.Model(inputs, outputs)
    optimizer = kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=64.0)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
    x[4:6] = 90000.0
    logdir = os.path.join(directory, "watched")
    autopilot = kmix.callbacks.PrecisionAutopilot(proactive=False)
    callbacks = [
        kmix.callbacks.MixedPrecisionMonitor(logdir, update_freq=2, histogram_freq=4),
        kmix.callbacks.LossScaleGuard(),
        autopilot,
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    tensorflow_imported = "tensorflow" in sys.modules  # before the report: its reader may
    from kmix import report

    summary = report.summarize(report.read_log(logdir)).to_dict()
    return {
        "moves": [[m.step, m.layer, m.from_policy, m.to_policy] for m in autopilot.moves],
        "events": events(optimizer),
        "layers": sorted(optimizer.activations_by_layer()),
        "health_step": optimizer.read_state().health_step,
        "histogram_step": optimizer.read_state().histogram_step,
        "summary": summary,
        "files": sorted(os.listdir(os.path.join(logdir, "train"))),
        "tensorflow_imported": tensorflow_imported,
    }


def lazy_origin() -> list[dict]:
    """A Sequential without Input casts its data to float16 on entry (Functional's input
    conversion, not the first layer's policy): the origin still judges the data as given."""
    keras.utils.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")
    ones = keras.initializers.Constant(1.0)
    model = keras.Sequential(
        [keras.layers.Dense(8, kernel_initializer=ones, name="d"), keras.layers.Dense(1, name="o")]
    )
    optimizer = kmix.LossScaleOptimizer("sgd", initial_scale=64.0)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    x[5] = 90000.0
    guard = kmix.callbacks.LossScaleGuard()  # any kmix callback taps the model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=2, verbose=0, shuffle=False, callbacks=[guard])
    return events(optimizer)


class Peek(keras.layers.Layer):
    """Passes its input on and keeps max |input| of its call, as ``kept`` (a variable the
    forward pass assigns; fit keeps the main pass's): what the step's own pass saw. A
    float variable is given back by a skipped step; an int32 one keeps the skipped step's
    value, so it survives the overflow it watches. Not autocast: on torch Keras 3.15 drops
    a float variable's assignment made in an autocast float16 call (it writes into the
    autocast copy); its float16 input is not cast anyway."""

    def __init__(self, kept: str = "float32", **kwargs: Any) -> None:
        super().__init__(autocast=False, **kwargs)
        self.kept = kept

    def build(self, shape: tuple) -> None:
        self.seen = self.add_weight(
            shape=(), initializer="zeros", trainable=False, dtype=self.kept, name="seen"
        )

    def call(self, x: Any) -> Any:
        self.seen.assign(keras.ops.cast(keras.ops.max(keras.ops.abs(x)), self.kept))
        return x


class SeenAndMeasured(keras.callbacks.Callback):
    """After each step: what Peek saw, and kmix's activation statistics of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        model = self.model  # syncs JAX's state into the variables
        by_layer = model.optimizer.recorder.activations_by_layer()
        self.rows.append(
            {
                "seen": float(np.asarray(model.get_layer("peek").seen.value)),
                "drop": by_layer.get("drop"),
            }
        )


def measured_again() -> list[dict]:
    """With dropout (random per step), kmix's activation statistics must be those of the
    step's own pass (a pass run again with another seed state would differ)."""
    keras.utils.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    wide = keras.layers.Dense(64, name="wide")(inputs)
    dropped = keras.layers.Dropout(0.5, name="drop")(wide)
    peeked = Peek(name="peek")(dropped)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="out")(peeked))
    optimizer = kmix.LossScaleOptimizer("sgd", initial_scale=64.0)
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 8)).astype("float32"), np.ones((40, 1), "float32")
    seen = SeenAndMeasured()
    callbacks = [AskAt(0, 1), kmix.callbacks.LossScaleGuard(), seen]  # the guard taps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False, callbacks=callbacks)
    return seen.rows


class SeenAndChosen(keras.callbacks.Callback):
    """After each step: what Peek (int32) saw, and how many executions measured their pass."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.measured: list[int | None] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        model = self.model  # syncs JAX's state into the variables
        self.seen.append(int(np.asarray(model.get_layer("peek").seen.value)))
        self.measured.append(getattr(model.train_function, "measured_executions", None))


def origin_again(directory: str) -> dict:
    """Every step overflows where Dropout keeps a unit: the forward origin's largest input
    depends on the step's dropout mask. Statistics every 3 steps: steps 3 and 6 measure
    their own pass, the others run it again for the origin; both must name what the
    step's own pass saw (PeekInt)."""
    keras.utils.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(5)
    units = 8
    kernel = keras.initializers.Constant(np.arange(40000, 40000 + 5000 * units, 5000)[None, :])
    inputs = keras.Input((1,))
    spread = keras.layers.Dense(units, kernel_initializer=kernel, dtype="float32", name="spread")
    hidden = keras.layers.Dropout(0.5, dtype="float32", name="drop")(spread(inputs))
    hidden = Peek("int32", dtype="float32", name="peek")(hidden)  # kept units: 80000 and more
    outputs = keras.layers.Dense(1, name="post")(hidden)  # float16: its input cast overflows
    model = keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(outputs))
    optimizer = kmix.LossScaleOptimizer("sgd", initial_scale=64.0)
    model.compile(optimizer=optimizer, loss="mse")
    logdir = os.path.join(directory, "origin_again")
    seen = SeenAndChosen()
    callbacks = [kmix.callbacks.MixedPrecisionMonitor(logdir, update_freq=3, verbose=0), seen]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(
            np.ones((6, 1), "float32"),
            np.ones((6, 1), "float32"),
            batch_size=1,
            verbose=0,
            shuffle=False,
            callbacks=callbacks,
        )
    return {"events": events(optimizer), "seen": seen.seen, "measured": seen.measured}


class CountedTraces(keras.Sequential):
    """A Sequential whose train step counts how often JAX traced it."""

    traces = 0

    def train_step(self, state: tuple, data: Any) -> tuple:
        CountedTraces.traces += 1
        return super().train_step(state, data)


class AskAt(keras.callbacks.Callback):
    """Requests health statistics every ``every`` steps from batch ``batch`` on."""

    def __init__(self, batch: int, every: int) -> None:
        super().__init__()
        self.batch, self.every = batch, every

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if batch == self.batch:
            self.model.optimizer.request_statistics(self, self.every, 0)

    def on_train_end(self, logs: dict | None = None) -> None:
        self.model.optimizer.release_statistics(self)


def retraces(directory: str) -> dict:
    """Statistics settings are constants of the jit step: each change must reach it, and
    a fit asking for what an earlier fit asked for must not trace again."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = CountedTraces([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    optimizer = kmix.LossScaleOptimizer("sgd", health_every=1000)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
    found: dict = {"health_steps": [], "traces": []}

    def fit(*callbacks: keras.callbacks.Callback) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=list(callbacks))
        found["health_steps"].append(optimizer.read_state().health_step)
        found["traces"].append(CountedTraces.traces)

    logdir = os.path.join(directory, "retraces")
    fit(kmix.callbacks.MixedPrecisionMonitor(logdir, update_freq=3))  # steps 1-8
    fit(kmix.callbacks.MixedPrecisionMonitor(logdir, update_freq=3))  # 9-16: the same trace
    fit(AskAt(batch=2, every=5))  # 17-24: every 1000 until batch 2 (step 19), then every 5
    return found


def data_parallel_scenario(directory: str) -> dict:
    import jax

    devices = jax.devices()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    model, optimizer = build()
    model.fit(*batch("ok", rows=4), batch_size=4, epochs=1, verbose=0)  # builds, one step
    result = {"devices": len(devices), "steps": {}}
    logdir = os.path.join(directory, "data_parallel")
    for kind in ("forward", "gradient", "ok"):
        before = state_of(model, optimizer)
        monitor = kmix.callbacks.MixedPrecisionMonitor(logdir, update_freq=4, verbose=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(
                *batch(kind, rows=4, bad_row=3),
                batch_size=4,
                shuffle=False,  # the bad row stays on the second device
                epochs=1,
                verbose=0,
                callbacks=[monitor],
            )
        per_device = [
            [np.asarray(shard.data) for shard in v.value.addressable_shards]
            for v in model.trainable_variables
        ]
        result["steps"][kind] = {
            "unchanged": same_bits(before, state_of(model, optimizer)),
            "replicas_identical": all(
                all(s.tobytes() == shards[0].tobytes() for s in shards) for shards in per_device
            ),
            "replicas": min(len(shards) for shards in per_device),
            "finite": all(np.isfinite(w).all() for w in model.get_weights()),
        }
    result["state"] = dataclasses.asdict(optimizer.read_state())
    result["events"] = events(optimizer)
    result["variables"] = optimizer.variable_paths()
    result["layers"] = sorted(optimizer.activations_by_layer())
    from kmix import report

    result["report_events"] = [
        e["step"] for e in report.summarize(report.read_log(logdir)).to_dict()["events"]
    ]
    return result


if __name__ == "__main__":
    scenario, directory = sys.argv[1], sys.argv[2]
    run = {"fit": fit_scenario, "data_parallel": data_parallel_scenario}[scenario]
    print("JSON " + json.dumps(run(directory)))
