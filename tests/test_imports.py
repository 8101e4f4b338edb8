"""The layout holds: imports flow one way, each folder is entered by its face, the backend
is chosen in one place, and nothing hidden crosses modules.

Read from the source (every ``import`` statement, at module level or inside a function,
since a lazy import back is still a cycle), so the test needs no TensorFlow.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "kmix"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def package_of(name: str) -> str:
    """The folder a module lives in (a face is its own folder's)."""
    return name if name in PACKAGES else name.rpartition(".")[0]


def imports_of(name: str) -> set[str]:
    """The kmix modules ``name`` imports anywhere in its source.

    ``from kmix.record import health`` names the module ``kmix.record.health`` when that
    is a module, else the face ``kmix.record`` (a name it exports). Parent packages,
    which Python runs first, are not counted as edges.
    """
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
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
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
    assert "kmix.optimizer.recorder" in GRAPH["kmix.optimizer.loss_scale_optimizer"]
    assert "kmix.record" in GRAPH["kmix.optimizer.recorder"]
    assert "kmix.record.grouped" in GRAPH["kmix.record.health"]  # a sibling, by its module
    assert "kmix.tags" in reachable_from("kmix.report.summary")


def test_no_import_cycle():
    cycles = sorted(name for name in GRAPH if name in reachable_from(name))
    assert cycles == []


@pytest.mark.parametrize("training", ["kmix.optimizer", "kmix.record", "kmix.backend"])
def test_training_code_imports_no_callback_and_no_report(training):
    loaded = reachable_from(training) | {
        m for m in GRAPH if m.startswith(training + ".") for m in reachable_from(m)
    }
    assert not {m for m in loaded if m.startswith(("kmix.callbacks", "kmix.report"))}


def test_outside_a_folder_only_its_face_is_imported():
    """Code outside ``kmix/<folder>/`` imports ``kmix.<folder>``, never its modules."""
    crossings = {
        (name, target)
        for name, targets in GRAPH.items()
        for target in targets
        if target not in PACKAGES
        and package_of(target) != "kmix"
        and not (package_of(name) + ".").startswith(package_of(target) + ".")
    }
    assert crossings == set()


def test_few_modules_at_the_top_and_no_prefix_family():
    """At most 12 modules directly in kmix/ (faces and shared leaves), and no family of
    three or more sharing a ``_prefix_`` anywhere: such a family is a folder."""
    top = [p.name for p in ROOT.glob("*.py")]
    assert len(top) <= 12, sorted(top)
    families = collections.Counter()
    for path in ROOT.rglob("*.py"):
        match = re.match(r"(_?[a-z0-9]+)_", path.stem.lstrip("_"))
        if path.stem.startswith("_") and match:
            families[(str(path.parent), match.group(1))] += 1
    assert {family: n for family, n in families.items() if n >= 3} == {}


BACKEND_TEST = re.compile(
    r"on_jax\(\)|backend\(\) *[!=]=|name\(\) *[!=]=|^\s*import (tensorflow|jax|torch)\b"
    r"|^\s*from (tensorflow|jax|torch)\b",
    re.MULTILINE,
)
BACKEND_OWNERS = {
    "kmix.backend",
    "kmix.backend.tensorflow",
    "kmix.backend.jax",
    "kmix.backend.torch",
    "kmix.backend.generic",
    "kmix.optimizer.tensorflow_step",
    "kmix.optimizer.jax_step",
    "kmix.optimizer.torch_step",
    "kmix.optimizer.jax_shards",
}
"""The backend package and the step modules (the JAX step's shard check among them): where
kmix asks which backend it runs on."""
LIBRARY_USERS = {
    "kmix.tags.event_file": "tf.io.gfile for remote log dirs: the tags folder imports no Keras",
    "kmix.policy.machine": "lists a library's devices, before Keras is imported",
    "kmix.policy.timing": "times a named library's kernels, in a process without Keras",
}
"""The documented others: each uses a library by name, without Keras (so without the
backend package, which imports Keras)."""


def test_the_backend_is_asked_in_one_place():
    askers = {name for name, path in MODULES.items() if BACKEND_TEST.search(path.read_text())}
    assert askers - BACKEND_OWNERS == set(LIBRARY_USERS)


def test_no_hidden_channels():
    """One owner of thread-local state; no warning filtered by its words or all at once."""
    sources = {name: path.read_text() for name, path in MODULES.items()}
    assert {n for n, s in sources.items() if "threading.local(" in s} == {"kmix.optimizer.trace"}
    assert {
        n for n, s in sources.items() if re.search(r"simplefilter\([^)]*UserWarning", s)
    } == set()
    by_words = re.compile(r"filterwarnings\(\s*\"ignore\",\s*[r\"f]")
    assert {n for n, s in sources.items() if by_words.search(s)} == set()


def test_no_module_is_longer_than_500_lines_and_the_optimizer_class_350():
    """Small enough to read in one sitting: no kmix module over 500 lines, and
    LossScaleOptimizer, glue over the step recorder and the model hooks, at most 350."""
    lengths = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {name: n for name, n in lengths.items() if n > 500} == {}
    tree = ast.parse(MODULES["kmix.optimizer.loss_scale_optimizer"].read_text())
    (cls,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LossScaleOptimizer"
    ]
    assert cls.end_lineno - cls.lineno + 1 <= 350


@pytest.mark.slow
def test_importing_kmix_and_choosing_a_policy_change_nothing_in_keras():
    """kmix's fit wrapper comes with a kmix optimizer or callback, never with an import."""
    import subprocess
    import sys

    code = (
        "import kmix, keras; f = keras.Model.fit; kmix.use('mixed_float16'); "
        "import kmix.callbacks, kmix.report; assert keras.Model.fit is f; "
        "kmix.callbacks.MixedPrecisionMonitor('unused'); assert keras.Model.fit is not f"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
