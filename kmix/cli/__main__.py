"""``python -m kmix.cli``: the ``kmix`` command."""

import sys

from kmix.cli import main

sys.exit(main())
