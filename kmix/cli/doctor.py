"""``kmix doctor``: versions, hardware, speed, the Keras backend, and what is known not to work.

The rules are pure (:func:`version_warnings` over :class:`VersionFacts`; the speed
ratios and their judgement in ``kmix/policy/speed.py``, the timing in
``kmix/policy/timing.py``); only :func:`run_doctor` reads
the machine, importing the Keras backend's library when it runs (TensorFlow, or JAX with
``KERAS_BACKEND=jax``, or torch with ``KERAS_BACKEND=torch``; those two import no
TensorFlow). It times a small float32, float16 and
bfloat16 matmul and convolution on the CPU with that backend's kernels (about a second)
and, on TensorFlow only, where oneDNN's float16 path is pathologically slow, times float16
again in a fresh process with ``TF_ENABLE_ONEDNN_OPTS=0`` (a few seconds more, TensorFlow's
start-up included) to show the fix's measured effect.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PACKAGES = (
    "tensorflow",
    "keras",
    "tensorboard",
    "tf-keras",
    "jax",
    "jaxlib",
    "torch",
    "numpy",
    "matplotlib",
    "kmix",
)
"""The packages ``kmix doctor`` reports the versions of."""

ON_JAX = (
    "kmix.LossScaleOptimizer in model.fit (the bounded scale, skipped steps, events, "
    "gradient health, exponent histograms, activation statistics, the forward origin), "
    "MixedPrecisionMonitor, LossScaleGuard, PrecisionAutopilot and kmix report; not "
    "LoopDriver (it drives tf.distribute: TensorFlow only)"
)
"""What kmix runs on Keras's JAX backend, as ``kmix doctor`` says it."""

ON_TORCH = (
    "kmix.LossScaleOptimizer in model.fit (the bounded scale, skipped steps, events, "
    "gradient health, exponent histograms, activation statistics, the forward origin), "
    "MixedPrecisionMonitor, LossScaleGuard, PrecisionAutopilot, kmix report and kmix "
    "compare (from arrays), without TensorFlow; not LoopDriver (it drives "
    "tf.distribute: TensorFlow only)"
)
"""What kmix runs on Keras's torch backend, as ``kmix doctor`` says it."""


def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, str | None]:
    """Returns the installed version of each package, ``None`` if it is not installed.

    Args:
        names: distribution names, e.g. ``("tensorflow", "keras")``.

    Returns:
        ``{name: version or None}``.
    """
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@dataclasses.dataclass(frozen=True)
class VersionFacts:
    """What the rules of :func:`version_warnings` look at.

    Attributes:
        versions: ``{package: version or None}``, as from :func:`package_versions`.
        tensorflow: TensorFlow's version as ``packaging.version.Version``, or None when it
            is not installed or cannot be parsed; likewise ``keras`` and ``tensorboard``.
        keras_pin: the ``keras`` requirement TensorFlow declares (without a marker), or None.
        legacy_keras: whether ``TF_USE_LEGACY_KERAS`` is set, making ``tf.keras`` Keras 2.
        backend: the Keras backend in use or chosen by ``KERAS_BACKEND``, or None.
    """

    versions: Mapping[str, str | None]
    tensorflow: Any
    keras: Any
    tensorboard: Any
    keras_pin: Any
    legacy_keras: bool
    backend: str | None

    def missing(self, name: str) -> bool:
        """Whether the package ``name`` is not installed."""
        return self.versions.get(name) is None


def _older(version: Any, release: tuple[int, ...]) -> bool:
    """Whether a parsed ``version`` is known and older than ``release``, e.g. ``(2, 16)``."""
    return version is not None and version.release < release


