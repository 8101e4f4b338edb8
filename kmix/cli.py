"""The ``kmix`` command: ``kmix demo``, ``kmix report LOGDIR`` and ``kmix doctor``.

Heavy modules (TensorFlow, Keras, matplotlib) are imported inside the subcommands,
so ``kmix --help`` and ``kmix report`` start without TensorFlow.

Exit status: 0 on success, 2 for bad input (arguments, a log dir without kmix data, a
log dir the demo may not write to), 1 when training fails.

TensorFlow's start-up log lines ("Could not find cuda drivers", "failed call to
cuInit", oneDNN notes) are not what the user asked for: the commands that import
TensorFlow drop those known lines from stderr and pass every other line through
(:func:`quiet_tensorflow_startup`). ``TF_CPP_MIN_LOG_LEVEL=0 kmix ...`` shows them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kmix import __version__
from kmix.policy import POLICY_NAMES

BAD_INPUT = 2

PACKAGES = ("tensorflow", "keras", "tensorboard", "tf-keras", "numpy", "matplotlib", "kmix")
"""The packages ``kmix doctor`` reports the versions of."""


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
    parser = argparse.ArgumentParser(
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
            "ship with kmix, in mixed precision with kmix.LossScaleOptimizer, "
            "MixedPrecisionMonitor and LossScaleGuard. The loss scale starts far too "
            "high, so the first steps overflow and back off; the report shows the "
            "recovery. Then the same model trains in float32 for comparison."
        ),
    )
    demo.add_argument(
        "--logdir", default=os.path.join("runs", "demo"), help="TensorBoard log dir (%(default)s)"
    )
    demo.add_argument(
        "--epochs", type=_positive_int, default=10, help="epochs to train, >= 1 (%(default)s)"
    )
    demo.add_argument(
        "--policy",
        default="mixed_float16",
        choices=POLICY_NAMES,
        help="dtype policy for the mixed-precision run (%(default)s)",
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
            "scale event, gradient-health trends and findings; write PNG plots."
        ),
    )
    report.add_argument("logdir", metavar="LOGDIR", help="the log_dir given to the monitor")
    report.add_argument("--out", metavar="DIR", help="where to write the PNGs (LOGDIR/report)")
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    report.add_argument("--no-plots", action="store_true", help="do not write PNGs")
    report.set_defaults(run=_run_report, imports_tensorflow=False)

    doctor = commands.add_parser(
        "doctor",
        help="show hardware, the policy 'auto' would choose, and package versions",
        description=(
            "Print the detected hardware, the policy kmix.use('auto') would choose and "
            "why, and the versions of TensorFlow, Keras and TensorBoard, with a warning "
            "for combinations known not to work."
        ),
    )
    doctor.set_defaults(run=_run_doctor, imports_tensorflow=True)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _error(command: str, message: str) -> int:
    print(f"kmix {command}: {message}", file=sys.stderr)
    return BAD_INPUT


# ------------------------------------------------------------------------ demo
def _run_demo(args: argparse.Namespace) -> int:
    from kmix import demo  # light: TensorFlow is imported when training starts

    try:  # before TensorFlow starts, so that a bad --logdir is a quick one-line error
        demo.prepare_logdir(args.logdir, overwrite=args.overwrite)
    except demo.LogdirError as error:
        return _error("demo", str(error))
    except OSError as error:
        return _error("demo", _cannot_write(args.logdir, error))
    return demo.main(
        logdir=args.logdir, epochs=args.epochs, policy=args.policy, overwrite=args.overwrite
    )


def _cannot_write(logdir: str, error: OSError) -> str:
    where = f" ({error.filename})" if error.filename and error.filename != logdir else ""
    return (
        f"cannot write to --logdir {logdir}: {error.strerror or error}{where}; "
        "choose a directory you can write to, e.g. --logdir runs/demo"
    )


# ------------------------------------------------------ TensorFlow's start-up log
STARTUP_NOISE = (
    "All log messages before absl::InitializeLog() is called are written to STDERR",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions:",
    "oneDNN supports DT_HALF only on platforms with AVX-512",
    "Unable to register cuDNN factory",
    "Unable to register cuFFT factory",
    "Unable to register cuBLAS factory",
    "computation placer already registered",
    "TF-TRT Warning: Could not find TensorRT",
    "successful NUMA node read from SysFS had negative value",
)
"""Phrases of the lines TensorFlow logs at start-up that say nothing about the command."""

_LOG_PREFIX = re.compile(r"^(WARNING: |[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] |To enable )")


def is_startup_noise(line: str) -> bool:
    """Whether a stderr line is one of TensorFlow's known start-up log lines.

    Only lines in TensorFlow's (absl's) log format, or the line that continues its
    CPU-instructions note, that contain a phrase of :data:`STARTUP_NOISE` are noise;
    every other line (a traceback, a warning, a real error) is not.

    Args:
        line: one line of stderr, with or without its newline.

    Returns:
        True if the line should not be shown.
    """
    return bool(_LOG_PREFIX.match(line)) and any(phrase in line for phrase in STARTUP_NOISE)


@contextlib.contextmanager
def quiet_tensorflow_startup() -> Iterator[None]:
    """Drops TensorFlow's start-up log lines from this process's stderr, keeps the rest.

    TensorFlow's C++ side writes them to file descriptor 2 before its log levels
    apply, so ``TF_CPP_MIN_LOG_LEVEL`` cannot hide them all. Inside the block, file
    descriptor 2 is a pipe read by a thread that forwards each line to the real stderr
    unless :func:`is_startup_noise` says it is start-up noise. ``TF_CPP_MIN_LOG_LEVEL``
    is set to 2 (no info or warning lines) unless the user set it.

    Yields:
        Nothing; stderr is restored when the block ends.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    try:
        real = os.dup(2)
    except OSError:  # no stderr at all: nothing to keep quiet
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        with open(read_end, "rb", closefd=True) as pipe:
            for line in pipe:
                try:
                    keep = not is_startup_noise(line.decode("utf-8", "replace"))
                except Exception:  # never lose a line to a bug here
                    keep = True
                if keep:
                    _write_all(real, line)

    thread = threading.Thread(target=forward, name="kmix-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end: the thread reads to the end
        thread.join(timeout=10)
        os.close(real)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


# ---------------------------------------------------------------------- report
def _run_report(args: argparse.Namespace) -> int:
    import dataclasses

    from kmix import report

    report.avoid_tensorflow()
    try:
        log = report.read_log(args.logdir)
    except report.ReportError as error:
        return _error("report", str(error))
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


# ---------------------------------------------------------------------- doctor
def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, str | None]:
    """Returns the installed version of each package, ``None`` if it is not installed.

    Args:
        names: distribution names, e.g. ``("tensorflow", "keras")``.

    Returns:
        ``{name: version or None}``.
    """
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@dataclasses.dataclass(frozen=True)
class VersionFacts:
    """What the rules of :func:`version_warnings` look at.

    Attributes:
        versions: ``{package: version or None}``, as from :func:`package_versions`.
        tensorflow: TensorFlow's version as ``packaging.version.Version``, or None when it
            is not installed or cannot be parsed; likewise ``keras`` and ``tensorboard``.
        keras_pin: the ``keras`` requirement TensorFlow declares (without a marker), or None.
        legacy_keras: whether ``TF_USE_LEGACY_KERAS`` is set, making ``tf.keras`` Keras 2.
        backend: the Keras backend in use or chosen by ``KERAS_BACKEND``, or None.
    """

    versions: Mapping[str, str | None]
    tensorflow: Any
    keras: Any
    tensorboard: Any
    keras_pin: Any
    legacy_keras: bool
    backend: str | None

    def missing(self, name: str) -> bool:
        """Whether the package ``name`` is not installed."""
        return self.versions.get(name) is None


