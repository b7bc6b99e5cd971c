"""Reward models as GRPO rewards (--reward_model, ms-swift's default reward-model plugin).

ms-swift's `--reward_model M ...` appends one reward per model after the --reward_funcs ones (their
weights follow in --reward_weights, in that order). Its default plugin (swift/rewards/rm_plugin.
DefaultRMPlugin) renders each completion's conversation (the prompt's messages, then the completion as
the assistant turn) with the reward model's own template, runs the model, and takes its first logit:
the score of a sequence-classification model with one output, pooled at the last token that is not
padding (transformers' pooling). That is what `swiftlite rlhf --rlhf_type rm` trains and `swiftlite
export` writes, so a reward model trained here scores GRPO's completions as is.

Here the template is the reward model's tokenizer's chat template (its folder's), each process scores
its own completions (one frozen copy of each reward model per process, in the run's compute dtype, on
its device: the planner counts it so, planner/memory.reference_bytes), in batches of BATCH rows,
right-padded. Only ms-swift's `default` plugin is available (its `genrm` asks a generative model in a
chat and parses "Reward: x"; custom plugins are Python classes of ms-swift's): the rules refuse others.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from swiftlite.errors import UserError

if TYPE_CHECKING:   # torch is imported where a model runs: the rules and the planner import this module
    import torch

#: completions per forward of a reward model
BATCH = 8


def config_problem(path: str) -> str | None:
    """Why a local --reward_model folder is not a one-output sequence classifier (None when it is, or
    when the argument is a hub id: its config is read when the run loads it). Called before launch
    (rlhf/grpo_data.prepare_prompts)."""
    from swiftlite.models.source import resolve_model
    try:
        src = resolve_model(path)
    except UserError as e:
        return f"--reward_model {path}: {str(e).split(': ', 1)[-1]}"
    conf = src.config_dict() if src.kind == "folder" else None
    if conf is None:
        return None
    arch = (conf.get("architectures") or [""])[0]
    labels = len(conf.get("id2label") or {}) or conf.get("num_labels") or 2
    if not arch.endswith("ForSequenceClassification") or labels != 1:
        return (f"--reward_model {path}: a {arch or 'model'} with {labels} outputs; ms-swift's default reward-model "
                "plugin scores with a sequence-classification model of one output (what `swiftlite rlhf --rlhf_type "
                "rm` trains and `swiftlite export` writes); generative judges (ms-swift's genrm) are not available")
    return None


class RewardModelScorer:
    """One --reward_model, loaded frozen on `device` in `dtype`; called as a reward function."""

    def __init__(self, path: str, device: Any, dtype: "torch.dtype", trust_remote_code: bool = False):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code).to(device).train(False).requires_grad_(False)
        if self.model.config.num_labels != 1:
            raise UserError(config_problem(path) or f"--reward_model {path}: {self.model.config.num_labels} outputs, "
                            "not 1")
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        if self.model.config.pad_token_id is None:   # transformers pools at the last token that is not this one
            self.model.config.pad_token_id = self.pad_id
        self.device = device

    def __call__(self, completions: list[str], messages: list[list[dict]], **kwargs: Any) -> list[float]:
        import torch
        texts = [self.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in conv],
                                                    tokenize=False) for conv in messages]
        out: list[float] = []
        for i in range(0, len(texts), BATCH):
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[i:i + BATCH]]
            n = max(len(x) for x in ids)
            batch = torch.full((len(ids), n), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(ids), n), dtype=torch.long)
            for j, x in enumerate(ids):
                batch[j, :len(x)] = torch.tensor(x)
                mask[j, :len(x)] = 1
            with torch.no_grad():
                logits = self.model(input_ids=batch.to(self.device), attention_mask=mask.to(self.device)).logits
            out += logits[:, 0].float().tolist()
        return out


def build_reward_models(r: Any, device: Any, dtype: "torch.dtype", trust_remote_code: bool = False) -> list:
    """--reward_model -> plugin.Reward entries (after the --reward_funcs ones), named as ms-swift names them
    (the folder's last part)."""
    from swiftlite.plugin import Reward
    out = []
    for path in r.reward_model or []:
        scorer = RewardModelScorer(path, device, dtype, trust_remote_code)
        out.append(Reward(path, scorer, Path(path.rstrip("/")).name, ()))
    return out


__all__ = ["BATCH", "RewardModelScorer", "build_reward_models", "config_problem"]
