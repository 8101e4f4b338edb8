"""The Custom Scalars layout the monitor writes at train begin: how the kmix charts group."""

from __future__ import annotations

from typing import Any

from kmix import tags


def layout() -> Any:
    """The custom-scalars layout that groups the kmix charts.

    Returns:
        A ``tensorboard.plugins.custom_scalar.layout_pb2.Layout``.
    """
    from tensorboard.plugins.custom_scalar import layout_pb2

    def chart(title: str, *patterns: str) -> Any:
        return layout_pb2.Chart(
            title=title, multiline=layout_pb2.MultilineChartContent(tag=list(patterns))
        )

    def exact(tag: str) -> str:
        return f"^{tag}$"

    return layout_pb2.Layout(
        category=[
            layout_pb2.Category(
                title="kmix: loss scale",
                chart=[
                    chart("loss scale (log2)", exact(tags.LOSS_SCALE_LOG2)),
                    chart("skip rate (per read)", exact(tags.SKIP_RATE)),
                    chart("skipped steps (cumulative)", exact(tags.SKIPPED_STEPS)),
                    chart("loss finite (1 = yes)", exact(tags.LOSS_FINITE)),
                ],
            ),
            layout_pb2.Category(
                title="kmix: gradient health",
                chart=[
                    chart("gradient norm (unscaled)", exact(tags.GRAD_NORM)),
                    chart(
                        "overflow headroom (bits; < 0 = overflow)",
                        exact(tags.OVERFLOW_HEADROOM_BITS),
                    ),
                    chart("max |scaled gradient|", exact(tags.MAX_ABS_SCALED_GRAD)),
                    chart("underflow fraction (zeros + subnormal)", exact(tags.UNDERFLOW_FRACTION)),
                    chart(
                        "subnormal fraction (what float16 loses)", exact(tags.SUBNORMAL_FRACTION)
                    ),
                    chart("non-finite elements", exact(tags.NONFINITE_ELEMENTS)),
                ],
            ),
            layout_pb2.Category(
                title="kmix: per variable (one line each: see the Mixed Precision tab)",
                chart=[
                    chart("underflow fraction", f"^{tags.UNDERFLOW_BY_VARIABLE}.*"),
                    chart("subnormal fraction", f"^{tags.SUBNORMAL_BY_VARIABLE}.*"),
                ],
            ),
        ]
    )
