"""What the memory model needs to know about an architecture, from its config alone.

    shape = resolve_model("llama-8b").shape()       # --model's shape (models/source.py owns it)
    shape = shape_from_config(config_dict, "name")  # an HF config dict

Llama, Mistral and Qwen2 configs are counted by a closed formula (GQA, SwiGLU, RMSNorm, Qwen2's
q/k/v biases); any other `model_type` transformers knows is built on torch's meta device (no memory,
no weights) and its parameters counted. No weights are read and nothing is downloaded. torch and
transformers are imported only on the meta-device path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from swiftlite.errors import UserError


class Linear(NamedTuple):
    """A kind of linear layer: its leaf name (q_proj ...), in/out features, how many in the model."""
    name: str
    in_features: int
    out_features: int
    count: int


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about an architecture (counts, not weights).

    `n_params` counts unique parameters (tied embeddings once). `linears` lists every linear layer
    except the output head: exactly what bitsandbytes quantizes and what peft's "all-linear" adapts.
    """
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int
    tie: bool
    n_params: int
    n_linear_params: int          # weights of `linears` (no biases, no lm_head)
    n_layer_params: int           # one decoder layer, all of its parameters
    n_layer_linear_params: int    # one decoder layer, linear weights only
    largest_module_params: int    # the biggest single module (usually the embedding or lm_head)
    linears: tuple[Linear, ...] = ()
    name: str = ""

    @property
    def n_nonlayer_params(self) -> int:
        """Embeddings, final norm and (untied) lm_head: what FSDP's root unit holds."""
        return self.n_params - self.layers * self.n_layer_params

    def lora_params(self, rank: int, targets: tuple[str, ...] = ("all-linear",)) -> int:
        """Trainable LoRA parameters: r * (in + out) for every adapted linear (A is r x in, B out x r)."""
        return sum(rank * (lin.in_features + lin.out_features) * lin.count
                   for lin in self.linears if _targeted(lin.name, targets))

    def boft_params(self, block_size: int, block_num: int, butterfly: int,
                    targets: tuple[str, ...] = ("all-linear",)) -> int:
        """Trainable BOFT parameters (peft boft_R, boft_s): per adapted linear, `butterfly` factors of
        in/b blocks of b x b each (b = block_size, or in / block_num), and one scale per output row."""
        total = 0
        for lin in self.linears:
            if _targeted(lin.name, targets):
                b = block_size or max(1, lin.in_features // max(1, block_num))
                total += (butterfly * lin.in_features * b + lin.out_features) * lin.count
        return total

    def lora_input_features(self, targets: tuple[str, ...] = ("all-linear",)) -> int:
        """Sum of in_features of the adapted linears of one layer (LoRA dropout keeps a copy of each input)."""
        total = sum(lin.in_features * lin.count for lin in self.linears if _targeted(lin.name, targets))
        return total // max(1, self.layers)

    def expanded(self, new_layers: int) -> "ModelShape":
        """This architecture with `new_layers` more decoder layers, each like the others (LLaMA-Pro's
        inserted copies, models/llamapro.py): what a --train_type llamapro run holds."""
        import dataclasses
        if new_layers <= 0:
            return self
        n = self.layers + new_layers
        return dataclasses.replace(
            self, layers=n, n_params=self.n_params + new_layers * self.n_layer_params,
            n_linear_params=self.n_linear_params + new_layers * self.n_layer_linear_params,
            linears=tuple(lin._replace(count=lin.count * n // max(1, self.layers)) for lin in self.linears))

    @property
    def linear_out_rows(self) -> int:
        """Output rows of all quantizable linears (LLM.int8 keeps one fp32 scale per row)."""
        return sum(lin.out_features * lin.count for lin in self.linears)


def _targeted(name: str, targets: tuple[str, ...]) -> bool:
    return "all-linear" in targets or name in targets


# Architectures with a closed formula: Llama-style decoders (RMSNorm, GQA attention, SwiGLU MLP).
_ANALYTIC = {"llama", "mistral", "qwen2"}
_ANALYTIC_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def shape_from_config(cfg: dict, name: str = "") -> ModelShape:
    """A ModelShape from an HF config dict (a preset's or a config.json).

    Llama/Mistral/Qwen2 configs are counted by formula; any other `model_type` transformers knows is
    built on the meta device (no memory, no weights) and its parameters counted.
    """
    if not isinstance(cfg, dict):
        raise UserError(f"{name or 'model config'}: expected a JSON object, got {type(cfg).__name__}")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        # Multimodal wrappers: the language model is what dominates training memory.
        cfg = {"model_type": cfg.get("model_type"), **cfg["text_config"]}
    model_type = cfg.get("model_type")
    if not model_type:
        raise UserError(f"{name or 'model config'}: config has no model_type")
    if model_type in _ANALYTIC and all(k in cfg for k in _ANALYTIC_KEYS):
        return _shape_analytic(cfg, name)
    return _shape_from_meta(cfg, name)


def _shape_analytic(cfg: dict, name: str) -> ModelShape:
    h, i, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, vocab = cfg["num_attention_heads"], cfg["vocab_size"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    tie = bool(cfg.get("tie_word_embeddings", False))
    per_layer = [
        Linear("q_proj", h, heads * hd, n_layers), Linear("k_proj", h, kv * hd, n_layers),
        Linear("v_proj", h, kv * hd, n_layers), Linear("o_proj", heads * hd, h, n_layers),
        Linear("gate_proj", h, i, n_layers), Linear("up_proj", h, i, n_layers),
        Linear("down_proj", i, h, n_layers),
    ]
    layer_linear = sum(lin.in_features * lin.out_features for lin in per_layer)
    biases = 0
    if _has_qkv_bias(cfg):
        biases = heads * hd + 2 * kv * hd
    layer = layer_linear + biases + 2 * h  # + input and post-attention RMSNorm weights
    embed = vocab * h
    nonlayer = embed + (0 if tie else embed) + h  # + final norm
    return ModelShape(
        model_type=cfg["model_type"], hidden=h, intermediate=i, layers=n_layers, heads=heads, kv_heads=kv,
        vocab=vocab, head_dim=hd, tie=tie, n_params=n_layers * layer + nonlayer,
        n_linear_params=n_layers * layer_linear, n_layer_params=layer, n_layer_linear_params=layer_linear,
        largest_module_params=max(embed, max(lin.in_features * lin.out_features for lin in per_layer)),
        linears=tuple(per_layer), name=name)


def _has_qkv_bias(cfg: dict) -> bool:
    """Qwen2 has q/k/v biases; Llama/Mistral only when `attention_bias` says so."""
    return cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False))


def _shape_from_meta(cfg: dict, name: str) -> ModelShape:
    """Count an arbitrary transformers architecture by building it on the meta device."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = cfg["model_type"]
    label = name or "model config"
    if cfg.get("auto_map"):
        raise UserError(f"{label}: model_type {model_type!r} needs its own code (auto_map); "
                        "swiftlite estimate does not run remote code")
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version")}
    try:
        conf = AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, KeyError) as e:
        raise UserError(f"{label}: model_type {model_type!r} is unknown to transformers "
                        f"{transformers.__version__} ({str(e).splitlines()[0]})") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(conf)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{label}: cannot build model_type {model_type!r} as a causal LM "
                        f"({str(e).splitlines()[0]})") from None

    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    head = model.get_output_embeddings()
    kinds: dict[tuple[str, int, int], int] = {}
    largest = 0
    for mod_name, mod in model.named_modules():
        own = sum(p.numel() for p in mod.parameters(recurse=False))
        largest = max(largest, own)
        if mod is head:
            continue
        dims = _linear_dims(mod)
        if dims is not None:
            key = (mod_name.rsplit(".", 1)[-1], *dims)
            kinds[key] = kinds.get(key, 0) + 1
    linears = tuple(Linear(k[0], k[1], k[2], c) for k, c in kinds.items())
    n_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    blocks = _decoder_blocks(model, n_layers)
    if blocks is not None:
        n_layers = len(blocks)
        layer = sum(p.numel() for p in blocks[0].parameters())
        layer_linear = sum(m.weight.numel() for m in blocks[0].modules() if _linear_dims(m) is not None)
    else:  # no recognisable block list: treat the whole model as one layer (estimates stay conservative)
        n_layers = max(1, n_layers)
        layer = sum(p.numel() for p in model.parameters()) // n_layers
        layer_linear = sum(lin.in_features * lin.out_features * lin.count for lin in linears) // n_layers
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    return ModelShape(
        model_type=model_type, hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden),
        layers=n_layers, heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        vocab=int(text.vocab_size), head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        tie=bool(getattr(text, "tie_word_embeddings", False)),
        n_params=sum(p.numel() for p in model.parameters()),  # parameters() counts tied tensors once
        n_linear_params=sum(lin.in_features * lin.out_features * lin.count for lin in linears),
        n_layer_params=layer, n_layer_linear_params=layer_linear, largest_module_params=largest,
        linears=linears, name=name)


def _linear_dims(mod) -> tuple[int, int] | None:
    """(in, out) of a torch Linear or transformers' Conv1D (GPT-2 stores its weight transposed)."""
    import torch
    if isinstance(mod, torch.nn.Linear):
        return mod.in_features, mod.out_features
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "weight") and mod.weight.dim() == 2:
        return int(mod.weight.shape[0]), int(mod.weight.shape[1])
    return None


def _decoder_blocks(model, n_layers: int):
    """The ModuleList of decoder blocks: the one whose length is num_hidden_layers (else the longest)."""
    import torch
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    exact = [m for m in lists if len(m) == n_layers]
    pool = exact or lists
    return max(pool, key=len) if pool else None


__all__ = ["Linear", "ModelShape", "shape_from_config"]
