"""Counts the ops of the train step that ``fit`` traces: what every step runs, and what
only a condition's branch runs. Deterministic, so two kmix versions compare exactly on a
noisy machine (the timing scripts say how much each op costs).

For each model (``bench_matrix.MODELS``) and configuration, fits one step in
``mixed_float16`` (so the optimizer is built and kmix has hooked the model), traces
``tf.function(model.train_step)`` (what ``fit``'s step calls) and walks its graph: ops
outside conditionals (called functions are entered), the ``If`` ops among them (each
runs every step and calls one branch), and the ops inside the branches (run only when
taken).

Configurations: ``stock`` (Keras's ``LossScaleOptimizer(Adam)``), ``optimizer`` (kmix's,
no callbacks), ``monitor`` (kmix's with ``MixedPrecisionMonitor`` at its defaults).

Usage: ``python bench/count_step_ops.py [--model mlp,deep]``; to count another kmix
version, put its checkout first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from bench_matrix import MODELS, kmix_optimizer, stock_optimizer  # noqa: E402

import kmix  # noqa: E402

CALLS = {"StatefulPartitionedCall", "PartitionedCall"}
CONDS = {"If", "StatelessIf"}


def count(graph_def: tf.compat.v1.GraphDef) -> tuple[int, int, int]:
    """``(ops outside conds, If ops outside conds, ops inside cond branches)``."""
    library = {f.signature.name: f for f in graph_def.library.function}
    outside = ifs = inside = 0

    def walk(nodes: list, in_cond: bool) -> None:
        nonlocal outside, ifs, inside
        for node in nodes:
            if in_cond:
                inside += 1
            else:
                outside += 1
                ifs += node.op in CONDS
            if node.op in CALLS:
                walk(library[node.attr["f"].func.name].node_def, in_cond)
            elif node.op in CONDS:
                for branch in ("then_branch", "else_branch"):
                    walk(library[node.attr[branch].func.name].node_def, True)

    walk(list(graph_def.node), False)
    return outside, ifs, inside


def traced(name: str, config: str, log_dir: str) -> tuple[int, int, int]:
    keras.utils.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model, x = MODELS[name][1]()
    y = np.random.randint(0, 10, len(x))
    opt = stock_optimizer() if config == "stock" else kmix_optimizer()
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [kmix.callbacks.MixedPrecisionMonitor(log_dir, verbose=0)]
    model.fit(x, y, epochs=1, verbose=0, callbacks=callbacks if config == "monitor" else [])
    spec = tuple(tf.TensorSpec(a.shape, a.dtype) for a in (x, y))
    function = tf.function(model.train_step).get_concrete_function(spec)
    return count(function.graph.as_graph_def())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp,deep")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(kmix.__file__)))
    print(f"kmix from {root}\n")
    print("| model | configuration | ops outside conds | `If` outside conds | ops in branches |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as log_dir:
        for name in args.model.split(","):
            for config in ("stock", "optimizer", "monitor"):
                outside, ifs, inside = traced(name, config, log_dir)
                print(f"| {name} | {config} | {outside} | {ifs} | {inside} |")


if __name__ == "__main__":
    main()
