"""The base architecture of an export: the meta-device model (names, shapes, ties), how the base is
named (model cards, adapter configs), and the tokenizer the run trained with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from swiftlite.config.tasks import task_spec
from swiftlite.errors import UserError
from swiftlite.export.source import Source


def auto_class(conf: Any) -> Any:
    """transformers' Auto class of a config: AutoModelForSequenceClassification for a reward model
    (architectures ...ForSequenceClassification: `rlhf --rlhf_type rm`), else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    archs = getattr(conf, "architectures", None) or []
    return AutoModelForSequenceClassification if any(a.endswith("ForSequenceClassification") for a in archs) \
        else AutoModelForCausalLM


def folder_class(folder: Any) -> Any:
    """auto_class of an HF folder's config.json."""
    from transformers import AutoConfig
    return auto_class(AutoConfig.from_pretrained(str(folder)))


def meta_model(conf: Any, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model of `conf` on the meta device (no memory): the reference for names and shapes."""
    with torch.device("meta"):
        return auto_class(conf).from_config(conf, trust_remote_code=trust_remote_code)


def expected_tensors(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Persistent state-dict names -> shapes, in the model's own order (tied names included)."""
    return {k: torch.Size(v.shape) for k, v in model.state_dict().items()}


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """{'lm_head.weight': 'model.embed_tokens.weight'} for tied models (transformers' own table)."""
    tied = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, dict):
        return dict(tied)
    conf = getattr(model, "config", None)
    return tie_candidates(model) if getattr(conf, "tie_word_embeddings", False) else {}


def tie_candidates(model: torch.nn.Module) -> dict[str, str]:
    """For an untied model: {output embedding weight name: input embedding weight name}."""
    try:
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return {}
    if out_emb is None or in_emb is None:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    o, i = names.get(id(out_emb)), names.get(id(in_emb))
    return {f"{o}.weight": f"{i}.weight"} if o is not None and i is not None else {}


def base_ref(src: Source, ms: Any) -> str:
    """How a model card / adapter_config names the base: preset name, hub id or absolute folder."""
    name = src.cfg.model.model
    if ms.kind == "preset":
        return name
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name


def tokenizer_for(src: Source, ms: Any) -> Any:
    """The tokenizer the run trained with (checkpoint model/ copy, else the base's with --template)."""
    from transformers import AutoTokenizer
    if src.hf_dir is not None and ((src.hf_dir / "tokenizer.json").is_file()
                                   or (src.hf_dir / "tokenizer_config.json").is_file()):
        return AutoTokenizer.from_pretrained(str(src.hf_dir))
    if src.form == "checkpoint" and src.cfg is not None:
        from swiftlite.models.loading import load_tokenizer
        try:
            return load_tokenizer(src.cfg, ms)
        except UserError:
            if task_spec(src.cfg.task).needs_chat_template:  # its rows were rendered with one
                raise
    if ms is not None:
        try:
            return AutoTokenizer.from_pretrained(ms.tokenizer_ref)
        except (OSError, ValueError):
            return None
    return None
