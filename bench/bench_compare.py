"""Model and data for ``kmix compare`` on a Transformer block (issue 23).

The Transformer encoder of ``bench_matrix.py`` (4 blocks, width 64, sequence 32,
vocabulary 1000), compiled with Adam and a from-logits cross-entropy, on 2,048 random
token sequences whose label is the first token modulo 10 (learnable, so the loss
curves fall and can be compared). From the repository root::

    cd bench && kmix compare bench_compare:transformer_model \\
        --data bench_compare:transformer_data --logdir /tmp/compare-transformer

``kmix compare --demo`` is the digits CNN; ``bench/README.md`` records both.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

EXAMPLES = 2048
SEQUENCE = 32
VOCABULARY = 1000


def transformer_model():
    """bench_matrix's Transformer encoder, compiled (built under the current policy).

    Returns:
        The compiled ``keras.Model``.
    """
    import keras
    from bench_matrix import transformer

    model, _ = transformer(seq=SEQUENCE, vocab=VOCABULARY)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def transformer_data() -> tuple[np.ndarray, np.ndarray]:
    """2,048 token sequences and labels (the first token modulo 10), seeded.

    Returns:
        ``(tokens, labels)``: int32 arrays of shapes (2048, 32) and (2048,).
    """
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCABULARY, (EXAMPLES, SEQUENCE)).astype("int32")
    return tokens, (tokens[:, 0] % 10).astype("int32")
