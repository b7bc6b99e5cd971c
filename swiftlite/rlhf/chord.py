"""CHORD (arXiv 2508.11408; ms-swift's `--chord_*`, swift/rlhf_trainers/utils.py `compute_chord_loss`):
GRPO with an SFT loss on expert rows mixed in. Each micro-batch of a step backpropagates

    (1 - mu) x GRPO's micro-batch loss  +  mu x SFT / GA

where SFT is the mean cross-entropy over the target tokens of one batch of
--chord_sft_per_device_train_batch_size expert rows (tokenized as sft's rows, rlhf/grpo_data.py), and
GA the gradient accumulation steps (ms-swift's trainer divides both terms by GA; swiftlite's GRPO loss
carries that division already, rlhf/grpo_loss.micro_batch_loss). With --chord_enable_phi_function each
token's loss is weighted by phi = p (1 - p), p its probability under the policy, detached (CHORD-phi).
mu follows ms-swift's schedule at the 0-based optimizer step: linear from 0 to --chord_mu_peak over
--chord_mu_warmup_steps, a cosine from the peak to --chord_mu_valley over --chord_mu_decay_steps, then
the valley; with mu 0 no expert batch is drawn.

The expert rows are drawn per process, as ms-swift's (a RandomSampler per process over all the rows,
no distributed split): process r walks its own permutations of the rows, one per pass (seeded with
--seed, r and the pass), taking the next batch for every micro-batch of every step. Batch k of a process
is a function of k alone, so a resumed run draws what the uninterrupted one would have.

The SFT forward runs on the backend's root module and its backward is a micro-batch of its own in the
step's accumulation (the engine's gradient sync with the last one), after the GRPO micro-batch it
joins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from swiftlite.data.tokenize import IGNORE


def mu_schedule(step: int, warmup: int, decay: int, peak: float, valley: float) -> float:
    """ms-swift's mu at 0-based step `step` (mu_schedule_function)."""
    if step < warmup:
        return step / warmup * peak
    if step >= warmup + decay:
        return valley
    return (peak - valley) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / decay)) + valley


@dataclass
class ChordData:
    """The expert rows and how one process draws its batches from them."""
    rows: list[dict]
    per_device: int
    seed: int
    rank: int
    pad_id: int

    def batch_rows(self, k: int) -> list[dict]:
        """This process's k-th expert batch (0-based, over the whole run)."""
        n, out = len(self.rows), []
        for j in range(k * self.per_device, (k + 1) * self.per_device):
            epoch, i = divmod(j, n)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + epoch)
            out.append(self.rows[int(torch.randperm(n, generator=g)[i])])
        return out

    def batch(self, k: int, device: Any) -> dict[str, torch.Tensor]:
        from swiftlite.data.collate import collate
        return {n: t.to(device) for n, t in collate(self.batch_rows(k), self.pad_id).items()}


def sft_loss(module: Any, batch: dict[str, torch.Tensor], ctx: Any, phi: bool) -> tuple[torch.Tensor, int]:
    """(the mean cross-entropy over the batch's target tokens, phi-weighted when asked; the token count)."""
    import contextlib
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with ctx if ctx is not None else contextlib.nullcontext():
        out = module(**inputs, use_cache=False)
    logits = (out.logits if hasattr(out, "logits") else out[0])[:, :-1]
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE
    tok = F.cross_entropy(logits[keep].float(), labels[keep], reduction="none")
    if phi:
        p = torch.exp(-tok.detach())
        tok = tok * p * (1 - p)
    n = int(keep.sum())
    return tok.sum() / max(1, n), n


__all__ = ["ChordData", "mu_schedule", "sft_loss"]
