"""What kmix detects about this machine: accelerators and the CPU flags that matter.

``kmix.hardware()`` returns a small, printable, JSON-serialisable :class:`Hardware`
value. Detection asks the Keras backend's own library for its devices (JAX:
``jax.local_devices()``; torch: ``torch.cuda``'s devices, with their names and compute
capabilities; on both TensorFlow is never imported; otherwise TensorFlow's physical
devices) and reads the CPU flags from ``/proc/cpuinfo`` on Linux; it uses no network and
starts no subprocess.

Example:
    >>> import json, kmix
    >>> hw = kmix.hardware()                      # doctest: +SKIP
    >>> print(hw)                                 # doctest: +SKIP
    >>> json.dumps(hw.to_dict())                  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from kmix._json import json_ready

# Where the CPU flags are read from; tests pass another file to ``hardware()``.
CPUINFO_PATH = "/proc/cpuinfo"

# The CPU flags (as Linux spells them) that decide how fast half precision runs.
CPU_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "f16c")


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU as the Keras backend's library reports it.

    Attributes:
        device: the device's name: TensorFlow's, e.g. ``"/physical_device:GPU:0"``,
            JAX's platform and id, e.g. ``"gpu:0"``, or torch's, e.g. ``"cuda:0"``.
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
            ``("/physical_device:CPU:0",)``; on Keras's JAX backend every local device
            JAX sees, its CPU included, e.g. ``("cpu:0", "gpu:0")``; on Keras's torch
            backend torch's CPU and CUDA devices, e.g. ``("cpu", "cuda:0")``.
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
    cpu_model, cpu_flags = read_cpuinfo(cpuinfo_path)
    backend = keras_backend()
    if backend in ("jax", "torch"):
        if backend == "jax":
            import jax

            devices = jax_devices(_local_jax_devices(jax))
        else:
            import torch

            devices = torch_devices(torch.cuda)
        return dataclasses.replace(devices, cpu_model=cpu_model, cpu_flags=cpu_flags)
    try:
        import tensorflow as tf
    except ImportError:  # another Keras backend: only the CPU is known
        tf, devices = None, []
    else:
        devices = tf.config.list_physical_devices()
    gpus = tuple(_describe_gpu(tf, device) for device in devices if device.device_type == "GPU")
    return Hardware(
        devices=tuple(device.name for device in devices),
        gpus=gpus,
        tpus=tuple(device.name for device in devices if device.device_type == "TPU"),
        cpu_model=cpu_model,
        cpu_flags=cpu_flags,
    )


def keras_backend() -> str | None:
    """The active Keras backend's name, e.g. ``"jax"``; None when Keras does not import.

    Importing Keras imports its backend's library (TensorFlow by default), so this is
    asked only where that library is needed anyway.
    """
    try:
        import keras

        return keras.backend.backend()
    except Exception:  # no Keras, or a broken install: the caller falls back to TensorFlow
        return None


def jax_devices(devices: Sequence[Any]) -> Hardware:
    """The devices, GPUs and TPUs of a :class:`Hardware` from JAX's device objects.

    Rule: a device's name is ``"{platform}:{id}"``; platform ``"gpu"`` is a :class:`GPU`
    named by ``device_kind``, its capability from ``compute_capability`` when present
    (:func:`parse_compute_capability`); platform ``"tpu"`` is a TPU; ``"cpu"`` neither.

    Args:
        devices: objects with JAX's device attributes ``platform``, ``id`` and
            ``device_kind`` (and, on CUDA GPUs, ``compute_capability``), e.g.
            ``jax.local_devices()``.

    Returns:
        A :class:`Hardware` with ``devices``, ``gpus`` and ``tpus`` set, the CPU fields
        empty.

    Example:
        >>> from types import SimpleNamespace as Device
        >>> gpu = Device(platform="gpu", id=0, device_kind="NVIDIA H200", compute_capability="9.0")
        >>> jax_devices([gpu]).gpus
        (GPU(device='gpu:0', name='NVIDIA H200', compute_capability=(9, 0)),)
    """
    names = tuple(f"{device.platform}:{device.id}" for device in devices)
    gpus = tuple(
        GPU(
            device=name,
            name=str(getattr(device, "device_kind", "") or ""),
            compute_capability=parse_compute_capability(
                getattr(device, "compute_capability", None)
            ),
        )
        for name, device in zip(names, devices, strict=True)
        if device.platform == "gpu"
    )
    tpus = tuple(
        name for name, device in zip(names, devices, strict=True) if device.platform == "tpu"
    )
    return Hardware(devices=names, gpus=gpus, tpus=tpus)


def torch_devices(cuda: Any) -> Hardware:
    """The devices and GPUs of a :class:`Hardware` from torch's CUDA module.

    Rule: the CPU is ``"cpu"``; when ``cuda.is_available()``, each of
    ``cuda.device_count()`` devices is ``"cuda:{i}"``, a :class:`GPU` named by
    ``cuda.get_device_name(i)`` with capability ``cuda.get_device_capability(i)``
    (:func:`parse_compute_capability`; ROCm builds of torch answer through ``torch.cuda``
    too). torch has no TPUs of its own (torch_xla's are not looked for).

    Args:
        cuda: ``torch.cuda``, or an object with its ``is_available``, ``device_count``,
            ``get_device_name`` and ``get_device_capability``.

    Returns:
        A :class:`Hardware` with ``devices`` and ``gpus`` set, the CPU fields empty.

    Example:
        >>> from types import SimpleNamespace as Cuda
        >>> cuda = Cuda(is_available=lambda: True, device_count=lambda: 1,
        ...             get_device_name=lambda i: "NVIDIA H200",
        ...             get_device_capability=lambda i: (9, 0))
        >>> torch_devices(cuda).gpus
        (GPU(device='cuda:0', name='NVIDIA H200', compute_capability=(9, 0)),)
    """
    count = cuda.device_count() if cuda.is_available() else 0
    gpus = tuple(
        GPU(
            device=f"cuda:{index}",
            name=str(cuda.get_device_name(index) or ""),
            compute_capability=parse_compute_capability(cuda.get_device_capability(index)),
        )
        for index in range(count)
    )
    return Hardware(devices=("cpu", *(gpu.device for gpu in gpus)), gpus=gpus)


_CAPABILITY = re.compile(r"\s*(\d+)\.(\d+)\s*")


def parse_compute_capability(value: Any) -> tuple[int, int] | None:
    """A CUDA compute capability as ``(major, minor)``, from JAX's string or a pair.

    Args:
        value: e.g. ``"9.0"`` (JAX's ``device.compute_capability``), ``(8, 6)``, or None.

    Returns:
        ``(major, minor)``, or None when ``value`` is None or names no CUDA capability
        (e.g. a ROCm GPU's ``"gfx90a"``).

    Example:
        >>> parse_compute_capability("8.6"), parse_compute_capability("gfx90a")
        ((8, 6), None)
    """
    if isinstance(value, tuple | list) and len(value) == 2:
        try:
            return int(value[0]), int(value[1])
        except (TypeError, ValueError):
            return None
    match = _CAPABILITY.fullmatch(value) if isinstance(value, str) else None
    return None if match is None else (int(match[1]), int(match[2]))


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


def _local_jax_devices(jax: Any) -> list[Any]:
    """This process's JAX devices: the CPU first, then the default backend's if not the CPU."""
    try:
        cpus = jax.local_devices(backend="cpu")
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
        cpus = []
    return cpus + [device for device in jax.local_devices() if device.platform != "cpu"]


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
