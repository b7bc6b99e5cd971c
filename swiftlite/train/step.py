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

from dataclasses import dataclass, field
from typing import Any, Callable

from swiftlite.data.collate import PADDED, collate, real_tokens
from swiftlite.data.loader import select
from swiftlite.distributed import all_reduce_sum
from swiftlite.metrics import StepStats


@dataclass
class TokenBatches:
    """The tokenized training rows and the step-indexed order that cuts them into batches (sft, pt)."""
    rows: list[dict]
    plan: Any                      # data.loader.BatchPlan
    pad_id: int
    world: Any
    targets: list[int] = field(default_factory=list)   # target tokens per row (Tokenized.targets)
    form: Any = None               # data.collate.BatchForm (models.loading.batch_form); None = padded

    def global_targets(self, step: int) -> int:
        """Target tokens of the whole global batch of `step` (every rank computes it alike, no comms)."""
        return sum(self.targets[i] for mb in self.plan.all_micro_batches(step) for i in mb)


def token_batches(cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> TokenBatches:
    """sft/pt's batches (`TokenTask.make_batches`, train/tasks.py)."""
    from swiftlite.models.loading import batch_form
    return TokenBatches(train.rows, plan, tokenizer.pad_token_id, world,
                        [train.targets(i) for i in range(len(train.rows))], batch_form(cfg))


def train_step(engine: Any, batches: Any, step: int, *, data_step: int | None = None,
               before_optimizer: Callable[[Any], None] | None = None) -> StepStats:
    """Run optimizer step `step` (0-based) on `batches` (`TokenBatches`). `data_step` picks
    the global batch (the step itself unless a resume restarts the data order); `before_optimizer`
    sees the engine between the last backward and the optimizer step (gradients exist only then)."""
    world = batches.world
    k = step if data_step is None else data_step
    global_targets = batches.global_targets(k)
    scale = world.world_size / max(1, global_targets)
    local_loss, local_tokens = 0.0, 0
    micro = batches.plan.micro_batches(k, world.rank)
    padding_free = (batches.form or PADDED).padding_free
    for m, mb in enumerate(micro):
        batch = collate(select(batches.rows, mb), batches.pad_id, padding_free=padding_free)
        local_tokens += real_tokens(batch)
        batch = {key: v.to(world.device) for key, v in batch.items()}
        with engine.micro_batch(last=m == len(micro) - 1):
            loss_sum = engine.forward(batch)
            engine.backward(loss_sum * scale)
        local_loss += float(loss_sum.detach())
    if before_optimizer is not None:
        before_optimizer(engine)
    grad_norm = engine.step()
    loss_total, tokens_total = all_reduce_sum([local_loss, float(local_tokens)])
    return StepStats(step=step + 1, loss=loss_total / max(1, global_targets), grad_norm=float(grad_norm),
                     tokens=int(tokens_total), target_tokens=global_targets)
