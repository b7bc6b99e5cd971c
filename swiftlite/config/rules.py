"""The validation rules: one table of generic checks on a `RunConfig`.

Each rule (registered with `@rule(name)` into `RULES`) returns an error message or None; `validate`
runs them all and refuses with every failure at once (one line each). The rules here are generic: value
ranges, required options, and combinations that no backend can run. Backend-specific combinations
(what one backend refuses) live in the backend records under `swiftlite/parallel/` and are checked
by `swiftlite.parallel.resolve.resolve_backend`, which preflight runs before any process starts.
`load_config` calls `validate`. Import-light (no torch).
"""

from __future__ import annotations

import re
from pathlib import Path

from swiftlite.config.schema import RunConfig, field_reads
from swiftlite.config.tasks import task_spec
from swiftlite.config.tuner_options import moves_base
from swiftlite.config.rules_vllm import vllm_problem
from swiftlite.config.chord_options import CHORD_KEYS, chord_problem
from swiftlite.config.multi_turn_options import MULTI_TURN_KEYS, multi_turn_problem, reward_weights_problem
from swiftlite.config.muonclip_options import muonclip_args
from swiftlite.config.rules_teacher import teacher_problem
from swiftlite.config.rules_grpo_loss import _real_problem, _reward_model_problem
from swiftlite.config.teacher_options import TEACHER_KEYS
from swiftlite.config.gkd_options import GKD_KEYS, GKD_SHARED
from swiftlite.config.generation_options import GENERATION_KEYS
from swiftlite.config.grpo_variant_options import GRPO_VARIANT_KEYS
from swiftlite.config.vllm_options import VLLM_KEYS
from swiftlite.config.data_options import TEMPLATE_NAMES
from swiftlite.errors import Refusals, UserError


from swiftlite.config.rule_table import RULES, Rule, rule  # noqa: E402  (the registry; rules_targets adds to it)


@rule("learning rate positive")
def _lr(c: RunConfig):
    if c.optim.learning_rate is not None and not c.optim.learning_rate > 0:
        return f"--learning-rate must be > 0, got {c.optim.learning_rate}"


@rule("max length positive")
def _max_len(c: RunConfig):
    if c.data.max_length is not None and c.data.max_length <= 0:
        return f"--max-length must be > 0, got {c.data.max_length}"


@rule("column map")
def _columns(c: RunConfig):
    cols = c.data.columns or {}
    bad = next(((k, v) for k, v in cols.items() if not isinstance(v, str) or not v or not k), None)
    if bad is not None:
        return f"--columns: {bad[0]!r} -> {bad[1]!r}: each column maps to a new column name (a non-empty string)"
    if len(set(cols.values())) < len(cols):
        return f"--columns {cols}: two columns renamed to the same name"


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


#: Options that only mean something for a LoRA adapter / a quantized base (refused on a full run when
#: given explicitly, in a config file or as a flag: ms-swift's default train type is lora).
from swiftlite.config.tuner_options import LORA_ONLY  # noqa: E402  (rules_tuners reads it too)
QUANT_ONLY = ("quant_bits", "quant_method", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
              "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage", "hqq_axis")
#: --quant_bits values HQQ takes (transformers' HqqConfig: nbits in 1, 2, 3, 4, 8; models/hqq.py).
HQQ_BITS = (1, 2, 3, 4, 8)
BNB_4BIT = ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage")


@rule("lora options on a full run")
def _full_with_lora_options(c: RunConfig):
    if c.train.train_type != "full":
        return None
    for k in LORA_ONLY:
        if k in c.explicit:
            return (f"{_flag(k)} needs --train-type lora/qlora (or boft/adalora/bone: an adapter; a full fine-tune "
                    "trains none): drop it, or leave out --train-type full (lora is the default)")
    for k in QUANT_ONLY:
        if k in c.explicit:
            return f"{_flag(k)} needs --train-type lora/qlora (a quantized base cannot be trained in full)"


@rule("batch sizes positive")
def _batch(c: RunConfig):
    for k in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        v = getattr(c.train, k)
        if v <= 0:
            return f"--{k.replace('_', '-')} must be > 0, got {v}"


