"""Output shared by the benchmark scripts: print the result document and write it where ``--out`` says."""

from __future__ import annotations

import json
from typing import Any


def emit_json(doc: Any, path: str | None) -> None:
    """Print ``doc`` as indented JSON and also write it to ``path`` when given."""
    text = json.dumps(doc, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    print(text)
