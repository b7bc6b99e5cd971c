"""The rules of the tuners besides LoRA (--train_type boft, adalora, bone, llamapro, adapter) and of LISA's layer
sampling (--lisa_activated_layers, a full fine-tune): which options apply to which tuner, and the
combinations peft or swiftlite cannot run, each with its reason. Rules of
config/rules.py's table, kept here so that module stays short. Import-light (no torch)."""

from __future__ import annotations

from swiftlite.config.rule_table import rule
from swiftlite.config.schema import RunConfig
from swiftlite.config.tasks import task_spec

BOFT_KEYS = ("boft_block_size", "boft_block_num", "boft_n_butterfly_factor", "boft_dropout")
LORA_GA_KEYS = ("lora_ga_batch_size", "lora_ga_iters", "lora_ga_max_length", "lora_ga_direction", "lora_ga_scale",
                "lora_ga_stable_gamma")
ADALORA_KEYS = ("adalora_target_r", "adalora_init_r", "adalora_tinit", "adalora_tfinal", "adalora_deltaT",
                "adalora_beta1", "adalora_beta2", "adalora_orth_reg_weight")
LLAMAPRO_KEYS = ("llamapro_num_new_blocks", "llamapro_num_groups")
ADAPTER_KEYS = ("adapter_length", "adapter_act")
BONE_KEYS = ("reft_rank",)
#: --init_weights values of --train_type bone: ms-swift's documented ones (swift/arguments/tuner_args.py),
#: peft MissConfig's True, False and "bat".
BONE_INIT_WEIGHTS = ("true", "false", "bat")
LISA_KEYS = ("lisa_activated_layers", "lisa_step_interval")
#: LoRA's own options, by the tuner that has no use for them, with the reason.
NOT_FOR = {
    "boft": {"lora_rank": "BOFT has no rank: its blocks are --boft_block_size/--boft_block_num",
             "lora_alpha": "BOFT has no alpha scale (an orthogonal rotation and a trained scale per output)",
             "lora_dropout": "BOFT's dropout is --boft_dropout",
             "lora_bias": "ms-swift's BOFT trains no bias"},
    "adalora": {"lora_rank": "AdaLoRA's ranks are --adalora_init_r (start) and --adalora_target_r (budget)",
                "use_rslora": "AdaLoRA scales by lora_alpha / its rank count, never lora_alpha / sqrt(r)"},
    "bone": {"lora_rank": "Bone's rank is --reft_rank (ms-swift's name for it)",
             "lora_alpha": "Bone (peft's MiSS) has no alpha scale: its trained block is added as it is",
             "lora_dropout": "ms-swift's Bone has no dropout (peft's miss_dropout stays 0)",
             "lora_bias": "ms-swift's Bone trains no bias",
             "use_rslora": "Bone (peft's MiSS) has no alpha / sqrt(r) scale"},
}
#: LoRA variants peft implements for its LoRA alone (refused for any other adapter).
LORA_VARIANTS = {"use_dora": "DoRA", "init_weights": "--init_weights (PiSSA, OLoRA, LoftQ, gaussian)",
                 "lorap_lr_ratio": "LoRA+ (the B matrices' learning rate)"}


def _flag(key: str) -> str:
    return "--" + key


@rule("tuner options")
def _tuner_options(c: RunConfig):
    t = c.train.train_type
    for keys, owner in ((BOFT_KEYS, "boft"), (ADALORA_KEYS, "adalora"), (BONE_KEYS, "bone"),
                        (LLAMAPRO_KEYS, "llamapro"), (ADAPTER_KEYS, "adapter")):
        if t != owner:
            given = [k for k in keys if k in c.explicit]
            if given == ["reft_rank"]:   # ms-swift's name serves two tuners; ReFT is not one here
                return (f"--reft_rank is the rank of --train_type bone here (ms-swift's ReFT, --train_type reft, is "
                        f"not available); this run trains {t}: drop it")
            if given:
                return f"{_flag(given[0])} is an option of --train_type {owner}; this run trains {t}: drop it"
    if t not in NOT_FOR:
        return None
    for k, why in NOT_FOR[t].items():
        if k in c.explicit:
            return f"{_flag(k)} does not apply to --train_type {t}: {why}"
    from swiftlite.config.schema import field_specs
    specs = field_specs()
    for k, what in LORA_VARIANTS.items():   # given and on (`--use_dora false` asks for nothing)
        if k == "init_weights" and t == "bone":
            continue   # Bone has --init_weights values of its own (`_bone`)
        if k in c.explicit and getattr(c.lora, k) != specs[k].default:
            return f"{_flag(k)}: {what} is a variant of peft's LoRA; --train_type {t} is not LoRA: drop it"
    if c.quant_bits is not None:
        return (f"--quant_bits {c.quant_bits} with --train_type {t}: swiftlite trains BOFT, AdaLoRA and Bone on a "
                "16-bit base only (QLoRA is --train_type qlora): drop --quant_bits")