@rule("steps and epochs")
def _steps(c: RunConfig):
    if c.train.max_steps == 0 or c.train.max_steps < -1:
        return f"--max-steps must be > 0 (or -1 for epochs), got {c.train.max_steps}"
    if c.train.max_skipped_steps < 0:
        return f"--max-skipped-steps must be >= 0, got {c.train.max_skipped_steps}"
    if c.train.max_steps == -1 and not c.train.num_train_epochs > 0:
        return f"--num-train-epochs must be > 0, got {c.train.num_train_epochs}"
    for k in ("logging_steps", "eval_steps"):
        v = getattr(c.train, k)
        if v is not None and v <= 0:
            return f"--{k.replace('_', '-')} must be > 0, got {v}"
    for k in ("save_steps", "save_total_limit"):
        v = getattr(c.checkpoint, k)
        if v is not None and v <= 0:
            return f"--{k.replace('_', '-')} must be > 0, got {v}"


@rule("optimizer ranges")
def _optim(c: RunConfig):
    o = c.optim
    if not 0 <= o.warmup_ratio < 1:
        return f"--warmup-ratio must be in [0, 1), got {o.warmup_ratio}"
    if o.warmup_steps < 0:
        return f"--warmup-steps must be >= 0, got {o.warmup_steps}"
    if o.weight_decay < 0:
        return f"--weight-decay must be >= 0, got {o.weight_decay}"
    if o.max_grad_norm < 0:
        return f"--max-grad-norm must be >= 0, got {o.max_grad_norm}"
    for k in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(o, k) < 1:
            return f"--{k.replace('_', '-')} must be in [0, 1), got {getattr(o, k)}"
    if o.optim_args is not None and o.optimizer != "muonclip":
        return (f"--optim_args {o.optim_args!r}: only --optimizer muonclip reads it; the other optimizers take "
                "--adam-beta1, --adam-beta2, --adam-epsilon and --weight-decay")
    if o.optimizer == "muonclip":
        try:
            muonclip_args(o.optim_args)
        except ValueError as e:
            return f"--optim_args {e}"


@rule("dataset given")
def _dataset(c: RunConfig):
    if not c.data.dataset and not c.data.cached_dataset:
        return ("--dataset is required (a .jsonl/.json/.csv/.parquet file or a saved HF dataset folder), or "
                "--cached_dataset")
    if c.data.dataset_num_proc < 1:
        return f"--dataset-num-proc must be >= 1, got {c.data.dataset_num_proc}"
    if not 0 <= c.data.split_dataset_ratio < 1:
        return f"--split-dataset-ratio must be in [0, 1), got {c.data.split_dataset_ratio}"
    if c.data.val_dataset and c.data.split_dataset_ratio > 0:
        return "--val-dataset and --split-dataset-ratio both given: use one of them"


@rule("world size")
def _world(c: RunConfig):
    pr = c.parallel
    for k in ("nproc_per_node", "nnodes"):
        v = getattr(pr, k)
        if v is not None and v <= 0:
            return f"--{k.replace('_', '-')} must be > 0, got {v}"
    if pr.node_rank is not None and pr.nnodes is not None and not 0 <= pr.node_rank < pr.nnodes:
        return f"--node-rank {pr.node_rank} is out of range for --nnodes {pr.nnodes}"
    if pr.master_port is not None and not 0 < pr.master_port < 65536:
        return f"--master-port must be in 1..65535, got {pr.master_port}"
    if pr.ddp_timeout <= 0:
        return f"--ddp-timeout must be > 0 seconds, got {pr.ddp_timeout}"


@rule("parallel knob ranges")
def _parallel_knobs(c: RunConfig):
    pr = c.parallel
    for k in ("hsdp_shard_size", "forward_prefetch", "backward_prefetch"):
        v = getattr(pr, k)
        if v is not None and v < 1:
            return f"--{k.replace('_', '-')} must be >= 1, got {v}" + (
                " (leave it out for FSDP2's own one-layer overlap)" if "prefetch" in k else "")


