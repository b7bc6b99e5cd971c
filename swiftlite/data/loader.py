"""Global batches that are the same whatever the world size, in a resumable order.

Each optimizer step consumes one global batch of `per_device x world x accumulation` samples, taken
from a permutation of the dataset seeded by (seed, epoch). The global batch is cut into
`world x accumulation` micro-batches; rank r takes micro-batches r, r+world, ... So the same samples
meet in the same optimizer step on 1 or N processes, and the position is just the global step:
resuming at step k replays nothing and skips nothing. The last incomplete global batch of an epoch
is dropped (`drop_last`, --dataloader_drop_last true), or (false) filled up with the first samples of
the same epoch's order, so every step still has the same number of samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class BatchPlan:
    n_samples: int
    per_device: int
    world_size: int
    accumulation: int
    seed: int
    drop_last: bool = True

    @property
    def global_batch(self) -> int:
        return self.per_device * self.world_size * self.accumulation

    @property
    def steps_per_epoch(self) -> int:
        """0 when the data holds less than one global batch (refused by the callers)."""
        whole, left = divmod(self.n_samples, self.global_batch)
        return whole + (1 if left and whole and not self.drop_last else 0)

    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(self.n_samples, generator=g).tolist()

    def global_order(self, step: int) -> list[int]:
        """The sample indices of global optimizer step `step` (0-based), whatever the world size."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        order = self.order(epoch)
        idx = order[pos * self.global_batch:(pos + 1) * self.global_batch]
        if len(idx) < self.global_batch:   # the last batch of an epoch under drop_last=False
            idx = idx + order[:self.global_batch - len(idx)]
        return idx

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """Sample indices of this rank's micro-batches for global optimizer step `step` (0-based)."""
        idx = self.global_order(step)
        chunks = [idx[i * self.per_device:(i + 1) * self.per_device]
                  for i in range(self.world_size * self.accumulation)]
        return [chunks[m * self.world_size + rank] for m in range(self.accumulation)]

    def all_micro_batches(self, step: int) -> list[list[int]]:
        """Every rank's micro-batches of a step (to count the global target tokens without comms)."""
        return [mb for r in range(self.world_size) for mb in self.micro_batches(step, r)]


def select(rows: Sequence[dict], idx: Sequence[int]) -> list[dict]:
    return [rows[i] for i in idx]