@rule("boft options")
def _boft(c: RunConfig):
    if c.train.train_type != "boft":
        return None
    lc = c.lora
    if lc.boft_block_size < 0 or lc.boft_block_num < 0:
        return "--boft_block_size and --boft_block_num must be >= 0"
    if (lc.boft_block_size == 0) == (lc.boft_block_num == 0):
        return (f"--boft_block_size {lc.boft_block_size} --boft_block_num {lc.boft_block_num}: give exactly one of "
                "them (peft: block size x block number = each layer's input width); the other 0")
    if lc.boft_n_butterfly_factor < 1:
        return f"--boft_n_butterfly_factor must be >= 1, got {lc.boft_n_butterfly_factor}"
    if not 0 <= lc.boft_dropout < 1:
        return f"--boft_dropout must be in [0, 1), got {lc.boft_dropout}"
    if task_spec(c.task).own_options == "rlhf" and c.rlhf.use_vllm:
        return ("--use_vllm with --train_type boft: the weight sync hands vLLM base + B@A x scale (a LoRA merge); a "
                "BOFT rotation is not one: drop --use_vllm")


@rule("adalora options")
def _adalora(c: RunConfig):
    if c.train.train_type != "adalora":
        return None
    lc = c.lora
    if not 0 < lc.adalora_target_r <= lc.adalora_init_r:
        return (f"--adalora_target_r {lc.adalora_target_r}: must be > 0 and at most --adalora_init_r "
                f"{lc.adalora_init_r} (the budget only prunes ranks)")
    if lc.adalora_tinit < 0 or lc.adalora_tfinal < 0 or lc.adalora_deltaT < 1:
        return "--adalora_tinit and --adalora_tfinal must be >= 0, --adalora_deltaT >= 1"
    if not (0 <= lc.adalora_beta1 < 1 and 0 <= lc.adalora_beta2 < 1):
        return "--adalora_beta1 and --adalora_beta2 must be in [0, 1)"
    if lc.adalora_orth_reg_weight < 0:
        return f"--adalora_orth_reg_weight must be >= 0, got {lc.adalora_orth_reg_weight}"
    if task_spec(c.task).own_options == "rlhf":
        return (f"--train_type adalora with swiftlite rlhf: AdaLoRA's rank allocation and orthogonal penalty are "
                "run by the sft/pt step only: train it with swiftlite sft or pt")


@rule("bone options")
def _bone(c: RunConfig):
    if c.train.train_type != "bone":
        return None
    w = c.lora.init_weights
    if w == "mini":
        return ("--init_weights mini: peft MiSS's mini variant needs its mini_r, which ms-swift has no flag for; "
                f"--train_type bone takes {', '.join(BONE_INIT_WEIGHTS)}")
    if w not in BONE_INIT_WEIGHTS:
        return (f"--init_weights {w}: a LoRA initialisation; --train_type bone (peft's MiSS) takes "
                f"{', '.join(BONE_INIT_WEIGHTS)}")
    if c.lora.reft_rank < 1:
        return f"--reft_rank must be >= 1 (Bone's rank), got {c.lora.reft_rank}"
    if task_spec(c.task).own_options == "rlhf" and c.rlhf.use_vllm:
        return ("--use_vllm with --train_type bone: the weight sync hands vLLM base + B@A x scale (a LoRA merge); "
                "Bone's blocks are not one: drop --use_vllm")


@rule("lora-ga")
def _lora_ga(c: RunConfig):
    lc = c.lora
    if not (c.is_lora and lc.init_weights == "lora-ga"):
        given = [k for k in LORA_GA_KEYS if k in c.explicit]
        if given:
            return f"{_flag(given[0])} is an option of LoRA-GA: add --init_weights lora-ga, or drop it"
        return None
    if min(lc.lora_ga_batch_size, lc.lora_ga_iters, lc.lora_ga_max_length, lc.lora_ga_stable_gamma) < 1:
        return ("--lora_ga_batch_size, --lora_ga_iters, --lora_ga_max_length and --lora_ga_stable_gamma must be "
                ">= 1")
    if task_spec(c.task).own_options == "rlhf":
        return ("--init_weights lora-ga with swiftlite rlhf: its gradients are estimated on sft/pt rows (the "
                "token loss); use it with swiftlite sft or pt")
    if c.data.streaming:
        return ("--init_weights lora-ga with --streaming: the gradients are estimated on the first training rows "
                "before training starts, which a stream reads only as training consumes them; drop one")
    return None


