"""``kmix compare`` on Keras's torch backend: the same comparison, as on JAX.

From arrays its input is :class:`kmix.compare.batches.ArrayBatches` where the backend is
not TensorFlow, so a comparison on torch imports no TensorFlow. The slow test runs ``kmix
compare`` in a fresh process with ``KERAS_BACKEND=torch``, the memory processes included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_compare import user_module

from kmix.compare.values import comparison_from_dict

__all__ = ["user_module"]  # a fixture, used by name

RUN = (
    "import json, sys\n"
    "from kmix.cli import commands as cli\n"
    "status = cli.main(sys.argv[1:])\n"
    "import keras\n"
    "print(json.dumps({'status': status, 'backend': keras.backend.backend(),\n"
    "    'tensorflow': 'tensorflow' in sys.modules}), file=sys.stderr)\n"
)


@pytest.mark.slow  # three small models side by side, then two memory processes, on torch
def test_compare_on_torch_measures_each_policy_without_tensorflow(user_module):
    pytest.importorskip("torch")
    argv = ["compare", "cmpmodels:tiny", "--data", "cmpmodels:data", "--steps", "13"]
    argv += ["--rounds", "2", "--policies", "float32,mixed_float16", "--logdir", "cmp", "--json"]
    env = {**os.environ, "KERAS_BACKEND": "torch", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(user_module), *sys.path[1:]])
    done = subprocess.run(
        [sys.executable, "-c", RUN, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=user_module,
        timeout=600,
        check=False,
    )
    facts = json.loads(done.stderr.strip().splitlines()[-1])
    assert facts["status"] == 0, done.stderr[-3000:]
    assert facts["backend"] == "torch"
    assert facts["tensorflow"] is False  # the arrays are batched without tf.data
    got = comparison_from_dict(json.loads(done.stdout))
    float32, float16 = got.row("float32"), got.row("mixed_float16")
    for r in got.rows:
        assert r.steps == 13 and len(r.loss_curve) == 13
        assert r.step_time_s > 0
        assert r.weights_bytes == (6 * 8 + 8 + 8 * 2 + 2) * 4
        assert r.peak_memory_bytes is not None, r.memory_note  # its process ran on torch too
    assert float16.min_headroom_bits is not None and float16.tightest_layer
    assert float32.min_headroom_bits is None
    assert got.recommendation.policy in ("float32", "mixed_float16")
    assert os.path.isdir(user_module / "cmp" / "mixed_float16" / "train")
