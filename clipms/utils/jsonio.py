"""JSON files of the library: written atomically (clipms.utils.atomic), key-sorted, pretty."""

# tested by: tests/clipms/deploy/test_searchindex.py

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clipms.utils.atomic import write_text


def write_json(path: Path | str, obj: Any) -> None:
    """Write `obj` as pretty, key-sorted JSON, atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path | str) -> Any:
    """Read a JSON file."""
    return json.loads(Path(path).read_text())
