"""Tests for kmix.hardware: CPU flags from a fake cpuinfo, GPUs from a fake TF."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import kmix
from kmix import hardware as hardware_module
from kmix.policy import choose_auto
from kmix.policy.machine import (
    GPU,
    Hardware,
    hardware,
    jax_devices,
    parse_compute_capability,
    read_cpuinfo,
    torch_devices,
)

CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx f16c avx512f avx512_bf16 amx_bf16 amx_tile avx512_vnni

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx f16c avx512f avx512_bf16 amx_bf16 amx_tile avx512_vnni
"""


@pytest.fixture
def cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    return str(path)


def test_read_cpuinfo_keeps_only_the_flags_that_matter(cpuinfo):
    assert read_cpuinfo(cpuinfo) == (
        "Intel(R) Xeon(R) Platinum 8480+",
        ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "f16c"),
    )


def test_read_cpuinfo_of_a_plain_cpu(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor : 0\nmodel name : Old CPU\nflags : fpu sse2 avx\n")
    assert read_cpuinfo(str(path)) == ("Old CPU", ())


def test_read_cpuinfo_without_the_file(tmp_path):
    assert read_cpuinfo(str(tmp_path / "missing")) == ("", ())


def test_hardware_reads_the_given_cpuinfo_and_tensorflow_devices(cpuinfo):
    hw = hardware(cpuinfo)
    devices = tf.config.list_physical_devices()
    assert hw.devices == tuple(device.name for device in devices)
    assert "/physical_device:CPU:0" in hw.devices
    assert [gpu.device for gpu in hw.gpus] == [
        device.name for device in devices if device.device_type == "GPU"
    ]
    assert hw.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert hw.cpu_flags == ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "f16c")


def test_hardware_describes_gpus(monkeypatch, cpuinfo):
    devices = [
        tf.config.PhysicalDevice("/physical_device:CPU:0", "CPU"),
        tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU"),
        tf.config.PhysicalDevice("/physical_device:GPU:1", "GPU"),
    ]

    def details(device):
        if device.name.endswith("1"):
            raise RuntimeError("cannot describe this device")
        return {"compute_capability": (8, 0), "device_name": "NVIDIA A100"}

    monkeypatch.setattr(tf.config, "list_physical_devices", lambda: devices)
    monkeypatch.setattr(tf.config.experimental, "get_device_details", details)
    assert hardware(cpuinfo).gpus == (
        GPU("/physical_device:GPU:0", "NVIDIA A100", (8, 0)),
        GPU("/physical_device:GPU:1", "", None),
    )


def test_hardware_describes_tpus(monkeypatch, cpuinfo):
    devices = [tf.config.PhysicalDevice("/physical_device:TPU:0", "TPU")]
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda: devices)
    hw = hardware(cpuinfo)
    assert (hw.devices, hw.gpus, hw.tpus) == (
        ("/physical_device:TPU:0",),
        (),
        ("/physical_device:TPU:0",),
    )


def test_hardware_starts_no_subprocess(monkeypatch, cpuinfo):
    def refuse(*args, **kwargs):
        raise AssertionError("kmix.hardware must not start a subprocess")

    expected = hardware(cpuinfo)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    assert hardware(cpuinfo) == expected


FAKE = Hardware(
    devices=("/physical_device:CPU:0", "/physical_device:GPU:0"),
    gpus=(GPU("/physical_device:GPU:0", "NVIDIA A100", (8, 0)),),
    cpu_model="Xeon",
    cpu_flags=("avx512f", "f16c"),
)


def test_to_dict_is_json_ready():
    expected = {
        "devices": ["/physical_device:CPU:0", "/physical_device:GPU:0"],
        "gpus": [
            {
                "device": "/physical_device:GPU:0",
                "name": "NVIDIA A100",
                "compute_capability": [8, 0],
            }
        ],
        "tpus": [],
        "cpu_model": "Xeon",
        "cpu_flags": ["avx512f", "f16c"],
    }
    assert FAKE.to_dict() == expected
    assert json.loads(json.dumps(FAKE.to_dict())) == expected


def test_str_is_readable():
    assert str(FAKE) == (
        "devices: /physical_device:CPU:0, /physical_device:GPU:0\n"
        "GPUs: /physical_device:GPU:0 NVIDIA A100 (compute capability 8.0)\n"
        "TPUs: none\n"
        "CPU: Xeon\n"
        "CPU flags: avx512f, f16c"
    )
    assert str(Hardware()) == (
        "devices: none\nGPUs: none\nTPUs: none\nCPU: unknown\nCPU flags: none that matter"
    )
    assert str(GPU("GPU:0")) == "GPU:0 ? (compute capability unknown)"


def test_public_names(cpuinfo):
    # `import kmix.hardware` binds the module to kmix.hardware; calling it works.
    assert kmix.hardware(cpuinfo) == hardware(cpuinfo)
    assert hardware_module(cpuinfo) == hardware(cpuinfo)
    assert kmix.Hardware is Hardware


