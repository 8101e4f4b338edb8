"""kmix.report.whatif: shares lost in float16, bfloat16 and FP8, checked by hand."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_report import exponent_histogram

from kmix import tags
from kmix.report import whatif
from kmix.report.whatif import FORMATS, FormatShares


def shares(counts, name):
    return dataclasses.astuple(whatif.format_shares(counts, FORMATS[name]))


def test_hand_computed_histogram():
    # 100 elements: 10 zeros, 5 at 2**-30, 10 at 2**-20, 70 at 2**0, 3 at 2**16, 2 inf/NaN.
    counts = exponent_histogram(zero=10, m30=5, m20=10, e0=70, e16=3)
    counts[-1] = 2
    # float16 as recorded: -30 < -24 flushes, -20 is subnormal, 2**16 and inf/NaN overflow.
    assert shares(counts, "float16") == (0.05, 0.10, 0.05)
    # bfloat16: everything finite fits; inf/NaN stay non-finite.
    assert shares(counts, "bfloat16") == (0.0, 0.0, 0.02)
    # E4M3 scaled to its max: top bin 16 -> 8, a shift of -8: -38 and -28 flush (< -9),
    # 0 -> -8 is subnormal (-9 <= e < -6).
    assert shares(counts, "fp8_e4m3") == (0.15, 0.70, 0.02)
    # E5M2: shift -1: -31 and -21 flush (< -16), -1 is normal.
    assert shares(counts, "fp8_e5m2") == (0.15, 0.0, 0.02)


@pytest.mark.parametrize(
    ("exponent", "expected"),
    [  # float16 boundaries, exact at powers of two
        (-25, (1.0, 0.0, 0.0)),
        (-24, (0.0, 1.0, 0.0)),
        (-15, (0.0, 1.0, 0.0)),
        (-14, (0.0, 0.0, 0.0)),
        (15, (0.0, 0.0, 0.0)),  # [2**15, 2**16): counted in range (the top-bin approximation)
        (16, (0.0, 0.0, 1.0)),
    ],
)
def test_float16_boundaries(exponent, expected):
    counts = np.zeros(tags.NUM_EXPONENT_BINS)
    counts[tags.exponent_bin(exponent)] = 4
    assert shares(counts, "float16") == expected


def test_fp8_boundaries_after_scaling():
    # Top at 2**0; E4M3 shifts by +8: e -> e + 8. Normal from -6, subnormal from -9.
    counts = exponent_histogram(e0=1, m14=1, m15=1, m17=1, m18=1)
    counts = counts / 1  # 5 elements
    # -14 -> -6 normal; -15 -> -7 subnormal; -17 -> -9 subnormal; -18 -> -10 flushes.
    assert shares(counts, "fp8_e4m3") == (0.2, 0.4, 0.0)
    # E5M2 shifts by +15: -18 -> -3, all normal.
    assert shares(counts, "fp8_e5m2") == (0.0, 0.0, 0.0)


def test_open_ended_bins():
    counts = np.zeros(tags.NUM_EXPONENT_BINS)
    counts[1] = 1  # below 2**-40: placed at 2**-41
    counts[tags.NUM_EXPONENT_BINS - 2] = 1  # 2**18 or more: placed at 2**18
    assert shares(counts, "float16") == (0.5, 0.0, 0.5)
    assert shares(counts, "bfloat16") == (0.0, 0.0, 0.0)
    # E5M2: top 18 -> 15, a shift of -3: -41 -> -44 flushes.
    assert shares(counts, "fp8_e5m2") == (0.5, 0.0, 0.0)


def test_empty_and_zero_histograms():
    assert shares(np.zeros(tags.NUM_EXPONENT_BINS), "fp8_e4m3") == (0.0, 0.0, 0.0)
    assert shares(exponent_histogram(zero=9), "fp8_e4m3") == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="one count per exponent bin"):
        whatif.format_shares(np.zeros(3), FORMATS["float16"])


def test_overall_scales_each_tensor_to_its_own_max():
    histograms = {
        "a": [(5, exponent_histogram(e0=9)), (10, exponent_histogram(e0=10))],
        "b": [(10, exponent_histogram(m10=10, m20=10))],
        "stale": [(5, exponent_histogram(m30=10))],  # no histogram at step 10: left out
    }
    result = whatif.whatif(histograms)
    assert result.step == 10
    assert sorted(result.by_variable) == ["a", "b"]
    # Per tensor, b shifts by +18 (-10 -> 8, -20 -> -2): nothing flushes in E4M3. One
    # shared scale (+8, for a's max) would flush b's 2**-20 (-> -12).
    assert result.overall["fp8_e4m3"] == FormatShares(0.0, 0.0, 0.0)
    # float16 as recorded: b's 2**-20 are subnormal: 10 of 30 elements.
    assert result.overall["float16"] == FormatShares(0.0, 10 / 30, 0.0)
    assert result.by_variable["b"]["float16"] == FormatShares(0.0, 0.5, 0.0)
    assert set(result.overall) == {"float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"}
    assert whatif.whatif({}) is None


def test_a_float8_layer_gets_e5m2_at_its_real_output_gradient_scale():
    """log2(57344) = 15.807...: headroom h puts the output gradients' amax in the bin of
    exponent floor(15.807 - h); the layer's variables have their top bin placed there."""
    kernel = exponent_histogram(zero=2, e0=4, m24=2, m26=2)  # 10 elements, top 2**0
    other = exponent_histogram(e0=5, m26=5)
    histograms = {
        "mlp/dense/kernel": [(20, kernel)],
        "mlp/dense/bias": [(20, exponent_histogram(e3=2))],
        "other/kernel": [(20, other)],
    }
    headroom = {"mlp/dense": [(10, 0.25), (20, 6.0), (30, -1.0)], "mlp/dense_9": [(20, 1.0)]}
    result = whatif.whatif(histograms, headroom)
    assert result.float8_headroom_bits == {"mlp/dense/bias": 6.0, "mlp/dense/kernel": 6.0}
    # h = 6 (a scale 6 bits coarse) at step 20: top at floor(9.807) = 9, a shift of +9:
    # 2**-24 -> 2**-15 subnormal (-16 <= e < -14), 2**-26 -> 2**-17 flushes.
    assert result.by_variable["mlp/dense/kernel"]["fp8_e5m2"] == FormatShares(0.2, 0.2, 0.0)
    # The ideal scale (top at 15, shift +15) keeps them all normal.
    assert shares(kernel, "fp8_e5m2") == (0.0, 0.0, 0.0)
    # E4M3 is not a float8 layer's gradient format: scaled to its max (shift +8, -24 and
    # -26 below -9 flush); float16 as recorded (-24 subnormal, -26 flushes).
    assert result.by_variable["mlp/dense/kernel"]["fp8_e4m3"] == FormatShares(0.4, 0.0, 0.0)
    assert result.by_variable["mlp/dense/kernel"]["float16"] == FormatShares(0.2, 0.2, 0.0)
    # Another layer's variable keeps the ideal: shift +15, 2**-26 -> 2**-11, normal.
    assert result.by_variable["other/kernel"]["fp8_e5m2"] == FormatShares(0.0, 0.0, 0.0)
    # Over all 22 elements: the kernel's 2 flushed and 2 subnormal (the bias's top is its
    # only bin).
    assert result.overall["fp8_e5m2"] == FormatShares(2 / 22, 2 / 22, 0.0)
    # A clipping scale (h = -1 at step 30): top at floor(16.807) = 16, past E5M2's 15.
    late = whatif.whatif({"mlp/dense/kernel": [(30, kernel)]}, headroom)
    assert late.by_variable["mlp/dense/kernel"]["fp8_e5m2"] == FormatShares(0.0, 0.0, 0.4)
    # No read at or before the histogram's step: the ideal scale.
    early = whatif.whatif({"mlp/dense/kernel": [(5, kernel)]}, headroom)
    assert early.float8_headroom_bits == {}
    assert early.by_variable["mlp/dense/kernel"]["fp8_e5m2"] == FormatShares(0.0, 0.0, 0.0)


