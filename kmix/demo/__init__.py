"""``kmix demo``: mixed-precision training made visible, on data that ships with kmix.

- :mod:`~kmix.demo.train`: the model, the data, the run and its report.
- :mod:`~kmix.demo.logdir`: which files in the log dir a demo may replace.
- :mod:`~kmix.demo.scalars`: the epoch scalars (Keras's TensorBoard callback, or kmix's writer).

Code outside this folder imports these names from ``kmix.demo``.
"""

from kmix.demo.logdir import LogdirError, prepare_logdir
from kmix.demo.train import (
    LEARNING_RATE,
    DemoResult,
    build_model,
    load_digits,
    main,
    run,
    split,
)

__all__ = [
    "LEARNING_RATE",
    "DemoResult",
    "LogdirError",
    "build_model",
    "load_digits",
    "main",
    "prepare_logdir",
    "run",
    "split",
]
