"""``kmix demo``: mixed-precision training made visible, on data that ships with kmix.

A small convolutional network learns the 8x8 handwritten digits in
``mixed_float16`` with :class:`kmix.LossScaleOptimizer`,
:class:`kmix.callbacks.MixedPrecisionMonitor` and
:class:`kmix.callbacks.LossScaleGuard`. The loss scale starts at ``2**24``, far too
high, so the first steps overflow float16 and back off: the report shows the
overflow episode, the recovery, the growth events that follow, gradient health
and exponent histograms. The same model is then trained in float32 from the same
seed, to compare test accuracies.

It runs on the Keras backend in use, TensorFlow, JAX or torch (``kmix demo --backend jax``,
``--backend torch``); on JAX and torch it imports no TensorFlow of its own
(``kmix/demo/scalars.py``). What the demo may
write where (its log dir and the marker file) is decided in ``kmix/demo/logdir.py``;
those names are importable from here too.

Example:
    >>> from kmix import demo
    >>> result = demo.run("runs/demo", epochs=1, verbose=0)  # doctest: +SKIP
    >>> result.mixed_accuracy, result.float32_accuracy       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import math
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kmix._checks import NotFloat16Note, SpeedWarning
from kmix._words import plural
from kmix.demo.logdir import (
    MARKER,
    LogdirError,
    files_to_replace,
    files_under,
    prepare_logdir,
    read_marker,
    record_run,
)

if TYPE_CHECKING:
    from kmix.policy import Hardware

__all__ = [
    "BATCH_SIZE",
    "GROWTH_STEPS",
    "HISTOGRAM_FREQ",
    "INITIAL_SCALE",
    "LEARNING_RATE",
    "MARKER",
    "TEST_EVERY",
    "UPDATE_FREQ",
    "DemoResult",
    "LogdirError",
    "Trained",
    "build_model",
    "files_to_replace",
    "files_under",
    "load_digits",
    "main",
    "prepare_logdir",
    "read_marker",
    "record_run",
    "run",
    "split",
]

TEST_EVERY = 6
"""Every 6th image is a test image: 300 test, 1,497 train, all classes in both."""

BATCH_SIZE = 32
LEARNING_RATE = 3e-3
INITIAL_SCALE = 2.0**24  # the optimizer's max_scale: gradients overflow float16 at once
GROWTH_STEPS = 50  # small, so that growth events appear within a few epochs
UPDATE_FREQ = 10
HISTOGRAM_FREQ = 25  # at least one histogram in the first epoch (47 steps)

_RANGE_MAX = {"float32": "3.4e38", "bfloat16": "3.4e38", "float64": "1.8e308"}
"""The largest finite value of each compute dtype but float16, as the introduction says it."""


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """What :func:`run` trained and measured.

    Attributes:
        logdir: the TensorBoard log dir of the run.
        policy: the dtype policy of the mixed-precision run, and why.
        mixed_accuracy: test accuracy of the mixed-precision model.
        float32_accuracy: the same model's test accuracy in float32 (None: not run).
        guard_diagnosis: why LossScaleGuard stopped training, or None.
        summary: the :class:`kmix.report.Summary` of the run.
        plots: the PNG files written (empty without matplotlib).
        seconds: wall time of the whole demo.
        mixed_step_s, float32_step_s: each run's median step time in s (None: unmeasured).
        float32_steps_a_call: steps a call of the float32 run (1 on torch); None: not run.
    """

    logdir: str
    policy: str
    mixed_accuracy: float
    float32_accuracy: float | None
    guard_diagnosis: str | None
    summary: Any  # a kmix.report.Summary (imported lazily: no TensorBoard at import)
    plots: list[str]
    seconds: float
    mixed_step_s: float | None = None
    float32_step_s: float | None = None
    float32_steps_a_call: int | None = None


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Loads the 1,797 8x8 handwritten digits shipped in ``kmix/data/digits.npz``.

    See ``kmix/data/README.md`` for the source (UCI, CC BY 4.0).

    Returns:
        ``(images, labels)``: uint8, shapes (1797, 8, 8) (0..16) and (1797,) (0..9).
    """
    resource = importlib.resources.files("kmix").joinpath("data", "digits.npz")
    with resource.open("rb") as file, np.load(file) as data:
        return data["images"], data["labels"]


