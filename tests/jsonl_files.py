"""JSONL files for the bulk tests: written from dicts (or raw lines, to test malformed ones) and read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_jsonl(path: Path, items: list[Any]) -> Path:
    """One line per item: a str as it is, anything else as JSON."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]