VERSION_RULES: tuple[tuple[Callable[[VersionFacts], bool], Callable[[VersionFacts], str]], ...] = (
    (
        lambda f: f.missing("tensorflow"),
        lambda f: (
            "TensorFlow is not installed: kmix requires it, for the TensorFlow backend "
            "and LoopDriver (pip install 'tensorflow>=2.16')"
        ),
    ),
    (
        lambda f: _older(f.tensorflow, (2, 16)),
        lambda f: (
            f"TensorFlow {f.tensorflow} is older than 2.16 and uses Keras 2 (tf.keras); "
            "kmix needs TensorFlow >= 2.16 with Keras 3 (pip install -U 'tensorflow>=2.16')"
        ),
    ),
    (
        lambda f: f.missing("keras"),
        lambda f: "Keras is not installed: kmix needs Keras 3 (pip install 'keras>=3.8')",
    ),
    (
        lambda f: _older(f.keras, (3,)),
        lambda f: f"Keras {f.keras} is Keras 2; kmix needs Keras 3 (pip install -U 'keras>=3.8')",
    ),
    (
        lambda f: not _older(f.keras, (3,)) and _older(f.keras, (3, 8)),
        lambda f: f"Keras {f.keras} is older than 3.8, which kmix needs (pip install -U keras)",
    ),
    (
        lambda f: (
            f.keras is not None
            and f.keras_pin is not None
            and not f.keras_pin.contains(f.keras, prereleases=True)
        ),
        lambda f: (
            f"TensorFlow {f.tensorflow} expects keras{f.keras_pin} but Keras {f.keras} "
            f"is installed (pip install 'keras{f.keras_pin}')"
        ),
    ),
    (
        lambda f: f.legacy_keras,
        lambda f: (
            "TF_USE_LEGACY_KERAS is set, so tf.keras is Keras 2"
            + (f" (tf-keras {f.versions['tf-keras']})" if f.versions.get("tf-keras") else "")
            + ": models built with tf.keras do not work with kmix; use `import keras` "
            "(Keras 3) or unset TF_USE_LEGACY_KERAS"
        ),
    ),
    (
        lambda f: f.backend not in (None, "", "tensorflow", "jax", "torch"),
        lambda f: (
            f"the Keras backend is {f.backend!r}: kmix.LossScaleOptimizer and the "
            "callbacks need 'tensorflow', 'jax' or 'torch' (set KERAS_BACKEND to one of them)"
        ),
    ),
    (
        lambda f: f.backend == "jax" and (f.missing("jax") or f.missing("jaxlib")),
        lambda f: (
            "the Keras backend is 'jax' but JAX is not installed: pip install \".[jax]\" "
            "from the root of kmix's checkout (or set KERAS_BACKEND=tensorflow)"
        ),
    ),
    (
        lambda f: f.backend == "torch" and f.missing("torch"),
        lambda f: (
            "the Keras backend is 'torch' but torch is not installed: pip install \".[torch]\" "
            "from the root of kmix's checkout (or set KERAS_BACKEND=tensorflow)"
        ),
    ),
    (
        lambda f: f.missing("tensorboard"),
        lambda f: (
            "TensorBoard is not installed: MixedPrecisionMonitor and kmix report need it "
            "(pip install tensorboard)"
        ),
    ),
    (
        lambda f: f.tensorflow is not None and _older(f.tensorboard, (2,)),
        lambda f: f"TensorBoard {f.tensorboard} is too old for TensorFlow {f.tensorflow}",
    ),
)
"""``(when, says)`` pairs: the package combinations known not to work, in the order shown."""