def split(
    images: np.ndarray, labels: np.ndarray, train_limit: int | None = None
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Splits the digits into train and test sets, scaled to [0, 1] with a channel axis.

    Args:
        images: uint8 images, values 0..16.
        labels: their labels.
        train_limit: keep only the first this many training images (for quick tests).

    Returns:
        ``((x_train, y_train), (x_test, y_test))``; x is float32 of shape (n, 8, 8, 1).
    """
    x = (images.astype("float32") / 16.0)[..., None]
    test = np.arange(len(images)) % TEST_EVERY == 0
    train = (x[~test][:train_limit], labels[~test][:train_limit])
    return train, (x[test], labels[test])


def build_model() -> Any:
    """Builds the small CNN under the current global dtype policy.

    The softmax head computes in float32, as mixed precision advises.

    Returns:
        An uncompiled ``keras.Model``: two 3x3 convolutions (16 and 32 filters),
        max pooling, a third convolution (64), global average pooling, Dense(10).
    """
    import keras
    from keras import layers

    inputs = keras.Input((8, 8, 1))
    x = layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    x = layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name="digits_cnn")


class Trained(NamedTuple):
    """One model the demo trained.

    Attributes:
        model: the trained ``keras.Model``.
        policy: its dtype policy and why it was chosen, as ``str(PolicyChoice)``.
        accuracy: its test accuracy.
        step_s: its median time of a training step, in seconds (None: not measured).
        steps_a_call: the steps one call of its train function ran.
    """

    model: Any
    policy: str
    accuracy: float
    step_s: float | None = None
    steps_a_call: int = 1


def _train(
    policy: str,
    data: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    *,
    epochs: int,
    seed: int,
    callbacks: list[Any],
    scaled: bool,
    verbose: int,
    logged: bool = True,
    detected: Hardware | None = None,
) -> Trained:
    """Builds, compiles, trains and evaluates one model.

    Args:
        policy: the dtype policy to build it under.
        data: ``((x_train, y_train), (x_test, y_test))``, as from :func:`split`.
        epochs: epochs to train.
        seed: the random seed set before building.
        callbacks: callbacks for ``fit``.
        scaled: wrap the optimizer in :class:`kmix.LossScaleOptimizer`.
        verbose: Keras's verbosity for ``fit``.
        logged: validate after every epoch and run the callbacks after every step. When
            False (the float32 comparison, of which only the test accuracy is shown),
            Keras runs a whole epoch per call (``steps_per_execution``; not on torch:
            ``steps.compile_model``): the same steps and weights, about 30% faster.
        detected: the hardware to choose ``"auto"`` for; ``None`` detects it.

    Returns:
        The model, its policy text and its test accuracy.
    """
    import keras

    import kmix
    from kmix import backend
    from kmix.demo.steps import StepClock, compile_model

    clock = StepClock()
    backend.set_random_seed(seed)  # on JAX and torch without importing TensorFlow
    with contextlib.ExitStack() as stack:
        with warnings.catch_warnings():  # the choice's reason says when float16 is slow here
            warnings.filterwarnings("ignore", category=SpeedWarning)
            choice = stack.enter_context(kmix.policy_scope(policy, detected=detected))
        (x_train, y_train), (x_test, y_test) = data
        model = build_model()
        optimizer: Any = keras.optimizers.Adam(LEARNING_RATE)
        if scaled:
            optimizer = kmix.LossScaleOptimizer(
                optimizer, initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH_STEPS
            )
        compile_model(model, optimizer, 1 if logged else math.ceil(len(x_train) / BATCH_SIZE))
        with warnings.catch_warnings():
            # The monitor's note that float16's statistics do not apply to this policy is
            # said by the demo's introduction and report; as a warning it would point at
            # no code of the user's.
            warnings.filterwarnings("ignore", category=NotFloat16Note)
            model.fit(
                x_train,
                y_train,
                batch_size=BATCH_SIZE,
                epochs=epochs,
                validation_data=(x_test, y_test) if logged else None,
                callbacks=[clock, *callbacks],  # first: it times the step alone
                verbose=verbose,
            )
        _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    return Trained(model, str(choice), float(accuracy), clock.median_step_s, clock.steps_a_call)


def run(
    logdir: str,
    epochs: int = 10,
    policy: str = "mixed_float16",
    *,
    train_limit: int | None = None,
    compare_float32: bool = True,
    seed: int = 0,
    verbose: int = 1,
    overwrite: bool = False,
    detected: Hardware | None = None,
) -> DemoResult:
    """Trains the demo in mixed precision (logged), then in float32, and reports.

    The global dtype policy is the same afterwards as before. The log dir must be new,
    empty, or (with ``overwrite``) a previous demo run, whose files alone are removed;
    the demo marks its run with the file :data:`MARKER`, listing what it wrote.

    Args:
        logdir: TensorBoard log dir, created if missing.
        epochs: epochs per run, >= 1.
        policy: the dtype policy of the logged run (any name ``kmix.use`` accepts).
        train_limit: train on only the first this many training images.
        compare_float32: also train the same model in float32.
        seed: random seed of both runs.
        verbose: Keras's verbosity for the logged run: 1 shows a progress bar.
        overwrite: replace a previous kmix demo run in ``logdir``.
        detected: the hardware ``policy="auto"`` chooses for (see ``kmix.use``);
            ``None`` detects it.

    Returns:
        A :class:`DemoResult`.

    Raises:
        ValueError: ``epochs`` < 1, an unknown ``policy``, or several processes running.
        LogdirError: ``logdir`` holds files the demo may not replace (a
            ``ValueError``; see :func:`prepare_logdir`).
        OSError: ``logdir`` cannot be created or written.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"Invalid `epochs` for kmix demo: epochs={epochs!r}. Use an integer >= 1.")
    from kmix.backend import check_single_process

    check_single_process("kmix demo")
    start = time.perf_counter()
    prepare_logdir(logdir, overwrite=overwrite)
    try:
        result = _train_and_report(
            logdir,
            epochs,
            policy,
            train_limit=train_limit,
            compare_float32=compare_float32,
            seed=seed,
            verbose=verbose,
            detected=detected,
        )
    finally:  # also when training fails or is interrupted: the run is the demo's own
        record_run(logdir)
    return dataclasses.replace(result, seconds=time.perf_counter() - start)


