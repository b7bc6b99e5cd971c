"""Memory model per GPU and the `--parallelism auto` decision.

Everything here works from the model's *config* (no weights are read): a preset's dict, a local
``config.json``, or, for architectures without a closed formula, the model built on torch's meta
device. The numbers are bytes per GPU rank, split by component, so the table `swiftlite estimate`
prints says *why* a backend fits or not. docs/estimate.md gives the formulas and their limits.

    shape = shape_from_model_arg("llama-8b")
    work = Workload(train_type="full", dtype="bf16", world_size=8, gpu_memory_bytes=80 * 10**9)
    est = estimate(shape, work, "fsdp")       # MemoryEstimate (bytes per GPU)
    decision = recommend(shape, work)          # Decision(backend, reason, table)

Model-state accounting (Ψ = parameters, N = ranks sharing the states):
  full, bf16/fp16 (mixed precision AdamW, ZeRO paper): params 2Ψ, grads 2Ψ, optimizer 12Ψ
  full, fp32: params 4Ψ, grads 4Ψ, optimizer 8Ψ (exp_avg + exp_avg_sq; `step` scalars ignored)
  LoRA/QLoRA: frozen base in its storage form + adapters (params, grads, AdamW state)
  sharded by N: zero2 -> grads + optimizer; zero3 / fsdp / fsdp1 -> all three; zero3_offload -> all
  three, and they live in CPU memory.

This module must stay import-light (no torch at import time): the CLI imports it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

from swiftlite.config import DTYPES, TRAIN_TYPES
from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.config import RunConfig

GiB = 2**30

#: Backends the estimator knows, in the order the table shows them. "single" replaces "ddp" when
#: the world is one GPU.
BACKENDS = ("ddp", "fsdp", "fsdp1", "zero2", "zero3", "zero3_offload")

#: Which model states each backend shards over the ranks: (params, grads, optimizer).
SHARDING: dict[str, tuple[bool, bool, bool]] = {
    "single": (False, False, False),
    "ddp": (False, False, False),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "zero3_offload": (True, True, True),
    "fsdp": (True, True, True),
    "fsdp1": (True, True, True),
}

#: Logits memory, bytes per (token x vocab entry). The loss upcasts logits to fp32; cross-entropy
#: saves its fp32 log-probabilities (4 bytes), and at the start of backward the gradient arriving
#: from the loss and the gradient of the logits exist next to them (4 + 4): the peak is 12 bytes.
#: (The steady state between forward and backward is 4; a run OOMs at the peak.)
LOGIT_BYTES = 12

#: ZeRO-3 prefetch bucket in units of h*h elements: ds_config.py fills DeepSpeed's "auto" sizes the
#: Hugging Face way (reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h). ZeRO-2's
#: allgather_bucket_size only chunks the gather into the existing 16-bit buffer: no extra memory.
ZERO3_PREFETCH_FACTOR = 0.9

#: ZeRO-3 keeps gathered parameters resident up to stage3_max_live_parameters (1e9 in
#: ds_configs/zero3*.json, DeepSpeed's default): measured on CPU (2 ranks, 24M-parameter Llama),
#: from the second step on a whole gathered copy of the model is alive at the memory peak, on top
#: of the partitions (torch.profiler memory events; it did not shrink with stage3_max_reuse_distance
#: or stage3_max_live_parameters set to 0 in that run, so the knob is modelled as the cap DeepSpeed
#: documents, not as a lever). For models above 1e9 parameters this is the usual ~2 GB in 16-bit.
ZERO3_MAX_LIVE_PARAMETERS = 10**9


# --------------------------------------------------------------------------------------------------
# Model shape


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

    def lora_input_features(self, targets: tuple[str, ...] = ("all-linear",)) -> int:
        """Sum of in_features of the adapted linears of one layer (LoRA dropout keeps a copy of each input)."""
        total = sum(lin.in_features * lin.count for lin in self.linears if _targeted(lin.name, targets))
        return total // max(1, self.layers)

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


def shape_from_model_arg(model: str) -> ModelShape:
    """ModelShape of `--model`: a preset name, or a local HF folder (only config.json is read)."""
    from swiftlite.models.presets import PRESETS, get_preset

    preset = get_preset(model)
    if preset is not None:
        return shape_from_config(preset.config, preset.name)
    path = Path(model).expanduser()
    if path.is_dir():
        conf = path / "config.json"
        if not conf.is_file():
            raise UserError(f"--model {model}: folder has no config.json")
        try:
            data = json.loads(conf.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise UserError(f"--model {model}: {conf}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
        return shape_from_config(data, str(model))
    if path.is_file() and path.name == "config.json":
        return shape_from_model_arg(str(path.parent))
    raise UserError(f"--model {model}: not a preset (known: {', '.join(PRESETS)}) and not a local folder "
                    "with config.json (estimate reads configs only; it never downloads)")


# --------------------------------------------------------------------------------------------------
# Workload


@dataclass(kw_only=True)
class Workload:
    """The run being planned: what is trained, how, and on which hardware.

    `gpu_memory_bytes` and `cpu_memory_bytes` (per node) may be None: estimates then carry no
    fits verdict, and CPU offload is not checked against RAM.
    """
    train_type: str = "full"
    dtype: str = "bf16"                  # parameter dtype; bf16/fp16 mean mixed-precision AdamW
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_dropout: float = 0.05           # > 0: peft keeps a dropped-out copy of every adapted input
    quant_bits: int | None = None        # None, 4 (nf4) or 8 (LLM.int8); qlora implies 4
    double_quant: bool = True            # nf4 double quantization of the absmax constants
    max_length: int = 2048
    micro_batch: int = 1
    gradient_checkpointing: bool = False
    flash_attention: bool = True         # SDPA/flash: no seq x seq attention matrix is kept
    world_size: int = 1
    gpus_per_node: int | None = None     # default: world_size (one node)
    gpu_memory_bytes: int | None = None
    cpu_memory_bytes: int | None = None  # per node
    overhead_bytes: int = GiB            # CUDA context + allocator slack; 0 when measuring tensors on CPU
    cpu: bool = False                    # tensors on CPU: dropout keeps a noise tensor in the compute
                                         # dtype (CUDA's fused dropout keeps a 1-byte mask)
    usable_fraction: float = 0.9         # a GPU "fits" when the total stays under this share of memory
    fsdp2_available: bool = True         # torch >= 2.4 (fully_shard)

    def __post_init__(self) -> None:
        if self.train_type not in TRAIN_TYPES:
            raise UserError(f"--train-type {self.train_type!r}: choose from {', '.join(TRAIN_TYPES)}")
        if self.dtype not in DTYPES:
            raise UserError(f"--torch-dtype {self.dtype!r}: choose from {', '.join(DTYPES)}")
        if self.train_type == "qlora" and self.quant_bits is None:
            self.quant_bits = 4  # QLoRA means a 4-bit base, as in config.build_config
        if self.quant_bits not in (None, 4, 8):
            raise UserError(f"--quant-bits must be 4 or 8, got {self.quant_bits}")
        if self.train_type == "full" and self.quant_bits is not None:
            raise UserError("--quant-bits needs --train-type lora/qlora (a quantized base cannot be trained in full)")
        for flag, v in (("--lora-rank", self.lora_rank), ("--max-length", self.max_length),
                        ("--batch-size", self.micro_batch), ("--gpus", self.world_size)):
            if not isinstance(v, int) or v <= 0:
                raise UserError(f"{flag} must be a positive integer, got {v!r}")
        if self.gpus_per_node is None:
            self.gpus_per_node = self.world_size
        if self.gpus_per_node <= 0 or self.world_size % self.gpus_per_node:
            raise UserError(f"--gpus {self.gpus_per_node} per node does not divide a world of {self.world_size}")
        for flag, v in (("--gpu-memory", self.gpu_memory_bytes), ("--cpu-memory", self.cpu_memory_bytes)):
            if v is not None and v <= 0:
                raise UserError(f"{flag} must be > 0, got {v}")
        if not 0 < self.usable_fraction <= 1:
            raise UserError(f"usable_fraction must be in (0, 1], got {self.usable_fraction}")

    @property
    def mixed(self) -> bool:
        """16-bit params with fp32 master weights in the optimizer (the ZeRO accounting)."""
        return self.dtype in ("bf16", "fp16")

    @property
    def elem(self) -> int:
        """Bytes per element of params/grads/activations in the compute dtype."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def peft(self) -> bool:
        return self.train_type in ("lora", "qlora")


