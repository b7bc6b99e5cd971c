"""Validation loss: the token mean over every rank's share of the validation rows, in the training
run's batch form (padding-free or padded: models.loading.batch_form)."""

from __future__ import annotations

import math
from typing import Any

from swiftlite.data.collate import collate
from swiftlite.data.tokenize import IGNORE
from swiftlite.distributed import all_reduce_sum


def evaluate(engine: Any, val_data: Any, cfg: Any, world: Any, pad_id: int, form: Any = None) -> float:
    """Token-mean validation loss over all ranks, batched like training (`form`, by default the run's
    `batch_form(cfg)`). Every rank runs the same number of forwards (sharded backends need every rank
    in each collective), padding with batches that have no target.
    A quantized base cannot be repacked by this eval() + no_grad forward: model loading disabled
    bitsandbytes' CPU repack (docs/design.md trap 1)."""
    import torch

    from swiftlite.models.loading import batch_form
    padding_free = (form if form is not None else batch_form(cfg)).padding_free
    rows = val_data.rows
    bs = cfg.train.per_device_eval_batch_size
    mine = list(range(world.rank, len(rows), world.world_size))
    per_rank = math.ceil(len(rows) / world.world_size)
    n_batches = math.ceil(per_rank / bs)
    total, count = 0.0, 0
    engine.eval()
    with torch.no_grad():
        for b in range(n_batches):
            idx = mine[b * bs:(b + 1) * bs]
            if idx:
                batch_rows = [rows[i] for i in idx]
            else:  # this rank ran out: a dummy batch that contributes nothing
                batch_rows = [{"input_ids": rows[0]["input_ids"], "labels": [IGNORE] * len(rows[0]["labels"])}]
            batch = collate(batch_rows, pad_id, padding_free=padding_free)
            batch = {k: v.to(world.device) for k, v in batch.items()}
            total += float(engine.forward(batch))
            count += int((batch["labels"][:, 1:] != IGNORE).sum())
    engine.train()
    total, count = all_reduce_sum([total, float(count)])
    return round(total / max(1.0, count), 6)


def evaluate_run(run: Any) -> dict[str, float]:
    """The sft/pt validation record of a run (train/tasks.py "evaluate")."""
    return {"eval_loss": evaluate(run.engine, run.val_data, run.cfg, run.world, run.batches.pad_id)}
