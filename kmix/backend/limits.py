"""Sizes the backend modules and the record's statistics share (a leaf: no imports)."""

STACK_LIMIT = 1 << 16
"""Elements from which a tensor is measured alone rather than stacked with others of its
shape (:mod:`kmix.record.grouped`), and below which JAX stacks a reduction's columns
(:func:`kmix.backend.jax.reduce_rows`): a stack is a copy, cheap only when small."""