# --------------------------------------------------------------------------------------------------
# Memory estimate


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU rank for one backend; `total` sums the GPU components."""
    backend: str
    params: int
    grads: int
    optimizer: int
    activations: int
    temp_buffers: int       # all-gather / reduce-scatter / bucket memory the backend adds
    overhead: int           # CUDA context and allocator slack
    cpu_offloaded: int      # per rank, in CPU memory (zero3_offload)
    cpu_per_node: int       # cpu_offloaded * GPUs per node
    total: int
    fits: bool | None       # None when the GPU memory is unknown
    comm_bytes_per_step: int  # per rank, per micro-step (no gradient accumulation)
    gpu_memory_bytes: int | None
    available: bool = True
    note: str = ""          # why the backend cannot run this workload, when it cannot

    @property
    def used_fraction(self) -> float | None:
        """Share of the GPU's memory the estimate uses (None when the GPU is unknown)."""
        return self.total / self.gpu_memory_bytes if self.gpu_memory_bytes else None


def _ceil_div(a: int, b: int) -> int:
    """a / b rounded up, in integers (byte counts of 405B models exceed float precision margins)."""
    return -(-a // b)


def quantized_bytes(n_weights: int, w: Workload, out_rows: int = 0) -> int:
    """Storage of `n_weights` linear weights quantized with bitsandbytes.

    nf4: 4 bits per weight plus one absmax per 64-weight block: fp32 (32/64 = 0.5 bit) or, with double
    quantization, 8-bit absmax plus an fp32 constant per 256 blocks (8/64 + 32/16384 = 0.127 bit).
    LLM.int8: 1 byte per weight plus an fp32 scale per output row.
    """
    if w.quant_bits == 4:
        absmax = n_weights / 64 + 4 * n_weights / (64 * 256) if w.double_quant else 4 * n_weights / 64
        return int(math.ceil(n_weights / 2 + absmax))
    if w.quant_bits == 8:
        return n_weights + 4 * out_rows
    raise ValueError(f"quant_bits {w.quant_bits}")


def _base_bytes(w: Workload, n_linear: int, n_other: int, out_rows: int) -> int:
    """Bytes of frozen/gathered base weights: quantized linears (if any) + the rest in the dtype."""
    if w.quant_bits is None:
        return (n_linear + n_other) * w.elem
    return quantized_bytes(n_linear, w, out_rows) + n_other * w.elem


def trainable_params(shape: ModelShape, w: Workload) -> int:
    """Parameters the optimizer updates: all of them (full) or the LoRA adapters."""
    return shape.n_params if w.train_type == "full" else shape.lora_params(w.lora_rank, w.lora_targets)


def _state_bytes_per_param(w: Workload, backend: str) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per *trainable* parameter."""
    if not w.mixed:
        if backend.startswith("zero"):
            # DeepSpeed's ZeRO optimizer keeps its own fp32 flat partition of the weights even when
            # they are fp32 already (measured: 4 + 8 bytes per trainable param, sharded).
            return 4, 4, 12
        return 4, 4, 8                     # fp32 weights, fp32 grads, AdamW exp_avg + exp_avg_sq
    if w.peft and not backend.startswith("zero"):
        # peft keeps adapter weights in fp32 under a 16-bit base (autocast_adapter_dtype), so their
        # AdamW state needs no master copy. DeepSpeed casts the whole module to 16-bit and keeps
        # the fp32 master in the optimizer instead (2 + 2 + 12): the same 16 bytes, split differently.
        return 4, 4, 8
    return w.elem, w.elem, 12              # ZeRO paper: 16-bit param + grad, fp32 master + m + v


def model_state_bytes(shape: ModelShape, workload: Workload, backend: str) -> dict[str, int]:
    """Params, grads and optimizer state bytes per rank, before any CPU offload.

    With dtype fp32 these are exactly what torch holds (FSDP2 DTensor shards, DDP replicas, AdamW
    exp_avg/exp_avg_sq; `step` scalars ignored) when each sharded tensor splits evenly over N.
    Sharded values are rounded up (DeepSpeed pads partitions; FSDP gives low ranks the extra row).
    """
    if backend not in SHARDING:
        raise UserError(f"--parallelism {backend!r}: the estimator knows {', '.join(SHARDING)}")
    w = workload
    n = 1 if backend == "single" else w.world_size
    shard_p, shard_g, shard_o = SHARDING[backend]
    p_b, g_b, o_b = _state_bytes_per_param(w, backend)
    trainable = trainable_params(shape, w)
    frozen = 0
    if w.peft:
        n_other = shape.n_params - shape.n_linear_params
        frozen = _base_bytes(w, shape.n_linear_params, n_other, shape.linear_out_rows)

    def part(nbytes: int, sharded: bool) -> int:
        return _ceil_div(nbytes, n) if sharded else nbytes

    return {"params": part(frozen + trainable * p_b, shard_p),
            "grads": part(trainable * g_b, shard_g),
            "optimizer": part(trainable * o_b, shard_o)}


def activation_bytes(shape: ModelShape, w: Workload) -> int:
    """Activation memory per GPU at the peak of one micro-batch (see docs/estimate.md).

    Per token and decoder layer, a Llama-style block keeps (in the compute dtype): both norm inputs
    and outputs (4h), q and the attention output (2 * heads * head_dim), k and v (2 * kv * head_dim),
    and the SwiGLU gate, up, act and product (4i): Korthikanti et al.'s 34sbh adapted to RMSNorm,
    GQA, SwiGLU and no dropout. 16-bit RMSNorm upcasts its input to fp32 (+2 * 4h bytes).
    Eager attention adds the softmax matrix (heads * s^2, fp32 + a 16-bit copy); SDPA/flash keeps
    only its fp32 logsumexp (heads * s). LoRA dropout keeps a dropped-out copy of each adapted input
    plus its mask (1 byte on CUDA; on CPU, torch's dropout multiplies by a noise tensor of the
    input's dtype and keeps that). With checkpointing, each layer keeps only its input (s * b * h) and one
    layer is recomputed at a time. The logits add LOGIT_BYTES per (token x vocab entry).
    """
    e = w.elem
    s, b = w.max_length, w.micro_batch
    tokens = s * b
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_token = (4 * shape.hidden + 2 * q_dim + 2 * kv_dim + 4 * shape.intermediate) * e
    if e < 4:
        per_token += 2 * 4 * shape.hidden
    if w.peft and w.lora_dropout > 0:
        per_token += shape.lora_input_features(w.lora_targets) * (e + (e if w.cpu else 1))
    layer = tokens * per_token
    if w.flash_attention:
        layer += shape.heads * tokens * 4
    else:
        layer += shape.heads * s * s * b * (4 + e)
    if w.gradient_checkpointing:
        layers = shape.layers * tokens * shape.hidden * e + layer
    else:
        layers = shape.layers * layer
    return layers + tokens * shape.vocab * LOGIT_BYTES


def _gathered_layer_bytes(shape: ModelShape, w: Workload) -> int:
    """One decoder layer unsharded in its compute/storage form (what an all-gather materialises)."""
    n_other = shape.n_layer_params - shape.n_layer_linear_params
    base = _base_bytes(w, shape.n_layer_linear_params, n_other,
                       shape.linear_out_rows // max(1, shape.layers))
    adapters = _ceil_div(shape.lora_params(w.lora_rank, w.lora_targets), shape.layers) * w.elem if w.peft else 0
    return base + adapters


def temp_buffer_bytes(shape: ModelShape, w: Workload, backend: str) -> int:
    """Communication buffers a backend adds on top of the model states (bytes per GPU).

    ddp: none beyond the gradients: swiftlite's DDP uses gradient_as_bucket_view=True, so the
         gradients are views into DDP's buckets rather than a second copy. single: none.
    zero2: the reduce bucket (reduce_bucket_size = h*h elements, 16-bit); updated params are
         all-gathered into the existing 16-bit buffer.
    zero3 / zero3_offload: the gathered parameters DeepSpeed keeps live (the whole model in the
         compute dtype, up to stage3_max_live_parameters; see ZERO3_MAX_LIVE_PARAMETERS), or for a
         bitsandbytes base (never partitioned) the largest module gathered; + the prefetch bucket
         (0.9*h*h) + the reduce bucket (h*h).
    fsdp / fsdp1 (wrapped per decoder layer, then the root): the root unit (embeddings, final norm,
         lm_head) is one all-gather that stays unsharded for the whole backward (lm_head is used
         first, the embedding last), with its unsharded gradients for a full fine-tune; two decoder
         layers are unsharded at a time (current + prefetched), plus one layer's unsharded gradients.
    """
    e = w.elem
    trainable = trainable_params(shape, w)
    h2 = shape.hidden * shape.hidden
    if backend in ("single", "ddp"):
        return 0
    if backend == "zero2":
        return min(h2, trainable) * e
    if backend in ("zero3", "zero3_offload"):
        if w.quant_bits is not None:
            largest_linear = max((lin.in_features * lin.out_features for lin in shape.linears), default=0)
            gathered = max(shape.vocab * shape.hidden * e, quantized_bytes(largest_linear, w))
        else:
            gathered = max(shape.largest_module_params, min(shape.n_params, ZERO3_MAX_LIVE_PARAMETERS)) * e
        return gathered + int(ZERO3_PREFETCH_FACTOR * h2) * e + min(h2, trainable) * e
    if backend in ("fsdp", "fsdp1"):
        root = shape.n_nonlayer_params * e
        root_grads = root if w.train_type == "full" else 0
        layer_grads = (shape.n_layer_params if w.train_type == "full"
                       else _ceil_div(shape.lora_params(w.lora_rank, w.lora_targets), shape.layers)) * e
        return root + root_grads + 2 * _gathered_layer_bytes(shape, w) + layer_grads
    raise UserError(f"--parallelism {backend!r}: the estimator knows {', '.join(SHARDING)}")


def comm_bytes_per_step(shape: ModelShape, w: Workload, backend: str) -> int:
    """Bytes each rank sends per micro-step (ring collectives move (N-1)/N of the buffer per rank).

    ddp: all-reduce of the gradients = 2(N-1)/N * grad bytes.
    zero2: reduce-scatter of grads + all-gather of updated params = 2(N-1)/N * 16-bit trainable bytes.
    fsdp/fsdp1/zero3: all-gather in forward + all-gather in backward + reduce-scatter of grads
         = 3(N-1)/N * param bytes in the compute dtype for a full fine-tune (for LoRA the frozen base
         is all-gathered twice in its storage form and only adapter grads are reduced).
    """
    n = 1 if backend == "single" else w.world_size
    if n == 1:
        return 0
    ring = (n - 1) / n
    trainable = trainable_params(shape, w)
    if backend == "ddp":
        return int(2 * ring * trainable * _state_bytes_per_param(w, backend)[1])
    if backend == "zero2":
        return int(2 * ring * trainable * w.elem)
    if w.train_type == "full":
        gathered = shape.n_params * w.elem
    else:
        gathered = (_base_bytes(w, shape.n_linear_params, shape.n_params - shape.n_linear_params,
                                shape.linear_out_rows) + trainable * w.elem)
    return int(ring * (2 * gathered + trainable * w.elem))


def unavailable_reason(w: Workload, backend: str) -> str:
    """Why `backend` cannot run this workload (mirrors config.py's rules), or "" when it can."""
    if w.dtype == "fp16" and backend in ("single", "ddp", "fsdp", "fsdp1"):
        return "fp16 needs loss scaling, which only the DeepSpeed backends provide"
    if w.quant_bits is not None and backend == "zero3_offload":
        return "DeepSpeed offload cannot move bitsandbytes-quantized weights"
    if backend == "fsdp" and not w.fsdp2_available:
        return "FSDP2 (fully_shard) needs torch >= 2.4"
    return ""


def estimate(shape: ModelShape, workload: Workload, backend: str) -> MemoryEstimate:
    """Memory per GPU (and per node in CPU memory) for `backend`, with comm volume and a verdict."""
    w = workload
    states = model_state_bytes(shape, w, backend)
    cpu = 0
    if backend == "zero3_offload":
        # Params, grads and optimizer partitions live in CPU memory; DeepSpeed's CPU Adam works on
        # fp32 gradient partitions, so a 16-bit run's grads take 4 bytes there, not 2.
        grads_cpu = states["grads"] * 4 // w.elem if w.mixed else states["grads"]
        cpu = states["params"] + grads_cpu + states["optimizer"]
        states = {"params": 0, "grads": 0, "optimizer": 0}
    acts = activation_bytes(shape, w)
    temp = temp_buffer_bytes(shape, w, backend)
    total = sum(states.values()) + acts + temp + w.overhead_bytes
    cpu_node = cpu * (w.gpus_per_node or w.world_size)
    fits: bool | None = None
    if w.gpu_memory_bytes is not None:
        fits = total <= w.usable_fraction * w.gpu_memory_bytes
        if cpu and w.cpu_memory_bytes is not None:
            fits = fits and cpu_node <= w.usable_fraction * w.cpu_memory_bytes
    note = unavailable_reason(w, backend)
    if backend == "single" and w.world_size > 1:
        note = "one process cannot use several GPUs"
    return MemoryEstimate(
        backend=backend, params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
        activations=acts, temp_buffers=temp, overhead=w.overhead_bytes, cpu_offloaded=cpu,
        cpu_per_node=cpu_node, total=total, fits=fits if not note else False,
        comm_bytes_per_step=comm_bytes_per_step(shape, w, backend), gpu_memory_bytes=w.gpu_memory_bytes,
        available=not note, note=note)


def estimate_all(shape: ModelShape, workload: Workload) -> dict[str, MemoryEstimate]:
    """Estimates for every backend; "single" stands in for "ddp" on a one-GPU world."""
    names = [("single" if b == "ddp" and workload.world_size == 1 else b) for b in BACKENDS]
    return {b: estimate(shape, workload, b) for b in names}


# --------------------------------------------------------------------------------------------------
# Recommendation


def fmt_gb(nbytes: float) -> str:
    """Bytes as GiB with one decimal (the unit `estimate` prints)."""
    return f"{nbytes / GiB:.1f} GiB"


@dataclass(frozen=True)
class Decision:
    """The backend to use (or "none"), why, and the per-backend estimates behind it."""
    backend: str
    reason: str
    table: dict[str, MemoryEstimate] = field(default_factory=dict)
    shape: ModelShape | None = None
    workload: Workload | None = None

    def to_dict(self) -> dict:
        """Plain data (for --json output and logs)."""
        return asdict(self)


@dataclass(frozen=True)
class Rule:
    """One line of the decision table: pick `backend` when it applies and its total stays under
    `limit` of the GPU's memory. `reason` is formatted with the estimate's numbers."""
    backend: str
    applies: Callable[[Workload], bool]
    limit: float | None     # share of GPU memory; None: the workload's usable_fraction
    reason: str


#: Ordered: the first rule whose backend is available, applies and fits wins. Cheaper communication
#: first; sharding only when needed; offload (slow: PCIe every step) only when nothing else fits.
ROOM = 0.8
RULES: tuple[Rule, ...] = (
    Rule("single", lambda w: w.world_size == 1, None,
         "one GPU holds the whole run ({used} of {gpu}); no communication"),
    Rule("ddp", lambda w: w.world_size > 1, ROOM,
         "fits on every GPU with room ({used} of {gpu}); no sharding communication, only a gradient "
         "all-reduce ({comm}/step)"),
    # fp16 rules out the torch backends (no loss scaling); ZeRO-2 is DeepSpeed's closest to DDP.
    Rule("zero2", lambda w: w.dtype == "fp16", ROOM,
         "fits on every GPU with room ({used} of {gpu}); fp16 needs DeepSpeed's loss scaling, and ZeRO-2 "
         "only shards grads and optimizer state"),
    Rule("fsdp", lambda w: w.world_size > 1, None,
         "a full replica does not fit with room; FSDP2 shards params, grads and optimizer state over "
         "{n} GPUs ({used} of {gpu}; {comm}/step)"),
    # Reached when FSDP2 is unavailable (fp16, old torch) or its larger gather units (two layers
    # plus the unsharded root) do not fit: ZeRO-3 shards the same states in smaller pieces.
    Rule("zero3", lambda w: w.world_size > 1, None,
         "{fsdp_status}; DeepSpeed ZeRO-3 shards params, grads and optimizer state over {n} GPUs and "
         "gathers one module at a time ({used} of {gpu}; {comm}/step)"),
    Rule("zero3_offload", lambda w: True, None,
         "only offload fits: params, grads and optimizer state move to CPU memory ({cpu}/node{cpu_check}); "
         "GPUs hold {used} of {gpu}; expect PCIe-bound steps"),
)


def _reason(rule: Rule, est: MemoryEstimate, w: Workload, table: dict[str, MemoryEstimate]) -> str:
    cpu_check = "" if w.cpu_memory_bytes is not None else ", not checked: pass --cpu-memory"
    fsdp = table.get("fsdp")
    if fsdp is None or not fsdp.available:
        fsdp_status = f"fsdp is out ({fsdp.note if fsdp else 'not estimated'})"
    else:
        fsdp_status = f"fsdp does not fit ({fmt_gb(fsdp.total)} with its root and two layers unsharded)"
    return f"{est.backend}: " + rule.reason.format(
        used=fmt_gb(est.total), gpu=fmt_gb(est.gpu_memory_bytes or 0), n=w.world_size,
        comm=fmt_gb(est.comm_bytes_per_step), cpu=fmt_gb(est.cpu_per_node), cpu_check=cpu_check,
        fsdp_status=fsdp_status)


def recommend(shape: ModelShape, workload: Workload, rules: tuple[Rule, ...] = RULES) -> Decision:
    """The first rule of `rules` whose backend fits; "none" with the smallest requirement otherwise."""
    w = workload
    if w.gpu_memory_bytes is None:
        raise UserError("--gpu-memory is needed to recommend a backend")
    table = estimate_all(shape, w)
    for rule in rules:
        est = table.get(rule.backend)
        if est is None or not est.available or not rule.applies(w):
            continue
        # est.fits covers the usable share of the GPU and, for offload, the CPU memory per node.
        limit = w.usable_fraction if rule.limit is None else rule.limit
        if est.fits and est.total <= limit * w.gpu_memory_bytes:
            return Decision(rule.backend, _reason(rule, est, w, table), table, shape, w)
    return Decision("none", _nothing_fits(table, w), table, shape, w)


def _nothing_fits(table: dict[str, MemoryEstimate], w: Workload) -> str:
    usable = w.usable_fraction * (w.gpu_memory_bytes or 0)
    candidates = [e for e in table.values() if e.available]
    best = min(candidates, key=lambda e: e.total)
    need = f"{best.backend}'s {fmt_gb(best.total)} per GPU"
    if best.total <= usable and best.cpu_per_node:
        need += f" and {fmt_gb(best.cpu_per_node)} of CPU memory per node (have {fmt_gb(w.cpu_memory_bytes or 0)})"
    hints = ["more GPUs"]
    if not w.gradient_checkpointing:
        hints.append("--gradient-checkpointing")
    if w.micro_batch > 1:
        hints.append("a smaller --batch-size")
    hints.append("a shorter --max-length")
    if w.train_type == "full":
        hints.append("--train-type lora/qlora")
    elif w.quant_bits is None:
        hints.append("--train-type qlora")
    return (f"no backend fits in {fmt_gb(w.gpu_memory_bytes or 0)} per GPU "
            f"({fmt_gb(usable)} usable): the smallest requirement is {need}; try {', '.join(hints)}")


# --------------------------------------------------------------------------------------------------
# --parallelism auto


def workload_from_config(cfg: "RunConfig", world_size: int, gpu_memory_bytes: int | None,
                         gpus_per_node: int | None = None) -> Workload:
    """The Workload a RunConfig describes on `world_size` ranks."""
    return Workload(
        train_type=cfg.train.train_type, dtype=cfg.model.torch_dtype, lora_rank=cfg.lora.lora_rank,
        lora_targets=tuple(cfg.lora.target_modules) or ("all-linear",), lora_dropout=cfg.lora.lora_dropout,
        quant_bits=cfg.quant.quant_bits, double_quant=cfg.quant.bnb_4bit_use_double_quant,
        max_length=cfg.data.max_length, micro_batch=cfg.train.per_device_train_batch_size,
        gradient_checkpointing=cfg.train.gradient_checkpointing, world_size=world_size,
        gpus_per_node=gpus_per_node or cfg.parallel.nproc_per_node or world_size,
        gpu_memory_bytes=gpu_memory_bytes, fsdp2_available=_has_fsdp2())


def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_auto(cfg: "RunConfig", world_size: int, gpu_memory_bytes: int | None, *,
                 shape: ModelShape | None = None, gpus_per_node: int | None = None) -> Decision:
    """The backend `--parallelism auto` runs with.

    On CPU (`gpu_memory_bytes` None) memory is not the constraint: one process runs "single", several
    run "fsdp" (fp16 runs go to DeepSpeed ZeRO-2, the only backend with loss scaling). On GPU the
    memory model decides (`recommend`); pass `shape` when the model is a hub id (this reads only
    presets and local folders). A run that fits nowhere is a UserError naming the smallest need.
    """
    if gpu_memory_bytes is None:
        if cfg.model.torch_dtype == "fp16":
            return Decision("zero2", "fp16 needs loss scaling, which only the DeepSpeed backends provide")
        if world_size == 1:
            return Decision("single", "one process on CPU: no parallelism needed")
        return Decision("fsdp", f"{world_size} CPU processes: FSDP2 shards params, grads and optimizer "
                        "state (memory is not estimated on CPU)")
    shape = shape or shape_from_model_arg(cfg.model.model)
    decision = recommend(shape, workload_from_config(cfg, world_size, gpu_memory_bytes, gpus_per_node))
    if decision.backend == "none":
        raise UserError(f"--parallelism auto: {decision.reason}; or pick --parallelism explicitly")
    return decision


__all__ = [
    "BACKENDS", "Decision", "GiB", "Linear", "MemoryEstimate", "ModelShape", "RULES", "Rule", "Workload",
    "activation_bytes", "comm_bytes_per_step", "estimate", "estimate_all", "model_state_bytes",
    "quantized_bytes", "recommend", "resolve_auto", "shape_from_config", "shape_from_model_arg",
    "temp_buffer_bytes", "trainable_params", "unavailable_reason", "workload_from_config",
]
