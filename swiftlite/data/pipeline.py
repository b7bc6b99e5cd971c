"""Dataset specs -> tokenized train/validation rows, cached on disk.

Rows are converted (formats.py) and tokenized (tokenize.py) in plain Python with the fast tokenizer;
the result is cached as a NumPy .npz (no pickle) keyed by the source files, tokenizer, template,
max length, truncation strategy, system prompt, task and packing, so a second run or every rank after
the first skips the work. Rows longer than --max-length are deleted (ms-swift's default; counted in
`DataStats.deleted`) or cut on the left or right (counted in `DataStats.truncated`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from swiftlite.data.collate import pack_rows
from swiftlite.data.formats import to_messages, to_text
from swiftlite.data.sources import load_rows, parse_spec
from swiftlite.config.tasks import task_spec
from swiftlite.data.tokenize import IGNORE, encode_messages, encode_text
from swiftlite import env
from swiftlite.errors import UserError

CACHE_VERSION = 3


@dataclass
class DataStats:
    rows: int = 0              # rows read and tokenized
    truncated: int = 0         # cut to --max-length (--truncation-strategy left/right), kept
    skipped: list[str] = field(default_factory=list)
    no_target: int = 0         # dropped: no target token left
    deleted: int = 0           # dropped: longer than --max-length (--truncation-strategy delete)

    def add(self, other: "DataStats") -> None:
        self.rows += other.rows
        self.truncated += other.truncated
        self.skipped += other.skipped
        self.no_target += other.no_target
        self.deleted += other.deleted

    def unusable(self) -> str:
        """Why rows were not used, for "no usable rows" errors."""
        return (f"read {self.rows}, skipped {len(self.skipped)}, {self.no_target} without an answer"
                + (f", {self.deleted} longer than --max-length deleted" if self.deleted else ""))


@dataclass
class Tokenized:
    rows: list[dict[str, Any]]  # {"input_ids": [...], "labels": [...], (position_ids)}
    stats: DataStats

    def targets(self, i: int) -> int:
        lab = self.rows[i]["labels"]
        return sum(1 for x in lab[1:] if x != IGNORE)


def cache_dir() -> Path:
    return env.settings().cache / "tokenized"


def _fingerprint(specs: list[str], tokenizer: Any, extra: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"v": CACHE_VERSION, **extra}, sort_keys=True).encode())
    for spec in specs:
        path, _ = parse_spec(spec)
        p = Path(path)
        h.update(spec.encode())
        if p.is_file():
            st = p.stat()
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file():
                    st = f.stat()
                    h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update((getattr(tokenizer, "chat_template", "") or "").encode())
    h.update(str(getattr(tokenizer, "name_or_path", "")).encode())
    h.update(str(len(tokenizer)).encode())
    return h.hexdigest()[:24]


def _save_cache(path: Path, tok: Tokenized) -> None:
    lengths = np.array([len(r["input_ids"]) for r in tok.rows], dtype=np.int64)
    ids = np.concatenate([np.asarray(r["input_ids"], dtype=np.int64) for r in tok.rows]) if tok.rows else np.zeros(0, np.int64)
    labels = np.concatenate([np.asarray(r["labels"], dtype=np.int64) for r in tok.rows]) if tok.rows else np.zeros(0, np.int64)
    arrays = {"lengths": lengths, "ids": ids, "labels": labels}
    if tok.rows and "position_ids" in tok.rows[0]:
        arrays["pos"] = np.concatenate([np.asarray(r["position_ids"], dtype=np.int64) for r in tok.rows])
    stats = json.dumps({"rows": tok.stats.rows, "truncated": tok.stats.truncated,
                        "skipped": tok.stats.skipped, "no_target": tok.stats.no_target,
                        "deleted": tok.stats.deleted})
    arrays["stats"] = np.frombuffer(stats.encode(), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _load_cache(path: Path) -> Tokenized | None:
    try:
        z = np.load(path, allow_pickle=False)
        lengths, ids, labels = z["lengths"], z["ids"], z["labels"]
        pos = z["pos"] if "pos" in z.files else None
        st = json.loads(bytes(z["stats"]).decode())
    except (OSError, ValueError, KeyError):
        return None
    rows = []
    off = 0
    for n in lengths.tolist():
        r = {"input_ids": ids[off:off + n].tolist(), "labels": labels[off:off + n].tolist()}
        if pos is not None:
            r["position_ids"] = pos[off:off + n].tolist()
        rows.append(r)
        off += n
    return Tokenized(rows, DataStats(**st))


def _encode_rows(items: list[tuple[dict, str]], tokenizer: Any, task: str, max_length: int,
                 skip_bad_rows: bool, truncation: str = "right", system: str | None = None
                 ) -> tuple[list[dict], DataStats]:
    """Tokenize (row, where) pairs in order; rows with no target token are dropped and counted, and so
    are rows longer than max_length under truncation "delete". A bad row raises its UserError, or is
    skipped and counted with --skip-bad-rows."""
    stats = DataStats()
    rows: list[dict] = []
    cut = "right" if truncation == "delete" else truncation
    for row, where in items:
        try:
            if task_spec(task).plain_text:  # pt: every token a target, no template
                enc = encode_text(tokenizer, to_text(row, where), max_length, truncation=cut)
            else:
                enc = encode_messages(tokenizer, to_messages(row, where), max_length, where, truncation=cut,
                                      system=system)
        except UserError as e:
            if skip_bad_rows:
                stats.skipped.append(str(e))
                continue
            raise
        stats.rows += 1
        if enc.truncated and truncation == "delete":
            stats.deleted += 1
            continue
        stats.truncated += int(enc.truncated)
        if not any(x != IGNORE for x in enc.labels[1:]):
            stats.no_target += 1  # nothing to learn (e.g. the answer was truncated away)
            continue
        rows.append({"input_ids": enc.input_ids, "labels": enc.labels})
    return rows, stats


# What forked tokenization workers use: set in the parent just before the pool forks, so the
# tokenizer (a Rust object that does not pickle cheaply) is inherited, never sent.
_WORKER: dict[str, Any] = {}


def _encode_chunk(items: list[tuple[dict, str]]) -> tuple[list[dict], DataStats] | UserError:
    w = _WORKER
    try:
        return _encode_rows(items, w["tokenizer"], w["task"], w["max_length"], w["skip"], w["truncation"],
                            w["system"])
    except UserError as e:  # returned, not raised: the parent re-raises the first one in row order
        return e


def _encode_parallel(items: list[tuple[dict, str]], tokenizer: Any, task: str, max_length: int,
                     skip_bad_rows: bool, num_proc: int, truncation: str = "right",
                     system: str | None = None) -> tuple[list[dict], DataStats]:
    """`_encode_rows` over `num_proc` forked processes, chunked in row order: the same rows, stats
    and first error as one process. The tokenizer's own thread pool is turned off first (a forked
    Rust pool deadlocks)."""
    import multiprocessing as mp
    env.set_default("TOKENIZERS_PARALLELISM", "false")
    n_chunks = num_proc * 4
    size = max(1, -(-len(items) // n_chunks))
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    _WORKER.update(tokenizer=tokenizer, task=task, max_length=max_length, skip=skip_bad_rows,
                   truncation=truncation, system=system)
    try:
        with mp.get_context("fork").Pool(num_proc) as pool:
            parts = pool.map(_encode_chunk, chunks)
    finally:
        _WORKER.clear()
    rows: list[dict] = []
    stats = DataStats()
    for part in parts:
        if isinstance(part, UserError):
            raise part
        r, st = part
        rows += r
        stats.add(st)
    return rows, stats


#: Below this many rows a process pool costs more than it saves.
PARALLEL_MIN_ROWS = 2000


def tokenize_specs(specs: list[str], tokenizer: Any, *, task: str, max_length: int, packing: bool,
                   skip_bad_rows: bool, use_cache: bool = True, num_proc: int = 1,
                   progress: Callable[[str, int], Any] | None = None, truncation_strategy: str = "right",
                   system: str | None = None, seed: int = 42) -> Tokenized:
    """Load, convert and tokenize every spec; rows with no target token are dropped and counted, and
    rows over max_length are cut or (truncation_strategy "delete") dropped and counted. `system` is the
    system turn of sft rows that have none. `num_proc` > 1 (--dataset-num-proc) tokenizes in that many
    forked processes (files of at least PARALLEL_MIN_ROWS rows); the result is identical to one process.
    `path#N` specs draw their rows with `seed` (one RandomState over the specs in order, as ms-swift),
    then the specs are concatenated."""
    key = _fingerprint(specs, tokenizer, {"task": task, "max_length": max_length, "packing": packing,
                                          "skip": skip_bad_rows, "truncation": truncation_strategy,
                                          "system": system, "seed": seed})
    cpath = cache_dir() / f"{key}.npz"
    if use_cache and cpath.is_file():
        cached = _load_cache(cpath)
        if cached is not None:
            return cached
    stats = DataStats()
    rows: list[dict] = []
    rng = np.random.RandomState(seed)
    for spec in specs:
        src = load_rows(spec, skip_bad_rows=skip_bad_rows, seed=rng)
        stats.skipped += src.skipped
        items = list(zip(src.rows, src.where))
        if num_proc > 1 and len(items) >= PARALLEL_MIN_ROWS:
            part, st = _encode_parallel(items, tokenizer, task, max_length, skip_bad_rows, num_proc,
                                        truncation_strategy, system)
        else:
            it = progress(f"tokenizing {spec}", len(items))(items) if progress is not None else items
            part, st = _encode_rows(it, tokenizer, task, max_length, skip_bad_rows, truncation_strategy, system)
        rows += part
        stats.add(st)
    if packing:
        rows = pack_rows(rows, max_length)
    tok = Tokenized(rows, stats)
    if use_cache:
        _save_cache(cpath, tok)
    return tok


def split_validation(tok: Tokenized, ratio: float, seed: int) -> tuple[Tokenized, Tokenized]:
    """Hold out a seeded share of the rows for validation."""
    import random
    idx = list(range(len(tok.rows)))
    random.Random(seed).shuffle(idx)
    n_val = max(1, int(round(len(idx) * ratio)))
    val_set = set(idx[:n_val])
    train = [r for i, r in enumerate(tok.rows) if i not in val_set]
    val = [r for i, r in enumerate(tok.rows) if i in val_set]
    kind = type(tok)  # Tokenized, or rlhf's PairData
    return kind(train, tok.stats), kind(val, DataStats(rows=len(val)))


def train_and_validation(d: Any, tok: Callable[[list[str]], Tokenized], seed: int, unit: str = "row"
                         ) -> tuple[Tokenized, Tokenized | None]:
    """--dataset, then --val-dataset or a --split-dataset-ratio share of it, tokenized by `tok`; a
    selection with nothing usable is a UserError naming the flag (`unit`: row or pair)."""
    train = tok(d.dataset)
    val = None
    if d.val_dataset:
        val = tok(d.val_dataset)
        if not val.rows:
            raise UserError(f"--val-dataset {' '.join(d.val_dataset)}: no usable {unit}s ({val.stats.unusable()})")
    elif d.split_dataset_ratio > 0:
        if len(train.rows) < 2:
            raise UserError(f"--split-dataset-ratio {d.split_dataset_ratio}: --dataset has "
                            f"{len(train.rows)} usable {unit}(s), too few to hold some out")
        train, val = split_validation(train, d.split_dataset_ratio, seed)
    if not train.rows:
        raise UserError(f"--dataset {' '.join(d.dataset)}: no usable {unit}s ({train.stats.unusable()})")
    return train, val


def prepare_datasets(cfg: Any, tokenizer: Any, world_size: int, *,
                     progress: Callable[[str, int], Any] | None = None
                     ) -> tuple[Tokenized, Tokenized | None, Any]:
    """--dataset / --val-dataset / --split-dataset-ratio -> (train, validation or None, BatchPlan),
    with the checks a run needs before it starts: some usable rows, and at least one global batch
    (per-device x world size x accumulation) of them. UserErrors name the culprit."""
    from swiftlite.config import resolve_strategies
    from swiftlite.data.loader import BatchPlan
    from swiftlite.data.tokenize import system_prompt
    d, t = cfg.data, cfg.train
    # --max-length from a hub model's config (config.load reads local configs only) is settled by the
    # caller, TokenTask.prepare_data (train/tasks.py): the model loader is not data's to call.
    system = system_prompt(d.system) if task_spec(cfg.task).chat else None

    def tok(specs: list[str]) -> Tokenized:
        return tokenize_specs(specs, tokenizer, task=cfg.task, max_length=d.max_length, packing=d.packing,
                              skip_bad_rows=d.skip_bad_rows, num_proc=d.dataset_num_proc, progress=progress,
                              truncation_strategy=d.truncation_strategy, system=system, seed=t.seed)
    train, val = train_and_validation(d, tok, t.seed)
    plan = BatchPlan(len(train.rows), t.per_device_train_batch_size, world_size,
                     t.gradient_accumulation_steps, t.seed)
    if plan.steps_per_epoch == 0:
        held = (f" after --split-dataset-ratio {d.split_dataset_ratio} held out {len(val.rows)} for validation"
                if d.split_dataset_ratio > 0 and val is not None else "")
        raise UserError(f"--dataset has {len(train.rows)} usable rows{held}, fewer than one global batch of "
                        f"{plan.global_batch} (per-device {plan.per_device} x {plan.world_size} processes x "
                        f"accumulation {plan.accumulation})")
    resolve_strategies(cfg, plan.steps_per_epoch)  # --save-strategy/--eval-strategy epoch: now known
    return train, val, plan

