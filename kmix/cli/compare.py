"""``kmix compare``: float32, mixed_float16 and mixed_bfloat16 side by side, on a model.

``kmix compare MODULE:FUNCTION --data MODULE:FUNCTION`` imports the user's functions
(the current directory first on the path, as ``python -m`` does), runs
:func:`kmix.compare_policies` and prints the table, the noise floor and the
recommendation (``--json``: the comparison's dict). ``kmix compare --demo`` compares
the digits CNN of ``kmix demo``. With ``--logdir DIR`` each policy is a TensorBoard run
``DIR/<policy>/train`` and the comparison is recorded in ``DIR``, which ``kmix report
DIR`` and the Mixed Precision tab show (:func:`report_comparison`).

Bad input (a target that is not ``MODULE:FUNCTION``, a module that does not import, a
function that returns no model, data that does not fit the model, a log dir in use)
is one line on stderr and exit status 2. Light at import: TensorFlow is imported
when the comparison starts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "DEMO_TARGET",
    "TargetError",
    "add_compare_parser",
    "demo_data",
    "demo_model",
    "load_target",
    "report_comparison",
    "run_compare",
]

BAD_INPUT = 2
DEMO_TARGET = "kmix.cli.compare:demo_model"
"""What ``--demo`` compares: the digits CNN of ``kmix demo``, compiled as the demo does."""


class TargetError(ValueError):
    """A ``MODULE:FUNCTION`` that cannot be used; the message says which and what to do."""


def add_compare_parser(commands: Any) -> argparse.ArgumentParser:
    """Adds the ``compare`` subcommand to the ``kmix`` parser's subcommands.

    Args:
        commands: the ``add_subparsers`` object of the ``kmix`` parser.

    Returns:
        The subcommand's parser.
    """
    from kmix.compare import COMPARABLE, DEFAULT_POLICIES

    compare = commands.add_parser(
        "compare",
        help="measure float32, mixed_float16 and mixed_bfloat16 side by side on a model",
        description=(
            "Train the model of MODULE:FUNCTION (a function returning a compiled or "
            "uncompiled keras.Model, built under the policy kmix sets) under each policy, "
            "in turns, beside a second float32 model that measures the noise floor; print "
            "step times, speed-ups, memory, loss, skipped steps and float16 headroom per "
            "policy, and the policy to use with its reasons. --demo compares kmix demo's "
            "digits CNN."
        ),
    )
    compare.add_argument(
        "target", nargs="?", metavar="MODULE:FUNCTION", help="the function that builds the model"
    )
    compare.add_argument("--demo", action="store_true", help="compare kmix demo's digits CNN")
    compare.add_argument(
        "--data",
        metavar="MODULE:FUNCTION",
        help="a function returning (x, y) arrays or a batched tf.data.Dataset of (x, y)",
    )
    compare.add_argument(
        "--steps", type=positive_int, default=200, help="steps per policy (%(default)s)"
    )
    compare.add_argument(
        "--rounds", type=positive_int, default=4, help="turns per policy (%(default)s)"
    )
    compare.add_argument(
        "--batch-size", type=positive_int, default=32, help="batch size of (x, y) data (32)"
    )
    compare.add_argument(
        "--policies",
        nargs="+",
        default=list(DEFAULT_POLICIES),
        metavar="POLICY",
        help=f"policies to compare, float32 among them; from {', '.join(COMPARABLE)}",
    )
    compare.add_argument("--loss", help="the loss of an uncompiled model, e.g. 'mse'")
    compare.add_argument(
        "--logdir", metavar="DIR", help="write a TensorBoard run per policy and the comparison"
    )
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    compare.add_argument(
        "--no-memory", action="store_true", help="skip the per-policy memory processes"
    )
    compare.set_defaults(run=run_compare, imports_tensorflow=True)
    return compare


def positive_int(text: str) -> int:
    """Parses an option that takes an integer >= 1 (``--steps``, ``--epochs``, ...).

    Args:
        text: the argument as given.

    Returns:
        The integer.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not an integer >= 1; argparse names the
            option and exits with status 2.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _error(message: str) -> int:
    print(f"kmix compare: {message}", file=sys.stderr)
    return BAD_INPUT


