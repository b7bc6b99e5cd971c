"""Dataset sources: local files and folders, HF hub datasets when online; `#N` sampling as ms-swift.

A spec is `[hf::]source[#N]` (ms-swift's syntax):

    data.jsonl           every row, in file order
    data.jsonl#500       500 rows drawn with the run's seed (see `sample_indices`)
    hf::tatsu-lab/alpaca the HF hub, through `datasets.load_dataset` (offline: a one-line error)
    ms::...              ModelScope: refused with what to do instead (download, pass the folder)
    user/name            a bare hub id is looked up on the HF hub (ms-swift's default hub is ModelScope)

A local file whose whole name exists (even with a `#` in it) is that file. JSONL is read line by
line so that a bad line is reported as `file:line` (and optionally skipped and counted), never as a
parser traceback from deep inside a library. Other formats go through `datasets`: a folder saved
with `save_to_disk`, or any other folder of data files (what a hub or ModelScope download gives).
Several specs are concatenated in the order given (pipeline.py), each sampled on its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from swiftlite.errors import UserError

if TYPE_CHECKING:
    import numpy as np

HF_PREFIX, MS_PREFIX = "hf::", "ms::"
DEFAULT_SEED = 42  # ms-swift's and swiftlite's default --seed
FILE_KINDS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass
class Rows:
    """Rows of one source plus where each came from (for error messages)."""
    source: str
    rows: list[dict[str, Any]]
    where: list[str]
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Spec:
    """One parsed --dataset value."""
    text: str            # as given
    path: str            # file, folder or hub id, without the hub prefix and the count
    count: int | None    # #N
    hub: str | None      # "hf" (hf::), "ms" (ms::) or None


def parse_source(spec: str) -> Spec:
    """`hf::user/name#500` -> Spec(path="user/name", count=500, hub="hf"). Prefixes are
    case-insensitive, as in ms-swift; a spec that names an existing file is that file, `#` and all."""
    hub = None
    rest = spec
    head, sep, tail = spec.partition("::")
    if sep and head.strip().lower() in ("hf", "ms"):
        hub, rest = head.strip().lower(), tail
    if hub is None and Path(rest).expanduser().is_file():
        return Spec(spec, rest, None, None)
    path, count = rest, None
    if "#" in rest:
        path, _, n = rest.rpartition("#")
        try:
            count = int(n)
        except ValueError:
            raise UserError(f"--dataset {spec}: '#{n}' is not a row count") from None
        if count <= 0:
            raise UserError(f"--dataset {spec}: the row count must be > 0")
    if hub is not None and not path.strip():
        raise UserError(f"--dataset {spec}: no dataset id after '{hub}::'")
    return Spec(spec, path.strip() if hub else path, count, hub)


def parse_spec(spec: str) -> tuple[str, int | None]:
    """`data.jsonl#500` -> ("data.jsonl", 500); hub prefixes are dropped (see parse_source)."""
    s = parse_source(spec)
    return s.path, s.count


def sample_indices(n_rows: int, count: int, rng: "np.random.RandomState") -> list[int]:
    """The rows `#count` takes from a source of `n_rows`, by ms-swift's rule: every row
    `count // n_rows` times in file order, then the first `count % n_rows` of a seeded permutation.
    So `#N` below the size is a seeded sample without replacement (in the permutation's order),
    `#N` equal to the size is every row once, and beyond the size every row repeats as often as it
    fits and the rest is a seeded sample. numpy's RandomState seeded with --seed, as ms-swift's, so
    the same file, N and seed pick the same rows in both."""
    if n_rows == 0:
        return []
    full, rest = divmod(count, n_rows)
    idx = list(range(n_rows)) * full
    if rest:
        idx += rng.permutation(n_rows)[:rest].tolist()
    return idx


def _ms_error(spec: str, flag: str, path: str) -> UserError:
    return UserError(f"{flag} {spec}: ModelScope datasets are not supported (swiftlite reads local files and "
                     f"the Hugging Face hub); download it (`modelscope download --dataset {path} --local_dir DIR`) "
                     f"and pass the folder, or use hf::{path} if the dataset is on the HF hub")


def check_spec(spec: str, flag: str = "--dataset") -> None:
    """Cheap check of one --dataset/--val-dataset spec (no reading): it names an existing file of a
    supported type, a folder, or (only then) a hub id; `ms::` is refused here."""
    s = parse_source(spec)
    from swiftlite.data import registered
    if registered.find(s.path) is not None:   # a plugin registered it: read (and refused) with its meta
        return
    if s.hub == "ms":
        raise _ms_error(spec, flag, s.path)
    if s.hub == "hf":
        return
    path_s = s.path
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


def rename_columns(row: dict, columns: dict[str, str] | None) -> dict:
    """--columns (ms-swift's): the row with its keys old -> new renamed, the others kept."""
    if not columns:
        return row
    return {columns.get(k, k): v for k, v in row.items()}


def load_rows(spec: str, *, skip_bad_rows: bool = False,
              seed: "int | np.random.RandomState" = DEFAULT_SEED, columns: dict[str, str] | None = None) -> Rows:
    """Read one dataset spec into memory as plain dict rows; `#N` draws N of them with `seed` (an
    int, or a RandomState shared by several specs, as ms-swift shares one over its datasets);
    `columns` (--columns) renames keys before any row format reads them."""
    s = parse_source(spec)
    from swiftlite.data import registered
    meta = registered.find(s.path)
    if meta is not None:   # a plugin's register_dataset: its source, then its preprocessor (data/registered.py)
        src = registered.source(meta, spec)
        s = Spec(spec, src, s.count, "hf" if src == meta.hf_dataset_id and not meta.dataset_path else None)
    if s.hub == "ms":
        raise _ms_error(spec, "--dataset", s.path)
    path_s, limit = s.path, s.count
    path = Path(path_s).expanduser()
    skipped: list[str] = []
    rows: list[dict] = []
    where: list[str] = []
    if s.hub == "hf":
        rows, where = _load_hub(path_s, spec)
    elif path.is_dir():
        rows, where = _load_hf_folder(path)
    elif path.is_file():
        kind = FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise UserError(f"--dataset {path_s}: unsupported file type '{path.suffix}' "
                            f"(use {', '.join(FILE_KINDS)} or a saved HF dataset folder)")
        arr = _load_json_array(path) if path.suffix.lower() == ".json" else []
        if arr:
            for i, r in enumerate(arr):
                if not isinstance(r, dict):
                    raise UserError(f"{path}: item {i}: expected a JSON object, got {type(r).__name__}")
                rows.append(r)
                where.append(f"{path}: item {i}")
        elif kind == "json":
            for row, w in _iter_jsonl(path, skip_bad_rows, skipped):
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
        rows, where = _load_hub(path_s, spec)
    else:
        raise UserError(f"--dataset {path_s}: file not found")
    if meta is not None:
        rows, where = registered.preprocess(meta, rows, where)
    if limit is not None:
        import numpy as np
        rng = seed if isinstance(seed, np.random.RandomState) else np.random.RandomState(seed)
        idx = sample_indices(len(rows), limit, rng)
        rows, where = [rows[i] for i in idx], [where[i] for i in idx]
    if columns:
        rows = [rename_columns(r, columns) for r in rows]
    return Rows(spec, rows, where, skipped)


def _rows_from_dataset(ds: Any, label: str) -> tuple[list[dict], list[str]]:
    rows = [dict(r) for r in ds]
    return rows, [f"{label}: row {i + 1}" for i in range(len(rows))]


def _quiet_datasets() -> None:
    """No progress bars or hub retry warnings from `datasets` on stderr: errors are one line."""
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def _load_with_datasets(kind: str, path: Path) -> tuple[list[dict], list[str]]:
    import datasets
    _quiet_datasets()
    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # a parser error from pandas/pyarrow: name the file, one line
        raise UserError(f"{path}: cannot read as {kind}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return _rows_from_dataset(ds, str(path))


def _saved_with_save_to_disk(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_hf_folder(path: Path) -> tuple[list[dict], list[str]]:
    """A folder written by `save_to_disk`, else a folder of data files (its `train` split, as
    `datasets.load_dataset(folder)` finds it: what a hub or ModelScope download holds)."""
    import datasets
    _quiet_datasets()
    if not _saved_with_save_to_disk(path):
        try:
            ds = datasets.load_dataset(str(path), split="train")
        except Exception as e:
            raise UserError(f"--dataset {path}: not a saved HF dataset folder and no data files datasets can read "
                            f"({_first_line(e)})") from None
        return _rows_from_dataset(ds, str(path))
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise UserError(f"--dataset {path}: not a saved HF dataset folder ({_first_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"--dataset {path}: dataset dict has no 'train' split (has {', '.join(ds)})")
        ds = ds["train"]
    return _rows_from_dataset(ds, str(path))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _looks_like_hub_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/")) and not os.path.splitext(s)[1]


def _load_hub(name: str, spec: str) -> tuple[list[dict], list[str]]:
    """A dataset on the HF hub (its `train` split), for users with a network: `hf::name` or a bare
    `user/name`. Unreachable hub, unknown id: one line naming the dataset."""
    import datasets
    from huggingface_hub.utils import logging as hub_logging
    _quiet_datasets()
    level = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # its "Retrying in 8s" lines while the hub is unreachable
    try:
        ds = datasets.load_dataset(name, split="train")
    except ConnectionError as e:  # offline, DNS, HF_HUB_OFFLINE without a cached copy
        bare = "" if spec.lower().startswith(HF_PREFIX) else \
            " (a bare id is looked up on the HF hub; for a ModelScope dataset, download it and pass the folder)"
        raise UserError(f"--dataset {spec}: the Hugging Face hub is unreachable and {name} is not in the local "
                        f"datasets cache ({_first_line(e)}); download it where there is a network and pass its "
                        f"files or folder{bare}") from None
    except Exception as e:
        raise UserError(f"--dataset {spec}: not a local file and not loadable from the Hugging Face hub "
                        f"({type(e).__name__}: {_first_line(e)})") from None
    finally:
        hub_logging.set_verbosity(level)
    return _rows_from_dataset(ds, name)
