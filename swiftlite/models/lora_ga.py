"""--init_weights lora-ga (LoRA-GA, Wang et al. 2024, arXiv 2407.05000) through peft: before the
adapter is built, peft's `preprocess_loraga` averages the gradient of every adapted weight over a few
batches of training rows, then peft's LoRA layers take A and B from that gradient's top 2r singular
vectors (--lora_ga_direction, --lora_ga_scale, --lora_ga_stable_gamma) and subtract s B0 A0 from the
base, so the model starts where the base was and moves first along the full fine-tune's gradient.

ms-swift runs it on its training dataset with --lora_ga_batch_size rows per batch, --lora_ga_iters
batches, each row cut to --lora_ga_max_length tokens; here the same: the first batch_size x iters rows
of the run's tokenized training data (the rows the run trains on, packed rows read as one sequence),
the model's own token loss (labels as the run's), every rank on the same rows and from --seed, so all
ranks build the same adapter (peft's SVD is randomised: torch.svd_lowrank).

The base changes as with PiSSA/OLoRA (models/lora.mutates_base): saved adapters are converted to a
plain LoRA of the model folder's weights (peft's rank-2r conversion), which export merges. The
gradient needs the whole weights: refused where the base is a skeleton when the adapter is built
(sharded loading: models/lora.check_skeleton) or partitioned (ZeRO-3), on a quantized base (rules),
with rlhf and with --streaming (config/rules_tuners.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig


def uses_lora_ga(cfg: "RunConfig") -> bool:
    return bool(cfg.is_lora and cfg.lora.init_weights == "lora-ga")


def lora_ga_problem(cfg: "RunConfig", choice: Any = None) -> str | None:
    """Why LoRA-GA cannot run on the chosen backend (a parallel.base.BackendChoice), or None."""
    if not uses_lora_ga(cfg) or choice is None:
        return None
    if choice.record.loading == "partitioned" and cfg.quant_bits is None:
        return (f"--init_weights lora-ga with --parallelism {choice.name}: the gradient estimation needs each "
                "adapted weight whole, and ZeRO-3 partitions the model as it loads; use --parallelism ddp, zero2, "
                "or fsdp with --sharded_loading false")
    return None


def estimation_rows(cfg: "RunConfig", train: Any) -> list[dict] | None:
    """The rows the gradient is estimated on (None without LoRA-GA): the first batch_size x iters of the
    run's tokenized training rows."""
    if not uses_lora_ga(cfg):
        return None
    lc = cfg.lora
    return list(train.rows[: lc.lora_ga_batch_size * lc.lora_ga_iters])


def preprocess(model: "torch.nn.Module", conf: Any, cfg: "RunConfig", rows: list[dict] | None) -> None:
    """peft's preprocess_loraga on `rows`: attaches each adapted layer's averaged gradient, which
    get_peft_model then turns into the initial A and B."""
    import torch
    from peft import preprocess_loraga

    from swiftlite.errors import UserError
    if not rows:
        raise UserError("--init_weights lora-ga: no training rows to estimate the gradient on")
    lc = cfg.lora
    device = next(model.parameters()).device
    pad = getattr(model.config, "pad_token_id", None) or 0

    def train_step() -> None:
        for i in range(0, len(rows), lc.lora_ga_batch_size):
            batch = rows[i:i + lc.lora_ga_batch_size]
            cut = [(r["input_ids"][:lc.lora_ga_max_length], r["labels"][:lc.lora_ga_max_length]) for r in batch]
            width = max(len(ids) for ids, _ in cut)
            ids = torch.full((len(cut), width), pad, dtype=torch.long)
            labels = torch.full((len(cut), width), -100, dtype=torch.long)   # HF's ignore index, the rows' too
            mask = torch.zeros((len(cut), width), dtype=torch.long)
            for j, (a, b) in enumerate(cut):
                ids[j, :len(a)], labels[j, :len(b)], mask[j, :len(a)] = torch.tensor(a), torch.tensor(b), 1
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
            out.loss.backward()

    preprocess_loraga(model, conf, train_step)