def test_read_cpuinfo_keeps_the_float16_flags_that_decide_onednn_s_path(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("model name\t: Xeon\nflags\t\t: avx512f avx512_fp16 amx_fp16 amx_bf16 sse2\n")
    assert read_cpuinfo(str(path)) == (
        "Xeon",
        ("amx_bf16", "amx_fp16", "avx512_fp16", "avx512f"),
    )


# ------------------------------------------------------------- Keras's JAX backend (issue 24)
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("9.0", (9, 0)),  # JAX's device.compute_capability on CUDA
        ("8.6", (8, 6)),
        (" 7.5 ", (7, 5)),
        ("10.0", (10, 0)),
        ((8, 0), (8, 0)),  # TensorFlow's pair
        ([8, 6], (8, 6)),
        (None, None),
        ("gfx90a", None),  # a ROCm GPU names no CUDA capability
        ("9", None),
        ("", None),
        (("a", "b"), None),
        ((9, 0, 1), None),
        (9.0, None),
    ],
)
def test_parse_compute_capability(value, expected):
    assert parse_compute_capability(value) == expected


def test_jax_devices_map_platforms_to_the_same_fields():
    from types import SimpleNamespace as Device

    devices = [
        Device(platform="cpu", id=0, device_kind="cpu"),
        Device(platform="gpu", id=0, device_kind="NVIDIA H200", compute_capability="9.0"),
        Device(platform="gpu", id=1, device_kind="AMD Instinct MI250X"),  # no capability
        Device(platform="gpu", id=2, device_kind="", compute_capability="7.0"),
        Device(platform="tpu", id=3, device_kind="TPU v4"),
    ]
    assert jax_devices(devices) == Hardware(
        devices=("cpu:0", "gpu:0", "gpu:1", "gpu:2", "tpu:3"),
        gpus=(
            GPU("gpu:0", "NVIDIA H200", (9, 0)),
            GPU("gpu:1", "AMD Instinct MI250X", None),
            GPU("gpu:2", "", (7, 0)),
        ),
        tpus=("tpu:3",),
    )
    assert jax_devices([]) == Hardware()


def test_hardware_on_jax_lists_jax_s_devices_and_reads_the_cpuinfo(monkeypatch, cpuinfo):
    jax = pytest.importorskip("jax")
    monkeypatch.setattr(sys.modules["kmix.policy.machine"], "keras_backend", lambda: "jax")
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # importing it would raise
    hw = hardware(cpuinfo)
    assert hw.devices[0] == "cpu:0"
    assert hw.devices[1:] == tuple(
        f"{d.platform}:{d.id}" for d in jax.local_devices() if d.platform != "cpu"
    )
    assert hw.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert hw.cpu_flags == ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "f16c")


@pytest.mark.slow
def test_hardware_on_jax_imports_no_tensorflow():
    pytest.importorskip("jax")
    code = (
        "import json, sys, kmix\n"
        "hw = kmix.hardware()\n"
        "print(json.dumps({'tensorflow': 'tensorflow' in sys.modules, 'devices': hw.devices}))"
    )
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts == {"tensorflow": False, "devices": ["cpu:0"]}


# ------------------------------------------------------------ Keras's torch backend (issue 33)
def fake_cuda(*gpus: tuple[str, tuple[int, int]], available: bool = True):
    """A stand-in for ``torch.cuda`` with the given ``(name, capability)`` devices."""
    from types import SimpleNamespace

    return SimpleNamespace(
        is_available=lambda: available,
        device_count=lambda: len(gpus),
        get_device_name=lambda i: gpus[i][0],
        get_device_capability=lambda i: gpus[i][1],
    )


def test_torch_devices_list_the_cpu_and_cuda_s_devices():
    cuda = fake_cuda(("NVIDIA H200", (9, 0)), ("Tesla V100-SXM2-16GB", (7, 0)))
    assert torch_devices(cuda) == Hardware(
        devices=("cpu", "cuda:0", "cuda:1"),
        gpus=(GPU("cuda:0", "NVIDIA H200", (9, 0)), GPU("cuda:1", "Tesla V100-SXM2-16GB", (7, 0))),
    )
    # The rule of kmix.use("auto") applies to them as to TensorFlow's and JAX's: the lowest decides.
    assert choose_auto(torch_devices(cuda))[0] == "mixed_float16"
    # A CUDA build on a machine without a GPU answers device_count() 0 or raises: not asked.
    assert torch_devices(fake_cuda(("?", (9, 0)), available=False)) == Hardware(devices=("cpu",))
    assert torch_devices(fake_cuda()) == Hardware(devices=("cpu",))


def test_hardware_on_torch_lists_torch_s_devices_and_reads_the_cpuinfo(monkeypatch, cpuinfo):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(sys.modules["kmix.policy.machine"], "keras_backend", lambda: "torch")
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # importing it would raise
    hw = hardware(cpuinfo)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert hw.devices == ("cpu", *(f"cuda:{i}" for i in range(count)))
    assert hw.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert hw.cpu_flags == ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "f16c")


@pytest.mark.slow
def test_hardware_and_use_on_torch_import_no_tensorflow():
    """kmix.hardware() and kmix.use("mixed_float16") (its float16 probe: torch's kernels)."""
    pytest.importorskip("torch")
    code = (
        "import json, sys, warnings, kmix\n"
        "hw = kmix.hardware()\n"
        "warnings.simplefilter('ignore')\n"
        "choice = kmix.use('mixed_float16')\n"
        "print(json.dumps({'tensorflow': 'tensorflow' in sys.modules, 'devices': hw.devices,\n"
        "    'reason': choice.reason}))"
    )
    env = {**os.environ, "KERAS_BACKEND": "torch", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert (facts["tensorflow"], facts["devices"]) == (False, ["cpu"])
    assert "on this CPU a float16 " in facts["reason"]  # measured, with torch's kernels