def _older(version: Any, release: tuple[int, ...]) -> bool:
    return version is not None and version.release < release


VERSION_RULES: tuple[tuple[Callable[[VersionFacts], bool], Callable[[VersionFacts], str]], ...] = (
    (
        lambda f: f.missing("tensorflow"),
        lambda f: (
            "TensorFlow is not installed: kmix.LossScaleOptimizer needs the TensorFlow "
            "backend (pip install 'tensorflow>=2.16')"
        ),
    ),
    (
        lambda f: _older(f.tensorflow, (2, 16)),
        lambda f: (
            f"TensorFlow {f.tensorflow} is older than 2.16 and uses Keras 2 (tf.keras); "
            "kmix needs TensorFlow >= 2.16 with Keras 3 (pip install -U 'tensorflow>=2.16')"
        ),
    ),
    (
        lambda f: f.missing("keras"),
        lambda f: "Keras is not installed: kmix needs Keras 3 (pip install 'keras>=3.8')",
    ),
    (
        lambda f: _older(f.keras, (3,)),
        lambda f: f"Keras {f.keras} is Keras 2; kmix needs Keras 3 (pip install -U 'keras>=3.8')",
    ),
    (
        lambda f: not _older(f.keras, (3,)) and _older(f.keras, (3, 8)),
        lambda f: f"Keras {f.keras} is older than 3.8, which kmix needs (pip install -U keras)",
    ),
    (
        lambda f: (
            f.keras is not None
            and f.keras_pin is not None
            and not f.keras_pin.contains(f.keras, prereleases=True)
        ),
        lambda f: (
            f"TensorFlow {f.tensorflow} expects keras{f.keras_pin} but Keras {f.keras} "
            f"is installed (pip install 'keras{f.keras_pin}')"
        ),
    ),
    (
        lambda f: f.legacy_keras,
        lambda f: (
            "TF_USE_LEGACY_KERAS is set, so tf.keras is Keras 2"
            + (f" (tf-keras {f.versions['tf-keras']})" if f.versions.get("tf-keras") else "")
            + ": models built with tf.keras do not work with kmix; use `import keras` "
            "(Keras 3) or unset TF_USE_LEGACY_KERAS"
        ),
    ),
    (
        lambda f: f.backend not in (None, "", "tensorflow"),
        lambda f: (
            f"the Keras backend is {f.backend!r}: kmix.LossScaleOptimizer and the "
            "callbacks need 'tensorflow' (set KERAS_BACKEND=tensorflow)"
        ),
    ),
    (
        lambda f: f.missing("tensorboard"),
        lambda f: (
            "TensorBoard is not installed: MixedPrecisionMonitor and kmix report need it "
            "(pip install tensorboard)"
        ),
    ),
    (
        lambda f: f.tensorflow is not None and _older(f.tensorboard, (2,)),
        lambda f: f"TensorBoard {f.tensorboard} is too old for TensorFlow {f.tensorflow}",
    ),
)
"""``(when, says)`` pairs: the package combinations known not to work, in the order shown."""


