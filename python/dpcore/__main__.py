"""``python -m dpcore``: the command line of :mod:`dpcore.cli` (also the ``dpcore`` console script)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