@rule("quantization")
def _quant(c: RunConfig):
    q = c.quant.quant_bits
    if c.quant.quant_method == "hqq":
        if c.quant_bits is None:
            return "--quant-method hqq needs --quant-bits (1, 2, 3, 4 or 8), or --train-type qlora (4)"
        if c.quant_bits not in HQQ_BITS:
            return f"--quant-bits with --quant-method hqq must be 1, 2, 3, 4 or 8 (HQQ's bit widths), got {q}"
    elif q is not None and q not in (4, 8):
        return f"--quant-bits must be 4 or 8 (bitsandbytes 4-bit nf4/fp4 or 8-bit LLM.int8), got {q}"
    if c.train.train_type == "full" and q is not None:
        return "--quant-bits needs --train-type lora/qlora (a quantized base cannot be trained in full)"


@rule("hqq options")
def _hqq(c: RunConfig):
    if c.quant.hqq_axis is not None:
        if c.quant.quant_method != "hqq":
            return "--hqq-axis applies to --quant-method hqq"
        if c.quant.hqq_axis not in (0, 1):
            return f"--hqq-axis must be 0 or 1, got {c.quant.hqq_axis}"
    if c.quant.quant_method == "hqq":
        given = [k for k in BNB_4BIT if k in c.explicit]
        if given:
            return f"{_flag(given[0])} is a bitsandbytes option; this run's base is quantized with HQQ (--quant-method hqq)"


@rule("bitsandbytes options")
def _bnb(c: RunConfig):
    q = c.quant
    if q.quant_method == "hqq":
        return None   # _hqq's
    if q.quant_method == "bnb" and c.quant_bits is None:
        return "--quant-method bnb needs --quant-bits 4 or 8 (or --train-type qlora, which means 4)"
    if c.quant_bits != 4:
        for k in BNB_4BIT:
            if k in c.explicit:
                return (f"{_flag(k)} applies to a 4-bit base (--quant-bits 4 or --train-type qlora); "
                        f"this run's base is {'8-bit' if c.quant_bits == 8 else 'not quantized'}")
    dt = c.model.torch_dtype
    for k, what in (("bnb_4bit_compute_dtype", "compute"), ("bnb_4bit_quant_storage", "store the packed weights")):
        v = getattr(q, k)
        if v is not None and dt != "auto" and v != dt:
            return (f"{_flag(k)} {v} differs from --torch-dtype {dt}: the 4-bit layers {what} in --torch-dtype "
                    f"here; drop {_flag(k)} or pass --torch-dtype {v}")


@rule("quantized base and offload")
def _quant_offload(c: RunConfig):
    if c.quant_bits is None:
        return None
    if c.parallel.cpu_offload:
        return ("--cpu-offload with a bitsandbytes-quantized base (--qlora/--quant-bits) is not supported: FSDP "
                "offload moves parameters only, and each quantized layer's quantization state (absmax, codebook) "
                "would stay on the CPU; drop --cpu-offload (the 4-bit base is already a quarter of the size)")
    if c.parallel.compile and c.quant_method == "hqq":
        return ("--compile with an HQQ-quantized base is not available: hqq's layers dequantize in Python on "
                "every call, which swiftlite has not compiled or measured; drop --compile with --quant-method hqq")
    if c.parallel.compile:
        return ("--compile with a bitsandbytes-quantized base: dynamo recompiles every decoder layer around the "
                "4/8-bit matmuls until its recompile limit, then runs them eagerly (minutes of compiling, no "
                "speed-up); drop --compile with --qlora/--quant-bits")


@rule("lora options")
def _lora(c: RunConfig):
    if c.is_peft:
        lc = c.lora
        if lc.lora_rank <= 0:
            return f"--lora-rank must be > 0, got {lc.lora_rank}"
        if not lc.lora_alpha > 0:
            return f"--lora-alpha must be > 0, got {lc.lora_alpha}"
        if not 0 <= lc.lora_dropout < 1:
            return f"--lora-dropout must be in [0, 1), got {lc.lora_dropout}"
        if not lc.target_modules:
            return "--target-modules is empty: give all-linear or module names (q_proj v_proj ...)"


