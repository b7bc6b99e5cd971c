"""--lazy_tokenize: training rows read and checked up front, tokenized when a batch first needs them.

What is done before training: every `--dataset` row is read (with `#N` sampling, as eager), its
format converted (formats.to_messages / to_text: a bad row fails before launch, naming file:line, or
is skipped and counted with --skip-bad-rows), so the number of samples, and with it the batch plan,
is known. What is left to the step: the chat template and the tokenizer, in whichever process
builds the step (the training process, or a DataLoader worker with --dataloader-num-workers:
data/prefetch.py), once per row per process.

Eager tokenization drops a row without an answer (or one over --max-length under --truncation-strategy
delete) before the batch plan is made; lazily, that row is only found when its batch is built, so it
keeps its place with no target tokens (counted in `LazyRows.stats`). Where every row is usable, the
batches are the eager ones, row for row. The tokenized rows are not cached (ms-swift: lazy datasets
are not cached either), --dataset-num-proc applies to the (eager) validation rows only, and with
several processes each one tokenizes every row of a step's global batch: the loss is normalised by
the global batch's target tokens (docs/design.md, Numerics), which each rank counts itself rather
than exchanging them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

from swiftlite.data.rows import DataStats, Tokenized
from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError


class LazyRows:
    """rows[i] -> the tokenized row i ({"input_ids", "labels"}), tokenized on first use."""

    def __init__(self, items: list[tuple[dict, str]], encode: Callable[[dict, str], Any], fallback_id: int):
        self.items, self.encode, self.fallback_id = items, encode, fallback_id
        self.memo: dict[int, dict] = {}
        self.stats = DataStats()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        hit = self.memo.get(i)
        if hit is None:
            hit = self.memo[i] = self._tokenize(i)
        return hit

    def _tokenize(self, i: int) -> dict:
        row, where = self.items[i]
        rows, st = self.encode([(row, where)])
        self.stats.add(st)
        if rows:
            return rows[0]
        # dropped by eager tokenization: here it keeps its slot and contributes nothing
        return {"input_ids": [self.fallback_id], "labels": [IGNORE]}

    def targets(self, i: int) -> int:
        return sum(1 for x in self[i]["labels"][1:] if x != IGNORE)


class LazyTokenized(Tokenized):
    """Tokenized with LazyRows; `target_counts` is what train/step.TokenBatches asks per row, and
    `for_facts` hashes the raw rows (not the tokens: that would tokenize everything up front)."""

    @property
    def target_counts(self) -> Callable[[int], int]:
        return self.rows.targets

    def targets(self, i: int) -> int:
        return self.rows.targets(i)

    def split(self, val_idx: set[int]) -> tuple["LazyTokenized", Tokenized]:
        """--split-dataset-ratio: the held-out rows tokenized now (validation is eager), the rest lazy."""
        r = self.rows
        train = LazyRows([it for i, it in enumerate(r.items) if i not in val_idx], r.encode, r.fallback_id)
        val = [r[i] for i in sorted(val_idx)]
        val = [v for v in val if any(x != IGNORE for x in v["labels"][1:])]
        return LazyTokenized(train, self.stats), Tokenized(val, DataStats(rows=len(val)))

    def for_facts(self) -> Tokenized:
        h = [int.from_bytes(hashlib.sha256(json.dumps(r, sort_keys=True, default=str).encode()).digest()[:7], "big")
             for r, _ in self.rows.items]
        return Tokenized([{"input_ids": [x], "labels": [x]} for x in h], self.stats)


def lazy_tokenized(specs: list[str], encode: Callable[[list[tuple[dict, str]]], Any], tokenizer: Any, *,
                   task: str, skip_bad_rows: bool, seed: int, transform: Callable[[Any], Any] | None = None,
                   columns: dict[str, str] | None = None) -> LazyTokenized:
    """Read and format-check every row of `specs` (as eager: `#N` with one RandomState over the specs);
    tokenize nothing yet. `encode`: the eager pipeline's row encoder (pipeline.prepare_datasets)."""
    import numpy as np

    from swiftlite.config.tasks import task_spec
    from swiftlite.data.formats import to_messages, to_text
    from swiftlite.data.sources import load_rows
    stats = DataStats()
    items: list[tuple[dict, str]] = []
    plain = task_spec(task).plain_text
    rng = np.random.RandomState(seed)
    for spec in specs:
        src = load_rows(spec, skip_bad_rows=skip_bad_rows, seed=rng, columns=columns)
        if transform is not None:
            before = transform.matched
            src = transform(src)
            stats.self_cognition += transform.matched - before
        stats.skipped += src.skipped
        for row, where in zip(src.rows, src.where):
            try:
                to_text(row, where) if plain else to_messages(row, where, agent_roles=True)
            except UserError as e:
                if not skip_bad_rows:
                    raise
                stats.skipped.append(str(e))
                continue
            items.append((row, where))

    fallback = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    rows = LazyRows(items, encode, fallback)
    stats.rows = len(items)
    return LazyTokenized(rows, stats)