def test_float8_top_is_where_the_amax_sits_at_the_real_scale():
    assert [whatif.float8_top(h) for h in (0.0, 0.8, 0.81, 6.0, -0.2, -1.0)] == [
        15,
        15,
        14,
        9,
        16,
        16,
    ]


def test_the_report_says_which_rows_use_a_float8_layers_real_scale():
    from test_report import hand_log

    from kmix import report

    log = hand_log(
        scalars={
            tags.float8_tag(tags.FP8_HEADROOM_BITS, "mlp/dense", "outputs_grad"): ([20], [6.0]),
            tags.float8_tag(tags.FP8_HEADROOM_BITS, "mlp/dense", "inputs"): ([20], [-3.0]),
        },
        histograms={
            "mlp/dense/kernel": [(20, exponent_histogram(zero=2, e0=4, m24=2, m26=2))],
            "head/kernel": [(20, exponent_histogram(e0=1))],
        },
    )
    summary = report.summarize(log)
    gradients = summary.precision_whatif["gradients"]
    assert gradients.float8_headroom_bits == {"mlp/dense/kernel": 6.0}
    lines = report.format_summary(summary).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("precision what-if"))
    assert lines[start + 1 : start + 5] == [
        "  all variables       float16 18.18%/18.18%/0.00%  bfloat16 0.00%/0.00%/0.00%  "
        "fp8_e4m3 36.36%/0.00%/0.00%  fp8_e5m2 18.18%/18.18%/0.00%",
        "  head/kernel         float16 0.00%/0.00%/0.00%  bfloat16 0.00%/0.00%/0.00%  "
        "fp8_e4m3 0.00%/0.00%/0.00%  fp8_e5m2 0.00%/0.00%/0.00%",
        "  mlp/dense/kernel *  float16 20.00%/20.00%/0.00%  bfloat16 0.00%/0.00%/0.00%  "
        "fp8_e4m3 40.00%/0.00%/0.00%  fp8_e5m2 20.00%/20.00%/0.00%",
        "  * fp8_e5m2 as if held at the float8 layer's real output-gradient headroom, not "
        "scaled to its max (a proxy: Keras holds the layer's output gradients in E5M2, not "
        "these): `mlp/dense` 6.00 bits",
    ]
    data = json.loads(report.to_json(summary))["precision_whatif"]["gradients"]
    assert data["float8_headroom_bits"] == {"mlp/dense/kernel": 6.0}