#: --init_weights values (peft's init_lora_weights); pissa_niter_N is PiSSA by N subspace iterations.
INIT_WEIGHTS = ("true", "false", "gaussian", "pissa", "pissa_niter_N", "olora", "loftq", "lora-ga")


@rule("lora variants")
def _lora_variants(c: RunConfig):
    lc = c.lora
    w = lc.init_weights
    if c.train.train_type == "bone":
        return None   # Bone's own values (rules_tuners._bone); LoRA+ is refused with it there
    if w not in INIT_WEIGHTS and not re.fullmatch(r"pissa_niter_\d+", w):
        return (f"--init_weights {w}: not one of {', '.join(INIT_WEIGHTS)} (peft's init_lora_weights; ms-swift's "
                "corda is not available" + ("; bat is --train_type bone's)" if w == "bat" else ")"))
    if w == "loftq" and c.quant_bits != 4:
        return ("--init_weights loftq fits A and B to the quantization error of a 4-bit base (peft's "
                "replace_lora_weights_loftq): it needs --train-type qlora (or --quant-bits 4); on a 16-bit base use "
                "pissa or olora")
    if moves_base(w) and c.quant_bits is not None:
        return (f"--init_weights {w} moves part of each base weight into the adapter and keeps the residual "
                "in the base, which a bitsandbytes-quantized base cannot hold; use --train-type lora "
                "(16-bit base) or --init_weights true")
    if lc.lorap_lr_ratio is not None and not lc.lorap_lr_ratio > 0:
        return f"--lorap_lr_ratio must be > 0, got {lc.lorap_lr_ratio}"
    if (moves_base(w) and task_spec(c.task).own_options == "rlhf"
            and c.rlhf.rlhf_type in ("dpo", "kto", "grpo") and c.rlhf.ref_model is None):
        return (f"--init_weights {w}: the {c.rlhf.rlhf_type} reference is the base with the adapter off, which "
                f"{w} has turned into the residual; give --ref_model (the model itself) or --init_weights true")


@rule("early stopping")
def _early_stop(c: RunConfig):
    n = c.train.early_stop_interval
    if n is None:
        return None
    if n <= 0:
        return f"--early_stop_interval must be > 0, got {n}"
    if not (c.data.val_dataset or c.data.split_dataset_ratio > 0) or c.train.eval_strategy == "no":
        return (f"--early_stop_interval {n} stops when the validation metric stops improving: give validation data "
                "(--val_dataset or --split_dataset_ratio) and leave evaluation on")
    if c.checkpoint.save_strategy == "no":
        return (f"--early_stop_interval {n} counts checkpoints without improvement (ms-swift's rule): it needs "
                "--save_strategy steps")


@rule("dataloader drop_last")
def _drop_last(c: RunConfig):
    if (not c.train.dataloader_drop_last and task_spec(c.task).own_options == "rlhf"
            and c.rlhf.rlhf_type == "grpo"):
        return ("--dataloader_drop_last false: GRPO generates for whole rounds of prompts, and the prompts left "
                "over after the last whole round of an epoch are not used; drop the flag")


@rule("neftune")
def _neftune(c: RunConfig):
    a = c.train.neftune_noise_alpha
    if a is not None and not a >= 0:
        return f"--neftune_noise_alpha must be >= 0, got {a}"


#: torch.utils.checkpoint.checkpoint's keyword arguments (what --gradient-checkpointing-kwargs may set).
CHECKPOINT_KWARGS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop")
#: ms-swift template names look like this; a --template that is not a file and looks like one is a name.
_NAME = re.compile(r"^[A-Za-z][\w-]*$")


@rule("gradient checkpointing options")
def _gc_kwargs(c: RunConfig):
    kw = c.train.gradient_checkpointing_kwargs
    if kw is None:
        return None
    if not c.train.gradient_checkpointing:
        return "--gradient-checkpointing-kwargs needs --gradient-checkpointing true"
    bad = sorted(set(kw) - set(CHECKPOINT_KWARGS))
    if bad:
        return (f"--gradient-checkpointing-kwargs: unknown key {bad[0]!r} (torch.utils.checkpoint takes "
                f"{', '.join(CHECKPOINT_KWARGS)})")


