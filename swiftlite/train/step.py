"""One optimizer step: the micro-batches of this rank, the scaled backward, `engine.step()`.

Numerics (docs/design.md, "Numerics"): each optimizer step consumes one global batch (per-device x
world x accumulation samples, the same samples whatever the world size). Each micro-batch's summed
token loss is scaled by world_size / (target tokens of the whole global batch): every backend averages
gradients over ranks, so the averaged gradient is the gradient of the global token-mean loss, and the
logged loss (summed over ranks, divided by the global targets) equals the single-process one.

The batch form (padding-free or padded, `batches.form`: models.loading.batch_form) changes how a
micro-batch is laid out, never which tokens are targets: the global target count is the same and so
is the normalisation. `StepStats.tokens` counts real (non-pad) tokens in either form.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

from swiftlite.data.collate import PADDED
from swiftlite.distributed import all_reduce_sum
from swiftlite.metrics import StepStats


@dataclass
class TokenBatches:
    """The tokenized training rows and the step-indexed order that cuts them into batches (sft, pt).
    `num_workers` > 0 (--dataloader_num_workers) builds the steps ahead in DataLoader workers
    (data/prefetch.py): the same tensors in the same order as building them here."""
    rows: Any                      # list of rows, or data.pipeline.LazyRows (--lazy_tokenize)
    plan: Any                      # data.loader.BatchPlan
    pad_id: int
    world: Any
    targets: Any = field(default_factory=list)   # target tokens per row (Tokenized.targets), or a callable
    form: Any = None               # data.collate.BatchForm (models.loading.batch_form); None = padded
    num_workers: int = 0
    pin_memory: bool = True
    prefetch_factor: int | None = None
    sp: Any = None                 # parallel/sequence.SequenceParallel (--sequence_parallel_size > 1)
    _prefetch: Any = field(default=None, repr=False)

    def _target_count(self, i: int) -> int:
        return self.targets(i) if callable(self.targets) else self.targets[i]

    def _row(self, i: int) -> dict:
        return self.rows[i]

    def step_batches(self) -> Any:
        from swiftlite.data.prefetch import StepBatches
        return StepBatches(self.plan, data_rank(self.world, self.sp), self._row, self._target_count, self.pad_id,
                           (self.form or PADDED).padding_free)

    def global_targets(self, step: int) -> int:
        """Target tokens of the whole global batch of `step` (every rank computes it alike, no comms)."""
        return sum(self._target_count(i) for mb in self.plan.all_micro_batches(step) for i in mb)

    def prefetch(self, first: int, end: int) -> None:
        """The step loop will ask for data steps first, first + 1, ..., end - 1: start the workers."""
        from swiftlite.data.prefetch import Prefetcher
        self.close()
        if self.num_workers > 0:
            self._prefetch = Prefetcher(self.step_batches(), first, end, num_workers=self.num_workers,
                                        pin_memory=self.pin_memory, prefetch_factor=self.prefetch_factor)

    def step_data(self, k: int) -> Any:
        """data.prefetch.StepData of data step `k` for this rank: from the workers, or built here."""
        if self._prefetch is not None:
            return self._prefetch.get(k)
        return self.step_batches()[k]

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None


def data_rank(world: Any, sp: Any) -> int:
    """The data-parallel rank whose rows this rank trains on: its own, or its sequence-parallel group's."""
    return world.rank // (sp.size if sp is not None else 1)


def token_batches(cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> TokenBatches:
    """sft/pt's batches (`TokenTask.make_batches`, train/tasks.py)."""
    from swiftlite.models.loading import batch_form
    t = cfg.train
    if cfg.data.streaming:   # data/stream.py: the rows are read as the steps consume them
        from swiftlite.data.stream import StreamBatches
        return StreamBatches(train, plan, tokenizer.pad_token_id, world, batch_form(cfg), t.dataloader_num_workers,
                             t.dataloader_pin_memory, t.dataloader_prefetch_factor)
    targets = getattr(train, "target_counts", None) or [train.targets(i) for i in range(len(train.rows))]
    return TokenBatches(train.rows, plan, tokenizer.pad_token_id, world, targets, batch_form(cfg),
                        num_workers=t.dataloader_num_workers, pin_memory=t.dataloader_pin_memory,
                        prefetch_factor=t.dataloader_prefetch_factor)


def train_step(engine: Any, batches: Any, step: int, *, data_step: int | None = None,
               before_optimizer: Callable[[Any], None] | None = None) -> StepStats:
    """Run optimizer step `step` (0-based) on `batches` (`TokenBatches`). `data_step` picks
    the global batch (the step itself unless a resume restarts the data order); `before_optimizer`
    sees the engine between the last backward and the optimizer step (gradients exist only then)."""
    world = batches.world
    k = step if data_step is None else data_step
    data = batches.step_data(k)
    global_targets = data.global_targets
    scale = world.world_size / max(1, global_targets)
    local_loss, local_tokens = 0.0, data.local_tokens
    micro = data.micro
    sp = getattr(batches, "sp", None)   # sequence parallel: this rank's slice of each micro-batch
    for m, batch in enumerate(micro):
        batch = {key: v.to(world.device, non_blocking=True) for key, v in batch.items()}
        whole = contextlib.nullcontext()
        if sp is not None:
            batch, positions, mask = sp.shard(batch)
            whole = sp.active(positions, mask)   # forward and backward (recomputation) see the whole sequence
        with engine.micro_batch(last=m == len(micro) - 1), whole:
            loss_sum = engine.forward(batch)
            engine.backward(loss_sum * scale)
        local_loss += float(loss_sum.detach())
    if sp is not None:   # the ranks of a group count the same rows' tokens
        local_tokens = local_tokens / sp.size
    if before_optimizer is not None:
        before_optimizer(engine)
    grad_norm = engine.step()
    loss_total, tokens_total = all_reduce_sum([local_loss, float(local_tokens)])
    return StepStats(step=step + 1, loss=loss_total / max(1, global_targets), grad_norm=float(grad_norm),
                     tokens=int(round(tokens_total)), target_tokens=global_targets)
