"""Float8 under MirroredStrategy (TensorFlow only): Keras keeps each replica's float8 scales
apart, and kmix checks and rescales every replica's own copy. The script trains in a
subprocess (logical devices are set before TensorFlow starts) and replays every replica's
variables in NumPy (tests/scripts/mirrored_float8.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "mirrored_float8.py")


def test_saturations_on_any_replica_are_reported_at_their_step_through_growths_and_a_skip():
    """A spike on replica 1 alone is seen; loss-scale growths every 2 steps rescale each
    replica's own output-gradient state, and a skip gives each replica's own batch
    normalization statistics back (not the first replica's copied to all)."""
    result = subprocess.run(
        [sys.executable, SCRIPT, "2"],  # the loss scale grows every 2 applied steps
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "KERAS_BACKEND": "tensorflow"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["kmix"] == got["replay"] and len(got["replay"]) >= 5
    # the spike is in replica 1's share: its own amax against its own limit (replica 0's
    # limit is the same at that step, its amax far lower)
    assert got["spike_kmix"] == got["spike_replay"]
    assert got["spike_replay"][0] > 10 * got["spike_replay"][1]
    # Keras's, as said: each replica's copies its own, the first replica's read
    assert got["replicas_differ"] and got["read_is_first_replica"]
    assert got["outputs_grad_differ"]  # rescaled per replica, not made equal
    assert len(got["said"]) == 1 and "2 replicas" in got["said"][0]
    assert got["skipped"] == 1 and got["changes"] == 4  # 3 growths, 1 backoff
    # the skip gives each replica's batch-normalization statistics its own value back
    assert got["skips_give_back"] == [True] and got["norms_differ"]
    # the kernels' underflow: each model's own (not the first one read), as NumPy has it
    (read, replay), (other_read, other_replay) = got["kernel_underflow"]
    assert read.keys() == replay.keys() == {"sequential/hidden", "sequential/out"}
    assert other_read.keys() == other_replay.keys() == {"other/hidden", "other/out"}
    for got_read, want in [(read, replay), (other_read, other_replay)]:
        for path, share in want.items():
            assert got_read[path] == pytest.approx(share, rel=2**-23, abs=0)
    assert other_replay["other/hidden"] >= 0.25 > replay["sequential/hidden"]
