"""The training objective, computed the same way by every backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swiftlite.data.tokenize import IGNORE  # the label that marks a token without loss


def token_loss_sum(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over target tokens, in fp32.

    A sum, not a mean: the trainer divides by the target tokens of the whole global batch, so the
    objective does not change with micro-batching or the number of ranks (docs/design.md, "Numerics").
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = module(**inputs, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    labels = batch["labels"][:, 1:]
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
