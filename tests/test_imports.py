"""Imports flow one way: no cycle among kmix's modules, training code loads no reader.

Read from the source (every ``import`` statement, at module level or inside a function,
since a lazy import back is still a cycle), so the test needs no TensorFlow.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "kmix"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The kmix modules ``name`` imports anywhere in its source (the package root aside)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != "kmix" and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name) for name in MODULES if name != "kmix"}


def reachable_from(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for child in GRAPH[todo.pop()]:
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def test_the_graph_reader_sees_known_edges():
    assert "kmix.step_recorder" in GRAPH["kmix.optimizer"]
    assert "kmix.record" in GRAPH["kmix.step_recorder"]
    assert "kmix.tags" in reachable_from("kmix.report.summary")


def test_no_import_cycle():
    cycles = sorted(name for name in GRAPH if name in reachable_from(name))
    assert cycles == []


@pytest.mark.parametrize("training", ["kmix.optimizer", "kmix.step_recorder", "kmix.model_hooks"])
def test_training_code_imports_no_callback_and_no_report(training):
    loaded = reachable_from(training)
    assert not {m for m in loaded if m.startswith(("kmix.callbacks", "kmix.report"))}


def test_no_module_is_longer_than_500_lines_and_the_optimizer_class_350():
    """Small enough to read in one sitting (issue 20): no kmix module over 500 lines, and
    LossScaleOptimizer, glue over the step recorder and the model hooks, at most 350."""
    lengths = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {name: n for name, n in lengths.items() if n > 500} == {}
    tree = ast.parse(MODULES["kmix.optimizer"].read_text())
    (cls,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LossScaleOptimizer"
    ]
    assert cls.end_lineno - cls.lineno + 1 <= 350
