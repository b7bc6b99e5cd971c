"""Cached datasets (ms-swift's `swift export --to_cached_dataset true`, then `--cached_dataset DIR`):
tokenized rows written once, on a machine without GPUs, and read by training runs that then skip
the tokenization.

The format: a folder per split (`OUT/train`, `OUT/val`, ms-swift's layout), each an HF datasets
folder (`Dataset.save_to_disk`: Arrow files, no pickle, memory-mapped when read) with the columns
`input_ids` and `labels`, and `swiftlite_cached.json` next to them: what the rows were made with.
The rows are stored unpacked: --packing is a choice of the training run, applied when it reads them.

What the rows depend on is checked when a run reads them, each in one line naming the folder:
the task (a pt folder labels every token; an sft one the answers) and the tokenizer (its vocabulary,
special tokens and, for sft, the chat template: token ids of another tokenizer would train silently
wrong). Rows longer than the run's --max-length are treated as the run treats its own (`fit`).
ms-swift's own cached folders hold untokenized rows and its template's ids; they are refused
with that reason.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from swiftlite.data.rows import DataStats, Tokenized
from swiftlite.errors import UserError

META = "swiftlite_cached.json"
FORMAT = 1
#: The split folders `swiftlite export --to_cached_dataset true` writes under --output-dir.
SPLITS = ("train", "val")


def tokenizer_fingerprint(tokenizer: Any, chat: bool) -> str:
    """What the token ids of a row depend on: the vocabulary, the special tokens and (chat rows) the
    chat template. A tokenizer with the same files anywhere gives the same fingerprint."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    specials = {k: str(getattr(tokenizer, k, None)) for k in ("bos_token", "eos_token", "pad_token")}
    h.update(json.dumps(specials, sort_keys=True).encode())
    if chat:
        h.update((getattr(tokenizer, "chat_template", "") or "").encode())
    return h.hexdigest()[:24]


def rows_kind(chat: bool) -> str:
    """What a folder's rows are: chat rows (sft: the answers are targets) or plain text (pt: every
    token), recorded as meta["rows"] and compared with the reading run's."""
    return "chat" if chat else "text"


def write(folder: Path, data: Tokenized, meta: dict[str, Any]) -> None:
    """One split: the rows' input_ids and labels as an HF datasets folder, and `meta` (task,
    max_length, tokenizer fingerprint, ...) with the rows' stats."""
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar
    disable_progress_bar()   # a bar per split on the console; the export prints its own lines
    cols = {"input_ids": [r["input_ids"] for r in data.rows], "labels": [r["labels"] for r in data.rows]}
    if data.rows and "loss_scale" in data.rows[0]:   # a weighted --loss-scale: ms-swift's column of that name
        cols["loss_scale"] = [r["loss_scale"] for r in data.rows]
    ds = Dataset.from_dict(cols)
    ds.save_to_disk(str(folder))
    st = data.stats
    stats = {"rows": st.rows, "truncated": st.truncated, "skipped": len(st.skipped), "no_target": st.no_target,
             "deleted": st.deleted}
    (folder / META).write_text(json.dumps({"format": FORMAT, **meta, "stats": stats, "written": len(data.rows)},
                                          indent=2) + "\n")


def read_meta(path: str, flag: str) -> dict[str, Any]:
    """The folder's meta, or a one-line refusal saying what the folder is not."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"{flag} {path}: no such folder (write one with `swiftlite export --to_cached_dataset true "
                        "--dataset ... --output_dir DIR`, then pass DIR/train)")
    meta_file = p / META
    if not meta_file.is_file():
        if (p / "train").is_dir() and (p / "train" / META).is_file():
            raise UserError(f"{flag} {path}: the folder holds the splits: pass {path.rstrip('/')}/train (and "
                            f"--cached_val_dataset {path.rstrip('/')}/val)")
        if (p / "dataset_info.json").is_file() or (p / "state.json").is_file():
            raise UserError(f"{flag} {path}: an HF datasets folder without {META}, e.g. ms-swift's cached dataset "
                            "(its rows are encoded by ms-swift's template, or not at all): write it again with "
                            "`swiftlite export --to_cached_dataset true`, or pass the source files to --dataset")
        raise UserError(f"{flag} {path}: not a cached dataset (no {META}; written by `swiftlite export "
                        "--to_cached_dataset true`)")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:
        raise UserError(f"{flag} {path}: {META} is not valid JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{flag} {path}: cached-dataset format {meta.get('format')!r}, this swiftlite reads "
                        f"{FORMAT}: write it again with this version")
    return meta


def check_spec(spec: str, flag: str) -> None:
    """Cheap check before launch: the folder (a `#N` suffix allowed) is a cached dataset."""
    path, _ = _split(spec)
    read_meta(path, flag)


def _split(spec: str) -> tuple[str, int | None]:
    """`DIR#N` -> (DIR, N); a folder whose own name has a # is taken whole (ms-swift's rule)."""
    if Path(spec).expanduser().exists() or "#" not in spec:
        return spec, None
    path, _, n = spec.rpartition("#")
    if not n.isdigit() or int(n) < 1:
        raise UserError(f"{spec}: `#N` takes a row count >= 1, got {n!r}")
    return path, int(n)