def version_facts(
    versions: Mapping[str, str | None],
    environ: Mapping[str, str],
    tensorflow_requires: Sequence[str] = (),
    backend: str | None = None,
) -> VersionFacts:
    """Parses versions, TensorFlow's Keras pin and the environment for the rules.

    Args:
        versions: ``{package: version or None}``, as from :func:`package_versions`.
        environ: environment variables (``TF_USE_LEGACY_KERAS``, ``KERAS_BACKEND``).
        tensorflow_requires: TensorFlow's requirement strings, as from
            ``importlib.metadata.requires("tensorflow")``.
        backend: the active Keras backend, if known.

    Returns:
        A :class:`VersionFacts`; what cannot be parsed is None.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    def parsed(name: str) -> Version | None:
        try:
            return Version(versions[name]) if versions.get(name) else None
        except InvalidVersion:
            return None

    pin = None
    for text in tensorflow_requires:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.name == "keras" and requirement.marker is None:
            pin = requirement.specifier
    return VersionFacts(
        versions=versions,
        tensorflow=parsed("tensorflow"),
        keras=parsed("keras"),
        tensorboard=parsed("tensorboard"),
        keras_pin=pin,
        legacy_keras=environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes"),
        backend=backend or environ.get("KERAS_BACKEND"),
    )


def version_warnings(
    versions: Mapping[str, str | None],
    environ: Mapping[str, str],
    tensorflow_requires: Sequence[str] = (),
    backend: str | None = None,
) -> list[str]:
    """Finds package combinations known not to work with kmix (:data:`VERSION_RULES`).

    Args:
        versions: ``{package: version or None}``, as from :func:`package_versions`.
        environ: environment variables (``TF_USE_LEGACY_KERAS``, ``KERAS_BACKEND``).
        tensorflow_requires: TensorFlow's requirement strings, as from
            ``importlib.metadata.requires("tensorflow")``; its Keras pin is checked.
        backend: the active Keras backend, if known.

    Returns:
        One sentence per problem, saying what to do; empty when all is well.
    """
    facts = version_facts(versions, environ, tensorflow_requires, backend)
    return [says(facts) for when, says in VERSION_RULES if when(facts)]


def _run_doctor(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from kmix.hardware import hardware
    from kmix.policy import choose_auto, float16_slow_reason

    versions = package_versions()
    print("versions")
    width = max(map(len, versions))
    for name, version in versions.items():
        print(f"  {name:<{width}}  {version or 'not installed'}")
    try:
        detected = hardware()
    except Exception as error:  # a broken TensorFlow install: say so, do not crash
        print(f"kmix doctor: could not detect the hardware: {error}", file=sys.stderr)
        return 1
    print("hardware")
    print("\n".join(f"  {line}" for line in str(detected).splitlines()))
    name, reason = choose_auto(detected)
    print(f'kmix.use("auto") would choose {name}: {reason}')
    slow = float16_slow_reason(detected)
    if slow:
        print(f"float16 here: {slow}")
    backend = None
    if versions["keras"]:
        try:
            import keras

            backend = keras.backend.backend()
            print(f"Keras backend: {backend}")
        except Exception as error:
            print(f"warning: Keras does not import: {error}")
    try:
        requires = importlib.metadata.requires("tensorflow") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    problems = version_warnings(versions, os.environ, requires, backend)
    for problem in problems:
        print(f"warning: {problem}")
    if not problems:
        print("no known problems with these versions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
