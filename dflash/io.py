"""Atomic writes: a reader (or a crash) never sees a half-written JSON file.

Every JSON and JSONL file dflash writes whole goes through here: temp file in the same folder,
flush, fsync, rename over the old one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path


def _replace(path: Path, write) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj, indent: int | None = 1) -> None:
    """`obj` as JSON (sorted keys) into `path`, atomically."""
    _replace(path, lambda f: json.dump(obj, f, indent=indent, sort_keys=True, default=str))


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    """One JSON object per line into `path`, atomically."""
    def write(f):
        for r in records:
            f.write(json.dumps(r) + "\n")

    _replace(path, write)


def write_text(path: Path, text: str) -> None:
    """`text` into `path`, atomically."""
    _replace(path, lambda f: f.write(text))


def unused_path(folder: Path, stem: str, suffix: str = ".json") -> Path:
    """folder/<stem><suffix>, or the first of <stem>-2, <stem>-3, ... that does not exist: a result written
    there never replaces one written before it (a second benchmark of the day goes beside the first)."""
    folder = Path(folder)
    for n in range(1, 10_000):
        path = folder / f"{stem}{'' if n == 1 else f'-{n}'}{suffix}"
        if not path.exists():
            return path
    raise FileExistsError(f"{folder}/{stem}-*{suffix}: 9999 files exist; move old results away")


def read_json(path: Path):
    return json.loads(Path(path).read_text())
