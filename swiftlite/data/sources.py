"""Dataset sources: local files and saved HF dataset folders, hub ids when online.

A spec is `path` or `path#N` (take the first N rows). JSONL is read line by line so that a bad line
is reported as `file:line` (and optionally skipped and counted), never as a parser traceback from
deep inside a library. Other formats go through `datasets`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from swiftlite.errors import UserError

FILE_KINDS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass
class Rows:
    """Rows of one source plus where each came from (for error messages)."""
    source: str
    rows: list[dict[str, Any]]
    where: list[str]
    skipped: list[str] = field(default_factory=list)


def parse_spec(spec: str) -> tuple[str, int | None]:
    """`data.jsonl#500` -> ("data.jsonl", 500)."""
    if "#" in spec:
        path, _, n = spec.rpartition("#")
        try:
            count = int(n)
        except ValueError:
            raise UserError(f"--dataset {spec}: '#{n}' is not a row count") from None
        if count <= 0:
            raise UserError(f"--dataset {spec}: the row count must be > 0")
        return path, count
    return spec, None


def check_spec(spec: str, flag: str = "--dataset") -> None:
    """Cheap check of one --dataset/--val-dataset spec (no reading): it names an existing file of a
    supported type, a folder, or (only then) a hub id."""
    path_s, _ = parse_spec(spec)
    path = Path(path_s).expanduser()
    if path.is_dir():
        return
    if path.is_file():
        if path.suffix.lower() not in FILE_KINDS:
            raise UserError(f"{flag} {path_s}: unsupported file type '{path.suffix}' "
                            f"(use {', '.join(FILE_KINDS)} or a saved HF dataset folder)")
        return
    if path.exists():
        raise UserError(f"{flag} {path_s}: not a regular file or folder")
    if not _looks_like_hub_id(path_s):
        raise UserError(f"{flag} {path_s}: file not found")


def _iter_jsonl(path: Path, skip_bad: bool, skipped: list[str]) -> Iterator[tuple[dict, str]]:
    with path.open("rb") as fh:  # bytes, decoded line by line: a bad byte is reported on its own line
        lineno = 0
        for raw in fh:
            lineno += 1
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                msg = f"{where}: not UTF-8 text ({e.reason} at byte {e.start + 1})"
                if skip_bad:
                    skipped.append(msg)
                    continue
                raise UserError(msg) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                msg = f"{where}: not valid JSON ({e.msg} at column {e.colno})"
                if skip_bad:
                    skipped.append(msg)
                    continue
                raise UserError(msg) from None
            if not isinstance(row, dict):
                msg = f"{where}: expected a JSON object, got {type(row).__name__}"
                if skip_bad:
                    skipped.append(msg)
                    continue
                raise UserError(msg)
            yield row, where


def _load_json_array(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if not stripped.startswith("["):
        return []  # JSON lines with a .json suffix: handled by the JSONL reader
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    return data


def load_rows(spec: str, *, skip_bad_rows: bool = False) -> Rows:
    """Read one dataset spec into memory as plain dict rows."""
    path_s, limit = parse_spec(spec)
    path = Path(path_s).expanduser()
    skipped: list[str] = []
    rows: list[dict] = []
    where: list[str] = []
    if path.is_dir():
        rows, where = _load_hf_folder(path)
    elif path.is_file():
        kind = FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise UserError(f"--dataset {path_s}: unsupported file type '{path.suffix}' "
                            f"(use {', '.join(FILE_KINDS)} or a saved HF dataset folder)")
        if path.suffix.lower() == ".json":
            arr = _load_json_array(path)
            if arr:
                for i, r in enumerate(arr):
                    if limit is not None and len(rows) >= limit:
                        break
                    if not isinstance(r, dict):
                        raise UserError(f"{path}: item {i}: expected a JSON object, got {type(r).__name__}")
                    rows.append(r)
                    where.append(f"{path}: item {i}")
                return Rows(spec, rows, where, skipped)
        if kind == "json":
            for row, w in _iter_jsonl(path, skip_bad_rows, skipped):
                if limit is not None and len(rows) >= limit:
                    break
                rows.append(row)
                where.append(w)
        elif kind == "text":
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    rows.append({"text": line})
                    where.append(f"{path}:{i}")
        else:
            rows, where = _load_with_datasets(kind, path)
    elif _looks_like_hub_id(path_s):
        rows, where = _load_hub(path_s)
    else:
        raise UserError(f"--dataset {path_s}: file not found")
    if limit is not None:
        rows, where = rows[:limit], where[:limit]
    return Rows(spec, rows, where, skipped)


def _rows_from_dataset(ds: Any, label: str) -> tuple[list[dict], list[str]]:
    rows = [dict(r) for r in ds]
    return rows, [f"{label}: row {i}" for i in range(len(rows))]


def _load_with_datasets(kind: str, path: Path) -> tuple[list[dict], list[str]]:
    import datasets
    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # a parser error from pandas/pyarrow: name the file, one line
        raise UserError(f"{path}: cannot read as {kind}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return _rows_from_dataset(ds, str(path))


def _load_hf_folder(path: Path) -> tuple[list[dict], list[str]]:
    import datasets
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise UserError(f"--dataset {path}: not a saved HF dataset folder ({str(e).splitlines()[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"--dataset {path}: dataset dict has no 'train' split (has {', '.join(ds)})")
        ds = ds["train"]
    return _rows_from_dataset(ds, str(path))


def _looks_like_hub_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/")) and not os.path.splitext(s)[1]


def _load_hub(name: str) -> tuple[list[dict], list[str]]:
    """Hub datasets, for users with a network (offline this fails with a clear message)."""
    import datasets
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:
        raise UserError(f"--dataset {name}: not a local file and not loadable from the hub "
                        f"({type(e).__name__})") from None
    return _rows_from_dataset(ds, name)
