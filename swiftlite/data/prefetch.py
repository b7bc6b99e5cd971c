"""Building a step's micro-batches ahead of time in torch DataLoader workers (--dataloader_num_workers).

What a training step consumes is a function of the step alone (data/loader.BatchPlan): the rows of
this rank's micro-batches, collated, and the target tokens of the whole global batch (the loss
normalisation, docs/design.md "Numerics"). `StepBatches` is that function as a map-style dataset
indexed by the data step, so a `torch.utils.data.DataLoader` over the steps a run still has to train
(`range(first, end)`, in order: the DataLoader hands results back in sampler order whatever worker
built them) gives the same tensors, in the same order, as building them in the training process.
Resume is unchanged: the range starts at the resumed data step.

With 0 workers (or where a step is asked for out of order) the step is built inline, as before.
`pin_memory` is passed to the DataLoader only where a CUDA device exists (page-locked memory only
speeds up host-to-GPU copies; on a CPU-only machine torch warns and ignores it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from swiftlite.data.collate import collate, real_tokens


@dataclass
class StepData:
    """One optimizer step's data for this rank."""
    micro: list[dict]          # collated micro-batches (CPU tensors), in accumulation order
    global_targets: int        # target tokens of the whole global batch (every rank)
    local_tokens: int          # real (non-pad) tokens of this rank's micro-batches

    def pin_memory(self) -> "StepData":
        """Called by the DataLoader's pin-memory thread (--dataloader_pin_memory on a CUDA machine)."""
        return StepData([{k: v.pin_memory() for k, v in b.items()} for b in self.micro], self.global_targets,
                        self.local_tokens)


class StepBatches:
    """data step -> StepData for `rank` (a map-style dataset: what DataLoader workers call).

    `row(i)` gives a tokenized row and `targets(i)` its target-token count; both may tokenize on
    demand (--lazy_tokenize), in whichever process builds the step."""

    def __init__(self, plan: Any, rank: int, row: Callable[[int], dict], targets: Callable[[int], int],
                 pad_id: int, padding_free: bool):
        self.plan, self.rank, self.row, self.targets = plan, rank, row, targets
        self.pad_id, self.padding_free = pad_id, padding_free

    def __getitem__(self, k: int) -> StepData:
        global_targets = sum(self.targets(i) for mb in self.plan.all_micro_batches(k) for i in mb)
        micro = [collate([self.row(i) for i in mb], self.pad_id, padding_free=self.padding_free)
                 for mb in self.plan.micro_batches(k, self.rank)]
        return StepData(micro, global_targets, sum(real_tokens(b) for b in micro))


def _identity(x: Any) -> Any:
    return x


def loader_iter(dataset: Any, **kw: Any) -> Iterator[Any]:
    """An iterator over a DataLoader of `dataset` (one item each, as built) that draws nothing from
    torch's global RNG. A DataLoader iterator without a generator of its own draws its workers' base
    seed from the global RNG, which shifts every dropout mask after it, and differently on resume (the
    loader starts at another step): LoRA runs with workers neither equalled the inline run nor resumed
    exactly. Building a batch draws nothing random, so the seed of its own generator is immaterial."""
    import torch
    from torch.utils.data import DataLoader
    return iter(DataLoader(dataset, batch_size=None, collate_fn=_identity, worker_init_fn=_worker_signals,
                           generator=torch.Generator().manual_seed(0), **kw))


def _worker_signals(_worker_id: int) -> None:
    """A worker ignores the stop signals: a preemption's SIGTERM (or SIGUSR1, SIGINT) sent to the whole
    process group is the training process's to handle (finish the step, save, exit 75; train/preempt.py),
    and a worker that died of it would fail that step instead. The training process shuts its workers
    down, and a worker whose parent is gone exits by itself (torch's watchdog)."""
    import signal
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class Prefetcher:
    """StepData for the steps `first, first + 1, ...` (< end) from a DataLoader with workers;
    `get(k)` builds k inline when it is not the next step the loader holds."""

    def __init__(self, steps: StepBatches, first: int, end: int, *, num_workers: int,
                 pin_memory: bool = False, prefetch_factor: int | None = None):
        import torch
        self.steps = steps
        self.next = first
        self.end = end
        self._it: Iterator[StepData] | None = None
        if num_workers > 0 and end > first:
            self._it = loader_iter(steps, sampler=range(first, end), num_workers=num_workers,
                                   pin_memory=bool(pin_memory and torch.cuda.is_available()),
                                   prefetch_factor=prefetch_factor, persistent_workers=False)

    def get(self, k: int) -> StepData:
        if self._it is not None and k == self.next and k < self.end:
            self.next += 1
            return next(self._it)
        self.close()  # out of order (never in the step loop): build it here
        return self.steps[k]

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()  # stop the workers now, not at garbage collection
