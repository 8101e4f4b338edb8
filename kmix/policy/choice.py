"""Pick and set Keras's global dtype policy in one line, and say why.

Example:
    >>> import kmix
    >>> choice = kmix.use("auto")                 # doctest: +SKIP
    >>> print(choice)                             # doctest: +SKIP
    mixed_bfloat16: no GPU or TPU; the CPU has AVX512-BF16, ...
    >>> with kmix.policy_scope("float32"):        # doctest: +SKIP
    ...     head = keras.layers.Dense(10, activation="softmax")

How ``"auto"`` decides (:func:`choose_auto`, a pure function of the hardware):

    TPU                                   -> mixed_bfloat16
    GPU, compute capability >= 8.0        -> mixed_bfloat16
    GPU, compute capability 7.x           -> mixed_float16
    GPU, older or unknown capability      -> float32
    no accelerator, CPU with AMX-BF16
        or AVX512-BF16                    -> mixed_bfloat16
    otherwise                             -> float32

This is a choice from the hardware, not a measurement: ``kmix compare`` times each
policy on your model and settles it. With several GPUs the one with the lowest
capability decides, since training uses all of them. On compute capability 8.0 and
later, bfloat16 tensor cores are as fast as float16 ones, and bfloat16 has float32's
exponent range: gradients neither overflow nor underflow, so no loss scaling is
needed. kmix therefore prefers it there; ``kmix.use("mixed_float16")`` remains a fine
explicit choice on those GPUs.

Without a GPU or TPU, what ``kmix.use("mixed_float16")`` says of float16's speed is
measured: a matmul and a convolution, each forward and backward as training runs them,
timed in float16 and float32 on the CPU once per process, with the kernels the Keras
backend runs (TensorFlow's, or on JAX XLA's, without importing
TensorFlow; ``kmix/policy/timing.py``, judged by ``kmix/policy/speed.py``); it warns with the
measured ratio when float16 is slower beyond the noise and by 1.2x or more, states the
ratio in the choice's reason otherwise, and claims nothing it did not measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kmix._checks import SpeedWarning, WarnOnce
from kmix.policy.machine import GPU, Hardware, hardware

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from kmix.policy.speed import SpeedMeasurement

# The names ``use`` and ``policy_scope`` accept; all but "auto" are Keras's own.
POLICY_NAMES = (
    "auto",
    "mixed_float16",
    "mixed_bfloat16",
    "float32",
    "float16",
    "bfloat16",
    "float64",
)

AUTO_IS_NOT_MEASURED = (
    "chosen from the hardware, not measured: kmix compare times each policy on your model"
)
"""What ``kmix.use("auto")`` adds to its reason: where a measurement would settle it."""

_said = WarnOnce()
"""Situations already warned about in this process, by (policy, suggested policy)."""


@dataclasses.dataclass(frozen=True)
class PolicyChoice:
    """The dtype policy ``kmix.use`` set, and why.

    Attributes:
        name: the Keras policy name that was set, e.g. ``"mixed_float16"``.
        reason: the fact that decided it, in words.
        hardware: what kmix detected when choosing.
    """

    name: str
    reason: str
    hardware: Hardware

    def to_dict(self) -> dict[str, Any]:
        """Returns the choice as plain dicts, lists and strings, ready for JSON."""
        return {
            "name": self.name,
            "reason": self.reason,
            "hardware": self.hardware.to_dict(),
        }

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


def use(
    policy: str = "auto",
    *,
    detected: Hardware | None = None,
    measured: SpeedMeasurement | None = None,
) -> PolicyChoice:
    """Sets Keras's global dtype policy and returns what was chosen and why.

    Layers created afterwards compute in the policy's compute dtype and keep their
    variables in its variable dtype.

    Args:
        policy: ``"auto"`` to choose from the hardware (see the module docstring),
            or one of Keras's names: ``"mixed_float16"``, ``"mixed_bfloat16"``,
            ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``.
        detected: the hardware to decide for; ``None`` detects it with
            ``kmix.hardware()``.
        measured: float16's and float32's speed on this CPU, judged when ``policy``
            computes in float16 and ``detected`` has no GPU or TPU; ``None`` times a
            matmul and a convolution, forward and backward, in float16 and float32 on
            the CPU with the Keras backend's kernels (once per process: a fraction of a
            second where float16 is not pathological, seconds where it is; ``kmix
            doctor`` times bfloat16 too).

    Returns:
        A :class:`PolicyChoice` with the policy name, the reason and the hardware.
        ``"auto"``'s reason ends with :data:`AUTO_IS_NOT_MEASURED`; an explicit float16
        policy's reason says what was measured on a machine without a GPU or TPU.

    Raises:
        ValueError: if ``policy`` is not one of :data:`POLICY_NAMES`.

    Warns:
        UserWarning: once per process, when the policy computes in float16 where float16
            is not fast: a TPU, a GPU below compute capability 7.0, or a CPU where float16
            measured slower than float32 beyond the noise and by 1.2x or more (the message
            gives the measured ratio; below that the reason states it, and nothing is
            claimed). The message says what to use instead.

    Example:
        >>> import kmix
        >>> kmix.use("mixed_float16").name        # doctest: +SKIP
        'mixed_float16'
    """
    import keras

    _check_policy_name(policy)
    detected = hardware() if detected is None else detected
    auto_name, auto_reason = choose_auto(detected)
    if policy == "auto":
        name, reason = auto_name, f"{auto_reason} ({AUTO_IS_NOT_MEASURED})"
    else:
        name, reason = policy, f"{policy!r} was requested explicitly"
        if policy in ("mixed_float16", "float16"):
            if measured is None and not detected.gpus and not detected.tpus:
                from kmix.policy.timing import float16_probe

                measured = float16_probe()
            slow = float16_slow_reason(detected, measured)
            if slow:
                reason += f"; float16 is not fast here: {slow}"
                _warn_once(policy, auto_name, slow, auto_reason)
            elif measured is not None and not detected.gpus and not detected.tpus:
                reason += f"; {_cpu_float16_sentence(measured)}"
    keras.config.set_dtype_policy(name)
    return PolicyChoice(name=name, reason=reason, hardware=detected)


@contextlib.contextmanager
def policy_scope(policy: str, *, detected: Hardware | None = None) -> Iterator[PolicyChoice]:
    """Sets the global dtype policy inside a ``with`` block, then restores it.

    Layers created inside the block use ``policy``; typically ``"float32"`` for a
    numerically sensitive block such as a softmax head. The previous global policy
    comes back on exit, also when the block raises.

    Args:
        policy: any name :func:`use` accepts.
        detected: as for :func:`use`.

    Yields:
        The :class:`PolicyChoice` in effect inside the block.

    Raises:
        ValueError: if ``policy`` is not one of :data:`POLICY_NAMES`.

    Example:
        >>> import keras, kmix
        >>> with kmix.policy_scope("float32"):
        ...     head = keras.layers.Dense(10, activation="softmax")
        >>> head.compute_dtype
        'float32'
    """
    import keras

    _check_policy_name(policy)
    previous = keras.config.dtype_policy()
    try:
        yield use(policy, detected=detected)
    finally:
        keras.config.set_dtype_policy(previous)


def choose_auto(detected: Hardware) -> tuple[str, str]:
    """Chooses the policy ``"auto"`` means on the given hardware.

    Args:
        detected: the hardware, e.g. from ``kmix.hardware()`` or built by hand.

    Returns:
        ``(policy_name, reason)``; the reason names the fact that decided it.

    Example:
        >>> from kmix.policy.machine import GPU, Hardware
        >>> choose_auto(Hardware(gpus=(GPU("GPU:0", "V100", (7, 0)),)))[0]
        'mixed_float16'
    """
    if detected.tpus:
        return "mixed_bfloat16", f"TPU {detected.tpus[0]} computes bfloat16 natively"
    gpu = _weakest_gpu(detected)
    if gpu is not None:
        cc = gpu.compute_capability
        label = f"GPU {gpu.name or gpu.device}"
        if cc is None:
            return "float32", (
                f"{label} reports no compute capability, so its half-precision "
                "speed is unknown; pass a policy name to kmix.use to choose"
            )
        label += f" has compute capability {cc[0]}.{cc[1]}"
        if cc >= (8, 0):
            return "mixed_bfloat16", (
                f"{label} (8.0 or newer): bfloat16 tensor cores are as fast as "
                "float16 ones, and bfloat16 has float32's range, so it needs no "
                "loss scaling"
            )
        if cc >= (7, 0):
            return "mixed_float16", (
                f"{label}: float16 tensor cores start at 7.0, bfloat16 ones at 8.0"
            )
        return "float32", (
            f"{label}: tensor cores start at 7.0, so mixed precision would not "
            "be faster than float32"
        )
    for flag, label in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")):
        if flag in detected.cpu_flags:
            return "mixed_bfloat16", (
                f"no GPU or TPU; the CPU has {label}, which computes bfloat16 natively"
            )
    return "float32", (
        "no GPU or TPU, and the CPU has neither AMX-BF16 nor AVX512-BF16, "
        "so it computes no bfloat16 natively"
    )


def float16_slow_reason(detected: Hardware, measured: SpeedMeasurement | None = None) -> str | None:
    """Says why float16 is not fast on the given hardware, or ``None`` if it is.

    float16 is fast on GPUs with compute capability 7.0 or newer. A GPU that
    reports no capability gets the benefit of the doubt. Without a GPU or TPU only a
    measurement speaks: float16 is called slow when it measured slower than float32
    beyond the noise, with the measured ratio.

    Args:
        detected: the hardware, e.g. from ``kmix.hardware()``.
        measured: float16's and float32's speed on this CPU (see
            ``kmix.policy.timing.measure``), used when there is no GPU or TPU.

    Returns:
        A short reason, or ``None`` when float16 is fast, not measurably slower, or
        its speed is unknown (no GPU or TPU, and nothing measured).
    """
    if detected.tpus:
        return "TPUs compute in bfloat16; float16 is not native to them"
    gpu = _weakest_gpu(detected)
    if gpu is None:
        if measured is None:
            return None
        from kmix.policy.speed import float16_cpu_finding

        sentence, slower = float16_cpu_finding(measured)
        return sentence if slower else None
    cc = gpu.compute_capability
    if cc is not None and cc < (7, 0):
        return (
            f"GPU {gpu.name or gpu.device} has compute capability {cc[0]}.{cc[1]}, "
            "and float16 tensor cores start at 7.0"
        )
    return None


def _cpu_float16_sentence(measured: SpeedMeasurement) -> str:
    """What was measured of float16 on this CPU, when it was not measurably slower."""
    from kmix.policy.speed import float16_cpu_finding

    return float16_cpu_finding(measured)[0]


def _weakest_gpu(detected: Hardware) -> GPU | None:
    """The GPU with the lowest compute capability (unknown counts lowest)."""
    if not detected.gpus:
        return None
    return min(detected.gpus, key=lambda gpu: gpu.compute_capability or (-1, -1))


def _check_policy_name(policy: Any) -> None:
    if not isinstance(policy, str) or policy not in POLICY_NAMES:
        raise ValueError(
            f"Invalid policy: {policy!r}. Expected one of "
            f"{', '.join(map(repr, POLICY_NAMES))}. Use 'auto' to let kmix choose "
            "from the hardware, or a Keras name such as 'mixed_float16'."
        )


def _warn_once(policy: str, instead: str, slow: str, instead_reason: str) -> None:
    _said(
        f"kmix.use({policy!r}): float16 is not fast on this machine: {slow}. "
        f"Use kmix.use({instead!r}) instead ({instead_reason}); kmix doctor times "
        "matmul and convolution in each dtype here, kmix compare each policy on your model.",
        SpeedWarning,
        key=(policy, instead),
    )


def _reset_warnings() -> None:
    """Forgets which situations were warned about (for tests)."""
    _said.clear()
