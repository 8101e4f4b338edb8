"""What kmix detects about this machine: accelerators and the CPU flags that matter.

``kmix.hardware()`` returns a small, printable, JSON-serialisable :class:`Hardware`
value. Detection asks TensorFlow for its physical devices and reads the CPU flags
from ``/proc/cpuinfo`` on Linux; it uses no network and starts no subprocess.

Example:
    >>> import json, kmix
    >>> hw = kmix.hardware()                      # doctest: +SKIP
    >>> print(hw)                                 # doctest: +SKIP
    >>> json.dumps(hw.to_dict())                  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Where the CPU flags are read from; tests pass another file to ``hardware()``.
CPUINFO_PATH = "/proc/cpuinfo"

# The CPU flags (as Linux spells them) that decide how fast half precision runs.
CPU_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "f16c")


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU as TensorFlow reports it.

    Attributes:
        device: TensorFlow's device name, e.g. ``"/physical_device:GPU:0"``.
        name: the product name, e.g. ``"NVIDIA A100-SXM4-40GB"``; ``""`` if unknown.
        compute_capability: CUDA compute capability as ``(major, minor)``, or
            ``None`` when the device reports none (e.g. a non-CUDA GPU).
    """

    device: str
    name: str = ""
    compute_capability: tuple[int, int] | None = None

    def __str__(self) -> str:
        cc = self.compute_capability
        capability = "unknown" if cc is None else f"{cc[0]}.{cc[1]}"
        return f"{self.device} {self.name or '?'} (compute capability {capability})"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What kmix detected: devices, GPUs, TPUs and the CPU flags that matter.

    Attributes:
        devices: every physical device TensorFlow sees, e.g.
            ``("/physical_device:CPU:0",)``.
        gpus: one :class:`GPU` per GPU.
        tpus: the TPU device names.
        cpu_model: the CPU's model name from ``/proc/cpuinfo``; ``""`` if unknown.
        cpu_flags: those of :data:`CPU_FLAGS` the CPU has, sorted.
    """

    devices: tuple[str, ...] = ()
    gpus: tuple[GPU, ...] = ()
    tpus: tuple[str, ...] = ()
    cpu_model: str = ""
    cpu_flags: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Returns the value as plain dicts, lists and strings, ready for JSON."""
        return json_ready(dataclasses.asdict(self))

    def __str__(self) -> str:
        return "\n".join(
            [
                f"devices: {', '.join(self.devices) or 'none'}",
                f"GPUs: {'; '.join(map(str, self.gpus)) or 'none'}",
                f"TPUs: {', '.join(self.tpus) or 'none'}",
                f"CPU: {self.cpu_model or 'unknown'}",
                f"CPU flags: {', '.join(self.cpu_flags) or 'none that matter'}",
            ]
        )


def hardware(cpuinfo_path: str = CPUINFO_PATH) -> Hardware:
    """Detects the accelerators and CPU features that decide mixed-precision speed.

    Args:
        cpuinfo_path: the file to read the CPU model and flags from, in the format
            of Linux's ``/proc/cpuinfo``. A missing or unreadable file means no
            flags are known (as on macOS or Windows).

    Returns:
        A :class:`Hardware` value; ``str()`` prints it, ``to_dict()`` is JSON-ready.

    Example:
        >>> import kmix
        >>> kmix.hardware().gpus                  # doctest: +SKIP
        (GPU(device='/physical_device:GPU:0', name='NVIDIA A100-SXM4-40GB',
             compute_capability=(8, 0)),)
    """
    try:
        import tensorflow as tf
    except ImportError:  # another Keras backend: only the CPU is known
        tf, devices = None, []
    else:
        devices = tf.config.list_physical_devices()
    gpus = tuple(_describe_gpu(tf, device) for device in devices if device.device_type == "GPU")
    cpu_model, cpu_flags = read_cpuinfo(cpuinfo_path)
    return Hardware(
        devices=tuple(device.name for device in devices),
        gpus=gpus,
        tpus=tuple(device.name for device in devices if device.device_type == "TPU"),
        cpu_model=cpu_model,
        cpu_flags=cpu_flags,
    )


def read_cpuinfo(path: str = CPUINFO_PATH) -> tuple[str, tuple[str, ...]]:
    """Reads the CPU model name and the flags of :data:`CPU_FLAGS` it has.

    Args:
        path: a file in the format of Linux's ``/proc/cpuinfo``.

    Returns:
        ``(model_name, flags)``: ``""`` and ``()`` when the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
    except OSError:
        return "", ()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:  # the first processor's entry is enough: all cores are alike
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return fields.get("model name", ""), tuple(sorted(flags.intersection(CPU_FLAGS)))


def json_ready(value: Any) -> Any:
    """Turns tuples into lists, recursively, so ``json`` round-trips the value."""
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    return value


def _describe_gpu(tf: Any, device: Any) -> GPU:
    try:
        details = tf.config.experimental.get_device_details(device)
    except Exception:  # some platforms cannot describe their devices
        details = {}
    capability = details.get("compute_capability")
    return GPU(
        device=device.name,
        name=details.get("device_name", ""),
        compute_capability=None if capability is None else tuple(capability),
    )
