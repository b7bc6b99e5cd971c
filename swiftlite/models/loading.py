"""Load the tokenizer and the model, and prepare it for training.

`prepare_model` is the one place that fixes the order (docs/design.md, "Model preparation"):
load (meta or real) -> quantize (bnb) -> LoRA (peft) -> activation checkpointing -> compile (per
decoder layer). Wrapping by the backend and building the optimizer follow immediately, in
`parallel.base.build_engine` (docs/design.md trap 2: no forward may happen in between).
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swiftlite import dtypes
from swiftlite.errors import UserError
from swiftlite.models import rope   # --rope_scaling, --max_model_len: model_config applies them, once for all
from swiftlite.models.source import ModelSource, is_moe, resolve_model
from swiftlite.models.tuners import OWN_TUNERS, WHOLE_MODEL_TUNERS, apply_own   # swiftlite's own: llamapro, adapter

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig

# ModelSource and resolve_model live in models/source.py (the owner of --model's facts); callers may
# import them from here, where every loader takes a ModelSource.


def torch_dtype(name: str) -> "torch.dtype":
    """torch dtype of a --torch-dtype name (swiftlite.dtypes is the one table)."""
    return dtypes.torch_dtype(name)


# -- ms-swift's defaults that come from the model: --torch-dtype auto, --max-length ---------------------

def auto_dtype(cfg: "RunConfig", model_config: Any, has_cuda: bool, *, bf16_ok: bool = True) -> tuple[str, str] | None:
    """--torch-dtype auto -> (a concrete name, a phrase saying why), as ms-swift: on a GPU the model
    config's 16-bit dtype, which is bf16 for current models (bfloat16, float32 or none declared -> bf16);
    a float16 model trains in bf16 too where the GPU has it (fp16 needs loss scaling, which only
    DeepSpeed has here); on a GPU without bf16, and on CPU, fp32 (what every backend runs; pass
    --torch-dtype fp16 with --deepspeed for fp16). None when it was not auto. Needs no torch import
    (the caller says whether there is a GPU and whether it has bf16); writes nothing (job.resolve_run
    puts the answer into the run's config)."""
    if cfg.model.torch_dtype != "auto":
        return None
    if not has_cuda:
        return "fp32", "auto: fp32 on CPU"
    get = model_config.get if isinstance(model_config, dict) else lambda k: getattr(model_config, k, None)
    declared = get("dtype") or get("torch_dtype")
    name = dtypes.normalize(declared) if declared is not None else None
    if not bf16_ok:
        return "fp32", ("auto: fp32 on a GPU (this GPU has no bf16, and fp16 needs loss scaling: --torch-dtype "
                        "fp16 with --deepspeed)")
    why = {"bf16": "the model's dtype", "fp16": "the model declares float16; bf16 needs no loss scaling"}.get(
        name, "the model declares no 16-bit dtype")
    return "bf16", f"auto: bf16 on a GPU ({why})"


def context_max_length(cfg: "RunConfig", model_config: Any) -> tuple[int, str] | None:
    """--max-length unset -> (the model's context (max_position_embeddings), a phrase), as ms-swift; None
    when it was set. A config that declares no context length is a UserError. Writes nothing."""
    from swiftlite.config import context_length
    if cfg.data.max_length is not None:
        return None
    n = context_length(model_config)
    if n is None:
        raise UserError(f"--model {cfg.model.model}: its config declares no context length "
                        "(max_position_embeddings); pass --max-length")
    return n, f"max length {n}: the model's context"


def model_defaults(cfg: "RunConfig", source: ModelSource | None = None) -> tuple[str, int | None, list[str]]:
    """(torch dtype, max length, phrases of what was settled here): --torch-dtype and --max-length made
    concrete where config.load could not without torch or transformers (a GPU build of torch; a hub
    model). Reads the model's config and asks torch for a GPU only when something is still unresolved.
    Writes nothing: job.resolve_run is the one writer of the run's concrete config."""
    if cfg.model.torch_dtype != "auto" and cfg.data.max_length is not None:
        return cfg.model.torch_dtype, cfg.data.max_length, []
    conf, dtype, length, phrases = model_config(cfg, source), cfg.model.torch_dtype, cfg.data.max_length, []
    if dtype == "auto":
        dtype = _auto_dtype_here(cfg, conf, phrases)
    got = context_max_length(cfg, conf)
    if got is not None:
        length, why = got
        phrases.append(why)
    return dtype, length, phrases


def _auto_dtype_here(cfg: "RunConfig", conf: Any, phrases: list[str] | None = None) -> str:
    """`auto_dtype` with this process's GPU (torch asked only here)."""
    import torch
    cuda = torch.cuda.is_available()
    name, why = auto_dtype(cfg, conf, cuda, bf16_ok=not cuda or torch.cuda.is_bf16_supported())
    if phrases is not None:
        phrases.append(why)
    return name


def load_tokenizer(cfg: "RunConfig", source: ModelSource | None = None) -> Any:
    """The model's tokenizer, with the chat template from --template when given."""
    from transformers import AutoTokenizer
    src = source or resolve_model(cfg.model.model)
    key = (src.tokenizer_ref, cfg.model.template, cfg.model.trust_remote_code, cfg.model.model_revision, cfg.task,
           cfg.model.enable_thinking, tuple(cfg.model.new_special_tokens or ()))
    if key in _TOKENIZERS:  # preflight and the trainer share one process on single-process runs
        return _TOKENIZERS[key]
    try:
        tok = AutoTokenizer.from_pretrained(src.tokenizer_ref, trust_remote_code=cfg.model.trust_remote_code,
                                            revision=cfg.model.model_revision if src.kind == "hub" else None)
    except OSError as e:
        raise UserError(f"--model {cfg.model.model}: cannot load its tokenizer ({str(e).splitlines()[0]})") from None
    if cfg.model.template:
        from swiftlite.data.templates import chat_template
        tok.chat_template = chat_template(cfg.model.template)
    if cfg.model.enable_thinking is not None:
        with_thinking_switch(tok, cfg.model.enable_thinking)
    if cfg.model.new_special_tokens:
        add_special_tokens(tok, new_special_tokens(cfg))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    from swiftlite.config.tasks import task_spec
    if task_spec(cfg.task).needs_chat_template and not getattr(tok, "chat_template", None):
        raise UserError(f"--model {cfg.model.model}: its tokenizer has no chat template; pass --template FILE")
    _TOKENIZERS[key] = tok
    return tok


_TOKENIZERS: dict[tuple, Any] = {}


def new_special_tokens(cfg: "RunConfig") -> list[str]:
    """--new_special_tokens as ms-swift reads it: each value a token, or a .txt file whose
    whitespace-separated words are tokens."""
    out: list[str] = []
    for v in cfg.model.new_special_tokens or ():
        if v.endswith(".txt"):
            p = Path(v).expanduser()
            if not p.is_file():
                raise UserError(f"--new_special_tokens {v}: file not found (a value ending in .txt names a file)")
            out += p.read_text(encoding="utf-8").split()
        else:
            out.append(v)
    return list(dict.fromkeys(out))


def add_special_tokens(tok: Any, tokens: list[str]) -> int:
    """Add `tokens` as additional special tokens, keeping the tokenizer's own (transformers 5 and 4
    name that keyword differently)."""
    try:
        return tok.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
    except TypeError:   # transformers 4.x
        return tok.add_special_tokens({"additional_special_tokens": tokens}, replace_additional_special_tokens=False)


def grown_vocab(vocab_size: int, tokenizer_size: int) -> int | None:
    """ms-swift's rule: when the tokenizer has outgrown the embeddings, their new row count is the
    tokenizer's size rounded up to a multiple of 128; None when it still fits."""
    return -(-tokenizer_size // 128) * 128 if vocab_size < tokenizer_size else None


def with_thinking_switch(tok: Any, enabled: bool) -> None:
    """--enable_thinking: the template's own `enable_thinking` switch set at its top, so every rendering of
    this run (training rows, GRPO prompts, infer) and the tokenization cache key (the template's text)
    carry it, as `apply_chat_template(..., enable_thinking=...)` would for one call. A template without
    the switch renders the same either way: said in one line (ms-swift's non-thinking templates ignore
    the flag too)."""
    from swiftlite import env
    template = getattr(tok, "chat_template", None)
    if not isinstance(template, str) or "enable_thinking" not in template:
        if (env.rank() or "0") == "0":
            print(f"--enable_thinking {str(enabled).lower()}: this chat template has no enable_thinking switch "
                  "(not a hybrid-thinking model); it changes nothing here", flush=True)
        return
    tok.chat_template = "{%- set enable_thinking = " + ("true" if enabled else "false") + " -%}\n" + template


def model_config(cfg: "RunConfig", source: ModelSource | None = None) -> Any:
    """The transformers config of --model, without weights: `ModelSource.config` with the run's
    --trust-remote-code and --model_revision, its rope and context as --rope_scaling/--max_model_len say."""
    src = source or resolve_model(cfg.model.model)
    conf = rope.apply(src.config(cfg.model.trust_remote_code, cfg.model.model_revision), cfg.model)
    if cfg.model.new_special_tokens:   # the embeddings the run trains (and export writes): grown
        if (grown := grown_vocab(conf.vocab_size, len(load_tokenizer(cfg, src)))) is not None:
            conf = copy.deepcopy(conf)
            conf.vocab_size = grown
    return conf


def load_model(cfg: "RunConfig", source: ModelSource | None = None, world: Any = None, *,
               init_context: Any = None, attn_impl: str | None = None,
               skeleton: str | None = None) -> "torch.nn.Module":
    """Load weights (or build a built-in preset with weights seeded by --seed), quantized if asked,
    with `attn_impl` as transformers' `attn_implementation` (None: transformers' default; training
    passes --attn_impl, export and infer keep the default: the attention kernel changes no weight).

    `skeleton` returns a skeleton instead: parameters on the meta device (models/sharded.py).
    "shard" (the backend record's `loading == "sharded"`: fsdp, hsdp, fsdp1 on 2+ processes): the
    backend shards it, then each rank fills its shards. "fill" (a 4-bit base on the other backends):
    `prepare_model` fills it whole at its end, quantizing each weight as it arrives, so the 16-bit
    model is never in memory at once (the 4-bit base is what those backends hold). Where that cannot
    work (see `sharded_weights`) the model is loaded the usual way, and rank 0 says why in one line.

    Under ZeRO-3 a real checkpoint is loaded inside `deepspeed.zero.Init`, so no rank ever holds the
    whole model. Built-in presets are built normally (they are tiny, and their seeded weights must
    equal the other backends' for parity); quantized bases are loaded normally (bnb layers are not
    partitioned at construction).
    """
    import torch
    src = source or resolve_model(cfg.model.model)
    auto, head = _model_class(cfg)
    if head and skeleton:
        skeleton = None   # models/sharded.py builds causal LMs: a reward model loads whole on each rank
        if world is None or world.is_main:
            print("sharded loading is off: a reward model (score head) loads whole on every rank", flush=True)
    # Always --torch-dtype, for training too: with bf16 the backend then upcasts the trainable
    # parameters to fp32 master weights (optim.upcast_trainable), so every backend's masters start
    # from the same bf16 weights DeepSpeed's do (it builds its fp32 master from the bf16 module).
    # Loading in fp32 instead left the torch backends' masters off the bf16 grid and their lr-1e-5
    # curves 2% below ZeRO-3's after 8 steps (docs/backends.md, "Precision").
    if cfg.model.torch_dtype == "auto":  # a config built without a resolution (export, infer): a concrete copy
        cfg = cfg.with_values(torch_dtype=_auto_dtype_here(cfg, model_config(cfg, src)))
    dtype = torch_dtype(cfg.model.torch_dtype)
    quant = None   # bitsandbytes' config: transformers quantizes as it loads (HQQ: after, models/hqq.py)
    if cfg.quant_method == "bnb":
        from swiftlite.models.quant import bnb_config
        quant = bnb_config(cfg)
    attn = {"attn_implementation": attn_impl} if attn_impl else {}
    if cfg.model.experts_impl:   # MoE models (check_moe_options): transformers' experts kernel
        attn["experts_implementation"] = cfg.model.experts_impl
    if skeleton:
        from swiftlite.models import sharded as sharding
        weights, why_not = sharded_weights(cfg, src, dtype, attn, quantized=quant is not None)
        if weights is not None:
            model = sharding.build_skeleton(model_config(cfg, src), dtype, weights, attn, quantization=quant)
            if src.kind != "preset":
                model.config._name_or_path = src.ref  # what from_pretrained records (peft's base path)
            if quant is not None:   # what from_pretrained marks on a 4-bit model (peft reads it)
                model.is_loaded_in_4bit = True
                model.config.quantization_config = quant
                from swiftlite.models.quant import disable_cpu_repack
                disable_cpu_repack(model)
            return model
        if world is None or world.is_main:
            what = "sharded loading" if skeleton == "shard" else "loading the 4-bit base layer by layer"
            print(f"{what} is off: {why_not}; every rank loads the whole model", flush=True)
    if src.kind == "preset":
        conf = model_config(cfg, src)
        conf.use_cache = False
        # Same seed -> same initial weights on every rank and in every run (parity, resume tests).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.train.seed)
            if head:
                conf.num_labels = 1
            model = auto.from_config(conf, dtype=dtype, **attn)
        if quant is not None:
            from swiftlite.models.quant import quantize_in_place
            model = quantize_in_place(model, cfg)
        model = _hqq(cfg, model)
        return _with_pad_id(cfg, src, model) if head else model
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.model.trust_remote_code, **attn}
    if quant is not None:
        kwargs["quantization_config"] = quant
    if src.kind == "hub" and cfg.model.model_revision:
        kwargs["revision"] = cfg.model.model_revision
    if rope.asked(cfg.model):   # the folder's config with the run's rope and context (models/rope.py)
        kwargs["config"] = rope.apply(src.config(cfg.model.trust_remote_code, cfg.model.model_revision), cfg.model)
    # The backend's own loading context (ZeRO-3: zero.Init), handed in by the caller: a loader
    # never picks a backend.
    ctx: Any = init_context if init_context is not None else contextlib.nullcontext()
    if world is not None and not world.is_main:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # one "Loading weights" bar (rank 0's) is enough
    try:
        with ctx:
            model = auto.from_pretrained(src.ref, **kwargs, **head)
    except OSError as e:
        raise UserError(f"--model {cfg.model.model}: cannot load ({str(e).splitlines()[0]})") from None
    if cfg.model.new_special_tokens:
        _grow_embeddings(cfg, src, model)
    model.config.use_cache = False
    if quant is not None:
        from swiftlite.models.quant import disable_cpu_repack
        disable_cpu_repack(model)  # trap 1, for every quantized load (train, infer, export)
    model = _hqq(cfg, model)
    return _with_pad_id(cfg, src, model) if head else model


def _hqq(cfg: "RunConfig", model: "torch.nn.Module") -> "torch.nn.Module":
    """The 16-bit model quantized with HQQ where --quant-method hqq asks (transformers 5 no longer does it
    at load: models/hqq.py)."""
    if cfg.quant_method != "hqq":
        return model
    from swiftlite.models import hqq
    if not hqq.available():
        raise UserError(hqq.missing_package())
    return hqq.quantize(model, cfg)


def check_moe_options(cfg: "RunConfig", source: ModelSource | None = None) -> None:
    """--experts_impl and --router_aux_loss_coef apply to MoE models only: a dense one is refused in
    one line before launch, not trained as if the flag did something."""
    given = [f for f, v in (("--experts_impl", cfg.model.experts_impl),
                            ("--router_aux_loss_coef", cfg.train.router_aux_loss_coef)) if v]
    if not given:
        return
    conf = model_config(cfg, source)
    if not is_moe(conf):
        raise UserError(f"{', '.join(given)}: --model {cfg.model.model} is not a mixture-of-experts model "
                        f"({type(conf).__name__} has no experts); drop the flag")


def _grow_embeddings(cfg: "RunConfig", src: ModelSource, model: Any) -> None:
    """--new_special_tokens: the loaded embeddings (and an untied lm_head) grown to model_config's
    vocab_size, the new rows drawn by transformers' mean resizing under --seed, so that every rank
    (and a later export or resume rebuilding the base) draws the same rows. Under ZeRO-3 transformers
    resizes the partitioned weights itself."""
    import torch
    want = model_config(cfg, src).vocab_size
    if model.get_input_embeddings().num_embeddings >= want:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        model.resize_token_embeddings(want, mean_resizing=True)


def _model_class(cfg: "RunConfig") -> tuple[Any, dict[str, Any]]:
    """(transformers Auto class, its extra from_pretrained kwargs): a causal LM, or for a reward model
    (config/tasks.reward_model) the same config with a one-output sequence-classification head (its
    `score` drawn by transformers' init where the folder has none, as TRL's RewardTrainer gets it)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from swiftlite.config.tasks import reward_model
    if reward_model(cfg):
        return AutoModelForSequenceClassification, {"num_labels": 1}
    return AutoModelForCausalLM, {}


def _with_pad_id(cfg: "RunConfig", src: ModelSource, model: Any) -> Any:
    """A sequence-classification model scores the last token that is not the pad token: its config
    needs the tokenizer's pad id (TRL's RewardTrainer sets it the same way)."""
    model.config.pad_token_id = load_tokenizer(cfg, src).pad_token_id
    # from_config keeps a preset's (or base folder's) ...ForCausalLM; a saved folder must name this class
    model.config.architectures = [type(model).__name__]
    return model


def sharded_weights(cfg: "RunConfig", src: ModelSource, dtype: "torch.dtype", attn: dict[str, Any], *,
                    quantized: bool) -> tuple[Any, str | None]:
    """The weight source sharded loading reads (models/sharded.py), or (None, why it cannot):
    an 8-bit base (4-bit ones are quantized layer by layer as the weights arrive), a folder
    without safetensors files, or a checkpoint whose tensor names are not the model's own (weights
    transformers converts while loading). A built-in preset's source is its seeded weights."""
    from swiftlite.models import sharded as sharding
    if cfg.train.train_type in WHOLE_MODEL_TUNERS:
        return None, f"--train_type {cfg.train.train_type} {WHOLE_MODEL_TUNERS[cfg.train.train_type]}"
    if cfg.model.new_special_tokens and src.kind != "preset":
        return None, "--new_special_tokens grows the embeddings beyond the checkpoint's"
    if quantized and cfg.quant.quant_bits != 4:
        return None, "an 8-bit base is quantized whole as transformers loads it"
    if src.kind == "preset":
        import torch
        from transformers import AutoModelForCausalLM
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.train.seed)   # the very weights the whole-model path builds
            full = AutoModelForCausalLM.from_config(model_config(cfg, src), dtype=dtype, **attn)
        return sharding.PresetWeights(dict(full.state_dict())), None
    folder = Path(src.snapshot(cfg.model.model_revision).ref)   # a hub model: its config and safetensors files
    why_not = sharding.safetensors_folder(folder)
    if why_not:
        return None, why_not
    weights = sharding.FolderWeights(folder)
    missing = sharding.missing_names(model_config(cfg, src), dtype, weights, attn)
    if missing:
        return None, (f"the checkpoint names its tensors differently from the model ({len(missing)} missing, "
                      f"e.g. {missing[0]}; transformers converts them while loading)")
    return weights, None


