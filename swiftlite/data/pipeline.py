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
from pathlib import Path
from typing import Any, Callable

import numpy as np

from swiftlite.data.collate import pack_rows
from swiftlite.data.rows import DataStats, Tokenized  # noqa: F401  (re-exported: rlhf, tests)
from swiftlite.data.agent import Agent, render_turns
from swiftlite.data.formats import to_messages, to_text
from swiftlite.data.sources import load_rows, parse_spec
from swiftlite.config.tasks import task_spec
from swiftlite.config.loss_scale import LossScale
from swiftlite.config.loss_scale import parse as parse_loss_scale
from swiftlite.data.teacher_view import COLUMN as TEACHER_COLUMN, teacher_prompt_ids
from swiftlite.data.tokenize import IGNORE, encode_messages, encode_prompt, encode_text
from swiftlite import env
from swiftlite.errors import UserError

#: Part of every cache entry's key: raised when the same inputs would now tokenize to other rows (5: an OPSD
#: teacher's view is no longer held to --max_length), so an entry written before is never read as current.
CACHE_VERSION = 5


def cache_dir() -> Path:
    return env.settings().cache / "tokenized"


def _fingerprint(specs: list[str], tokenizer: Any, extra: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"v": CACHE_VERSION, **extra}, sort_keys=True).encode())
    from swiftlite.data.registered import fingerprint
    for spec in specs:
        path, _ = parse_spec(spec)
        p = Path(path)
        h.update(spec.encode())
        h.update(fingerprint(path).encode())     # a plugin's registered dataset: its preprocessor's code
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
    added = getattr(tokenizer, "get_added_vocab", None)   # --new_special_tokens: which tokens, not only how many
    if added is not None:
        h.update(json.dumps(added(), sort_keys=True).encode())
    return h.hexdigest()[:24]


#: Row fields of floats (every other list field holds token ids): a weighted --loss-scale's weights.
FLOAT_FIELDS = ("loss_scale",)


