"""Reward models as GRPO rewards (--reward_model, with ms-swift's reward-model plugins).

ms-swift's `--reward_model M ...` appends one reward per model after the --reward_funcs ones (their
weights follow in --reward_weights, in that order), each scored by its `--reward_model_plugin`
(swiftlite/msswift_api/rm_plugin.py, one per model, `default` when not given):

- `default` (DefaultRMPlugin): M is a sequence classifier with one output; the score is its first logit
  on the completion's conversation (the prompt's messages, then the completion as the assistant turn)
  rendered with M's template, pooled at the last token that is not padding (transformers' pooling).
  That is what `swiftlite rlhf --rlhf_type rm` trains and `swiftlite export` writes, so a reward model
  trained here scores GRPO's completions as is.
- `genrm` (GenRMPlugin): M is a causal LM asked to judge each conversation; the score is the
  "Reward: x" of its answer.
- a name a plugin file registered (`rm_plugins["name"] = Cls`, ms-swift's class shape): M is loaded as a
  sequence classifier when its config says so, else as a causal LM, and the class is built with it
  and its Template.

Here the template is M's tokenizer's chat template (its folder's); each process scores its own
completions (one frozen copy of each reward model per process, in the run's compute dtype, on its
device: the planner counts it so, planner/memory.reference_bytes), BATCH rows per plugin call.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from swiftlite.errors import UserError

if TYPE_CHECKING:   # torch is imported where a model runs: the rules and the planner import this module
    import torch

#: completions per forward of a reward model
BATCH = 8


def _is_classifier(conf: dict) -> bool:
    return (conf.get("architectures") or [""])[0].endswith("ForSequenceClassification")


def config_problem(path: str, plugin: str = "default") -> str | None:
    """Why a local --reward_model folder does not fit its plugin (None when it does, or when the argument
    is a hub id: its config is read when the run loads it). `default` needs a one-output sequence
    classifier, `genrm` a causal LM; a plugin file's class takes either. Called before launch
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
    if plugin == "genrm":
        return None if arch.endswith("ForCausalLM") else (
            f"--reward_model {path}: a {arch or 'model'}; the genrm plugin asks a causal LM (a chat model) to judge "
            "each completion: give one, or --reward_model_plugin default for a sequence classifier")
    if plugin != "default":
        return None
    labels = len(conf.get("id2label") or {}) or conf.get("num_labels") or 2
    if not _is_classifier(conf) or labels != 1:
        return (f"--reward_model {path}: a {arch or 'model'} with {labels} outputs; ms-swift's default reward-model "
                "plugin scores with a sequence-classification model of one output (what `swiftlite rlhf --rlhf_type "
                "rm` trains and `swiftlite export` writes); a chat model judges with --reward_model_plugin genrm")
    return None


def check_plugins(r: Any) -> None:
    """Every --reward_model_plugin is registered (built-ins, then what --external_plugins added): before
    launch, after the plugin files ran."""
    from swiftlite.plugin import rm_plugins
    for name in r.reward_model_plugin or []:
        if name not in rm_plugins:
            raise UserError(f"--reward_model_plugin {name}: unknown reward-model plugin (registered: "
                            f"{', '.join(sorted(rm_plugins))}; a plugin file adds one with rm_plugins['name'] = Cls, "
                            "ms-swift's shape)")


class RewardModelScorer:
    """One --reward_model with its plugin, loaded frozen on `device` in `dtype`; called as a reward function."""

    def __init__(self, path: str, device: Any, dtype: "torch.dtype", trust_remote_code: bool = False,
                 plugin: str = "default", max_length: int | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        from swiftlite.msswift_api.template import Template
        from swiftlite.plugin import rm_plugins
        from swiftlite.plugin_imports import msswift_aliases
        self.path = path
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        conf = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).to_dict()
        auto = AutoModelForSequenceClassification if _is_classifier(conf) else AutoModelForCausalLM
        if plugin == "default" and auto is not AutoModelForSequenceClassification or \
                plugin == "genrm" and auto is not AutoModelForCausalLM:
            raise UserError(config_problem(path, plugin) or f"--reward_model {path}: not a model for {plugin}")
        model = auto.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        model = model.to(device).train(False).requires_grad_(False)
        if plugin == "default" and model.config.num_labels != 1:
            raise UserError(config_problem(path) or f"--reward_model {path}: {model.config.num_labels} outputs, not 1")
        template = Template(tokenizer, max_length)
        if auto is AutoModelForSequenceClassification and model.config.pad_token_id is None:
            model.config.pad_token_id = template.pad_id   # transformers pools at the last token that is not this one
        self.model = model
        with msswift_aliases():   # a plugin class's own `from swift... import` in its __init__
            self.plugin = rm_plugins[plugin](model=model, template=template)

    def __call__(self, completions: list[str], messages: list[list[dict]], **kwargs: Any) -> list[Any]:
        """The plugin's scores of BATCH rows at a time; each row is ms-swift's: `messages` (prompt and
        completion) and the dataset row's columns, which also come batched as keyword lists."""
        lists = {k: v for k, v in kwargs.items() if isinstance(v, list) and len(v) == len(completions)}
        rows = [{"messages": m, **{k: v[i] for k, v in lists.items()}} for i, m in enumerate(messages)]
        out: list[Any] = []
        for i in range(0, len(rows), BATCH):
            part = {k: v[i:i + BATCH] for k, v in lists.items()}
            got = self.plugin(inputs=rows[i:i + BATCH], **part,
                              **{k: v for k, v in kwargs.items() if k not in lists})
            out += [None if v is None else float(v) for v in (got.tolist() if hasattr(got, "tolist") else got)]
        return out


def build_reward_models(r: Any, device: Any, dtype: "torch.dtype", trust_remote_code: bool = False,
                        max_length: int | None = None) -> list:
    """--reward_model -> plugin.Reward entries (after the --reward_funcs ones), named as ms-swift names them
    (the folder's last part)."""
    from swiftlite.plugin import Reward
    plugins = r.reward_model_plugin or ["default"] * len(r.reward_model or [])
    out = []
    for path, plugin in zip(r.reward_model or [], plugins):
        scorer = RewardModelScorer(path, device, dtype, trust_remote_code, plugin, max_length)
        out.append(Reward(path, scorer, Path(path.rstrip("/")).name, ()))
    return out


__all__ = ["BATCH", "RewardModelScorer", "build_reward_models", "check_plugins", "config_problem"]
