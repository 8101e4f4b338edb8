"""The ``kmix`` command (entry point ``kmix.cli:main``; also ``python -m kmix.cli``).

- :mod:`~kmix.cli.commands`: the parser and ``kmix demo`` / ``report`` / ``doctor``.
- :mod:`~kmix.cli.compare`: ``kmix compare``.
- :mod:`~kmix.cli.doctor`: ``kmix doctor``'s checks and words.
- :mod:`~kmix.cli.stderr`: TensorFlow's start-up lines, dropped from stderr.
"""

from kmix.cli.commands import main

__all__ = ["main"]