def _save_cache(path: Path, tok: Tokenized) -> None:
    """Every row field (lists of ints: input_ids, labels, position_ids; rlhf's chosen_/rejected_ ones;
    the float weights of a weighted --loss-scale, FLOAT_FIELDS) as one concatenated array plus the rows' lengths, the stats as JSON, and the data session that
    wrote it (`--load-from-cache-file false` reads only entries of its own session). No pickle."""
    keys = list(tok.rows[0]) if tok.rows else ["input_ids", "labels"]
    arrays: dict[str, Any] = {"keys": np.frombuffer(json.dumps(keys).encode(), dtype=np.uint8)}
    for k in keys:
        if tok.rows and not isinstance(tok.rows[0][k], list):   # a scalar per row (rlhf's margin): JSON
            arrays[f"json_{k}"] = np.frombuffer(json.dumps([r[k] for r in tok.rows]).encode(), dtype=np.uint8)
            continue
        arrays[f"len_{k}"] = np.array([len(r[k]) for r in tok.rows], dtype=np.int64)
        dt = np.float64 if k in FLOAT_FIELDS else np.int64
        arrays[f"val_{k}"] = (np.concatenate([np.asarray(r[k], dtype=dt) for r in tok.rows])
                              if tok.rows else np.zeros(0, dt))
    stats = json.dumps({"rows": tok.stats.rows, "truncated": tok.stats.truncated,
                        "skipped": tok.stats.skipped, "no_target": tok.stats.no_target,
                        "deleted": tok.stats.deleted, "self_cognition": tok.stats.self_cognition})
    arrays["stats"] = np.frombuffer(stats.encode(), dtype=np.uint8)
    arrays["session"] = np.frombuffer(env.data_session().encode(), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _load_cache(path: Path, kind: type = Tokenized, session: str | None = None) -> Tokenized | None:
    """A cache entry as `kind` (Tokenized, rlhf's PairData); None when it is unreadable or, with
    `session`, written by another data session."""
    try:
        z = np.load(path, allow_pickle=False)
        if session is not None and bytes(z["session"]).decode() != session:
            return None
        keys = json.loads(bytes(z["keys"]).decode())
        scalars = {k: json.loads(bytes(z[f"json_{k}"]).decode()) for k in keys if f"json_{k}" in z.files}
        cols = {k: (z[f"len_{k}"].tolist(), z[f"val_{k}"]) for k in keys if k not in scalars}
        st = json.loads(bytes(z["stats"]).decode())
    except (OSError, ValueError, KeyError):
        return None
    n = len(next(iter(scalars.values()))) if scalars else (len(next(iter(cols.values()))[0]) if cols else 0)
    rows: list[dict] = [{} for _ in range(n)]
    for k in keys:
        if k in scalars:
            for r, v in zip(rows, scalars[k]):
                r[k] = v
            continue
        lengths, vals = cols[k]
        off = 0
        for r, m in zip(rows, lengths):
            r[k] = vals[off:off + m].tolist()
            off += m
    return kind(rows, DataStats(**st))


def cached(key: str, build: Callable[[], Tokenized], *, kind: type = Tokenized, use_cache: bool = True,
           load_from_cache_file: bool = True) -> Tokenized:
    """`build()`'s result through the cache entry `key`. --load-from-cache-file true (ms-swift's
    meaning) reads any entry for the same inputs; false (ms-swift's default) tokenizes again and
    replaces the entry, which the other processes of the same job (preflight, then every rank, which
    inherit its data session: env.data_session) then read instead of tokenizing once more."""
    cpath = cache_dir() / f"{key}.npz"
    if use_cache and cpath.is_file():
        hit = _load_cache(cpath, kind, None if load_from_cache_file else env.data_session())
        if hit is not None:
            return hit
    tok = build()
    if use_cache:
        _save_cache(cpath, tok)
    return tok


def _encode_rows(items: list[tuple[dict, str]], tokenizer: Any, task: str, max_length: int,
                 skip_bad_rows: bool, truncation: str = "right", system: str | None = None,
                 loss_scale: LossScale | None = None, agent: Agent | None = None,
                 keep: tuple[str, ...] = ()) -> tuple[list[dict], DataStats]:
    """Tokenize (row, where) pairs in order; rows with no target token are dropped and counted, and so
    are rows longer than max_length under truncation "delete". A bad row raises its UserError, or is
    skipped and counted with --skip-bad-rows. `agent`: --agent_template (tool-calling rows: data/agent.py).
    `keep`: source columns each tokenized row carries as its "columns" (those the row has: the task's
    `prepare_data` asks for them, GKD's for its multi-turn scheduler and OPSD's teacher_prompt), and PROMPTS:
    a conversation ending with a user turn is then a prompt row, its tokens up to the generation prompt and
    no target (GKD when every step samples the response, --lmbda 1)."""
    stats = DataStats()
    rows: list[dict] = []
    cut = "right" if truncation in ("delete", "split") else truncation
    prompts = PROMPTS in keep
    keep = tuple(k for k in keep if k != PROMPTS)
    msgs: list[dict] = []
    for row, where in items:
        try:
            if task_spec(task).plain_text and truncation == "split":   # pt: --max-length pieces, each a row
                whole = encode_text(tokenizer, to_text(row, where), 1 << 62).input_ids
                stats.rows += 1
                for i in range(0, len(whole), max_length):
                    piece = whole[i:i + max_length]
                    if len(piece) < 2:
                        stats.no_target += 1   # a last piece of one token has nothing to predict
                        continue
                    rows.append({"input_ids": piece, "labels": list(piece)})
                continue
            if task_spec(task).plain_text:  # pt: every token a target, no template
                enc = encode_text(tokenizer, to_text(row, where), max_length, truncation=cut)
            else:
                msgs = render_turns(row, to_messages(row, where, agent_roles=True, prompts=prompts), agent, system,
                                    where)
                if prompts and msgs[-1]["role"] == "user":   # a prompt: the response is sampled (GKD)
                    enc = encode_prompt(tokenizer, msgs, max_length, truncation=cut, system=system)
                else:
                    enc = encode_messages(tokenizer, msgs, max_length, where, truncation=cut,
                                          system=system, loss_scale=loss_scale)
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
        if not any(x != IGNORE for x in enc.labels[1:]) and not (prompts and msgs and msgs[-1]["role"] == "user"):
            stats.no_target += 1  # nothing to learn (e.g. the answer was truncated away)
            continue
        extra = {}
        if TEACHER_COLUMN in keep and row.get(TEACHER_COLUMN) is not None and not task_spec(task).plain_text:
            try:   # OPSD: GKD's teacher reads its own prompt before the response (data/teacher_view.py)
                extra["teacher_prompt_ids"] = teacher_prompt_ids(tokenizer, msgs, row[TEACHER_COLUMN], enc.input_ids,
                                                                 enc.labels, where, system)
            except UserError as e:
                if not skip_bad_rows:
                    raise
                stats.skipped.append(str(e))
                continue
        rows.append({"input_ids": enc.input_ids, "labels": enc.labels,
                     **({"loss_scale": enc.weights} if enc.weights is not None else {}),
                     **({"columns": {k: row[k] for k in keep if k in row}} if keep else {}), **extra})
    return rows, stats



#: In `keep`: rows ending with a user turn are prompts (`_encode_rows`); part of the cache key as `keep` is.
PROMPTS = "<prompt rows>"


# What forked tokenization workers use: set in the parent just before the pool forks, so the
# tokenizer (a Rust object that does not pickle cheaply) is inherited, never sent.
_WORKER: dict[str, Any] = {}


def _encode_chunk(items: list[tuple[dict, str]]) -> tuple[list[dict], DataStats] | UserError:
    w = _WORKER
    try:
        return _encode_rows(items, w["tokenizer"], w["task"], w["max_length"], w["skip"], w["truncation"],
                            w["system"], w["loss_scale"], w["agent"], w["keep"])
    except UserError as e:  # returned, not raised: the parent re-raises the first one in row order
        return e


def _encode_parallel(items: list[tuple[dict, str]], tokenizer: Any, task: str, max_length: int,
                     skip_bad_rows: bool, num_proc: int, truncation: str = "right",
                     system: str | None = None, loss_scale: LossScale | None = None, agent: Agent | None = None,
                     keep: tuple[str, ...] = ()) -> tuple[list[dict], DataStats]:
    """`_encode_rows` over `num_proc` forked processes, chunked in row order: the same rows, stats
    and first error as one process. The tokenizer's own thread pool is turned off first (a forked
    Rust pool deadlocks)."""
    import multiprocessing as mp
    env.set_default("TOKENIZERS_PARALLELISM", "false")
    n_chunks = num_proc * 4
    size = max(1, -(-len(items) // n_chunks))
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    _WORKER.update(tokenizer=tokenizer, task=task, max_length=max_length, skip=skip_bad_rows,
                   truncation=truncation, system=system, loss_scale=loss_scale, agent=agent, keep=keep)
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
                   system: str | None = None, seed: int = 42, load_from_cache_file: bool = True,
                   transform: Callable[[Any], Any] | None = None, key_extra: dict | None = None,
                   columns: dict[str, str] | None = None, loss_scale: LossScale | None = None,
                   agent: Agent | None = None, keep: tuple[str, ...] = ()) -> Tokenized:
    """Load, convert and tokenize every spec; rows with no target token are dropped and counted, and
    rows over max_length are cut or (truncation_strategy "delete") dropped and counted. `system` is the
    system turn of sft rows that have none. `num_proc` > 1 (--dataset-num-proc) tokenizes in that many
    forked processes (files of at least PARALLEL_MIN_ROWS rows); the result is identical to one process.
    `path#N` specs draw their rows with `seed` (one RandomState over the specs in order, as ms-swift),
    then the specs are concatenated. `transform` rewrites each source's rows before tokenization
    (--model-name/--model-author: data/self_cognition.py; its inputs go into `key_extra`, the cache
    key); `load_from_cache_file`: see `cached`; `columns`: --columns, renamed as each source is read;
    `loss_scale`: --loss-scale, which tokens of a chat row are targets (config/loss_scale.py); `agent`:
    --agent_template, how tool-calling rows are written as turns (data/agent.py); `keep`: `_encode_rows`'s."""
    key = _fingerprint(specs, tokenizer, {"task": task, "max_length": max_length, "packing": packing,
                                          "skip": skip_bad_rows, "truncation": truncation_strategy,
                                          "system": system, "seed": seed, **({"columns": columns} if columns else {}),
                                          **({"loss_scale": repr(loss_scale)} if loss_scale not in (None, LossScale()) else {}),
                                          **({"agent": repr(agent)} if agent is not None else {}),
                                          **({"keep": list(keep)} if keep else {}),
                                          **(key_extra or {})})

    def build() -> Tokenized:
        stats = DataStats()
        rows: list[dict] = []
        rng = np.random.RandomState(seed)
        for spec in specs:
            src = load_rows(spec, skip_bad_rows=skip_bad_rows, seed=rng, columns=columns)
            if transform is not None:
                before = transform.matched
                src = transform(src)
                stats.self_cognition += transform.matched - before
            stats.skipped += src.skipped
            items = list(zip(src.rows, src.where))
            if num_proc > 1 and len(items) >= PARALLEL_MIN_ROWS:
                part, st = _encode_parallel(items, tokenizer, task, max_length, skip_bad_rows, num_proc,
                                            truncation_strategy, system, loss_scale, agent, keep)
            else:
                it = progress(f"tokenizing {spec}", len(items))(items) if progress is not None else items
                part, st = _encode_rows(it, tokenizer, task, max_length, skip_bad_rows, truncation_strategy,
                                        system, loss_scale, agent, keep)
            rows += part
            stats.add(st)
        if packing:
            rows = pack_rows(rows, max_length)
        return Tokenized(rows, stats)
    return cached(key, build, use_cache=use_cache, load_from_cache_file=load_from_cache_file)


def split_validation(tok: Tokenized, ratio: float, seed: int) -> tuple[Tokenized, Tokenized]:
    """Hold out a seeded share of the rows for validation."""
    import random
    idx = list(range(len(tok.rows)))
    random.Random(seed).shuffle(idx)
    n_val = max(1, int(round(len(idx) * ratio)))
    val_set = set(idx[:n_val])
    if hasattr(tok, "split"):   # --lazy-tokenize (data/lazy.py): the training rows stay untokenized
        return tok.split(val_set)
    train = [r for i, r in enumerate(tok.rows) if i not in val_set]
    val = [r for i, r in enumerate(tok.rows) if i in val_set]
    kind = type(tok)  # Tokenized, or rlhf's PairData
    return kind(train, tok.stats), kind(val, DataStats(rows=len(val)))


def train_and_validation(d: Any, tok: Callable[[list[str]], Tokenized], seed: int, unit: str = "row",
                         cached: Callable[[list[str], str], Tokenized] | None = None,
                         pack: Callable[[Tokenized], Tokenized] | None = None
                         ) -> tuple[Tokenized, Tokenized | None]:
    """--dataset, then --val-dataset or a --split-dataset-ratio share of it, tokenized by `tok`; a
    selection with nothing usable is a UserError naming the flag (`unit`: row or pair). `cached`
    reads --cached_dataset / --cached_val_dataset folders (sft, pt: data/cached.py); their rows
    follow --dataset's, and the held-out share is of --dataset's rows only (ms-swift's order).
    `pack` (--packing) packs each side after the split, as ms-swift packs its train and validation
    datasets apart: the share held out is a share of rows, not of packs (one pack of 512k tokens
    could not be split at all)."""
    train = tok(d.dataset) if d.dataset else None
    val = None
    if d.val_dataset:
        val = tok(d.val_dataset)
        if not val.rows:
            raise UserError(f"--val-dataset {' '.join(d.val_dataset)}: no usable {unit}s ({val.stats.unusable()})")
    elif d.split_dataset_ratio > 0 and train is not None:
        if len(train.rows) < 2:
            raise UserError(f"--split-dataset-ratio {d.split_dataset_ratio}: --dataset has "
                            f"{len(train.rows)} usable {unit}(s), too few to hold some out")
        train, val = split_validation(train, d.split_dataset_ratio, seed)
    if train is not None and not train.rows:
        raise UserError(f"--dataset {' '.join(d.dataset)}: no usable {unit}s ({train.stats.unusable()})")
    if pack is not None:
        train, val = (pack(x) if x is not None else None for x in (train, val))
    if cached is not None and getattr(d, "cached_dataset", None):
        train = _concat(train, cached(d.cached_dataset, "--cached_dataset"))
    if cached is not None and getattr(d, "cached_val_dataset", None):
        val = _concat(val, cached(d.cached_val_dataset, "--cached_val_dataset"))
    if train is None or not train.rows:
        raise UserError(f"--cached_dataset {' '.join(d.cached_dataset)}: no rows")
    return train, val


def _concat(a: Tokenized | None, b: Tokenized) -> Tokenized:
    if a is None:
        return b
    stats = DataStats()
    stats.add(a.stats)
    stats.add(b.stats)
    return Tokenized(a.rows + b.rows, stats)


def _rendering(cfg: Any, tokenizer: Any) -> tuple[str | None, LossScale | None, Agent | None]:
    """The run's default system prompt, loss scale and agent template (chat tasks only)."""
    from swiftlite.data.tokenize import system_prompt
    chat = task_spec(cfg.task).chat
    agent = None
    if chat and cfg.data.agent_template:
        from swiftlite.data.templates import default_system
        try:   # the chat template's default system, for a tools row without one (Qwen2.5's "You are Qwen, ...")
            base = default_system(tokenizer, f"--agent_template {cfg.data.agent_template}")
        except UserError:   # a template that cannot be cut into one exchange (thinking blocks) has none to find
            base = None
        agent = Agent(cfg.data.agent_template, base)
    return (system_prompt(cfg.data.system) if chat else None,
            parse_loss_scale(cfg.data.loss_scale, binary=cfg.data.is_binary_loss_scale) if chat else None, agent)


def run_agent(cfg: Any, tokenizer: Any) -> Agent | None:
    """The run's --agent_template (with the chat template's default system), for GRPO's prompts."""
    return _rendering(cfg, tokenizer)[2]


def spec_tokenizer(cfg: Any, tokenizer: Any, *, progress: Callable[[str, int], Any] | None = None,
                   keep: tuple[str, ...] = ()) -> tuple[Callable[[list[str]], Tokenized], Any]:
    """(specs -> their Tokenized rows under the run's options, the self-cognition transform or None):
    what training (prepare_datasets) and `swiftlite export --to_cached_dataset true` tokenize with, so
    that a cached folder holds exactly the rows the run would have made. `keep`: `_encode_rows`'s."""
    d, t = cfg.data, cfg.train
    system, scale, agent = _rendering(cfg, tokenizer)
    from swiftlite.data.self_cognition import from_config
    sc = from_config(d)   # --model_name / --model_author (data/self_cognition.py)

    def tok(specs: list[str]) -> Tokenized:
        return tokenize_specs(specs, tokenizer, task=cfg.task, max_length=d.max_length, packing=False,
                              skip_bad_rows=d.skip_bad_rows, num_proc=d.dataset_num_proc, progress=progress,
                              truncation_strategy=d.truncation_strategy, system=system, seed=t.seed,
                              load_from_cache_file=d.load_from_cache_file, transform=sc,
                              key_extra={"self_cognition": sc.key()} if sc else None, columns=d.columns,
                              loss_scale=scale, agent=agent, keep=keep)
    return tok, sc


def cached_reader(cfg: Any, tokenizer: Any) -> Callable[[list[str], str], Tokenized]:
    """--cached_dataset / --cached_val_dataset folders -> their rows, checked against this run (task,
    tokenizer, --max-length: data/cached.py), `#N` drawn with one RandomState over the folders as for
    --dataset, packed here with --packing (the folders hold single rows)."""
    import numpy as np

    from swiftlite.data import cached as cached_format
    d = cfg.data
    chat = task_spec(cfg.task).chat

    def read(specs: list[str], flag: str) -> Tokenized:
        rng = np.random.RandomState(cfg.train.seed)
        out = Tokenized([], DataStats())
        for spec in specs:
            out = _concat(out, cached_format.load(spec, flag, tokenizer=tokenizer, task=cfg.task, chat=chat,
                                                  max_length=d.max_length, truncation=d.truncation_strategy,
                                                  rng=rng))
        if d.packing:
            out = Tokenized(pack_rows(out.rows, d.max_length), out.stats)
        return out
    return read


def prepare_datasets(cfg: Any, tokenizer: Any, world_size: int, *,
                     progress: Callable[[str, int], Any] | None = None, keep: tuple[str, ...] = ()
                     ) -> tuple[Tokenized, Tokenized | None, Any]:
    """--dataset / --val-dataset / --split-dataset-ratio -> (train, validation or None, BatchPlan),
    with the checks a run needs before it starts: some usable rows, and at least one global batch
    (per-device x world size x accumulation) of them. UserErrors name the culprit. `keep`: the source
    columns the rows carry (`_encode_rows`)."""
    from swiftlite.data.loader import BatchPlan
    d, t = cfg.data, cfg.train
    # `cfg` is the run's resolved config (swiftlite/job.py): --max-length is concrete here.
    tok, sc = spec_tokenizer(cfg, tokenizer, progress=progress, keep=keep)   # rows; --packing packs after the split
    system, scale, agent = _rendering(cfg, tokenizer)

    def pack(rows: Tokenized) -> Tokenized:
        return Tokenized(pack_rows(rows.rows, d.max_length), rows.stats)

    def encode(items: list[tuple[dict, str]]) -> tuple[list[dict], DataStats]:
        """(row, where) items -> their usable tokenized rows and stats (lazy and streamed rows)."""
        return _encode_rows(items, tokenizer, cfg.task, d.max_length, d.skip_bad_rows, d.truncation_strategy,
                            system, scale, agent, keep)

    def tok_train(specs: list[str]) -> Tokenized:
        if d.lazy_tokenize and specs is d.dataset:   # validation rows stay eager
            from swiftlite.data.lazy import lazy_tokenized
            return lazy_tokenized(specs, encode, tokenizer, task=cfg.task, skip_bad_rows=d.skip_bad_rows,
                                  seed=t.seed, transform=sc, columns=d.columns)
        return tok(specs)
    if d.streaming:   # data/stream.py: nothing read up front but the first usable row
        from swiftlite.data.stream import StreamPlan, stream_tokenized
        train = stream_tokenized(d.dataset, encode, skip_bad_rows=d.skip_bad_rows, transform=sc,
                                 pack_length=d.max_length if d.packing else None, columns=d.columns)
        val = tok(d.val_dataset) if d.val_dataset else None
        val = pack(val) if val is not None and d.packing else val
        if sc is not None:
            sc.check_used([*d.dataset, *d.val_dataset], train.stats.self_cognition
                          + (val.stats.self_cognition if val is not None else 0))
        if val is not None and not val.rows:
            raise UserError(f"--val-dataset {' '.join(d.val_dataset)}: no usable rows ({val.stats.unusable()})")
        return train, val, StreamPlan(t.per_device_train_batch_size, world_size, t.gradient_accumulation_steps,
                                      t.max_steps)
    train, val = train_and_validation(d, tok_train, t.seed, cached=cached_reader(cfg, tokenizer),
                                      pack=pack if d.packing else None)
    if sc is not None:   # counted in the stats, so that a cache entry answers too
        sc.check_used([*d.dataset, *d.val_dataset], train.stats.self_cognition
                      + (val.stats.self_cognition if val is not None else 0))
    plan = BatchPlan(len(train.rows), t.per_device_train_batch_size, world_size,
                     t.gradient_accumulation_steps, t.seed, drop_last=t.dataloader_drop_last)
    if plan.steps_per_epoch == 0:
        held = (f" after --split-dataset-ratio {d.split_dataset_ratio} held out {len(val.rows)} for validation"
                if d.split_dataset_ratio > 0 and val is not None else "")
        source = " and ".join(f for f, v in (("--dataset", d.dataset), ("--cached_dataset", d.cached_dataset)) if v)
        unit = f"packs of {d.max_length} tokens (--packing)" if d.packing else "usable rows"
        raise UserError(f"{source} {'give' if ' and ' in source else 'has'} {len(train.rows)} {unit}{held}, fewer "
                        f"than one global batch of "
                        f"{plan.global_batch} (per-device {plan.per_device} x {plan.world_size} "
                        f"{'data-parallel ranks' if cfg.parallel.sequence_parallel_size > 1 else 'processes'} x "
                        f"accumulation {plan.accumulation})")
    return train, val, plan