# -- attention kernel and batch form (docs/usage.md, "Batches") ------------------------------------

#: --attn_impl values: transformers' attn_implementation names, each isolating the rows of one
#: sequence from its position ids (sdpa/eager/flex: a per-row causal mask; flash: varlen kernels).
ATTN_IMPLS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
#: flash kernels: (module transformers imports, pip distribution)
_FLASH = {"flash_attention_2": ("flash_attn", "flash-attn"), "flash_attention_3": ("flash_attn_interface", "flash-attn-3")}
_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
#: layer kinds that only attend (anything else, e.g. linear_attention / mamba, carries state across rows)
_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}


def check_attn_impl(cfg: "RunConfig") -> None:
    """Refuse, before launch, an --attn_impl this machine cannot run and a batch form that cannot be
    exact: flash attention needs a CUDA GPU and its package, flex_attention torch >= 2.5; --packing
    needs the padding-free form, and --packing / --padding_free true a model that keeps rows apart
    (`batch_form`, which then reads the model's config). One-line UserError naming what is missing.
    Called by preflight (before any process starts) and by prepare_model (in each rank)."""
    d = cfg.data
    if d.packing and d.padding_free is False:
        raise UserError("--packing with --padding_free false: a pack holds several rows in one sequence, and "
                        "padded with an attention mask they would attend to each other; drop --padding_free false")
    if d.packing or d.padding_free:
        batch_form(cfg)  # asked for explicitly: a model that cannot keep rows apart is refused here
    impl = cfg.model.attn_impl
    if impl is None:
        return
    import importlib.util

    import torch
    if impl in _FLASH:
        module, dist = _FLASH[impl]
        if not torch.cuda.is_available():
            raise UserError(f"--attn_impl {impl} needs a CUDA GPU (torch {torch.__version__} sees none); "
                            "use --attn_impl sdpa")
        if importlib.util.find_spec(module) is None:
            raise UserError(f"--attn_impl {impl} needs the {dist} package (pip install {dist}, module "
                            f"{module} not found); or use --attn_impl sdpa")
    elif impl == "flex_attention":
        major, minor = (int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
        if (major, minor) < (2, 5):
            raise UserError(f"--attn_impl flex_attention needs torch >= 2.5 (this is {torch.__version__}); "
                            "use --attn_impl sdpa")


def _call_args(src: str, start: int) -> str:
    """The argument text of the call whose '(' is at src[start]."""
    depth = 0
    for i in range(start, len(src)):
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        if depth == 0:
            return src[start + 1:i]
    return src[start + 1:]


def packed_sequence_support(config: Any, trust_remote_code: bool = False) -> str | None:
    """None when transformers keeps the rows of one sequence apart for this architecture (so padding-free
    batches and packs are exact), else why not, in a phrase. Read from the model class's own module:
    its causal mask must come from masking_utils with the position ids passed in (that is where
    `find_packed_sequence_indices` runs), and no layer may carry state from token to token
    (mamba, linear attention, short convolutions)."""
    import inspect
    import sys
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return "the model's own code (--trust-remote-code): its attention masking is not known"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return f"no causal-LM class known for model type {getattr(config, 'model_type', '?')}"
    name = cls.__name__
    try:
        src = inspect.getsource(sys.modules[cls.__module__])
    except (OSError, TypeError, KeyError):
        return f"{name}: its source cannot be read to check its attention masking"
    layer_types = set(getattr(config, "layer_types", None) or [])
    if "create_recurrent_attention_mask" in src or layer_types - _ATTENTION_LAYERS:
        return f"{name} has recurrent or linear-attention layers, whose state would flow from one row to the next"
    builders = set(_MASK_BUILDERS)  # and names bound to one: `mask_function = create_causal_mask if ...`
    builders |= {m.group(1) for m in re.finditer(r"^\s*(\w+)\s*=[^\n(]*\b(?:%s)\b(?!\()" % "|".join(_MASK_BUILDERS),
                                                   src, re.M)}
    calls = [m.end() - 1 for m in re.finditer(r"\b(%s)\(" % "|".join(sorted(builders)), src)
             if not src[max(0, m.start() - 4):m.start()].endswith("def ")]
    if not calls:
        return f"{name} does not build its attention mask with transformers' masking_utils"
    kwargs_dict = re.search(r"""["']position_ids["']\s*:""", src) is not None
    for at in calls:
        args = _call_args(src, at)
        if "position_ids" not in args and not ("**" in args and kwargs_dict):
            return f"{name} builds its attention mask without the position ids, so rows would attend to each other"
    return None


_SUPPORT: dict[tuple, str | None] = {}


def batch_form(cfg: "RunConfig", config: Any = None) -> Any:
    """The run's batch form (data.collate.BatchForm), the same in the trainer, evaluation and every
    rank: padding-free by default where `packed_sequence_support` allows it, padded with the reason
    where not; --padding_free true or --packing on a model that cannot keep rows apart is a UserError."""
    from swiftlite.data.collate import BatchForm
    d, impl = cfg.data, cfg.model.attn_impl
    if cfg.train.train_type == "longlora":   # padded rows only (models/longlora.py)
        from swiftlite.models.longlora import batch_form as s2_form
        return s2_form(cfg)
    if d.padding_free is False and not d.packing:
        return BatchForm(False, "--padding_free false", impl)
    if config is not None:
        why_not = packed_sequence_support(config, cfg.model.trust_remote_code)
    else:  # read once per process: evaluation asks again at every validation
        key = (cfg.model.model, cfg.model.model_revision, cfg.model.trust_remote_code)
        if key not in _SUPPORT:
            _SUPPORT[key] = packed_sequence_support(model_config(cfg), cfg.model.trust_remote_code)
        why_not = _SUPPORT[key]
    if why_not is None:
        return BatchForm(True, "--padding_free true" if d.padding_free else
                         "default; --padding_free false pads" if not d.packing else "", impl)
    if d.packing or d.padding_free:
        flag = "--packing" if d.packing else "--padding_free true"
        raise UserError(f"{flag}: {why_not}; train without it (padded batches)")
    return BatchForm(False, f"padding-free is off: {why_not}", impl)


def check_loaded_attention(cfg: "RunConfig", model: Any) -> None:
    """After loading: the attention transformers actually set up must be one that isolates rows by
    position ids (a hub kernel or custom function might not) when the batches are padding-free."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is None or impl in ATTN_IMPLS or not batch_form(cfg).padding_free:
        return
    raise UserError(f"--model {cfg.model.model}: transformers chose attention {impl!r}, which swiftlite cannot "
                    "check for per-row masking; pass --attn_impl sdpa or --padding_free false")


def decoder_layers(model: "torch.nn.Module") -> list["torch.nn.Module"]:
    """The transformer blocks (the unit FSDP shards and checkpointing wraps)."""
    import torch
    base = model
    for attr in ("base_model", "model"):  # peft -> LoraModel -> CausalLM
        while hasattr(base, attr) and not isinstance(getattr(base, attr), torch.nn.ModuleList):
            nxt = getattr(base, attr)
            if nxt is base:
                break
            base = nxt
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return list(layers)
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in no_split]
    if not found:
        raise UserError("cannot find the model's decoder layers to shard/checkpoint")
    return found


def add_neftune(model: "torch.nn.Module", alpha: float) -> None:
    """NEFTune as transformers' Trainer installs it (integrations/neftune.py): a forward hook on the
    input embeddings that adds noise while the module is in training mode. Every backend's eval()
    (validation) and the exported model see none; the hook stays on the module through wrapping."""
    from transformers.integrations.neftune import neftune_post_forward_hook
    base = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft: the CausalLM
    emb = base.get_input_embeddings()
    emb.neftune_noise_alpha = alpha
    emb.register_forward_hook(neftune_post_forward_hook)


def prepare_model(cfg: "RunConfig", source: ModelSource | None = None, world: Any = None, *,
                  init_context: Any = None, skeleton: str | None = None,
                  reentrant: bool = True, total_steps: int | None = None,
                  grad_rows: list[dict] | None = None) -> "torch.nn.Module":
    """load -> quantize -> LoRA (or LLaMA-Pro's blocks, Houlsby adapters) -> activation checkpointing -> compile.
    Wrap + optimizer come next.
    `total_steps`: the run's optimizer steps (AdaLoRA's budget schedule is part of its peft config).
    `skeleton`: "shard" (the backend shards the skeleton, then fills it) or "fill" (filled here, at
    the end, before wrapping), see `load_model`. `reentrant`: checkpointing's default form when
    --gradient_checkpointing_kwargs does not say (the backend record's `reentrant_checkpointing`).
    `grad_rows`: LoRA-GA's gradient-estimation rows (models/lora_ga.py)."""
    check_attn_impl(cfg)  # preflight checks it too; a rank started another way gets the same line
    # quantization happens inside loading (bnb needs it there)
    model = load_model(cfg, source, world, init_context=init_context, attn_impl=cfg.model.attn_impl,
                       skeleton=skeleton)
    check_loaded_attention(cfg, model)
    frozen_input = cfg.is_peft or cfg.train.train_type in OWN_TUNERS   # the embeddings do not train
    if cfg.is_peft:
        from swiftlite.models.lora import apply_lora
        model = apply_lora(model, cfg, total_steps, grad_rows)
        if cfg.train.train_type == "longlora":   # S2-Attn in training mode (models/longlora.py)
            from swiftlite.models.longlora import install
            install(model, cfg.data.max_length or model.config.max_position_embeddings)
    elif cfg.train.train_type in OWN_TUNERS:   # LLaMA-Pro (never on a skeleton: sharded_weights), Houlsby
        model = apply_own(model, cfg, world)
    if cfg.train.neftune_noise_alpha:
        add_neftune(model, cfg.train.neftune_noise_alpha)
    if cfg.train.gradient_checkpointing:
        kwargs = {"use_reentrant": reentrant, **(cfg.train.gradient_checkpointing_kwargs or {})}
        with warnings.catch_warnings():
            # transformers 5 renamed it activation_checkpointing_enable; the old name (peft and tests
            # hook it) still does the same: its deprecation notice says nothing to the user
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if frozen_input:   # reentrant checkpointing passes no gradient into a layer whose input needs none
            model.enable_input_require_grads()
    if cfg.parallel.compile:
        import torch
        if not hasattr(torch, "compile"):
            raise UserError("--compile needs torch >= 2.0 with torch.compile")
        for layer in decoder_layers(model):
            layer.compile()
    if skeleton == "fill":
        from swiftlite.models.sharded import materialize
        materialize(model, world.device if world is not None else "cpu")
    if cfg.is_lora and cfg.lora.init_weights == "loftq":   # needs the filled 4-bit base
        from swiftlite.models.lora import apply_loftq
        src = source or resolve_model(cfg.model.model)
        apply_loftq(model, cfg, src.ref if src.kind != "preset" else None)
    model.train()
    return model
