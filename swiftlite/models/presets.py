"""Model presets: short names for architectures users ask for.

A preset maps a name to an architecture (a transformers config as a dict) and, for real models, the
hub id its weights come from. `--model llama-70b` therefore means something even offline: `estimate`
works from the config alone (meta device), and `sft` downloads the weights when a network exists.
`tiny-llama` is the built-in demo: random weights seeded by --seed and a tokenizer shipped in the
package, so demos and tests need no network. No torch import here (the CLI lists presets fast).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_TOKENIZER = ASSETS / "tiny_tokenizer"


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A named architecture; `hub_id` is None for built-in models with random weights."""
    name: str
    config: dict
    hub_id: str | None = None
    tokenizer: str | None = None  # folder of a shipped tokenizer, else the hub id's
    description: str = ""
    tags: tuple[str, ...] = field(default=())

    @property
    def builtin(self) -> bool:
        return self.hub_id is None


def _llama(hidden, inter, layers, heads, kv, vocab, *, tie=False, max_pos=131072, rope_theta=500000.0,
           **extra) -> dict:
    cfg = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5, "rope_theta": rope_theta,
        "tie_word_embeddings": tie, "hidden_act": "silu", "attention_bias": False,
    }
    cfg.update(extra)
    return cfg


def _qwen2(hidden, inter, layers, heads, kv, vocab, *, tie=False) -> dict:
    return {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": tie, "hidden_act": "silu",
    }


TINY_VOCAB = 260  # the shipped byte-level tokenizer: 256 bytes + 4 specials

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset(name="tiny-llama", description="built-in demo: 4-layer Llama, 256 hidden, random init",
           config=_llama(256, 688, 4, 4, 2, TINY_VOCAB, max_pos=2048, rope_theta=10000.0,
                         bos_token_id=None, eos_token_id=258, pad_token_id=259),
           tokenizer=str(TINY_TOKENIZER), tags=("builtin",)),
    Preset(name="tiny-llama-2l", description="built-in test model: 2-layer Llama, 64 hidden",
           config=_llama(64, 176, 2, 4, 2, TINY_VOCAB, max_pos=2048, rope_theta=10000.0,
                         bos_token_id=None, eos_token_id=258, pad_token_id=259),
           tokenizer=str(TINY_TOKENIZER), tags=("builtin",)),
    Preset(name="llama-1b", hub_id="meta-llama/Llama-3.2-1B",
           config=_llama(2048, 8192, 16, 32, 8, 128256, tie=True, rope_scaling={
               "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192})),
    Preset(name="llama-3b", hub_id="meta-llama/Llama-3.2-3B",
           config=_llama(3072, 8192, 28, 24, 8, 128256, tie=True)),
    Preset(name="llama-8b", hub_id="meta-llama/Llama-3.1-8B",
           config=_llama(4096, 14336, 32, 32, 8, 128256)),
    Preset(name="llama-70b", hub_id="meta-llama/Llama-3.1-70B",
           config=_llama(8192, 28672, 80, 64, 8, 128256)),
    Preset(name="llama-405b", hub_id="meta-llama/Llama-3.1-405B",
           config=_llama(16384, 53248, 126, 128, 8, 128256)),
    Preset(name="qwen2.5-0.5b", hub_id="Qwen/Qwen2.5-0.5B-Instruct",
           config=_qwen2(896, 4864, 24, 14, 2, 151936, tie=True)),
    Preset(name="qwen2.5-7b", hub_id="Qwen/Qwen2.5-7B-Instruct",
           config=_qwen2(3584, 18944, 28, 28, 4, 152064)),
    Preset(name="qwen2.5-14b", hub_id="Qwen/Qwen2.5-14B-Instruct",
           config=_qwen2(5120, 13824, 48, 40, 8, 152064)),
    Preset(name="qwen2.5-72b", hub_id="Qwen/Qwen2.5-72B-Instruct",
           config=_qwen2(8192, 29568, 80, 64, 8, 152064)),
    Preset(name="mistral-7b", hub_id="mistralai/Mistral-7B-v0.3",
           config={**_llama(4096, 14336, 32, 32, 8, 32768, max_pos=32768, rope_theta=1000000.0),
                   "model_type": "mistral", "architectures": ["MistralForCausalLM"]}),
]}


def get_preset(name: str) -> Preset | None:
    """The preset called `name` (case-insensitive), or None."""
    return PRESETS.get(name.lower())


def suggest_preset(name: str) -> str | None:
    """The preset a mistyped name most likely meant (qwen2.5-7bb -> qwen2.5-7b), or None."""
    import difflib
    close = difflib.get_close_matches(name.lower(), list(PRESETS), n=1, cutoff=0.75)
    return close[0] if close else None


def param_count(cfg: dict) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its config, without building it."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if cfg.get("model_type") == "qwen2":
        attn += heads * hd + 2 * kv * hd  # q/k/v biases
    mlp = 3 * h * i
    layer = attn + mlp + 2 * h
    emb = v * h
    head = 0 if cfg.get("tie_word_embeddings") else v * h
    return n * layer + emb + head + h
