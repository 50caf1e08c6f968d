"""Files the project reads and writes: JSON (config.json, manifests) with one clear error for a missing file,
bad JSON or a value that is not an object, writes through a temporary name, and content hashes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from k2trt.atomic import atomic_write_text
from k2trt.errors import K2Error


def read_json_object(path: Path, missing_hint: str, error=K2Error) -> dict:
    path = Path(path)
    if not path.exists():
        raise error(f"{path.parent}: no {path.name} ({missing_hint})")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object")
    return value


def write_json(path: Path, value: dict) -> None:
    atomic_write_text(Path(path), json.dumps(value, indent=1) + "\n")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