@rule("save and eval strategies")
def _strategies(c: RunConfig):
    ck, t, d = c.checkpoint, c.train, c.data
    # given steps, not the ones job.Resolved.cadence derives from a strategy
    if ck.save_strategy != "steps" and "save_steps" in c.explicit:
        return (f"--save-steps with --save-strategy {ck.save_strategy}: the strategy decides when to save; "
                "drop one of them")
    if t.eval_strategy == "epoch" and "eval_steps" in c.explicit:
        return "--eval-steps with --eval-strategy epoch: the strategy decides when to validate; drop one of them"
    has_val = bool(d.val_dataset) or d.split_dataset_ratio > 0
    if t.eval_strategy == "no" and has_val:
        return ("--eval-strategy no with validation data (--val-dataset / --split-dataset-ratio): drop the "
                "validation data, or validate with --eval-strategy steps/epoch")


@rule("system prompt and template")
def _system_template(c: RunConfig):
    if c.data.system is not None and task_spec(c.task).plain_text:
        return f"--system applies to sft (chat rows); {c.task} trains on plain text"
    tpl = c.model.template
    if tpl and _NAME.match(tpl) and not Path(tpl).is_file() and tpl not in TEMPLATE_NAMES:
        return (f"--template {tpl}: ms-swift template names are not used here (but {', '.join(TEMPLATE_NAMES)}): "
                "conversations are rendered with the tokenizer's own chat template; to override it pass a Jinja "
                "file (--template chat.jinja)")


@rule("resume")
def _resume(c: RunConfig):
    if c.checkpoint.resume_only_model and c.checkpoint.resume == "false" and not c.checkpoint.resume_from:
        return "--resume-only-model needs --resume or --resume-from (the checkpoint whose weights to load)"
    if c.checkpoint.resume != "false" and c.checkpoint.resume_from:
        return "--resume and --resume-from both given: use one of them"


#: GRPO's own RlhfConfig keys (schema.py), besides beta and loss_type.
GRPO_KEYS = ("reward_funcs", "reward_model", "reward_model_plugin", "reward_weights", "num_generations", "max_completion_length", "temperature", "top_p",
             "top_k", "epsilon", "epsilon_high", "num_iterations", "importance_sampling_level", "scale_rewards", "real_tau",
             "log_completions", "log_rollout_offpolicy_metrics", "overlong_filter", "advantage_estimator", "kl_in_reward", "steps_per_generation", "generation_batch_size", "use_vllm", "vllm_mode", *VLLM_KEYS, "cosine_min_len_value_wrong",
             "cosine_max_len_value_wrong", "cosine_min_len_value_correct", "cosine_max_len_value_correct",
             "cosine_max_len", "repetition_n_grams", "repetition_max_penalty", "soft_max_length", "soft_cache_length", *TEACHER_KEYS, *CHORD_KEYS,
             *MULTI_TURN_KEYS, *GRPO_VARIANT_KEYS, *GENERATION_KEYS)
#: RlhfConfig keys (schema.py): `swiftlite rlhf` options, refused elsewhere when given.
RLHF_KEYS = ("rlhf_type", "beta", "loss_type", "rpo_alpha", "label_smoothing", "cpo_alpha", "simpo_gamma",
             "ref_model", "precompute_ref_log_probs", "desirable_weight", "undesirable_weight",
             "center_rewards_coefficient", *GRPO_KEYS, *GKD_KEYS)
#: Which rlhf options each --rlhf_type uses (the others are refused when given, never ignored).
RLHF_USES = {"dpo": {"beta", "loss_type", "rpo_alpha", "label_smoothing", "ref_model", "precompute_ref_log_probs"},
             "orpo": {"beta"},
             "simpo": {"beta", "label_smoothing", "cpo_alpha", "simpo_gamma"},
             "cpo": {"beta", "label_smoothing", "cpo_alpha"},
             "kto": {"beta", "desirable_weight", "undesirable_weight", "ref_model"},
             "rm": {"center_rewards_coefficient"},
             "grpo": {"beta", "loss_type", "ref_model", *GRPO_KEYS},
             # gkd: its own keys and those it shares with GRPO (its vLLM and multi-turn sampling)
             "gkd": {*GKD_KEYS, *GKD_SHARED, "use_vllm", "vllm_mode", *VLLM_KEYS, *MULTI_TURN_KEYS}}