def _train_and_report(
    logdir: str,
    epochs: int,
    policy: str,
    *,
    train_limit: int | None,
    compare_float32: bool,
    seed: int,
    verbose: int,
    detected: Hardware | None,
) -> DemoResult:
    """The body of :func:`run`, once the log dir is ready; its ``seconds`` are 0."""
    from kmix import report
    from kmix.callbacks import LossScaleGuard, MixedPrecisionMonitor
    from kmix.demo import scalars

    data = split(*load_digits(), train_limit=train_limit)
    guard = LossScaleGuard(check_freq=UPDATE_FREQ)
    callbacks = [
        MixedPrecisionMonitor(
            logdir, update_freq=UPDATE_FREQ, histogram_freq=HISTOGRAM_FREQ, verbose=0
        ),
        guard,
        scalars.tensorboard_callback(logdir),  # Keras's on TensorFlow
    ]
    mixed = _train(
        policy,
        data,
        epochs=epochs,
        seed=seed,
        callbacks=callbacks,
        scaled=True,
        verbose=verbose,
        detected=detected,
    )
    reference = None
    if compare_float32:
        reference = _train(
            "float32",
            data,
            epochs=epochs,
            seed=seed,
            callbacks=[],
            scaled=False,
            verbose=0,
            logged=False,
            detected=detected,
        )
    log = report.read_log(logdir)
    summary = report.summarize(log)
    try:
        plots = report.write_plots(log, summary, os.path.join(logdir, "report"))
    except ImportError:
        plots = []
    return DemoResult(
        logdir=logdir,
        policy=mixed.policy,
        mixed_accuracy=mixed.accuracy,
        float32_accuracy=None if reference is None else reference.accuracy,
        guard_diagnosis=guard.diagnosis,
        summary=summary,
        plots=plots,
        seconds=0.0,
        mixed_step_s=mixed.step_s,
        float32_step_s=None if reference is None else reference.step_s,
        float32_steps_a_call=None if reference is None else reference.steps_a_call,
    )


