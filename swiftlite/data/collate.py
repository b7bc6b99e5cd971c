"""Batching: padding-free batches (rows concatenated, isolated by position ids), right padding, and
packing of rows into --max-length sequences.

Two batch forms compute the same samples and the same loss (docs/usage.md, "Batches"):

- padding-free (`concat_rows`): the micro-batch's rows (or packs) concatenated into ONE sequence,
  shape 1 x sum of lengths, with `position_ids` restarting at 0 for each row and NO attention mask.
  transformers then builds a per-row causal mask from the position ids (sdpa, eager, flex:
  `masking_utils.find_packed_sequence_indices`; flash attention: varlen kernels from the same
  position ids), so no row attends to another and no pad token is computed. The first label of each
  row after the first is IGNORE: the last token of a row does not predict the next row's first.
- padded (`pad_batch`): rows right-padded to the longest, with an attention mask. Packs never take
  this form: an attention mask turns transformers' per-row masking off, and a pack's rows would
  attend to each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from swiftlite.data.tokenize import IGNORE


@dataclass(frozen=True)
class BatchForm:
    """How a run's micro-batches are built, decided once per run (models.loading.batch_form)."""
    padding_free: bool
    reason: str = ""            # why this form (one phrase, for the run's first line)
    attn_impl: str | None = None  # --attn_impl, None = transformers' default for the model

    def describe(self, packing: bool = False, max_length: int | None = None) -> str:
        """'padding-free batches (...)' / 'packed to N tokens, rows isolated (...)' / 'padded batches (...)'."""
        if packing:
            head = f"packed to {max_length} tokens, rows isolated by position ids" if max_length else "packed"
        else:
            head = "padding-free batches" if self.padding_free else "padded batches"
        return f"{head} ({self.reason})" if self.reason else head


PADDED = BatchForm(False, "")


def _weighted(rows: Sequence[dict]) -> bool:
    """Rows of a weighted --loss-scale carry each token's weight as "loss_scale" (data/tokenize.py); the
    batch then carries them too (a row without, e.g. lazy tokenization's placeholder: weight 1)."""
    return any("loss_scale" in r for r in rows)


def _row_weights(r: dict) -> list[float]:
    return list(r["loss_scale"]) if "loss_scale" in r else [1.0] * len(r["input_ids"])


def pad_batch(rows: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad input_ids with pad_id, labels with -100; attention_mask marks real tokens; weights
    (a weighted --loss-scale) padded with 0."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    weighted = _weighted(rows)
    weights = torch.zeros((len(rows), n), dtype=torch.float32) if weighted else None
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k] = torch.tensor(r["input_ids"], dtype=torch.long)
        labels[i, :k] = torch.tensor(r["labels"], dtype=torch.long)
        mask[i, :k] = 1
        if weights is not None:
            weights[i, :k] = torch.tensor(_row_weights(r), dtype=torch.float32)
    out = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return {**out, "loss_scale": weights} if weights is not None else out


def _join(rows: Sequence[dict]) -> tuple[list[int], list[int], list[int], list[float] | None]:
    """Concatenated ids, labels (IGNORE at each row's first token after the first row), position
    ids restarting per row (a pack brings its own, already restarting per packed row) and, for a
    weighted --loss-scale, the weights."""
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    weights: list[float] | None = [] if _weighted(rows) else None
    for r in rows:
        k = len(r["input_ids"])
        lab = list(r["labels"])
        if ids:  # the first token of a row is not predicted from the previous row
            lab[0] = IGNORE
        ids += list(r["input_ids"])
        labels += lab
        pos += list(r["position_ids"]) if "position_ids" in r else list(range(k))
        if weights is not None:
            weights += _row_weights(r)
    return ids, labels, pos, weights


def pack_rows(rows: Sequence[dict], max_length: int) -> list[dict]:
    """Greedy packing in order: concatenate whole rows into sequences of at most max_length tokens.

    Rows are never split (a row longer than max_length was already truncated), so no sample loses
    its answer to a boundary. Position ids restart per row; batched without an attention mask
    (`concat_rows`), they keep each row's attention inside the row, so a packed row computes what it
    computes alone.
    """
    return list(iter_packs(rows, max_length))


def iter_packs(rows: Iterable[dict], max_length: int) -> Iterator[dict]:
    """`pack_rows` as rows arrive (--streaming --packing: data/stream.py): next-fit in order, so it holds
    one open pack (at most max_length tokens) and yields each pack as soon as the next row does not fit
    (ms-swift's `packing_strategy sequential`); the last, open pack when `rows` ends."""
    cur: list[dict] = []
    size = 0
    for r in rows:
        k = len(r["input_ids"])
        if cur and size + k > max_length:
            yield _pack(cur)
            cur, size = [], 0
        cur.append(r)
        size += k
    if cur:
        yield _pack(cur)


def _pack(rows: list[dict]) -> dict:
    if any("teacher_prompt_ids" in r for r in rows):
        from swiftlite.errors import UserError
        raise UserError("--packing with a 'teacher_prompt' column (GKD's OPSD): a pack would put several rows' "
                        "responses after one teacher prompt; drop --packing (--padding_free true keeps rows whole)")
    ids, labels, pos, weights = _join(rows)
    out = {"input_ids": ids, "labels": labels, "position_ids": pos}
    return {**out, "loss_scale": weights} if weights is not None else out


def concat_rows(rows: Sequence[dict]) -> dict[str, torch.Tensor]:
    """The padding-free form: every row (or pack) of the micro-batch in one 1 x N sequence, per-row
    position ids, boundary labels IGNORE, and no attention mask (which would turn the per-row
    masking off)."""
    ids, labels, pos, weights = _join(rows)
    out = {"input_ids": torch.tensor([ids], dtype=torch.long), "labels": torch.tensor([labels], dtype=torch.long),
           "position_ids": torch.tensor([pos], dtype=torch.long)}
    return {**out, "loss_scale": torch.tensor([weights], dtype=torch.float32)} if weights is not None else out


def collate(rows: Sequence[dict], pad_id: int, *, padding_free: bool = False) -> dict[str, torch.Tensor]:
    """One micro-batch: padding-free (`concat_rows`) or right-padded (`pad_batch`). Packs (rows with
    position_ids) are always concatenated: padded with an attention mask, their rows would attend to
    each other."""
    if padding_free or "position_ids" in rows[0]:
        return concat_rows(rows)
    return pad_batch(rows, pad_id)


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that are not padding, in either form (a padding-free batch has none)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Target tokens after the causal shift (labels[:, 1:] that are not -100)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())
