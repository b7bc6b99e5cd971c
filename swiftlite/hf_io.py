"""Writing Hugging Face model folders: sharded safetensors + index, streamed; config, generation
config, tokenizer; peft adapter folders. The one writer of HF folders (checkpoints' model/ and
adapter/ copies, and `swiftlite export`).

Tensors arrive one at a time (an iterator), are cast to the target dtype, and are flushed to a
shard file as soon as the shard reaches `max_shard_size` bytes, so peak memory is about one shard.
Shards get their final `model-0000i-of-0000n` names once n is known. Names and layout follow
transformers' `save_pretrained`, which vLLM and LMDeploy read.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors.torch import save_file

from swiftlite import dtypes

# peft's file names in an adapter folder.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_BIN = "adapter_model.bin"  # older peft (torch pickle, read weights-only)
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_WEIGHTS_BIN)
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_sharded(tensors: Iterable[tuple[str, torch.Tensor]], out: Path, *, dtype: str | None,
                  max_shard_size: int, prefix: str = "model") -> dict[str, str]:
    """Stream (name, tensor) pairs into `prefix-0000i-of-0000n.safetensors` files + index.

    Floating tensors are cast to `dtype` (None keeps them). Returns name -> shard file. With one
    shard the file is `prefix.safetensors` and no index is written (as save_pretrained does).
    """
    out.mkdir(parents=True, exist_ok=True)
    target = dtypes.torch_dtype(dtype) if dtype else None
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    tmp_files: list[tuple[Path, list[str]]] = []
    total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        path = out / f".shard-{len(tmp_files):05d}.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})
        make_readable(path)
        tmp_files.append((path, list(shard)))
        shard, shard_bytes = {}, 0

    for name, t in tensors:
        t = t.detach()
        if target is not None and t.is_floating_point():
            t = t.to(target)
        t = t.contiguous().cpu()
        size = _nbytes(t)
        if shard and shard_bytes + size > max_shard_size:
            flush()
        shard[name] = t.clone() if t.data_ptr() in {v.data_ptr() for v in shard.values()} else t
        shard_bytes += size
        total += size
    flush()
    n = len(tmp_files)
    weight_map: dict[str, str] = {}
    for i, (path, names) in enumerate(tmp_files):
        final = f"{prefix}.safetensors" if n == 1 else f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(path, out / final)
        for k in names:
            weight_map[k] = final
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def drop_tied(sd_items: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Skip lm_head.weight when it is tied to the embeddings (save_pretrained does the same)."""
    for k, v in sd_items:
        if tie_word_embeddings and k.endswith("lm_head.weight"):
            continue
        yield k, v


