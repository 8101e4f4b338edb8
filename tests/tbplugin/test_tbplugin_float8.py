"""The tab's Float8 JSON (kmix/tbplugin/float8.py) on a hand-written log."""

from __future__ import annotations

from test_report import hand_log
from test_report_float8 import LAYERS, float8_log

from kmix import report, tags
from kmix.tags import Float8Saturation
from kmix.tbplugin.float8 import float8_payload


def test_the_payload_is_a_layer_by_tensor_grid_and_the_episodes():
    episodes = [Float8Saturation(11, LAYERS[1], "outputs_grad", 2.0, 1.0, 3)]
    log = float8_log(episodes=episodes, steps=(10, 20))
    payload = float8_payload(log, report.summarize(log), limit=200)
    assert payload["headroom"] == {
        "steps": [10, 20],
        "names": [f"{layer} {t}" for layer in LAYERS for t in ("inputs", "kernel", "outputs_grad")],
        "bits": [[0.5, 0.25]] * 6,
        # steps 11-13 of mlp/dense_1's output gradients: clipped after step 10, by 20
        "saturated": [[False, False]] * 5 + [[False, True]],
    }
    (episode,) = payload["episodes"]
    assert episode["line"] == (
        "float8 saturation at steps 11-13 (3 steps): mlp/dense_1 outputs_grad amax 2 > limit 1 "
        "(1.00 bits over)"
    )
    assert (payload["episode_count"], payload["saturated_tensor_steps"]) == (1, 12)
    assert payload["tensors"][0]["layer"] == LAYERS[0]
    assert float8_payload(log, report.summarize(log), limit=1)["headroom"]["steps"] == [10]


def test_no_float8_no_section():
    log = hand_log(scalars={tags.LOSS_SCALE: ([10], [8.0])})
    assert float8_payload(log, report.summarize(log), limit=200) is None