@rule("llamapro options")
def _llamapro(c: RunConfig):
    """LLaMA-Pro trains whole new decoder blocks of a 16-bit model (models/llamapro.py); the layer count's
    divisibility needs the model's config and is checked before launch (launch/preflight.py)."""
    if c.train.train_type != "llamapro":
        return None
    lc = c.lora
    if lc.llamapro_num_new_blocks < 1:
        return f"--llamapro_num_new_blocks must be >= 1, got {lc.llamapro_num_new_blocks}"
    if lc.llamapro_num_groups is not None and lc.llamapro_num_groups < 1:
        return f"--llamapro_num_groups must be >= 1, got {lc.llamapro_num_groups}"
    return _own_modules(c, "llamapro", "the new blocks", lora_why="it trains whole new decoder blocks, no adapter",
                        quant_why="the new blocks are copies of 16-bit layers trained in full",
                        rlhf_what="expands and trains LLaMA-Pro blocks")


def _own_modules(c: RunConfig, tuner: str, trained: str, *, lora_why: str, quant_why: str, rlhf_what: str):
    """What the tuners that train modules of their own on a frozen 16-bit base (llamapro, adapter) refuse
    alike: LoRA's options, a quantized base, new tokens (their embeddings would stay frozen), rlhf."""
    from swiftlite.config.tuner_options import LORA_ONLY
    given = [k for k in LORA_ONLY if k in c.explicit]
    if given:
        return f"{_flag(given[0])} does not apply to --train_type {tuner}: {lora_why}: drop it"
    if c.quant_bits is not None:
        return f"--quant_bits {c.quant_bits} with --train_type {tuner}: {quant_why}: drop --quant_bits"
    if c.model.new_special_tokens:
        return (f"--new_special_tokens with --train_type {tuner}: only {trained} train, so the new tokens' "
                "embeddings would stay untrained: drop it, or train them with --train_type full or lora")
    if task_spec(c.task).own_options == "rlhf":
        return f"--train_type {tuner} with swiftlite rlhf: swiftlite {rlhf_what} with sft and pt only"
    return None


@rule("adapter options")
def _adapter(c: RunConfig):
    """Houlsby adapters after each MLP of a 16-bit model (models/adapter.py); whether the model has an
    `mlp` in each decoder layer needs its config and is checked before launch (launch/preflight.py)."""
    if c.train.train_type != "adapter":
        return None
    lc = c.lora
    if lc.adapter_length < 1:
        return f"--adapter_length must be >= 1, got {lc.adapter_length}"
    from transformers.activations import ACT2CLS   # transformers' table, as ms-swift's AdapterModule reads it
    if lc.adapter_act not in ACT2CLS:
        return (f"--adapter_act {lc.adapter_act}: not an activation of transformers' ACT2CLS; choose one of "
                f"{', '.join(sorted(ACT2CLS))}")
    from swiftlite.config.galore_options import uses_galore
    if uses_galore(c):
        return ("--use_galore with --train_type adapter: GaLore projects the gradients of whole weight matrices, "
                "and this run trains only the adapters' small ones: drop it")
    return _own_modules(c, "adapter", "the adapters",
                        lora_why="it trains Houlsby adapters after each MLP (--adapter_length, --adapter_act), no LoRA",
                        quant_why=("swiftlite trains Houlsby adapters on a 16-bit base only (a quantized base is "
                                   "--train_type qlora)"),
                        rlhf_what="trains Houlsby adapters")


@rule("lisa layers")
def _lisa_layers(c: RunConfig):
    n = c.lora.lisa_activated_layers
    if n < 0:
        return f"--lisa_activated_layers {n}: must be >= 0 (0 turns LISA off)"
    if n == 0:
        return None
    t = c.train.train_type
    if t != "full":
        return (f"--lisa_activated_layers {n} with --train_type {t}: LISA samples the decoder layers of a full "
                "fine-tune (ms-swift: full only); add --train_type full, or drop --lisa_activated_layers")
    if task_spec(c.task).own_options == "rlhf":
        return (f"--lisa_activated_layers {n} with swiftlite rlhf: LISA's layer draws are run by the sft/pt step "
                "only: train it with swiftlite sft or pt")


@rule("lisa interval")
def _lisa_interval(c: RunConfig):
    # its own rule, reading the interval first: a bad interval leaves the layers' checks (the backend's) to run
    k = c.lora.lisa_step_interval
    if k < 1:
        return f"--lisa_step_interval {k}: must be >= 1 (optimizer steps between two draws of the layers)"
    if "lisa_step_interval" in c.explicit and c.lora.lisa_activated_layers == 0:
        return (f"--lisa_step_interval {k} without --lisa_activated_layers: LISA is off (0 layers), so the "
                "interval does nothing: drop it, or give --lisa_activated_layers N")