#: rlhf types that take neither --packing nor --padding-free true, and why (dpo, orpo, simpo and cpo take
#: both: rlhf/packing.py).
PACKED_RLHF_REFUSED = {
    "kto": "not available in swiftlite (KTO's rows and their mismatched KL rows are scored in padded batches); "
           "drop the flag",
    "rm": "ms-swift does not support it for reward modelling (the score is read at each row's last token); drop "
          "the flag",
    # --padding_free true is GRPO's packed form (rlhf/generate.token_logps); whole rows packed ahead of time are not
    "grpo": "completions are generated for each prompt as the round runs, so there are no rows to pack ahead; "
            "--padding_free true scores them without padding",
}


@rule("preference options")
def _rlhf(c: RunConfig):
    r = c.rlhf
    given = [k for k in RLHF_KEYS if k in c.explicit]
    from swiftlite.config.schema import SFT_LOSS_TYPES
    if task_spec(c.task).own_options != "rlhf":
        if r.loss_type in SFT_LOSS_TYPES:   # ms-swift's sft/pt loss types: the loss these train with
            given.remove("loss_type")
        elif "loss_type" in given:
            return (f"--loss-type {r.loss_type} is a loss of `swiftlite rlhf`; {c.task} takes "
                    f"{' or '.join(SFT_LOSS_TYPES)} (the token cross-entropy)")
        if given:   # every one named at once
            return (f"{', '.join(map(_flag, given))} {'is an option' if len(given) == 1 else 'are options'} "
                    f"of `swiftlite rlhf` (preference and RL training), not of {c.task}")
        return None
    foreign = [k for k in given if k != "rlhf_type" and k not in RLHF_USES[r.rlhf_type]]
    if foreign:
        return f"{', '.join(map(_flag, foreign))} {'does' if len(foreign) == 1 else 'do'} not apply to --rlhf-type {r.rlhf_type}"
    if r.beta is not None and not (r.beta > 0 or (r.beta == 0 and r.rlhf_type in ("grpo", "gkd"))):
        return f"--beta must be > 0, got {r.beta}" + (" (0: no reference model)" if r.rlhf_type == "grpo" else "")
    if not 0.0 <= r.label_smoothing < 0.5:
        return f"--label-smoothing must be in [0, 0.5), got {r.label_smoothing}"
    if r.label_smoothing and (r.loss_type or "sigmoid") != "sigmoid":
        return f"--label-smoothing applies to the sigmoid loss, not --loss-type {r.loss_type}"
    for k in ("rpo_alpha", "cpo_alpha"):
        v = getattr(r, k)
        if v is not None and v < 0:
            return f"{_flag(k)} must be >= 0, got {v}"
    for k in ("desirable_weight", "undesirable_weight"):
        if not getattr(r, k) > 0:
            return f"{_flag(k)} must be > 0, got {getattr(r, k)}"
    if c.data.packing or (c.data.padding_free and "padding_free" in c.explicit):
        flag = "--packing" if c.data.packing else "--padding-free true"
        why = PACKED_RLHF_REFUSED.get(r.rlhf_type)
        if why and (c.data.packing or r.rlhf_type != "grpo"):
            return f"{flag} with --rlhf-type {r.rlhf_type}: {why}"
    if c.train.loss_impl != "chunked" and "loss_impl" in c.explicit:
        return (f"--loss-impl {c.train.loss_impl} does not apply to rlhf: its log-probs come from the model's "
                "logits at the answer tokens")