def load(spec: str, flag: str, *, tokenizer: Any, task: str, chat: bool, max_length: int, truncation: str,
         rng: Any) -> Tokenized:
    """The rows of one cached folder (`DIR` or `DIR#N`, N drawn with `rng` by ms-swift's sampling
    rule, as --dataset's `#N`), after checking that they were made for this run's task and tokenizer,
    and fitted to its --max-length by its --truncation-strategy (`fit`)."""
    from datasets import load_from_disk

    from swiftlite.data.sources import sample_indices
    path, count = _split(spec)
    meta = read_meta(path, flag)
    problems = []
    if meta.get("rows") != rows_kind(chat):
        what = {"text": "pt rows (every token a target: --use_chat_template false)",
                "chat": "sft rows (the answers are the targets)"}
        problems.append(f"holds {what.get(meta.get('rows'), repr(meta.get('rows')))}, and this is `swiftlite {task}`")
    elif meta.get("tokenizer") != tokenizer_fingerprint(tokenizer, chat):
        problems.append(f"was tokenized by another tokenizer{' or chat template' if chat else ''} "
                        f"({meta.get('model')!r}) than this run's --model")
    if problems:
        raise UserError(f"{flag} {path}: {'; '.join(problems)}: write it again with `swiftlite export "
                        "--to_cached_dataset true` and this run's options")
    ds = load_from_disk(str(Path(path).expanduser()))
    missing = {"input_ids", "labels"} - set(ds.column_names)
    if missing:
        raise UserError(f"{flag} {path}: no {', '.join(sorted(missing))} column")
    cols = ds.to_dict()
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(cols["input_ids"], cols["labels"])]
    for r, w in zip(rows, cols.get("loss_scale") or ()):
        r["loss_scale"] = w
    if count is not None:
        rows = [rows[i] for i in sample_indices(len(rows), count, rng)]
    return fit(rows, max_length, truncation)


def fit(rows: list[dict], max_length: int, truncation: str) -> Tokenized:
    """Cached rows under the run's --max-length, as the run's own tokenization treats a longer row
    (data/pipeline.py): delete drops and counts it, left/right cut it (counted), split (pt) cuts it into
    --max-length pieces; a row left with no target is dropped and counted. A row tokenizes whole before
    it is cut, so a folder written with a --max-length at least the run's gives exactly the run's rows
    (ms-swift's scripts export at the model's context and train shorter)."""
    from swiftlite.data.tokenize import IGNORE, cut
    stats = DataStats(rows=len(rows))
    out: list[dict] = []
    for r in rows:
        ids, labels, weights = r["input_ids"], r["labels"], r.get("loss_scale")
        if len(ids) > max_length:
            if truncation == "delete":
                stats.deleted += 1
                continue
            if truncation == "split":   # pt rows: no weights
                pieces = [(ids[i:i + max_length], labels[i:i + max_length], None)
                          for i in range(0, len(ids), max_length)]
            else:
                enc = cut(ids, labels, max_length, truncation, weights)
                pieces = [(enc.input_ids, enc.labels, enc.weights)]
                stats.truncated += 1
        else:
            pieces = [(ids, labels, weights)]
        for p_ids, p_labels, p_weights in pieces:
            if not any(x != IGNORE for x in p_labels[1:]):
                stats.no_target += 1
                continue
            out.append({"input_ids": p_ids, "labels": p_labels,
                        **({"loss_scale": p_weights} if p_weights is not None else {})})
    return Tokenized(out, stats)
