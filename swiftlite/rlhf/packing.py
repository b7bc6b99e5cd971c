"""Padding-free and packed pair batches (`--padding_free true`, `--packing`) for dpo, orpo, simpo, cpo.

ms-swift's collator (`Template._rlhf_data_collator`) turns a micro-batch of n pairs into 2n rows, the n
chosen then the n rejected; with padding-free batches those rows are concatenated into one sequence
(data/collate.concat_rows: position ids restarting per row, no attention mask, so transformers keeps
each row's attention inside the row), and the per-row log-probs are summed per segment
(rlhf/reference.module_logps). The pair terms are those of the padded batch.

`--packing` (ms-swift's PackingDataset with a pair weighing its chosen + rejected tokens): whole pairs
are packed, in order, into packs of at most --max-length tokens (the two sides together; a pair longer
than that is a pack of its own), and a pack is the sample of the batch plan: `--per-device-train-
batch-size 1` is one pack per micro-batch, as in ms-swift. A pack never splits a pair. The step's
objective stays the mean over the pairs of the global batch (their number now varies by step), so a
packed run computes the loss of the same pairs unpacked. Validation batches are packed the same way
(`--per-device-eval-batch-size` packs), and `--precompute-ref-log-probs` runs over the packs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swiftlite.data.collate import BatchForm

PADDED_PAIRS = BatchForm(False, "rlhf default; --padding_free true concatenates the pairs")


def pair_form(cfg: Any) -> BatchForm:
    """The batch form of a pair run: padded (ms-swift's default for rlhf) unless --padding_free true or
    --packing (models.loading.batch_form then refuses a model that cannot keep rows apart)."""
    d = cfg.data
    if not (d.packing or d.padding_free):
        return PADDED_PAIRS if d.padding_free is None else BatchForm(False, "--padding_free false",
                                                                     cfg.model.attn_impl)
    from swiftlite.models.loading import batch_form
    return batch_form(cfg)


def pair_length(row: dict) -> int:
    return len(row["chosen_ids"]) + len(row["rejected_ids"])


def pack_pairs(rows: list[dict], max_length: int) -> list[list[int]]:
    """Pair indices grouped greedily, in order, into packs of at most max_length tokens (chosen and
    rejected together); a pair is never split, and one longer than max_length is a pack of its own."""
    packs: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, r in enumerate(rows):
        k = pair_length(r)
        if cur and size + k > max_length:
            packs.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += k
    if cur:
        packs.append(cur)
    return packs


@dataclass
class PackedPlan:
    """data.loader.BatchPlan over packs, answering in pair indices: `micro_batches(step, rank)` is this
    rank's micro-batches as the pairs of their packs. `global_batch` (packs) and `steps_per_epoch` are
    the inner plan's; `global_pairs(step)` is the number of pairs a step trains on."""
    plan: Any
    packs: list[list[int]]

    def __getattr__(self, name: str) -> Any:
        if name in ("plan", "packs"):
            raise AttributeError(name)
        return getattr(self.plan, name)

    def _pairs(self, mbs: list[list[int]]) -> list[list[int]]:
        return [[p for i in mb for p in self.packs[i]] for mb in mbs]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        return self._pairs(self.plan.micro_batches(step, rank))

    def all_micro_batches(self, step: int) -> list[list[int]]:
        return self._pairs(self.plan.all_micro_batches(step))

    def global_order(self, step: int) -> list[int]:
        return [p for i in self.plan.global_order(step) for p in self.packs[i]]


def units(data: Any) -> list[list[int]]:
    """The batch units of a PairData: its packs under --packing, else one pair each."""
    packs = getattr(data, "packs", None)
    return packs if packs is not None else [[i] for i in range(len(data.rows))]


__all__ = ["PADDED_PAIRS", "PackedPlan", "pack_pairs", "pair_form", "pair_length", "units"]