def current_umask() -> int:
    """The process umask (reading it means setting it: put it straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def make_readable(path: Path) -> None:
    """safetensors creates files 0600; model files are for other users (servers) too: give a file
    (or a folder) the permissions a plain write would have had under the umask."""
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~current_umask())


# -- the small JSON files of an HF folder (shared by checkpoints and export) ---------------------

def write_config(conf: Any, arch: str, out: Path, dtype: torch.dtype, tie: bool) -> dict:
    """config.json: architecture, dtype, tie_word_embeddings consistent with the written weights.

    transformers 5 writes `dtype` and `rope_parameters`; `torch_dtype`, `rope_theta` (and
    `rope_scaling` for scaled RoPE) are added for readers on transformers 4.x (vLLM, LMDeploy)."""
    c = copy.deepcopy(conf)
    d = c.to_dict()
    d.pop("quantization_config", None)
    d.pop("_name_or_path", None)
    d["architectures"] = [arch]
    d["tie_word_embeddings"] = bool(tie)
    d["use_cache"] = True
    d["dtype"] = d["torch_dtype"] = dtypes.hf_name(dtypes.from_torch(dtype))
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        d.setdefault("rope_theta", rp["rope_theta"])
        if rp.get("rope_type", "default") != "default" and not d.get("rope_scaling"):
            d["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    return d


def write_generation_config(out: Path, conf_dict: dict, tokenizer: Any, base_folder: Path | None) -> dict:
    """generation_config.json: every id that ends a turn (config eos + the tokenizer's eos), pad, bos."""
    gen: dict[str, Any] = {}
    if base_folder is not None and (base_folder / "generation_config.json").is_file():
        try:
            gen = json.loads((base_folder / "generation_config.json").read_text())
        except ValueError:
            gen = {}
    eos: list[int] = []
    for v in (gen.get("eos_token_id"), conf_dict.get("eos_token_id"),
              getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        for i in (v if isinstance(v, list) else [v]):
            if isinstance(i, int) and i not in eos:
                eos.append(i)
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = conf_dict.get("pad_token_id")
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    if pad is not None:
        gen["pad_token_id"] = pad
    if conf_dict.get("bos_token_id") is not None:
        gen.setdefault("bos_token_id", conf_dict["bos_token_id"])
    gen = {k: v for k, v in gen.items() if v is not None}
    gen.pop("transformers_version", None)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return gen


def write_tokenizer(tokenizer: Any, out: Path) -> bool:
    """Tokenizer files with the chat template, readable by transformers 4.x too. True if it has a template."""
    tokenizer.save_pretrained(str(out))
    tc_path = out / "tokenizer_config.json"
    if tc_path.is_file():
        tc = json.loads(tc_path.read_text())
        if tc.get("tokenizer_class") == "TokenizersBackend":  # transformers 5 only; 4.x knows the Fast one
            tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        for k in ("is_local", "local_files_only"):
            tc.pop(k, None)
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, str) and "chat_template" not in tc:
            tc["chat_template"] = template  # older readers look here; 5.x reads chat_template.jinja
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    return bool(getattr(tokenizer, "chat_template", None))


def write_model_folder(model: Any, sd: dict[str, torch.Tensor], tokenizer: Any, out: Path, dtype: str) -> None:
    """A full HF folder of a live model's gathered state dict (a checkpoint's model/ copy): shards in
    the run's dtype, config, generation config, tokenizer."""
    conf = model.config
    tie = bool(getattr(conf, "tie_word_embeddings", False))
    write_sharded(drop_tied(sd.items(), tie), out, dtype=dtype, max_shard_size=5 * 10**9)
    arch = (getattr(conf, "architectures", None) or [type(model).__name__])[0]
    conf_dict = write_config(conf, arch, out, dtypes.torch_dtype(dtype), tie)
    write_generation_config(out, conf_dict, tokenizer, None)
    write_tokenizer(tokenizer, out)


# -- peft adapter folders ----------------------------------------------------------------------------

def write_adapter_weights(tensors: dict[str, torch.Tensor], out: Path) -> Path:
    """adapter_model.safetensors (peft's names as given), readable by other users."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / ADAPTER_WEIGHTS
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    make_readable(path)
    return path


def write_adapter(peft_model: Any, sd: dict, out: Path) -> None:
    """adapter_config.json + adapter_model.safetensors, loadable by PeftModel.from_pretrained on the
    model folder's base. A PiSSA/OLoRA adapter (trained against the residual base peft left) is
    written converted to a plain LoRA of the original base (models/lora.as_plain_lora), as peft's
    documented save does, so merging it into the model folder's weights gives the trained model."""
    from swiftlite.models.lora import INITIAL_ADAPTER, as_plain_lora
    pruned = pruned_layers(peft_model.peft_config["default"].to_dict())
    empty = [k for k, v in sd.items() if v.numel() == 0 and _module_of(k) not in pruned]
    if empty or not sd:
        raise RuntimeError(f"adapter gather produced empty tensors: {empty[:3] or 'no tensors'}")
    out.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config["default"].save_pretrained(str(out))
    initial = getattr(peft_model, INITIAL_ADAPTER, None)
    if initial:
        conf, sd = as_plain_lora(json.loads((out / ADAPTER_CONFIG).read_text()), sd, initial)
        write_adapter_config(conf, out)
    write_adapter_weights(sd, out)


def pruned_layers(config: dict[str, Any]) -> set[str]:
    """Modules an AdaLoRA budget pruned to rank 0 (every singular value masked in its rank_pattern):
    peft saves and reloads them as empty tensors."""
    pattern = (config.get("rank_pattern") or {}) if str(config.get("peft_type")).endswith("ADALORA") else {}
    return {re.sub(r"\.lora_E(\.[^.]+)?$", "", k) for k, v in pattern.items() if not any(v)}


def _module_of(key: str) -> str:
    """`base_model.model.<module>.lora_A` -> `<module>`."""
    return re.sub(r"\.lora_[ABE]$", "", key.removeprefix("base_model.model."))


def write_adapter_config(config: dict[str, Any], out: Path) -> None:
    """adapter_config.json from a plain dict (an adapter rebuilt from a checkpoint's tensors)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