def load_target(target: str, option: str) -> Callable[..., Any]:
    """Imports ``MODULE:FUNCTION`` (the current directory first on the path).

    Args:
        target: the text given.
        option: how to name it in errors (``MODULE:FUNCTION`` or ``--data``).

    Returns:
        The function.

    Raises:
        TargetError: the text is not ``MODULE:FUNCTION``, the module does not import,
            or it has no such callable.
    """
    module_name, sep, name = target.partition(":")
    if not sep or not module_name or not name:
        raise TargetError(
            f"{option} {target!r} is not MODULE:FUNCTION: give a module and a function in "
            "it, e.g. mymodels:build_model for build_model in mymodels.py"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    missing = _not_defined(module_name, name.split(".")[0])
    if missing:  # said before the import, which may load TensorFlow (seconds)
        raise TargetError(
            f"{option} {target!r}: module {module_name} has no {name.split('.')[0]!r} (its "
            f"source, {missing}, defines none); give a function defined in it"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise TargetError(
            f"{option} {target!r}: no module named {error.name!r} "
            f"(looked in the current directory {os.getcwd()} and sys.path); run kmix compare "
            "where the module is, or install it"
        ) from None
    except Exception as error:  # the user's module raised while importing
        raise TargetError(
            f"{option} {target!r}: importing {module_name} raised {type(error).__name__}: "
            f"{_first_line(error)}"
        ) from None
    value: Any = module
    for part in name.split("."):
        value = getattr(value, part, None)
        if value is None:
            raise TargetError(
                f"{option} {target!r}: module {module_name} has no {name!r}; give a function "
                "defined in it"
            )
    if not callable(value):
        raise TargetError(
            f"{option} {target!r}: {name} is not a function but {type(value).__name__}; "
            "give a function that returns it"
        )
    return value


def _loss_problem(loss: str) -> str | None:
    """Why ``--loss`` names no Keras loss, or None when Keras knows it."""
    import keras

    try:
        keras.losses.get(loss)
    except (ValueError, TypeError):
        return (
            f"--loss {loss!r} is not a Keras loss: give a name Keras knows, e.g. 'mse', "
            "'binary_crossentropy' or 'sparse_categorical_crossentropy'"
        )
    return None


def _not_defined(module_name: str, name: str) -> str | None:
    """The module's file when its source plainly defines no ``name`` (no def, class,
    assignment or import of it anywhere, no star import); None when it may, or is not
    known."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    if spec is None or not origin or not origin.endswith(".py"):
        return None
    try:
        with open(origin, encoding="utf-8") as file:
            tree = ast.parse(file.read())
    except (OSError, SyntaxError, ValueError):
        return None  # the import says what is wrong
    defined: set[str] = set()  # anywhere in the source (under try/if too): never refuse
    for node in ast.walk(tree):  # what may be defined
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(alias.name == "*" for alias in node.names):
                return None
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    if name in defined or "__getattr__" in defined:
        return None
    return origin


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def demo_model() -> Any:
    """kmix demo's digits CNN, compiled as the demo compiles it (Adam 3e-3, cross-entropy).

    Returns:
        The compiled ``keras.Model``, under the current global policy.
    """
    import keras

    from kmix import demo

    model = demo.build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(demo.LEARNING_RATE),
        loss="sparse_categorical_crossentropy",
    )
    return model


def demo_data() -> tuple[Any, Any]:
    """kmix demo's training digits: ``(x, y)``, 1,497 images 8x8x1 in [0, 1]."""
    from kmix import demo

    return demo.split(*demo.load_digits())[0]


def _progress_printer() -> Callable[[Any], None]:
    """Progress on stderr: a line rewritten in place on a terminal, one per turn otherwise."""
    tty = sys.stderr.isatty()
    last = [0.0]

    def show(progress: Any) -> None:
        now = time.monotonic()
        done = progress.step == progress.steps
        if not done and now - last[0] < (0.25 if tty else 10.0):
            return
        last[0] = now
        where = "warm-up" if progress.round == 0 else f"round {progress.round}/{progress.rounds}"
        timing = ""
        if progress.step_time_s is not None:
            timing = f" ({progress.step_time_s * 1e3:.3g} ms/step)"
        line = f"kmix compare: {where}, {progress.run}, step {progress.step}/{progress.steps}"
        sys.stderr.write(("\r\033[K" if tty else "") + line + timing + ("" if tty else "\n"))
        sys.stderr.flush()

    return show


def run_compare(args: argparse.Namespace) -> int:
    """Runs ``kmix compare``.

    Args:
        args: the parsed arguments.

    Returns:
        The exit status: 0, or 2 for bad input.
    """
    if args.demo == bool(args.target):
        return _error(
            "give either MODULE:FUNCTION (a function that builds the model) with --data "
            "MODULE:FUNCTION, or --demo for kmix demo's digits CNN"
        )
    if args.demo and args.data:
        return _error(
            f"--demo trains on kmix demo's digits; --data {args.data} is for MODULE:FUNCTION: "
            "give one or the other"
        )
    if args.logdir is not None:
        from kmix.compare import logdir_problem

        problem = logdir_problem(args.logdir, "--logdir")
        if problem:
            return _error(problem)
    try:
        if args.demo:
            build, data, loss = demo_model, demo_data(), args.loss
        else:
            if not args.data:
                return _error(
                    f"{args.target} needs --data MODULE:FUNCTION, a function returning (x, y) "
                    "arrays or a batched tf.data.Dataset of (x, y) for the model"
                )
            build = load_target(args.target, "MODULE:FUNCTION")
            data_function = load_target(args.data, "--data")
            data, loss = _call_data(data_function, args.data), args.loss
    except TargetError as error:
        return _error(str(error))
    if loss is not None:
        problem = _loss_problem(loss)
        if problem:
            return _error(problem)
    from kmix.compare import CompareError, compare_policies

    policies = [p for text in args.policies for p in text.split(",") if p]
    try:
        comparison = compare_policies(
            build,
            data,
            policies=policies,
            steps=args.steps,
            logdir=args.logdir,
            rounds=args.rounds,
            batch_size=args.batch_size,
            loss=loss,
            measure_memory=not args.no_memory,
            progress=_progress_printer(),
        )
    except CompareError as error:
        return _error(str(error).replace("\n", " "))
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")  # the progress line
    if args.json:
        print(json.dumps(comparison.to_dict(), indent=1))
        return 0
    print(comparison.to_markdown())
    if args.logdir:
        print()
        print(f"TensorBoard (a run per policy): tensorboard --logdir {args.logdir}")
        print(f"again, from the logs: kmix report {args.logdir}")
    return 0


def _call_data(function: Callable[[], Any], target: str) -> Any:
    try:
        return function()
    except Exception as error:
        raise TargetError(
            f"--data {target!r} raised {type(error).__name__}: {_first_line(error)}"
        ) from None


def report_comparison(logdir: str, as_json: bool) -> bool:
    """Prints the comparison recorded in ``logdir`` (``kmix report DIR``), if there is one.

    Args:
        logdir: the directory given to ``kmix report``.
        as_json: print the comparison's dict as JSON.

    Returns:
        Whether ``logdir`` held a comparison (then it was printed).
    """
    from kmix import tags
    from kmix.compare import CompareError, comparison_from_dict

    data = tags.read_comparison_file(logdir)
    if data is None:
        return False
    try:
        comparison = comparison_from_dict(data)
    except CompareError:
        return False
    if as_json:
        print(json.dumps(comparison.to_dict(), indent=1))
        return True
    print(comparison.to_markdown())
    print()
    policies = ", ".join(row.policy for row in comparison.rows)
    print(f"each policy's own run: kmix report {os.path.join(logdir, '<policy>')} ({policies})")
    return True
