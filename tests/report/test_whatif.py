"""kmix.report.whatif: shares lost in float16, bfloat16 and FP8, checked by hand."""

from __future__ import annotations

import dataclasses

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
