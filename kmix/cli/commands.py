"""The ``kmix`` command: ``kmix demo``, ``kmix report LOGDIR``, ``kmix doctor``, ``kmix compare``.

Heavy modules (TensorFlow, Keras, matplotlib) are imported inside the subcommands,
so ``kmix --help`` and ``kmix report`` start without TensorFlow.

Exit status: 0 on success, 2 for bad input (arguments, a log dir without kmix data, a
log dir the demo may not write to), 1 when training fails.

TensorFlow's start-up log lines ("Could not find cuda drivers", "failed call to
cuInit", oneDNN notes) are not what the user asked for: the commands that import
TensorFlow drop those known lines from stderr and pass every other line through
(:func:`quiet_tensorflow_startup`). ``TF_CPP_MIN_LOG_LEVEL=0 kmix ...`` shows them.

This module holds the parser and the ``demo`` and ``report`` subcommands; ``kmix
doctor`` lives in ``kmix/cli/doctor.py`` and the start-up filter in
``kmix/cli/stderr.py``. Their public names are importable from here as before.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kmix import __version__
from kmix.cli.compare import add_compare_parser, positive_int, report_comparison
from kmix.cli.doctor import (
    PACKAGES,
    VERSION_RULES,
    VersionFacts,
    package_versions,
    run_doctor,
    version_facts,
    version_warnings,
)
from kmix.cli.stderr import STARTUP_NOISE, is_startup_noise, quiet_tensorflow_startup
from kmix.policy import POLICY_NAMES

__all__ = [
    "BACKENDS",
    "BAD_INPUT",
    "PACKAGES",
    "STARTUP_NOISE",
    "VERSION_RULES",
    "VersionFacts",
    "build_parser",
    "choose_backend",
    "is_startup_noise",
    "main",
    "package_versions",
    "quiet_tensorflow_startup",
    "version_facts",
    "version_warnings",
]

BAD_INPUT = 2
"""The exit status for bad input: arguments, a log dir without kmix data, a log dir the
demo may not write to."""

BACKENDS = ("tensorflow", "jax", "torch")
"""The Keras backends ``kmix demo --backend`` trains on."""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``kmix`` command.

    Args:
        argv: the arguments after the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit status: 0 on success, 2 for bad input, 1 when training fails.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return BAD_INPUT
    quiet = args.imports_tensorflow and os.environ.get("TF_CPP_MIN_LOG_LEVEL") != "0"
    try:
        with quiet_tensorflow_startup() if quiet else contextlib.nullcontext():
            status = args.run(args)
            sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except BrokenPipeError:  # `kmix report LOGDIR --json | head`: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser of the ``kmix`` command and its subcommands.

    Returns:
        The parser; each subcommand sets ``run``, the function to call with the
        parsed arguments.
    """
    parser = _KmixParser(
        prog="kmix",
        description="Safe and visible Keras mixed-precision training.",
    )
    parser.add_argument("--version", action="version", version=f"kmix {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train a small CNN on shipped digits in mixed precision and report on it",
        description=(
            "Train a small convolutional network on the 8x8 handwritten digits that "
            "ship with kmix, in mixed precision (--policy) with kmix.LossScaleOptimizer, "
            "MixedPrecisionMonitor and LossScaleGuard. The loss scale starts far too "
            "high for float16, so with a float16 policy the first steps overflow and "
            "back off; the report shows the recovery. Then the same model trains in "
            "float32 for comparison. --backend jax or --backend torch runs it on Keras's "
            "JAX or torch backend."
        ),
    )
    demo.add_argument(
        "--logdir", default=os.path.join("runs", "demo"), help="TensorBoard log dir (%(default)s)"
    )
    demo.add_argument(
        "--epochs", type=positive_int, default=10, help="epochs to train, >= 1 (%(default)s)"
    )
    demo.add_argument(
        "--policy",
        default="mixed_float16",
        choices=POLICY_NAMES,
        help="dtype policy of the logged run (default: %(default)s); auto chooses one "
        "from the hardware",
    )
    demo.add_argument(
        "--backend",
        choices=BACKENDS,
        help=(
            "the Keras backend to train on (default: KERAS_BACKEND if set, else tensorflow); "
            'jax needs JAX: pip install ".[jax]" from the root of kmix\'s checkout; torch '
            'needs torch: pip install ".[torch]"'
        ),
    )
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help=(
            "replace a previous kmix demo run in the log dir (only the files the demo "
            "wrote are removed); without it the log dir must be new or empty"
        ),
    )
    demo.set_defaults(run=_run_demo, imports_tensorflow=True)

    report = commands.add_parser(
        "report",
        help="summarize a kmix TensorBoard log dir and plot it",
        description=(
            "Read the kmix data in LOGDIR (written by MixedPrecisionMonitor, also while "
            "it is still being written); print the loss scale, skipped steps, every "
            "scale event, gradient-health trends and findings; write PNG plots. A log "
            "dir written by several runs (a script run twice) is reported on its latest "
            "run, with a note; --run picks another. A directory without kmix data of "
            "its own but with log dirs under it (runs/a, runs/b) lists the runs found."
        ),
    )
    report.add_argument("logdir", metavar="LOGDIR", help="the log_dir given to the monitor")
    report.add_argument(
        "--run",
        dest="which_run",
        metavar="N",
        help="which run of a log dir written by several: 1 for the oldest, or its id (the latest)",
    )
    report.add_argument("--out", metavar="DIR", help="where to write the PNGs (LOGDIR/report)")
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    report.add_argument("--no-plots", action="store_true", help="do not write PNGs")
    report.set_defaults(run=_run_report, imports_tensorflow=False)

    doctor = commands.add_parser(
        "doctor",
        help="show hardware, the policy 'auto' would choose, measured dtype speed, versions",
        description=(
            "Print the detected hardware, the policy kmix.use('auto') would choose and "
            "why, the time of a small float32, float16 and bfloat16 matmul and convolution "
            "measured on this CPU (about a second) as ratios to float32, with the known fix "
            "and its measured effect where one applies, the versions of TensorFlow, Keras, "
            "TensorBoard, JAX and torch, the Keras backend and what kmix runs on JAX and "
            "torch, with a "
            "warning for combinations known not to work."
        ),
    )
    doctor.set_defaults(run=run_doctor, imports_tensorflow=True)
    compare = add_compare_parser(commands)  # kmix/cli/compare.py
    parser.commands.update({"demo": demo, "report": report, "doctor": doctor, "compare": compare})
    return parser