def _introduction(
    logdir: str, epochs: int, policy: str, *, auto: bool = False, backend: str | None = None
) -> str:
    """The line ``kmix demo`` prints before it trains: what it runs and where it logs.

    The overflow the demo provokes is promised only where the policy computes in
    float16; any other compute dtype reaches far past 2^24 times the gradients.

    Args:
        logdir: TensorBoard log dir.
        epochs: epochs per run.
        policy: the dtype policy of the logged run, as a Keras name (what ``"auto"``
            chose, not ``"auto"``).
        auto: whether ``"auto"`` chose ``policy``.
        backend: the Keras backend it trains on, named when given.

    Returns:
        One line, without its newline.
    """
    head = f"kmix demo: {plural(epochs, 'epoch')} on the 8x8 digits, policy {policy}"
    if auto:
        head += " (chosen by --policy auto)"
    if backend:
        head += f", Keras backend {backend}"
    dtype = policy.removeprefix("mixed_")  # the dtype it computes in: mixed_bfloat16 -> bfloat16
    if dtype == "float16":
        what = (
            "The loss scale starts at 2^24, too high for float16 on purpose: the first "
            "float16 steps overflow and back off."
        )
    else:
        what = (
            f"It computes in {dtype}, whose range reaches {_RANGE_MAX[dtype]} (float16's ends "
            "at 65504), so it needs no loss scaling: the loss scale starts at 2^24 as in the "
            "float16 demo, whose first steps overflow on purpose, and float16's headroom and "
            "underflow are not measured (--policy mixed_float16 shows the overflow)."
        )
    return f"{head}. {what} Logs in {logdir}"


def main(
    logdir: str,
    epochs: int = 10,
    policy: str = "mixed_float16",
    *,
    overwrite: bool = False,
    detected: Hardware | None = None,
) -> int:
    """Runs the demo and prints accuracies, the report and how to open TensorBoard.

    Every line names the policy the run used: for ``"auto"``, the one it chose.

    Args:
        logdir: TensorBoard log dir.
        epochs: epochs per run, >= 1.
        policy: the dtype policy of the logged run (any name ``kmix.use`` accepts).
        overwrite: replace a previous kmix demo run in ``logdir``.
        detected: the hardware ``"auto"`` chooses for; ``None`` detects it (which
            imports TensorFlow) when ``policy`` is ``"auto"``.

    Returns:
        The exit status: 0, or 1 when LossScaleGuard stopped training.

    Raises:
        LogdirError: ``logdir`` holds files the demo may not replace.
        OSError: ``logdir`` cannot be created or written.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from kmix import report
    from kmix.policy import choose_auto

    name = policy
    if policy == "auto":  # choose once: the run chooses for the same hardware
        if detected is None:
            from kmix.policy import hardware

            detected = hardware()
        name = choose_auto(detected)[0]
    backend = keras.backend.backend()
    print(_introduction(logdir, epochs, name, auto=policy == "auto", backend=backend))
    result = run(logdir, epochs, policy, overwrite=overwrite, detected=detected)
    print()
    print(f"policy: {result.policy}")
    print(f"test accuracy, {name} with kmix: {result.mixed_accuracy:.4f}")
    if result.float32_accuracy is not None:
        print(f"test accuracy, same model in float32: {result.float32_accuracy:.4f}")
    if result.mixed_step_s is not None and result.float32_step_s is not None:
        from kmix.policy import step_line

        calls = "an epoch a call" if (result.float32_steps_a_call or 1) > 1 else None
        print(step_line(name, result.mixed_step_s, result.float32_step_s, calls))
    print()
    print(report.format_summary(result.summary))
    print()
    if result.plots:
        print("plots: " + ", ".join(result.plots))
    else:
        print("plots: none (matplotlib is not installed: pip install matplotlib)")
    print(f"TensorBoard: tensorboard --logdir {logdir}")
    print(f"again, from the logs: kmix report {logdir}")
    print(f"demo took {result.seconds:.0f} s")
    if result.guard_diagnosis:
        print(f"LossScaleGuard stopped training: {result.guard_diagnosis}")
        return 1
    return 0
