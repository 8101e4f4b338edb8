"""Read kmix's TensorBoard logs back: a summary, findings in plain words, PNG plots.

This is what ``kmix report LOGDIR`` runs. It reads the event files with
TensorBoard's own reader and imports neither TensorFlow nor Keras (TensorBoard
falls back to its stub once :func:`avoid_tensorflow` has been called), so it is
quick to start and works on a machine that only has TensorBoard.

Example:
    >>> from kmix import report
    >>> log = report.read_log("runs/demo")                    # doctest: +SKIP
    >>> summary = report.summarize(log)                       # doctest: +SKIP
    >>> print(report.format_summary(summary))                 # doctest: +SKIP
    >>> report.write_plots(log, summary, "runs/demo/report")  # doctest: +SKIP

One module per concern:

* :mod:`kmix.report.read`: event files (or TensorBoard's data provider, through
  :func:`build_logs`) -> one :class:`KmixLog` per run; its scale events from their
  structured records (:func:`kmix.report.read.scale_events_of`);
* :mod:`kmix.report.runs`: the runs of one log dir told apart (a script run twice
  into one ``log_dir``), :class:`RunInfo`;
* :mod:`kmix.report.values`: the typed values, :class:`Summary` (JSON via
  :meth:`Summary.to_dict`), its parts and :class:`Finding`;
* :mod:`kmix.report.summary`: :class:`KmixLog` -> :class:`Summary`;
* :mod:`kmix.report.finding_rules`: the :data:`RULES` table over a :class:`Summary`,
  and its thresholds; :mod:`kmix.report.advice`: what would skip fewer steps,
  from the kinds of skipped steps recorded and kmix's scale rule, and whether a run
  uses its loss scale at all (:func:`loss_scale_unused`: no chart when it does not);
* :mod:`kmix.report.whatif`: what the recorded exponent histograms would lose in
  float16, bfloat16 and FP8;
* :mod:`kmix.report.float8`: the Float8 section (episodes, each float8 tensor as last
  read, findings, its text);
* :mod:`kmix.report.text`: terminal text and JSON; :mod:`kmix.report.plots`: PNGs.

``read``, ``values``, ``summary``, ``findings``, ``advice`` and ``whatif`` neither
print nor import matplotlib: the TensorBoard plugin reuses them. They import one way:
``summary`` uses ``read``, ``findings``, ``values`` and ``whatif``; ``findings`` uses
``advice`` and ``values``, never ``summary``. (The name ``findings`` in this
package is the function; the module is ``sys.modules["kmix.report.finding_rules"]``.)
"""

from kmix._words import format_scale
from kmix.report.advice import float16_in_use, loss_scale_unused
from kmix.report.finding_rules import (
    HEADROOM_TIGHT_BITS,
    HEADROOM_WARN_BITS,
    RECENT_SKIP_RATE_WARN,
    RULES,
    SKIP_RATE_WARN,
    UNDERFLOW_WARN_FRACTION,
    Finding,
)
from kmix.report.finding_rules import findings as findings  # the function shadows the module
from kmix.report.plots import PLOT_FILES, write_plots
from kmix.report.read import (
    EventLog,
    KmixLog,
    ReportError,
    Series,
    avoid_tensorflow,
    build_log,
    build_logs,
    find_logdirs,
    read_log,
    read_runs,
    scale_events_of,
)
from kmix.report.runs import RunInfo, end_words, runs_message
from kmix.report.summary import (
    ExponentShares,
    Forecast,
    LossScale,
    Note,
    Summary,
    Trend,
    begin_scale,
    compute_dtype,
    exponent_shares,
    forecast_zero_crossing,
    summarize,
)
from kmix.report.text import (
    format_logdirs,
    format_summary,
    logdirs_json,
    processes_words,
    scale_caveat,
    to_json,
)
from kmix.report.values import Float8Summary, Float8TensorHealth, GrowthSaturation
from kmix.report.whatif import FORMATS, FormatShares, PrecisionWhatIf

__all__ = [
    "FORMATS",
    "HEADROOM_TIGHT_BITS",
    "HEADROOM_WARN_BITS",
    "PLOT_FILES",
    "RECENT_SKIP_RATE_WARN",
    "RULES",
    "SKIP_RATE_WARN",
    "UNDERFLOW_WARN_FRACTION",
    "EventLog",
    "ExponentShares",
    "Finding",
    "Float8Summary",
    "Float8TensorHealth",
    "Forecast",
    "FormatShares",
    "GrowthSaturation",
    "KmixLog",
    "LossScale",
    "Note",
    "PrecisionWhatIf",
    "ReportError",
    "RunInfo",
    "Series",
    "Summary",
    "Trend",
    "avoid_tensorflow",
    "begin_scale",
    "build_log",
    "build_logs",
    "compute_dtype",
    "end_words",
    "exponent_shares",
    "find_logdirs",
    "findings",
    "float16_in_use",
    "forecast_zero_crossing",
    "format_scale",
    "format_logdirs",
    "format_summary",
    "logdirs_json",
    "loss_scale_unused",
    "processes_words",
    "read_log",
    "read_runs",
    "runs_message",
    "scale_caveat",
    "scale_events_of",
    "summarize",
    "to_json",
    "write_plots",
]
