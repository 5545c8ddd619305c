"""``python -m magi_core``: the ``magi`` command."""

from __future__ import annotations

import sys

from magi_core.cli import main

if __name__ == "__main__":
    sys.exit(main())
