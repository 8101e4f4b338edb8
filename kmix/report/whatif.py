"""Precision what-if: what a recorded exponent histogram would lose in other formats.

Pure NumPy. From the counts per exponent bin (layout in :mod:`kmix.tags`) it gives
the share of all elements (zeros included in the total) that would

* ``underflow``: be non-zero and below the format's smallest subnormal
  ``2**min_subnormal_exponent``, i.e. flush to zero (values in the half-bin just
  below it round up to it under round-to-nearest: counted as underflow, since
  they keep none of their precision);
* ``subnormal``: land at or above the smallest subnormal but below the smallest
  normal ``2**min_normal_exponent`` (they lose precision);
* ``overflow``: be ``2**(max_exponent + 1)`` or more, or already inf/NaN.

Counts are exact at those power-of-two boundaries, which is where the bins split.
Two approximations remain:

* the top bin of a format: values in ``[2**max_exponent, 2**(max_exponent + 1))``
  count as in range, although those above the format's largest finite value
  (65504 for float16, 448 for FP8 E4M3, 57344 for FP8 E5M2) overflow or saturate;
* the histogram's own open ends: bin 1 (non-zero, below ``2**EXPONENT_MIN`` =
  ``2**-40``) is placed at exponent ``EXPONENT_MIN - 1`` and the bin of finite
  values of ``2**(EXPONENT_MAX + 1)`` or more at ``EXPONENT_MAX + 1`` (so for
  bfloat16, whose normals reach down to ``2**-126``, bin 1 counts as normal).

FP8 formats are evaluated with per-tensor scaling to the max, as FP8 recipes do:
the histogram is shifted by a power of two so that its largest finite non-zero
bin lands on the format's top exponent (a recipe's factor ``max / amax`` differs
from that power of two by a factor in ``(0.875, 1.75]``). float16 and bfloat16 are
evaluated as recorded (for gradients: scaled by the loss scale, as float16 saw them).

Where the run has float8 layers, their real scales replace that ideal for the format Keras
holds their gradients in (E5M2, the output gradients'): the monitor's
``kmix/fp8_headroom_bits/<layer>/outputs_grad`` at the latest read at or before the
histogram's step, ``h = log2(scale * 57344 / amax)``, says where the layer's output
gradients' amax sat at their real delayed scale: in the bin of exponent
``floor(log2(57344) - h)``. Each variable of that layer (its kernel, its bias) has its
histogram's top bin placed there instead of at E5M2's top exponent, so a stale spike's
coarse scale (``h`` of several bits) shows as underflow and a clipping scale (``h < 0``) as
overflow. E4M3 (Keras's format for a float8 layer's inputs and kernel values, never its
gradients) stays scaled to the max. This is a proxy, said where it is shown: Keras holds
the layer's *output* gradients in E5M2, never its kernel's or bias's gradients; their
histogram is placed as if held in E5M2 at the headroom the output gradients really had.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kmix import tags


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """The exponent range of a floating-point format.

    Attributes:
        max_exponent: the exponent of the largest finite value (its bin).
        min_normal_exponent: the exponent of the smallest normal value.
        min_subnormal_exponent: the exponent of the smallest subnormal value.
        scaled: whether values are scaled per tensor to the format's max first.
    """

    max_exponent: int
    min_normal_exponent: int
    min_subnormal_exponent: int
    scaled: bool


FLOAT8_GRADIENTS = "fp8_e5m2"
"""The what-if format a Keras float8 layer holds its gradients in (its output gradients)."""
_E5M2_MAX = tags.FLOAT8_FORMAT_MAX[tags.FLOAT8_FORMATS["outputs_grad"]]

FORMATS = {
    "float16": FloatFormat(15, -14, -24, scaled=False),
    "bfloat16": FloatFormat(127, -126, -133, scaled=False),
    "fp8_e4m3": FloatFormat(8, -6, -9, scaled=True),  # max 448
    "fp8_e5m2": FloatFormat(15, -14, -16, scaled=True),  # max 57344
}
"""The formats of the what-if, by the names used in the summary and its JSON."""


@dataclasses.dataclass(frozen=True)
class FormatShares:
    """Shares of all elements (zeros included) that a format would lose.

    Attributes:
        underflow: non-zero, below the smallest subnormal: flushed to zero.
        subnormal: between the smallest subnormal and the smallest normal.
        overflow: past the largest exponent, or already inf/NaN.
    """

    underflow: float
    subnormal: float
    overflow: float


@dataclasses.dataclass(frozen=True)
class PrecisionWhatIf:
    """The what-if of one kind of values (gradients) at one histogram step.

    Attributes:
        step: the step of the histograms.
        overall: format name -> shares over all variables' elements (each
            variable scaled to its own max for FP8).
        by_variable: variable path -> format name -> shares.
        float8_headroom_bits: variable path of a float8 layer's variable -> the headroom
            bits of the layer's output gradients that placed its E5M2 shares (its real
            scale; see the module's docstring); empty without float8 layers.
    """

    step: int
    overall: dict[str, FormatShares]
    by_variable: dict[str, dict[str, FormatShares]]
    float8_headroom_bits: dict[str, float] = dataclasses.field(default_factory=dict)


def _bin_exponents() -> np.ndarray:
    """The exponent each bin stands for (see the module's approximations); 0 unused."""
    exponents = np.zeros(tags.NUM_EXPONENT_BINS, dtype=np.int64)
    for index in range(1, tags.NUM_EXPONENT_BINS - 1):
        exponents[index] = tags.bin_exponent(index)
    return exponents


def loss_counts(
    counts: np.ndarray, fmt: FloatFormat, top: int | None = None
) -> tuple[float, float, float]:
    """How many elements of one histogram a format would flush, make subnormal, overflow.

    Args:
        counts: one count per exponent bin of :mod:`kmix.tags`.
        fmt: the format.
        top: for a scaled format, the exponent its scale gives the histogram's largest
            finite non-zero bin (default: the format's max exponent, the ideal scale).

    Returns:
        ``(underflow, subnormal, overflow)`` counts.

    Raises:
        ValueError: ``counts`` does not have one entry per bin.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.shape != (tags.NUM_EXPONENT_BINS,):
        raise ValueError(
            f"Invalid `counts`: shape {counts.shape}; expected ({tags.NUM_EXPONENT_BINS},), "
            "one count per exponent bin of kmix.tags."
        )
    finite = counts[1:-1]
    exponents = _bin_exponents()[1:-1]
    if fmt.scaled:
        present = np.nonzero(finite)[0]
        if present.size:
            goal = fmt.max_exponent if top is None else top
            exponents = exponents + (goal - exponents[present[-1]])
    underflow = finite[exponents < fmt.min_subnormal_exponent].sum()
    subnormal = finite[
        (exponents >= fmt.min_subnormal_exponent) & (exponents < fmt.min_normal_exponent)
    ].sum()
    overflow = finite[exponents > fmt.max_exponent].sum() + counts[-1]
    return float(underflow), float(subnormal), float(overflow)


def format_shares(counts: np.ndarray, fmt: FloatFormat, top: int | None = None) -> FormatShares:
    """The shares of one histogram's elements a format would lose.

    Args:
        counts: one count per exponent bin of :mod:`kmix.tags`.
        fmt: the format.
        top: as in :func:`loss_counts`.

    Returns:
        The :class:`FormatShares` (all 0.0 for an empty histogram).
    """
    total = float(np.sum(counts))
    lost = loss_counts(counts, fmt, top)
    return FormatShares(*(value / total if total else 0.0 for value in lost))


def float8_top(headroom_bits: float) -> int:
    """The exponent of the bin where a float8 layer's output gradients' amax sat at their
    real scale, from their recorded headroom: ``floor(log2(57344) - headroom_bits)``."""
    return math.floor(math.log2(_E5M2_MAX) - headroom_bits)


def _float8_headroom(
    variables: list[str], headroom: dict[str, list[tuple[int, float]]], step: int
) -> dict[str, float]:
    """Variable -> its float8 layer's output-gradient headroom at the latest read at or
    before ``step`` (finite reads only); variables of other layers are left out."""
    found = {}
    for variable in variables:
        layer = variable.rpartition("/")[0]
        read = [bits for at, bits in headroom.get(layer, ()) if at <= step and math.isfinite(bits)]
        if read:
            found[variable] = float(read[-1])
    return found


def whatif(
    histograms: dict[str, list[tuple[int, np.ndarray]]],
    float8_headroom: dict[str, list[tuple[int, float]]] | None = None,
) -> PrecisionWhatIf | None:
    """The what-if of the latest histograms, per variable and over all of them.

    Args:
        histograms: variable path -> ``[(step, counts)]`` in step order, as in
            :class:`kmix.report.KmixLog`.
        float8_headroom: float8 layer path -> ``[(step, headroom bits)]`` of its output
            gradients in step order (``kmix/fp8_headroom_bits/<layer>/outputs_grad``): the
            layer's variables get E5M2 at that real scale (see the module's docstring).

    Returns:
        The :class:`PrecisionWhatIf` at the latest step any variable has a
        histogram for (variables without one at that step are left out); None
        without histograms.
    """
    latest = [points[-1] for points in histograms.values() if points]
    if not latest:
        return None
    step = max(point_step for point_step, _ in latest)
    chosen = {
        variable: np.asarray(points[-1][1], dtype=np.float64)
        for variable, points in sorted(histograms.items())
        if points and points[-1][0] == step
    }
    real = _float8_headroom(list(chosen), float8_headroom or {}, step)

    def top(variable: str, name: str) -> int | None:
        if name != FLOAT8_GRADIENTS or variable not in real:
            return None
        return float8_top(real[variable])

    total = sum(float(counts.sum()) for counts in chosen.values())
    overall = {}
    for name, fmt in FORMATS.items():
        summed = np.sum(
            [loss_counts(counts, fmt, top(v, name)) for v, counts in chosen.items()], axis=0
        )
        overall[name] = FormatShares(*(float(v) / total if total else 0.0 for v in summed))
    by_variable = {
        variable: {
            name: format_shares(counts, fmt, top(variable, name)) for name, fmt in FORMATS.items()
        }
        for variable, counts in chosen.items()
    }
    return PrecisionWhatIf(
        step=int(step), overall=overall, by_variable=by_variable, float8_headroom_bits=real
    )
