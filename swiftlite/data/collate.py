"""Batching: right padding, and optional packing of rows into fixed-length sequences."""

from __future__ import annotations

from typing import Sequence

import torch

from swiftlite.data.tokenize import IGNORE


def pad_batch(rows: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad input_ids with pad_id, labels with -100; attention_mask marks real tokens."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k] = torch.tensor(r["input_ids"], dtype=torch.long)
        labels[i, :k] = torch.tensor(r["labels"], dtype=torch.long)
        mask[i, :k] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack_rows(rows: Sequence[dict], max_length: int) -> list[dict]:
    """Greedy first-fit packing: concatenate whole rows into sequences of at most max_length tokens.

    Rows are never split (a row longer than max_length was already truncated), so no sample loses
    its answer to a boundary. Attention still spans rows inside a pack (no varlen kernel on CPU);
    position ids restart per row so each row sees the positions it would see alone.
    """
    packs: list[dict] = []
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    cur_pos: list[int] = []
    for r in rows:
        k = len(r["input_ids"])
        if cur_ids and len(cur_ids) + k > max_length:
            packs.append({"input_ids": cur_ids, "labels": cur_labels, "position_ids": cur_pos})
            cur_ids, cur_labels, cur_pos = [], [], []
        cur_ids = cur_ids + list(r["input_ids"])
        # The first token of a row has no prediction from the previous row: mask the boundary label.
        cur_labels = cur_labels + [IGNORE] + list(r["labels"][1:]) if cur_labels else list(r["labels"])
        cur_pos = cur_pos + list(range(k))
    if cur_ids:
        packs.append({"input_ids": cur_ids, "labels": cur_labels, "position_ids": cur_pos})
    return packs


def collate(rows: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    batch = pad_batch(rows, pad_id)
    if "position_ids" in rows[0]:
        pos = torch.zeros_like(batch["input_ids"])
        for i, r in enumerate(rows):
            pos[i, : len(r["position_ids"])] = torch.tensor(r["position_ids"], dtype=torch.long)
        batch["position_ids"] = pos
    return batch


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Target tokens after the causal shift (labels[:, 1:] that are not -100)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())
