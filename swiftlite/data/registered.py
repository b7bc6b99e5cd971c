"""Datasets a plugin file registers (ms-swift's `register_dataset(DatasetMeta(...))`, swiftlite/msswift_api/
dataset.py): a `--dataset` value equal to one of a meta's ids or its path reads the meta's source, the
Hugging Face hub id (`hf_dataset_id`) or the local `dataset_path`, and every row goes through the meta's
`preprocess_func` before swiftlite's formats read it (a row it returns None for is dropped, as ms-swift
drops it; `#N` then samples from what is left, ms-swift's order). A meta that names only a ModelScope id
is refused with what to do, as a ModelScope dataset is. The preprocessor's whole file and the local source's
files are part of the tokenization cache's key (data/pipeline.py), so an edited plugin or source is not
served stale rows.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any

from swiftlite.errors import UserError

#: name (ms-swift's key: dataset_name, or (ms id, hf id, path)) -> DatasetMeta
DATASETS: dict[Any, Any] = {}


def find(path: str) -> Any:
    """The registered meta a --dataset value (without hub prefix and #N) names, or None."""
    for meta in DATASETS.values():
        if path in meta.names():
            return meta
    return None


def source(meta: Any, spec: str) -> str:
    """Where the meta's rows are read from: its local path, else its HF hub id."""
    if meta.subsets or meta.split:
        raise UserError(f"--dataset {spec}: its registered DatasetMeta names subsets or splits, which swiftlite does "
                        "not read; register one meta per file (dataset_path) or hub id without them")
    if meta.dataset_path:
        return meta.dataset_path
    if meta.hf_dataset_id:
        return meta.hf_dataset_id
    raise UserError(f"--dataset {spec}: its registered DatasetMeta names only a ModelScope id ({meta.ms_dataset_id}); "
                    "swiftlite reads the Hugging Face hub and local files: add hf_dataset_id or dataset_path")


def preprocess(meta: Any, rows: list[dict], where: list[str]) -> tuple[list[dict], list[str]]:
    """Every row through the meta's preprocess_func (the plugin's code, with ms-swift's imports resolvable):
    the kept rows and where each came from."""
    f = meta.preprocess_func
    if f is None:
        return rows, where
    from swiftlite.plugin_imports import msswift_aliases
    out, at = [], []
    with msswift_aliases():
        for r, w in zip(rows, where):
            try:
                new = f(dict(r))
            except Exception as e:     # the plugin's own failure, on the row that caused it
                raise UserError(f"{w}: the registered preprocessor {type(f).__name__} failed: "
                                f"{type(e).__name__}: {e}") from None
            if new is not None:
                out.append(new)
                at.append(w)
    return out, at


def fingerprint(path: str) -> str:
    """What the tokenization cache keys a registered dataset by: the meta's ids, the whole file that defines its
    preprocessor (its code and the module-level values it reads), and its local source's files (size, mtime)."""
    meta = find(path)
    if meta is None:
        return ""
    h = hashlib.sha256(repr(meta.names()).encode())
    f = meta.preprocess_func
    if f is not None:
        target = f if inspect.isfunction(f) else type(f)
        try:
            h.update(Path(inspect.getsourcefile(target) or "").read_bytes())
        except (OSError, TypeError):
            h.update(repr(f).encode())
    if meta.dataset_path:
        src = Path(meta.dataset_path).expanduser()
        for p in ([src] if src.is_file() else sorted(q for q in src.rglob("*") if q.is_file()) if src.is_dir() else []):
            st = p.stat()
            h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


__all__ = ["DATASETS", "find", "fingerprint", "preprocess", "source"]