def version_facts(
    versions: Mapping[str, str | None],
    environ: Mapping[str, str],
    tensorflow_requires: Sequence[str] = (),
    backend: str | None = None,
) -> VersionFacts:
    """Parses versions, TensorFlow's Keras pin and the environment for the rules.

    Args:
        versions: ``{package: version or None}``, as from :func:`package_versions`.
        environ: environment variables (``TF_USE_LEGACY_KERAS``, ``KERAS_BACKEND``).
        tensorflow_requires: TensorFlow's requirement strings, as from
            ``importlib.metadata.requires("tensorflow")``.
        backend: the active Keras backend, if known.

    Returns:
        A :class:`VersionFacts`; what cannot be parsed is None.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    def parsed(name: str) -> Version | None:
        try:
            return Version(versions[name]) if versions.get(name) else None
        except InvalidVersion:
            return None

    pin = None
    for text in tensorflow_requires:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.name == "keras" and requirement.marker is None:
            pin = requirement.specifier
    return VersionFacts(
        versions=versions,
        tensorflow=parsed("tensorflow"),
        keras=parsed("keras"),
        tensorboard=parsed("tensorboard"),
        keras_pin=pin,
        legacy_keras=environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes"),
        backend=backend or environ.get("KERAS_BACKEND"),
    )


def version_warnings(
    versions: Mapping[str, str | None],
    environ: Mapping[str, str],
    tensorflow_requires: Sequence[str] = (),
    backend: str | None = None,
) -> list[str]:
    """Finds package combinations known not to work with kmix (:data:`VERSION_RULES`).

    Args:
        versions: ``{package: version or None}``, as from :func:`package_versions`.
        environ: environment variables (``TF_USE_LEGACY_KERAS``, ``KERAS_BACKEND``).
        tensorflow_requires: TensorFlow's requirement strings, as from
            ``importlib.metadata.requires("tensorflow")``; its Keras pin is checked.
        backend: the active Keras backend, if known.

    Returns:
        One sentence per problem, saying what to do; empty when all is well.
    """
    facts = version_facts(versions, environ, tensorflow_requires, backend)
    return [says(facts) for when, says in VERSION_RULES if when(facts)]


def speed_section(detected: Any, measured: Any) -> list[str]:
    """Says what the speed measurement found, timing the known fix where one applies.

    Args:
        detected: the :class:`kmix.policy.machine.Hardware` of this machine.
        measured: a ``kmix.policy.speed.SpeedMeasurement`` taken in this process. Where
            ``onednn_fix_applies(measured)`` (a TensorFlow measurement only), float32 and
            float16 are timed again in a fresh process with ``TF_ENABLE_ONEDNN_OPTS=0``
            (a few seconds).

    Returns:
        The section's lines, indented, under the heading ``speed on this CPU``.
    """
    from kmix.policy import doctor_lines, measure_in_subprocess, onednn_fix_applies

    recheck, recheck_error = None, None
    if onednn_fix_applies(measured):
        try:
            recheck = measure_in_subprocess({"TF_ENABLE_ONEDNN_OPTS": "0"})
        except RuntimeError as error:
            recheck_error = str(error)
    lines = doctor_lines(measured, recheck, recheck_error)
    if detected.gpus or detected.tpus:
        lines.append(
            "the GPU or TPU is not timed here: kmix compare times each policy on your model"
        )
    return ["speed on this CPU (each dtype's time for the same op)"] + [f"  {x}" for x in lines]


def backend_section(
    backend: str | None, environ: Mapping[str, str], versions: Mapping[str, str | None]
) -> list[str]:
    """Says which Keras backend is in use, whether JAX and torch are installed, and what kmix
    runs on each.

    Args:
        backend: the Keras backend in use, or None when Keras does not import.
        environ: the environment (``KERAS_BACKEND``).
        versions: ``{package: version or None}``, as from :func:`package_versions`.

    Returns:
        The lines: ``Keras backend: NAME (...)``, then, indented, JAX's versions (or how
        to install it) and :data:`ON_JAX`, torch's version (or how to install it) and
        :data:`ON_TORCH`.
    """
    chosen = environ.get("KERAS_BACKEND")
    where = f"KERAS_BACKEND={chosen}" if chosen else "KERAS_BACKEND is not set"
    lines = [f"Keras backend: {backend or 'unknown (Keras does not import)'} ({where})"]
    if versions.get("jax") and versions.get("jaxlib"):
        jax = f"jax {versions['jax']}, jaxlib {versions['jaxlib']}"
        if backend != "jax":
            jax += " (KERAS_BACKEND=jax trains on it; kmix demo --backend jax shows it)"
    else:
        jax = (
            'not installed (pip install ".[jax]" from the root of kmix\'s checkout, '
            "for KERAS_BACKEND=jax)"
        )
    if versions.get("torch"):
        torch = f"torch {versions['torch']}"
        if backend != "torch":
            torch += " (KERAS_BACKEND=torch trains on it; kmix demo --backend torch shows it)"
    else:
        torch = (
            'not installed (pip install ".[torch]" from the root of kmix\'s checkout, '
            "for KERAS_BACKEND=torch)"
        )
    return lines + [
        f"  JAX: {jax}",
        f"  kmix on JAX: {ON_JAX}",
        f"  torch: {torch}",
        f"  kmix on torch: {ON_TORCH}",
    ]


def run_doctor(args: argparse.Namespace, measure: Callable[[], Any] | None = None) -> int:
    """Runs ``kmix doctor``: versions, hardware, the policy "auto" picks, speed, warnings.

    Args:
        args: the parsed arguments (``kmix doctor`` takes none).
        measure: returns a ``kmix.policy.speed.SpeedMeasurement``; ``None`` runs
            ``kmix.policy.timing.measure()`` (about a second; tests pass a hand-made one).

    Returns:
        The exit status: 0, or 1 when the hardware cannot be detected (a broken
        TensorFlow install; the reason is printed to stderr).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from kmix.policy import AUTO_IS_NOT_MEASURED, choose_auto, float16_slow_reason, hardware
    from kmix.policy import measure as measure_here

    versions = package_versions()
    print("versions")
    width = max(map(len, versions))
    for name, version in versions.items():
        print(f"  {name:<{width}}  {version or 'not installed'}")
    try:
        detected = hardware()
    except Exception as error:  # a broken TensorFlow or JAX install: say so, do not crash
        print(f"kmix doctor: could not detect the hardware: {error}", file=sys.stderr)
        return 1
    print("hardware")
    print("\n".join(f"  {line}" for line in str(detected).splitlines()))
    name, reason = choose_auto(detected)
    print(f'kmix.use("auto") would choose {name}: {reason} ({AUTO_IS_NOT_MEASURED})')
    measured = (measure or measure_here)()
    print("\n".join(speed_section(detected, measured)))
    slow = float16_slow_reason(detected, measured)
    if slow:
        print(f"float16 here: {slow}")
    backend = None
    if versions["keras"]:
        try:
            import keras

            backend = keras.backend.backend()
        except Exception as error:
            print(f"warning: Keras does not import: {error}")
    print("\n".join(backend_section(backend, os.environ, versions)))
    try:
        requires = importlib.metadata.requires("tensorflow") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    problems = version_warnings(versions, os.environ, requires, backend)
    for problem in problems:
        print(f"warning: {problem}")
    if not problems:
        print("no known problems with these versions")
    return 0