class _KmixParser(argparse.ArgumentParser):
    """The ``kmix`` parser: an argument no subcommand knows is that subcommand's error.

    A subcommand's parser hands the arguments it does not know back to this one, which
    stock argparse reports with ``kmix``'s usage (``usage: kmix [-h] [--version]
    COMMAND ...``); the user needs the usage of the command they typed.

    Attributes:
        commands: the parser of each subcommand, by name.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """Parses the command line; unknown arguments are an error of their subcommand.

        Args:
            args: the arguments after the program name; ``None`` reads ``sys.argv``.
            namespace: the object to store the values in (a new one if ``None``).

        Returns:
            The parsed arguments.

        Raises:
            SystemExit: with status 2 after printing the usage of the subcommand given
                (or ``kmix``'s, when there is none) and the error, for bad arguments.
        """
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            owner = self.commands.get(getattr(parsed, "command", None) or "", self)
            owner.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed


def _error(command: str, message: str) -> int:
    """Prints ``kmix COMMAND: MESSAGE`` to stderr and returns :data:`BAD_INPUT`."""
    print(f"kmix {command}: {message}", file=sys.stderr)
    return BAD_INPUT


# ------------------------------------------------------------------------ demo
def _run_demo(args: argparse.Namespace) -> int:
    """Runs ``kmix demo``, choosing the Keras backend and checking the log dir first.

    Args:
        args: the parsed arguments (``logdir``, ``epochs``, ``policy``, ``backend``,
            ``overwrite``).

    Returns:
        The exit status: 0, 1 when LossScaleGuard stopped training, 2 when the backend
        cannot be used or the demo may not write to the log dir.
    """
    from kmix import demo

    try:  # Keras reads KERAS_BACKEND once, when it is imported: set it before anything does
        backend = choose_backend(args.backend, os.environ)
    except ValueError as error:
        return _error("demo", str(error))
    os.environ["KERAS_BACKEND"] = backend
    try:  # before TensorFlow starts, so that a bad --logdir is a quick one-line error
        demo.prepare_logdir(args.logdir, overwrite=args.overwrite)
    except demo.LogdirError as error:
        return _error("demo", str(error))
    except OSError as error:
        return _error("demo", _cannot_write(args.logdir, error))
    if backend == "tensorflow":  # oneDNN's float16 is TensorFlow's
        from kmix.policy import avoid_slow_float16_path

        note = avoid_slow_float16_path(args.policy)
        if note:
            print(note)
    return demo.main(
        logdir=args.logdir, epochs=args.epochs, policy=args.policy, overwrite=args.overwrite
    )


def choose_backend(requested: str | None, environ: Mapping[str, str]) -> str:
    """The Keras backend ``kmix demo`` trains on, checked before Keras is imported.

    Args:
        requested: ``--backend``, or None when it was not given.
        environ: the environment: ``KERAS_BACKEND`` is the default (an empty value is
            unset, as for Keras); without it, ``"tensorflow"``.

    Returns:
        One of :data:`BACKENDS`.

    Raises:
        ValueError: one line saying what to do: ``KERAS_BACKEND`` names another backend,
            JAX or torch is chosen but not installed (:func:`jax_installed`,
            :func:`torch_installed`), or Keras is already
            imported in this process with another backend (:func:`loaded_backend`; Keras
            fixes its backend at import).
    """
    backend, source = requested, ""
    if backend is None:
        backend = environ.get("KERAS_BACKEND") or "tensorflow"
        source = " (from KERAS_BACKEND)" if environ.get("KERAS_BACKEND") else " (the default)"
    if backend not in BACKENDS:
        raise ValueError(
            f"KERAS_BACKEND={backend} is not a backend the demo trains on: use "
            "--backend tensorflow, --backend jax or --backend torch"
        )
    library, installed = {"jax": ("JAX", jax_installed), "torch": ("torch", torch_installed)}.get(
        backend, (None, None)
    )
    if installed is not None and not installed():
        raise ValueError(  # the extra pins the tested release (torch's: the CPU build)
            f"--backend {backend}{source} needs {library}, which is not installed: "
            f'pip install ".[{backend}]" from the root of kmix\'s checkout, or use '
            "--backend tensorflow"
        )
    loaded = loaded_backend()
    if loaded is not None and loaded != backend:
        raise ValueError(
            f"--backend {backend}{source}: Keras is already imported in this process with "
            f"the {loaded} backend, which it keeps until the process ends; run "
            f"`kmix demo --backend {backend}` in a new process"
        )
    return backend


def jax_installed() -> bool:
    """Whether ``jax`` and ``jaxlib`` can be imported (looked up, not imported)."""
    return all(importlib.util.find_spec(name) is not None for name in ("jax", "jaxlib"))


def torch_installed() -> bool:
    """Whether ``torch`` can be imported (looked up, not imported)."""
    return importlib.util.find_spec("torch") is not None


def loaded_backend() -> str | None:
    """The backend of the Keras imported in this process, or None when none is."""
    keras = sys.modules.get("keras")
    return None if keras is None else keras.backend.backend()


def _cannot_write(logdir: str, error: OSError) -> str:
    """The one-line message for a ``--logdir`` that cannot be created or written."""
    where = f" ({error.filename})" if error.filename and error.filename != logdir else ""
    return (
        f"cannot write to --logdir {logdir}: {error.strerror or error}{where}; "
        "choose a directory you can write to, e.g. --logdir runs/demo"
    )


# ---------------------------------------------------------------------- report
def _run_report(args: argparse.Namespace) -> int:
    """Runs ``kmix report``: prints the summary of ``args.logdir`` and writes its plots.

    Args:
        args: the parsed arguments (``logdir``, ``out``, ``json``, ``no_plots``,
            ``which_run``).

    Returns:
        The exit status: 0 (also when LOGDIR has no kmix data of its own but log
        dirs under it have, which are then listed), or 2 when the log dir is empty
        (``''``), has no kmix data, ``--run`` names no run of it, or the plots cannot
        be written.
    """
    if not args.logdir:  # the reader would look for "" + "/train": a puzzling message
        return _error(
            "report",
            "LOGDIR '' is empty: expected the log_dir given to "
            "kmix.callbacks.MixedPrecisionMonitor, e.g. kmix report runs/demo",
        )
    if report_comparison(args.logdir, args.json):  # a kmix compare log dir
        return 0
    from kmix import report

    report.avoid_tensorflow()
    try:
        log = report.read_log(args.logdir, run=args.which_run)
    except report.ReportError as error:
        found = _logdirs_under(args.logdir) if args.which_run is None else []
        if not found:
            return _error("report", str(error))
        listing = report.logdirs_json if args.json else report.format_logdirs
        print(listing(args.logdir, found))
        if not args.json:
            for compared in _comparisons_under(args.logdir):
                print(f"{compared} holds a kmix compare: kmix report {compared} shows its table")
        return 0
    summary = report.summarize(log)
    out = args.out or os.path.join(args.logdir, "report")
    if not args.no_plots:
        try:
            plots = report.write_plots(log, summary, out)
            summary = dataclasses.replace(summary, plots=tuple(plots))
        except ImportError:
            print(
                "kmix report: matplotlib is not installed, so no plots were written "
                "(pip install matplotlib)",
                file=sys.stderr,
            )
        except OSError as error:
            return _error("report", f"cannot write plots to {out}: {error.strerror or error}")
    if args.json:
        print(report.to_json(summary))
    else:
        print(report.format_summary(summary))
        for path in summary.plots:
            print(f"plot: {path}")
    return 0


def _comparisons_under(parent: str) -> list[str]:
    """The directories under ``parent`` (or ``parent``) that hold a kmix compare record."""
    from kmix import tags

    return sorted(folder for folder, _, names in os.walk(parent) if tags.COMPARISON_FILE in names)


def _logdirs_under(parent: str) -> list[tuple[str, tuple[Any, ...]]]:
    """The log dirs under ``parent`` with kmix data, each with its runs (``RunInfo``)."""
    from kmix import report

    if not os.path.isdir(parent):
        return []
    from kmix import tags

    found = []
    for logdir in report.find_logdirs(parent):
        here = os.path.dirname(logdir)
        if os.path.basename(logdir) == tags.COMPARISON_RUN and os.path.isfile(
            os.path.join(here, tags.COMPARISON_FILE)
        ):
            continue  # the comparison's own record, not a training run: listed with its table
        try:
            logs = report.read_runs(logdir)
        except report.ReportError:
            continue
        found.append((logdir, tuple(log.run for log in logs if log.run is not None)))
    return found