@rule("grpo options")
def _grpo(c: RunConfig):
    """ms-swift's GRPO argument checks that need no data, world size or plugin (those are in
    rlhf/grpo_data.py, before any rank starts)."""
    from swiftlite.config.schema import DPO_LOSS_TYPES, GRPO_LOSS_TYPES
    r = c.rlhf
    if task_spec(c.task).own_options != "rlhf":
        return None
    from swiftlite.config.schema import SFT_LOSS_TYPES
    if r.loss_type in SFT_LOSS_TYPES:
        return f"--loss-type {r.loss_type} is a loss of sft and pt, not of rlhf --rlhf-type {r.rlhf_type}"
    if r.rlhf_type != "grpo":
        if r.loss_type in GRPO_LOSS_TYPES:
            return f"--loss-type {r.loss_type} is a GRPO loss; --rlhf-type {r.rlhf_type} takes {', '.join(DPO_LOSS_TYPES)}"
        return None
    if r.loss_type is not None and r.loss_type not in GRPO_LOSS_TYPES:
        return f"--loss-type {r.loss_type} does not apply to GRPO: choose from {', '.join(GRPO_LOSS_TYPES)}"
    why = (teacher_problem(c) or chord_problem(r, c.explicit) or multi_turn_problem(r, c.explicit)
           or _real_problem(c))
    if why:
        return why
    why = reward_weights_problem(r)
    if why:
        return why
    why = _reward_model_problem(r)
    if why:
        return why
    checks = [("max_completion_length", r.max_completion_length >= 1), ("temperature", r.temperature > 0),
              ("top_p", 0 < r.top_p <= 1), ("top_k", r.top_k == -1 or r.top_k >= 1), ("epsilon", r.epsilon >= 0),
              ("epsilon_high", r.epsilon_high is None or r.epsilon_high >= 0), ("num_iterations", r.num_iterations >= 1),
              ("steps_per_generation", r.steps_per_generation is None or r.steps_per_generation >= 1)]
    for k, ok in checks:
        if not ok:
            return f"{_flag(k)} {getattr(r, k)}: out of range"
    ga = c.train.gradient_accumulation_steps
    if r.generation_batch_size is not None and r.steps_per_generation is not None:
        return "--generation-batch-size and --steps-per-generation both size the generation round: give one of them"
    if r.generation_batch_size is not None and r.generation_batch_size < 1:
        return f"--generation-batch-size must be >= 1, got {r.generation_batch_size}"
    if r.steps_per_generation is not None and r.steps_per_generation % ga:
        return (f"--steps-per-generation {r.steps_per_generation} is not a multiple of --gradient-accumulation-steps "
                f"{ga}: an optimizer step would straddle two generation rounds")
    why = vllm_problem(c)
    if why:
        return why
    if c.data.truncation_strategy == "right":
        return "--truncation-strategy right does not apply to GRPO prompts: use left (its default) or delete"
    if "soft_overlong" in r.reward_funcs:
        top = r.soft_max_length or r.max_completion_length
        if r.soft_cache_length is None or not 0 < r.soft_cache_length < top:
            return (f"the soft_overlong reward needs --soft-cache-length between 1 and --soft-max-length - 1 ({top - 1}), "
                    f"got {r.soft_cache_length}")
    return None


@rule("data loading")
def _data_loading(c: RunConfig):
    t = c.train
    if t.dataloader_num_workers < 0:
        return f"--dataloader-num-workers must be >= 0, got {t.dataloader_num_workers}"
    if t.dataloader_prefetch_factor is not None:
        if t.dataloader_num_workers == 0:
            return ("--dataloader-prefetch-factor needs --dataloader-num-workers > 0 (with 0 workers the "
                    "batches are built in the training process, nothing ahead)")
        if t.dataloader_prefetch_factor < 1:
            return f"--dataloader-prefetch-factor must be >= 1, got {t.dataloader_prefetch_factor}"
    d = c.data
    if task_spec(c.task).own_options is not None:   # rlhf (ms-swift's rlhf has no streaming either)
        for flag, on in (("--streaming", d.streaming), ("--lazy-tokenize", d.lazy_tokenize),
                         ("--model-name", bool(d.model_name)), ("--model-author", bool(d.model_author))):
            if on:
                return (f"{flag} applies to sft and pt: `swiftlite {c.task}` tokenizes its samples before "
                        "training (--load-from-cache-file true reuses them); drop the flag")
    if d.lazy_tokenize and d.packing:   # ms-swift: "Packing and lazy_tokenize are incompatible."
        return "--lazy-tokenize with --packing: packs are cut from tokenized rows; drop one of them"
    if d.lazy_tokenize and d.streaming:  # ms-swift: "Streaming and lazy_tokenize are incompatible."
        return "--lazy-tokenize with --streaming: a stream is already tokenized as it is read; drop --lazy-tokenize"
    if d.streaming:   # ms-swift's rules for an iterable dataset (data/stream.py)
        if t.max_steps <= 0:
            return "--streaming needs --max-steps: a stream has no length to count epochs in"
        if d.split_dataset_ratio > 0:
            return ("--streaming with --split-dataset-ratio: a stream cannot hold rows out; give --val-dataset "
                    "instead")
        for flag, v in (("--save-strategy", c.checkpoint.save_strategy), ("--eval-strategy", t.eval_strategy)):
            if v == "epoch":
                return f"{flag} epoch with --streaming: a stream has no epochs; use steps"


