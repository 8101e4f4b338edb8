"""The ``kmix`` command: ``kmix demo``, ``kmix report LOGDIR`` and ``kmix doctor``.

Heavy modules (TensorFlow, Keras, matplotlib) are imported inside the subcommands,
so ``kmix --help`` and ``kmix report`` start without TensorFlow.

Exit status: 0 on success, 2 for bad input (arguments, a log dir without kmix data),
1 when training fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Mapping, Sequence

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
    try:
        return args.run(args)
    except BrokenPipeError:  # e.g. `kmix report LOGDIR | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


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
    demo.set_defaults(run=_run_demo)

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
    report.set_defaults(run=_run_report)

    doctor = commands.add_parser(
        "doctor",
        help="show hardware, the policy 'auto' would choose, and package versions",
        description=(
            "Print the detected hardware, the policy kmix.use('auto') would choose and "
            "why, and the versions of TensorFlow, Keras and TensorBoard, with a warning "
            "for combinations known not to work."
        ),
    )
    doctor.set_defaults(run=_run_doctor)
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
    if os.path.exists(args.logdir) and not os.path.isdir(args.logdir):
        return _error(
            "demo", f"--logdir {args.logdir} is a file: expected a directory (created if missing)"
        )
    from kmix import demo

    return demo.main(logdir=args.logdir, epochs=args.epochs, policy=args.policy)


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


def version_warnings(
    versions: Mapping[str, str | None],
    environ: Mapping[str, str],
    tensorflow_requires: Sequence[str] = (),
    backend: str | None = None,
) -> list[str]:
    """Finds package combinations known not to work with kmix.

    Args:
        versions: ``{package: version or None}``, as from :func:`package_versions`.
        environ: environment variables (``TF_USE_LEGACY_KERAS``, ``KERAS_BACKEND``).
        tensorflow_requires: TensorFlow's requirement strings, as from
            ``importlib.metadata.requires("tensorflow")``; its Keras pin is checked.
        backend: the active Keras backend, if known.

    Returns:
        One sentence per problem, saying what to do; empty when all is well.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    def parsed(name: str) -> Version | None:
        try:
            return Version(versions[name]) if versions.get(name) else None
        except InvalidVersion:
            return None

    warnings = []
    tf, keras, tensorboard = parsed("tensorflow"), parsed("keras"), parsed("tensorboard")
    if versions.get("tensorflow") is None:
        warnings.append(
            "TensorFlow is not installed: kmix.LossScaleOptimizer needs the TensorFlow "
            "backend (pip install 'tensorflow>=2.16')"
        )
    elif tf is not None and tf < Version("2.16"):
        warnings.append(
            f"TensorFlow {tf} is older than 2.16 and uses Keras 2 (tf.keras); kmix needs "
            "TensorFlow >= 2.16 with Keras 3 (pip install -U 'tensorflow>=2.16')"
        )
    if versions.get("keras") is None:
        warnings.append("Keras is not installed: kmix needs Keras 3 (pip install 'keras>=3.8')")
    elif keras is not None and keras < Version("3"):
        warnings.append(
            f"Keras {keras} is Keras 2; kmix needs Keras 3 (pip install -U 'keras>=3.8')"
        )
    elif keras is not None and keras < Version("3.8"):
        warnings.append(f"Keras {keras} is older than 3.8, which kmix needs (pip install -U keras)")
    for text in tensorflow_requires:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.name == "keras" and requirement.marker is None and keras is not None:
            if not requirement.specifier.contains(keras, prereleases=True):
                warnings.append(
                    f"TensorFlow {tf} expects keras{requirement.specifier} but Keras {keras} "
                    f"is installed (pip install 'keras{requirement.specifier}')"
                )
    if environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes"):
        tf_keras = versions.get("tf-keras")
        warnings.append(
            "TF_USE_LEGACY_KERAS is set, so tf.keras is Keras 2"
            + (f" (tf-keras {tf_keras})" if tf_keras else "")
            + ": models built with tf.keras do not work with kmix; use `import keras` "
            "(Keras 3) or unset TF_USE_LEGACY_KERAS"
        )
    chosen = backend or environ.get("KERAS_BACKEND")
    if chosen and chosen != "tensorflow":
        warnings.append(
            f"the Keras backend is {chosen!r}: kmix.LossScaleOptimizer and the callbacks "
            "need 'tensorflow' (set KERAS_BACKEND=tensorflow)"
        )
    if versions.get("tensorboard") is None:
        warnings.append(
            "TensorBoard is not installed: MixedPrecisionMonitor and kmix report need it "
            "(pip install tensorboard)"
        )
    elif tf is not None and tensorboard is not None and tensorboard.major < 2:
        warnings.append(f"TensorBoard {tensorboard} is too old for TensorFlow {tf}")
    return warnings


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
