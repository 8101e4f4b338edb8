"""kmix.compare.comparison: a seeded model whose float16 forward pass overflows once.

What a user saw (issue 32): one skipped step made float16's loss curve NaN to the end
of the round, float16 was rejected as "loss not finite" without naming the layer, and
a ``build_model`` that seeds itself made float32's repeat identical, so its "spread" of
0.0 rejected any loss a little higher than float32's.
"""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from kmix.compare.comparison import _compare_to_float32
from kmix.compare.values import PolicyRow


def test_a_higher_loss_is_not_judged_without_a_spread_and_a_lower_one_is_fine():
    higher = _compare_to_float32(
        PolicyRow("mixed_bfloat16", final_loss=0.5015), None, 0.5, None, None
    )
    assert higher.loss_departure == pytest.approx(0.0015)
    assert higher.loss_ok is None  # not judged, not rejected
    lower = _compare_to_float32(
        PolicyRow("mixed_bfloat16", final_loss=0.4985), None, 0.5, None, None
    )
    assert lower.loss_ok is True  # a lower loss needs no spread
    judged = _compare_to_float32(PolicyRow("mixed_float16", final_loss=0.52), None, 0.5, 0.01, None)
    assert judged.loss_ok is False
    none = _compare_to_float32(PolicyRow("mixed_float16", final_loss=None), None, 0.5, None, None)
    assert none.loss_ok is False and none.loss_departure is None


@pytest.fixture
def seeded_module(tmp_path, monkeypatch):
    """``seededmodels``: a build function that seeds itself, data with one huge batch."""
    (tmp_path / "seededmodels.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def build():
                import keras
                keras.utils.set_random_seed(7)  # the user's seed: every call, the same weights
                model = keras.Sequential([
                    keras.Input((4,)),
                    keras.layers.Dense(16, name="wide"),
                    keras.layers.Softmax(name="pick"),
                    keras.layers.Dense(1, dtype="float32", name="head"),
                ])
                model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
                return model

            def data():
                rng = np.random.default_rng(0)
                x = rng.normal(size=(256, 4)).astype("float32")
                y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
                x[48:64] *= 1e5  # the 4th batch of 16: past float16's 65504
                return x, y
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("seededmodels", None)


@pytest.mark.slow  # three small models trained side by side
def test_one_forward_overflow_is_one_skipped_step_named_and_the_spread_is_measured(
    seeded_module,
):
    import seededmodels

    from kmix.compare.comparison import compare_policies

    got = compare_policies(
        seededmodels.build,
        seededmodels.data(),
        policies=("float32", "mixed_float16"),
        steps=13,  # warm-up 2, then rounds of 6 and 5: step 4 is inside round 1
        rounds=2,
        batch_size=16,
        measure_memory=False,
    )
    float32, float16 = got.row("float32"), got.row("mixed_float16")
    assert all(math.isfinite(v) for v in float32.loss_curve)
    # step 4's own loss is not finite (its batch overflows float16), and only step 4's
    assert [i for i, v in enumerate(float16.loss_curve) if not math.isfinite(v)] == [3]
    assert float16.final_loss == pytest.approx(float16.loss_curve[-1])
    assert float16.skipped_steps >= 1
    assert float16.overflow_layers == ("sequential/wide",)  # the layer path
    # the repeat's data in another order: a seeded build_model still has a spread
    assert got.loss_spread is not None and got.loss_spread > 0
    assert got.recommendation.policy == "float32"
    (why,) = [r for r in got.recommendation.reasons if r.startswith("mixed_float16")]
    assert "layer 'sequential/wide' overflows float16 in the forward pass" in why
    assert "kmix.callbacks.PrecisionAutopilot" in why
    assert "not finite" not in why


@pytest.mark.jax
def test_compare_and_demo_refuse_a_run_of_several_processes(monkeypatch, tmp_path):
    """The real refusal, under keras.distribution: tests/callbacks/test_jax_processes.py."""
    from kmix import backend, demo
    from kmix.compare import compare_policies
    from kmix.compare.values import CompareError

    monkeypatch.setattr(backend, "processes_and_devices", lambda: (2, 4))
    with pytest.raises(CompareError, match=r"^kmix compare is a single-process tool, but "):
        compare_policies(lambda: None, ([0.0], [0.0]))
    with pytest.raises(ValueError, match=r"^kmix demo is a single-process tool, but .* 2 proc"):
        demo.run(str(tmp_path / "demo"))
    assert not (tmp_path / "demo").exists()
    monkeypatch.setattr(backend, "processes_and_devices", lambda: (1, 2))
    backend.check_single_process("kmix demo")  # one process, two devices: fine