#: How many times this process ran the rules (a test checks that one `swiftlite sft` runs them once).
RUNS = {"count": 0}


from swiftlite.config.rules_targets import TARGET_RULES  # noqa: E402,F401  (they join RULES here, in this order)
from swiftlite.config.rules_data import cached_datasets  # noqa: E402,F401  (joins RULES here, after them)
from swiftlite.config.sequence_options import sequence_problem  # noqa: E402
rule("sequence parallelism")(sequence_problem)
from swiftlite.config.rope_options import rope_problem  # noqa: E402
rule("rope scaling")(rope_problem)
from swiftlite.config.rules_tuners import BOFT_KEYS  # noqa: E402,F401  (as rules_targets)
from swiftlite.config.rules_galore import GALORE_OPTIMS  # noqa: E402,F401  (as rules_targets)
from swiftlite.config.rules_gkd import gkd_teacher  # noqa: E402,F401  (as rules_targets)
from swiftlite.config.rules_grpo_variants import grpo_dynamic_sample  # noqa: E402,F401  (as rules_targets)


def validate(cfg: RunConfig, *, check_paths: bool = True, refusals: Refusals | None = None) -> None:
    """Run every rule and refuse with all their reasons at once (one line each: errors.raise_all). A
    rule that cannot judge a config another rule already refused (a value it divides by, say) is
    passed over: the refusals found stand, and the user fixes those first.

    `refusals`: the run's refusals so far (config.load's flag refusals; errors.Refusals): the rules'
    are added to them, and nothing is raised here. A rule that reads a field refused before the rules
    ran is passed over (it would judge the default standing in for the refused value); each rule's
    refusal records the fields it read, which the later stages (preflight) then pass over."""
    RUNS["count"] += 1
    found = refusals if refusals is not None else Refusals(watch=field_reads)
    before = set(found.fields)   # the rules judge each other independently: their own refusals block
    judged: set[str] = set()     # only the later stages
    for _name, fn in RULES:
        with field_reads() as read:
            try:
                msg = fn(cfg)
            except UserError as e:
                msg = str(e)
            except Exception:
                if found:
                    continue
                raise
        if msg and before.isdisjoint(read):
            found.add(msg)
            judged |= read
    found.fields |= judged
    if check_paths and cfg.model.template and not found.blocked(("template",)) \
            and not Path(cfg.model.template).is_file() and cfg.model.template not in TEMPLATE_NAMES:
        found.add(f"--template: file not found: {cfg.model.template}", ("template",))
    for v in cfg.model.new_special_tokens or ():
        if check_paths and v.endswith(".txt") and not Path(v).expanduser().is_file():
            found.add(f"--new_special_tokens {v}: file not found (a value ending in .txt names a file, as in "
                      "ms-swift)", ("new_special_tokens",))
    sysp = cfg.data.system
    if check_paths and sysp and sysp.endswith(".txt") and not found.blocked(("system",)) \
            and not Path(sysp).expanduser().is_file():
        found.add(f"--system {sysp}: file not found (a value ending in .txt names a file, as in ms-swift)", ("system",))
    if refusals is None:
        found.raise_all()
