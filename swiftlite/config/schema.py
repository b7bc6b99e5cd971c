"""The run configuration's schema: data only, no loading or checking.

`RunConfig` groups kw_only dataclasses, one per concern (`SECTIONS`). Every field is addressable by a
flat name (ms-swift style: ``max_length``, ``lora_rank``), which is what CLI flags and config files
use; the flat names are unique across sections. Each field carries its CLI metadata (`opt`), and
`field_specs()` lists every flat key with its section, type and flags (the CLI builds `--help` and
its flag table from it).

Reading files, flags and env vars into a `RunConfig` is `load.py`; the validation rules are `rules.py`.
Import-light (no torch): the CLI imports this to build `--help`.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from swiftlite.config.access import Sealable, Section, field_reads, opt
from swiftlite.config.chord_options import ChordOptions
from swiftlite.config.data_options import TRUNCATION, DataConfig
from swiftlite.config.galore_options import GaloreOptions
from swiftlite.config.generation_options import GenerationOptions
from swiftlite.config.gkd_options import GkdOptions
from swiftlite.config.grpo_variant_options import GrpoVariantOptions
from swiftlite.config.multi_turn_options import MultiTurnOptions
from swiftlite.config.muonclip_options import MuonClipOptions
from swiftlite.config.quant_options import QuantConfig
from swiftlite.config.rope_options import RopeOptions
from swiftlite.config.sequence_options import SequenceOptions
from swiftlite.config.teacher_options import TeacherOptions
from swiftlite.config.tuner_options import LORA_TYPES, PEFT_TYPES, TunerOptions
from swiftlite.config.vllm_options import VllmOptions
from swiftlite.dtypes import NAMES as _DTYPE_NAMES, normalize as _dtype_name


def _reshard_value(value: Any) -> str:
    """--reshard-after-forward: true/false (any boolean word) or an integer N >= 2 (FSDP2's partial
    resharding to groups of N ranks), kept as "true", "false" or "N" (parallel/fsdp2.py reads it)."""
    from swiftlite.errors import UserError
    s = str(value).strip().lower()
    if s in TRUE_WORDS:
        return "true"
    if s in FALSE_WORDS:
        return "false"
    if s.isdigit() and int(s) >= 2:
        return str(int(s))
    raise UserError(f"--reshard-after-forward {value}: expected true, false or a number of ranks >= 2 "
                    "(FSDP2 reshards each layer to groups of that many ranks after forward)")


def _attn_name(value: Any) -> Any:
    """ms-swift's `flash_attn` (kept there for backward compatibility) is flash_attention_2."""
    return "flash_attention_2" if str(value).strip().lower() == "flash_attn" else value


#: Keys whose values are never written or echoed (hub_token, password, api_key, ...).
SECRET_KEY = re.compile(r"(^|_)token$|secret|password|passwd|api_key|credential", re.IGNORECASE)
#: Words a boolean flag or config value accepts as true / false (case-insensitive).
TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y", "t"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", "n", "f"})

TRAIN_TYPES = ("full", "lora", "qlora", "longlora", "boft", "adalora", "bone", "llamapro", "adapter")
DTYPES = _DTYPE_NAMES  # swiftlite/dtypes.py is the one dtype table
#: transformers' scheduler names (SchedulerType), built by `transformers.get_scheduler` (optim.py);
#: reduce_lr_on_plateau and greedy step on a metric and are refused there with the reason.
SCHEDULERS = ("cosine", "linear", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
              "reduce_lr_on_plateau", "greedy")
STRATEGIES, DPO_LOSS_TYPES = ("steps", "epoch", "no"), ("sigmoid", "ipo", "hinge")
RLHF_TYPES = ("dpo", "orpo", "simpo", "cpo", "kto", "rm", "grpo", "gkd")
#: --optim values (optim.build_optimizer builds each; transformers' OptimizerNames spellings, plus muon).
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "sgd", "adagrad", "rmsprop", "adafactor", "muon")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "real", "fipo")
#: sft/pt --loss-type values (ms-swift's): with a binary --loss-scale both are the token cross-entropy.
SFT_LOSS_TYPES = ("cross_entropy", "loss_scale")


@dataclass(kw_only=True)
class ModelConfig(RopeOptions, Section):   # --rope_scaling, --max_model_len: config/rope_options.py
    model: str = opt("tiny-llama", "Preset name (see `swiftlite models`), local HF folder or hub id.")
    torch_dtype: str = opt("auto", "Parameter and compute dtype (also bfloat16, float16, float32). auto, as in "
                           "ms-swift: the model config's torch_dtype on a GPU (bf16 for current models; bf16 "
                           "for float16 ones too where the GPU has it), fp32 on CPU.", aliases=("--dtype",), choices=(*DTYPES, "auto"), normalize=_dtype_name)
    template: str | None = opt(None, "Chat template: a Jinja file; default the tokenizer's own (ms-swift "
                               "template names such as qwen2_5 do not apply).")
    enable_thinking: bool | None = opt(None, "Hybrid-thinking models (Qwen3's chat template): render with the "
                                       "template's enable_thinking switch set (false: no thinking block). "
                                       "Default: the template's own default. A template without the switch: a "
                                       "one-line notice, nothing changes.")
    trust_remote_code: bool = opt(False, "Allow the model folder's own Python code (off by default).")
    model_revision: str | None = opt(None, "Hub revision (branch, tag or commit) for hub ids.")
    new_special_tokens: list[str] = opt(help="Tokens to add to the tokenizer as special tokens (ms-swift's): each "
                                        "value a token, or a .txt file of whitespace-separated tokens. The "
                                        "embeddings grow to the next multiple of 128 when the tokenizer outgrows "
                                        "them (new rows: transformers' mean resizing, seeded by --seed); LoRA "
                                        "needs --modules-to-save embed_tokens lm_head, where the new rows train "
                                        "and are saved.", factory=list)
    experts_impl: str | None = opt(None, "MoE models: transformers' experts_implementation (grouped_mm, "
                                   "batched_mm or eager; ms-swift's --experts_impl). Default: transformers' "
                                   "choice. A dense model: refused.", choices=("grouped_mm", "batched_mm", "eager"))
    attn_impl: str | None = opt(None, "Attention kernel (transformers' attn_implementation): sdpa, eager, "
                                "flash_attention_2, flash_attention_3 or flex_attention. Default: transformers' "
                                "choice for the model (sdpa where it has it, else eager). "
                                "flash_attention_2/3 need a CUDA GPU and the flash-attn package; "
                                "flex_attention needs torch >= 2.5. ms-swift's flash_attn means flash_attention_2.",
                                choices=("sdpa", "eager", "flash_attention_2", "flash_attention_3",
                                         "flex_attention"), normalize=_attn_name)


@dataclass(kw_only=True)
class LoraConfig(TunerOptions, Section):   # boft_*/adalora_*/reft_rank/llamapro_*: config/tuner_options.py
    lora_rank: int = opt(8, "LoRA rank r.", aliases=("--lora-r",))
    lora_alpha: int = opt(32, "LoRA alpha.")
    lora_dropout: float = opt(0.05, "LoRA dropout.")
    target_modules: list[str] = opt(help="Modules to adapt: all-linear or names (q_proj v_proj ...).",
                                    factory=lambda: ["all-linear"])
    modules_to_save: list[str] = opt(help="Extra modules trained in full and saved with the adapter.", factory=list)
    use_dora: bool = opt(False, "DoRA (peft use_dora): a trained magnitude vector per adapted layer on top of "
                         "LoRA; saved in the adapter, merged by export.")
    use_rslora: bool = opt(False, "rsLoRA (peft use_rslora): scale the adapter by lora_alpha/sqrt(r) instead "
                           "of lora_alpha/r.")
    init_weights: str = opt("true", "LoRA initialisation (peft init_lora_weights): true (A random, B zero), "
                            "false (both random: the adapter starts non-zero), gaussian, pissa or "
                            "pissa_niter_N (principal singular vectors; the base keeps the residual), olora "
                            "(QR; the base keeps the residual), loftq (QLoRA: A and B fitted to the 4-bit "
                            "base's quantization error), lora-ga (ms-swift's LoRA-GA, peft's lora_ga: A and B from "
                            "the gradient of the first training rows, --lora_ga_*). Adapters saved from "
                            "pissa/olora/lora-ga runs are converted to plain LoRA on the original base (peft's "
                            "rank-2r conversion). --train_type bone (peft's MiSS, formerly Bone) takes true "
                            "(block zero), false (random) or bat.", normalize=lambda v: str(v).strip().lower())
    lorap_lr_ratio: float | None = opt(None, "LoRA+: the B matrices (and 1-D adapter tensors) train at "
                                       "learning rate x this ratio (ms-swift: 16 is typical). Default: off.")
    lora_bias: str = opt("none", "Biases trained with the adapter (peft bias): none, or all (every bias of "
                         "the model, saved with the adapter).", choices=("none", "all"))


@dataclass(kw_only=True)
class ParallelConfig(SequenceOptions, Section):   # --sequence_parallel_size: config/sequence_options.py
    parallelism: str = opt("auto", "How to spread the model: auto, single, ddp, fsdp (FSDP2), hsdp, fsdp1, "
                           "zero2, zero2_offload, zero3, zero3pp, zero3_offload, zero3_offload_nvme, or a DeepSpeed "
                           "JSON file (parallel/resolve.py decides; --dry-run shows the choice).",
                           aliases=("--parallelism_type", "--parallelism-type"))
    deepspeed: str | None = opt(None, "DeepSpeed JSON file or preset name (zero2, zero3, ...).")
    fsdp: list[str] | None = opt(None, "ms-swift's --fsdp: the preset fsdp2, a JSON file or text with \"fsdp\" "
                                 "and \"fsdp_config\" (ms-swift's or accelerate's fsdp_-prefixed keys), or HF's "
                                 "option words (full_shard, shard_grad_op, hybrid_shard, offload, auto_wrap); sets "
                                 "--parallelism fsdp/hsdp/fsdp1 and the FSDP options (docs/backends.md, "
                                 "\"ms-swift's --fsdp\").")
    fsdp_config: str | None = opt(None, "HF's --fsdp_config, with --fsdp option words: a JSON file or text of "
                                  "FSDP options (fsdp_version, reshard_after_forward, activation_checkpointing, ...).")
    nproc_per_node: int | None = opt(None, "Processes per node (env NPROC_PER_NODE); >1 starts ranks (see --launcher).")
    nnodes: int | None = opt(None, "Number of nodes (env NNODES).")
    node_rank: int | None = opt(None, "This node's rank (env NODE_RANK).")
    master_addr: str | None = opt(None, "Rendezvous address (env MASTER_ADDR).")
    master_port: int | None = opt(None, "Rendezvous port (env MASTER_PORT); a free one when single-node.")
    rdzv_backend: str | None = opt(None, "torchrun rendezvous backend for elastic runs (e.g. c10d).")
    rdzv_endpoint: str | None = opt(None, "torchrun rendezvous endpoint host:port.")
    rdzv_id: str | None = opt(None, "torchrun rendezvous id.")
    launcher: str = opt("auto", "Launcher for multi-process runs: auto (fork one node's ranks on a CPU build "
                        "of torch, else torchrun), fork, torchrun or deepspeed.",
                        choices=("auto", "fork", "torchrun", "deepspeed"))
    hostfile: str | None = opt(None, "DeepSpeed launcher hostfile (with --launcher deepspeed).")
    mixed_precision: str | None = opt(None, "FSDP's compute dtype (fsdp, hsdp, fsdp1): bf16 or fp16 (gradients reduced "
                                      "in fp32), or none (compute in the parameters' dtype). Default: the 16-bit "
                                      "--torch-dtype (docs/backends.md, Precision).",
                                      choices=("bf16", "fp16", "none"))
    reshard_after_forward: str | None = opt(
        None, "FSDP (fsdp, hsdp, fsdp1): after a layer's forward, true frees its gathered parameters "
        "(all-gathered again in backward, ZeRO-3 style; the default), false keeps them until backward "
        "(no second all-gather, more memory); fsdp/hsdp also take a number N of ranks, a divisor of the "
        "shard group between 2 and its size - 1: FSDP2 reshards to groups of N ranks, so the backward "
        "all-gather stays within N ranks (N = the GPUs per node: ZeRO++ hpZ's idea).", normalize=_reshard_value)
    forward_prefetch: int | None = opt(None, "fsdp/hsdp: all-gather the next N decoder layers while one runs "
                                       "forward (FSDP2 set_modules_to_forward_prefetch; more memory). Default: "
                                       "FSDP2's own overlap of one layer.")
    backward_prefetch: int | None = opt(None, "fsdp/hsdp: all-gather the previous N decoder layers while one runs "
                                        "backward (FSDP2 set_modules_to_backward_prefetch). Default: FSDP2's "
                                        "own prefetch of one layer.")
    cpu_offload: bool = opt(False, "FSDP (fsdp, hsdp, fsdp1): keep params, grads and optimizer state in CPU "
                            "memory (FSDP2's CPUOffloadPolicy, FSDP1's CPUOffload; GPU runs only).")
    hsdp_shard_size: int | None = opt(None, "hsdp: ranks per shard group (each group holds one sharded copy; "
                                      "copies are replicated across groups). Default: the processes per node.")
    zero_quantized_weights: bool = opt(False, "zero3pp: ZeRO++ qwZ, all-gather int8-quantized weights "
                                       "(DeepSpeed's CUDA quantizer kernels: GPU runs only).")
    zero_quantized_gradients: bool = opt(False, "zero3pp: ZeRO++ qgZ, reduce gradients quantized to int4 "
                                         "(DeepSpeed's CUDA quantizer kernels: GPU runs only).")
    sharded_loading: bool = opt(True, "fsdp/hsdp/fsdp1 on 2+ processes: build the model on the meta device, "
                                "shard it, then fill each rank's shards from the safetensors files, so no rank "
                                "holds the whole model (docs/backends.md, Loading at size). false: every rank "
                                "loads the whole model before sharding (more memory; for comparison).")
    compile: bool = opt(False, "torch.compile each decoder layer before wrapping.")
    offload_dir: str | None = opt(None, "NVMe folder for DeepSpeed parameter/optimizer offload.")
    ddp_timeout: int = opt(1800, "Seconds a collective may wait before the job fails (names the rank).")
    dry_run: bool = opt(False, "Print the resolved plan (backend, world, batch, launch command) and exit.")
    external_plugins: list[str] = opt(help="Python files run before anything else (ms-swift's flag); they may "
                                      "register backends (swiftlite.parallel.base.register_backend).",
                                      factory=list)
    pure_bf16: bool = opt(False, "With --torch-dtype bf16: train the bf16 parameters directly, with bf16 "
                          "gradients and AdamW state (8 bytes/param of model state instead of 16), instead "
                          "of fp32 master weights with bf16 compute. Less memory, but every update smaller "
                          "than half of bf16's spacing (0.2% of the weight; lr 1e-5 steps usually are) is "
                          "lost. DeepSpeed: its bf16 master/optimizer-state switches (no optimizer offload).")


@dataclass(kw_only=True)
class OptimConfig(MuonClipOptions, GaloreOptions, Section):   # config/muonclip_options.py, galore_options.py
    learning_rate: float | None = opt(None, "Peak learning rate (default 1e-5 for full, else 1e-4).",
                                      aliases=("--lr",))
    weight_decay: float = opt(0.1, "AdamW weight decay.")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.95, "AdamW beta2.")
    adam_epsilon: float = opt(1e-8, "AdamW epsilon.")
    max_grad_norm: float = opt(1.0, "Clip the global gradient norm to this (0 disables).")
    optim: str = opt("adamw_torch_fused", "Optimizer (HF's names, default as HF's and ms-swift's): adamw_torch_fused "
                     "(torch AdamW, fused kernel where it runs), adamw_torch, sgd, adagrad, rmsprop (elementwise: "
                     "every backend), adafactor (transformers' Adafactor, the schedule's lr), muon (torch.optim.Muon, "
                     "plain LoRA only); adafactor and muon need whole matrices: single/ddp.", choices=OPTIMIZERS)
    optimizer: str | None = opt(None, "ms-swift's optimizer plugin, which takes priority over --optim: muon "
                                "(= --optim muon), galore (= --use_galore true), muonclip (ms-swift's MuonClip: Muon "
                                "with QK-Clip, --optim_args; single/ddp); the other plugins are refused with their "
                                "alternative.", choices=("muon", "galore", "muonclip"))
    lr_scheduler: str = opt("cosine", "Learning-rate schedule: transformers' get_scheduler, the lr of each step "
                            "as HF Trainer's (constant has no warm-up; reduce_lr_on_plateau and greedy are "
                            "refused: they step on a metric).", aliases=("--lr_scheduler_type",
                            "--lr-scheduler-type"), choices=SCHEDULERS)
    warmup_ratio: float = opt(0.0, "Share of steps spent warming up linearly.")
    warmup_steps: int = opt(0, "Warm-up steps (overrides --warmup-ratio when > 0).")
    lr_scheduler_kwargs: dict | str | None = opt(None, "Extra arguments of the schedule, a JSON object as in HF/"
                                                 "ms-swift: '{\"min_lr\": 1e-6}' or '{\"min_lr_rate\": 0.1}' "
                                                 "(cosine_with_min_lr), '{\"num_cycles\": 2}', '{\"power\": 2}'.")


@dataclass(kw_only=True)
class TrainConfig(Section):
    train_type: str = opt("lora", "full, lora, qlora (--full / --lora / --qlora are shorthands), longlora (LoRA "
                          "trained with S2-Attn, groups of --max-length / 4), boft, adalora or bone (peft's BOFT, "
                          "AdaLoRA, MiSS), llamapro (LLaMA-Pro: new blocks), adapter (Houlsby: after each MLP).",
                          aliases=("--tuner_type", "--tuner-type"), choices=TRAIN_TYPES)
    per_device_train_batch_size: int = opt(1, "Micro-batch size per process.", aliases=("--batch-size",))
    per_device_eval_batch_size: int = opt(1, "Batch size per process for validation (ms-swift's 1).")
    gradient_accumulation_steps: int | None = opt(None, "Micro-batches per optimizer step. Default: ms-swift's rule, "
                                                  "ceil(16 / (per-device batch x world size)) and at least 1 (a "
                                                  "global batch of about 16); 1 for --rlhf_type grpo.")
    num_train_epochs: float = opt(3.0, "Epochs to train (ignored when --max-steps > 0); 3 as in ms-swift and HF.")
    max_steps: int = opt(-1, "Optimizer steps to train; -1 means from --num-train-epochs.")
    gradient_checkpointing: bool = opt(True, "Activation checkpointing per decoder layer (on by default, as in "
                                       "ms-swift: --gradient-checkpointing false keeps the activations).")
    gradient_checkpointing_kwargs: dict[str, Any] | None = opt(
        None, "JSON object passed to gradient_checkpointing_enable (torch.utils.checkpoint), e.g. "
        "'{\"use_reentrant\": false}'. Default as ms-swift's: use_reentrant true, false for ddp on 2+ "
        "processes (reentrant keeps nothing of a layer's first forward: bitsandbytes' 4-bit matmul would "
        "keep ZeRO-3's gathered weights otherwise).")
    seed: int = opt(42, "Seed for weights of built-in models, data order, dropout.")
    output_dir: str = opt("output", "Run folder (args.json, logs, checkpoints).")
    add_version: bool = opt(False, "Train in a new <output-dir>/v<N>-<YYYYMMDD-HHMMSS> folder (ms-swift's run "
                            "folders; N one more than the highest there). With --resume true/auto the newest "
                            "vN folder is resumed, so a requeued command continues its run. Default false, "
                            "unlike ms-swift's true: here --output-dir is the run folder that --resume auto, "
                            "the preemption marker (exit 75, then the same command again), export and bench "
                            "name, so a command must mean the same folder every time it runs.")
    logging_steps: int = opt(5, "Log every N optimizer steps.")
    eval_strategy: str | None = opt(None, "When to validate (needs validation data): steps (every --eval-steps), "
                                    "epoch, or no (then give no validation data). Unset: every --eval-steps, else "
                                    "at each checkpoint --save-strategy/--save-steps make, and at the end.",
                                    choices=STRATEGIES)
    eval_steps: int | None = opt(None, "Validate every N steps (default: at --save-steps and the end).")
    report_to: list[str] = opt(help="Loggers besides logging.jsonl (always written): tensorboard, wandb, swanlab, "
                               "all (those installed) or none (the default); wandb and swanlab are extras: "
                               "pip install 'swiftlite[wandb]'.", factory=list)
    nan_policy: str = opt("stop", "A step whose loss or gradient norm is nan/inf is never applied: stop the run "
                          "(naming the step and the last good checkpoint) or skip the step and go on.",
                          choices=("stop", "skip"))
    max_skipped_steps: int = opt(5, "--nan-policy skip: stop after this many non-finite steps in a row.")
    ignore_data_skip: bool = opt(False, "On resume, restart the data order at its first batch instead of skipping "
                                 "the batches already trained on; also lets a run resume on changed data.")
    overwrite_output_dir: bool = opt(False, "Allow a non-empty --output-dir without --resume.")
    neftune_noise_alpha: float | None = opt(None, "NEFTune (transformers' hook on the input embeddings): in "
                                            "training-mode forwards add uniform noise of magnitude alpha/sqrt(L*d) "
                                            "(L the micro-batch's sequence length: padding-free, all its rows "
                                            "together; d the hidden size); validation and export see none. "
                                            "Default: off, as ms-swift/HF (5-15 typical).")
    early_stop_interval: int | None = opt(None, "Early stopping, ms-swift's rule: after each checkpoint, if the "
                                          "best --metric-for-best-model seen so far has not improved since the "
                                          "previous checkpoint, count one; stop (the checkpoint just saved is "
                                          "the last) when the count reaches this. Validation runs at "
                                          "--eval-steps, so set it equal to --save-steps. Default: off.")
    metric_for_best_model: str | None = opt(None, "Validation metric that is tracked as best_metric / "
                                            "best_model_checkpoint in trainer_state.json and drives "
                                            "--early-stop-interval: loss (eval_loss) or another eval_ key the "
                                            "command logs (rlhf: rewards/accuracies, ...). Default: loss, as "
                                            "ms-swift.")
    greater_is_better: bool | None = opt(None, "Whether a larger --metric-for-best-model is better. Default, as "
                                         "ms-swift: false when the metric's name contains 'loss', else true.")
    loss_impl: str = opt("chunked", "How the loss is computed. chunked (default, exact, any device): logits "
                         "only for target tokens, lm_head + cross-entropy chunk by chunk, never the full "
                         "tokens x vocab logits; liger: Liger's fused linear cross-entropy (GPU, pip install "
                         "'swiftlite[liger]'); cce: Cut Cross-Entropy (GPU, 'swiftlite[cce]'); plain: full "
                         "logits in fp32, then cross-entropy (the most memory).",
                         choices=("chunked", "liger", "cce", "plain"))
    loss_chunk_tokens: int = opt(0, "Tokens per chunk of --loss-impl chunked (0: auto, ~64 MiB of fp32 "
                                 "logits per chunk, at least 128).")
    router_aux_loss_coef: float = opt(0.0, "MoE models: add coef x the router's load-balancing loss (the model's own "
                                      "load_balancing_loss_func) to each micro-batch's loss, weighted by its share "
                                      "of the step's target tokens, in training and validation (ms-swift's rule); "
                                      "0 (ms-swift's default): off. sft and pt; a dense model: refused.")
    enable_dft_loss: bool = opt(False, "DFT (Dynamic Fine-Tuning, ms-swift's): each target token's cross-entropy "
                                "weighted by the model's probability of that token (detached), in training and "
                                "validation; sft and pt; --loss-impl chunked or plain.")
    use_liger_kernel: bool = opt(False, "Liger's RMSNorm, RoPE and SwiGLU kernels (GPU, 'swiftlite[liger]'); "
                                 "the loss stays --loss-impl's.")
    dataloader_num_workers: int = opt(1, "torch DataLoader worker processes that build (collate) each step's "
                                      "micro-batches ahead of the step: the same batches in the same order as "
                                      "0 (built in the training process). Default 1, ms-swift's (off Windows).")
    dataloader_pin_memory: bool = opt(True, "Page-locked host memory for the built batches (faster copies to "
                                      "the GPU; on a machine without CUDA there is nothing to pin and it does "
                                      "nothing). Default true, as in ms-swift/HF.")
    dataloader_prefetch_factor: int | None = opt(None, "Steps each DataLoader worker builds ahead. Default: 2 "
                                                 "when --dataloader-num-workers > 0, as in ms-swift.")
    dataloader_drop_last: bool = opt(True, "true: an epoch is floor(rows / global batch) steps, the rows left "
                                     "over are not trained that epoch. false: one step more, its global batch "
                                     "filled up with the epoch's first rows (as accelerate fills the last batch "
                                     "across processes), so every step has a full global batch. Default true, "
                                     "unlike ms-swift/HF's false: the order of runs and checkpoints made before "
                                     "this flag stays the same.")


@dataclass(kw_only=True)
class CheckpointConfig(Section):
    save_strategy: str = opt("steps", "When to save: steps (every --save-steps), epoch, or no (the final "
                             "checkpoint only). The last step is always saved.", choices=STRATEGIES)
    save_steps: int | None = opt(500, "Save a checkpoint every N steps (always at the end); 500 as in ms-swift.")
    save_total_limit: int | None = opt(None, "Keep at most N checkpoints (the newest; never the last good).")
    save_hf_model: bool = opt(True, "Also write an HF model folder (full) or peft adapter in each checkpoint (adapter: none).")
    save_only_model: bool = opt(False, "Checkpoints without the optimizer, LR-schedule and RNG states (the weights' "
                                "shards, the data position, and model/ or adapter/): smaller, but --resume of one "
                                "continues at its step with fresh AdamW moments and the LR schedule from its "
                                "start (as ms-swift). Torch backends only: a DeepSpeed checkpoint holds the "
                                "weights inside its optimizer partitions.")
    resume: str = opt("false", "Resume from the newest good checkpoint in --output-dir: true (one must exist, "
                      "as in HF), auto (resume when one exists, start fresh when none does: requeued jobs), "
                      "or false.", choices=("false", "true", "auto"))
    save_on_signal: bool = opt(True, "On SIGTERM/SIGUSR1/SIGINT finish the step, save a checkpoint, write "
                               "<output-dir>/preempted and exit with code 75 (requeue, then --resume auto).")
    resume_from: str | None = opt(None, "Resume from this checkpoint folder.",
                                  aliases=("--resume_from_checkpoint", "--resume-from-checkpoint"))
    resume_only_model: bool = opt(False, "With --resume/--resume-from: load only the checkpoint's model weights; "
                                  "the optimizer, LR schedule and data order start fresh at step 0, and the check "
                                  "that the data and run shape are unchanged is skipped (ms-swift's flag, as before "
                                  "ms-swift 3.7 or with its --ignore_data_skip true; 3.7+ keeps the step by default).")


@dataclass(kw_only=True)
class RlhfConfig(VllmOptions, TeacherOptions, ChordOptions, MultiTurnOptions, GkdOptions, GrpoVariantOptions,
                 GenerationOptions):
    """`swiftlite rlhf` only (ms-swift's names; bases: config/*_options.py); refused in sft/pt (rules.py)."""
    rlhf_type: str = opt("dpo", "Preference method: dpo or kto (unpaired rows with a label; both with a reference "
                         "model), orpo, simpo or cpo (none); rm (a reward model: a score head on the pairs); "
                         "grpo (online: completions scored by --reward-funcs); gkd (distilling --teacher-model).",
                         choices=RLHF_TYPES)
    beta: float | None = opt(None, "DPO's KL strength / ORPO's odds-ratio weight / SimPO's and CPO's reward scale / "
                             "GRPO's KL weight (0: no reference model) / GKD's JSD interpolation in [0, 1]. "
                             "Default: 2.0 for simpo, 0.04 for grpo, 0.5 for gkd, 0.1 otherwise (ms-swift's).")
    loss_type: str | None = opt(None, "DPO loss: sigmoid (default), ipo (on per-token mean log-ratios, as TRL) or "
                                "hinge. GRPO loss aggregation: grpo (default, ms-swift's), bnpo, dr_grpo, dapo, real "
                                "(REAL) or fipo (FIPO) "
                                "(docs/rlhf.md). sft/pt: cross_entropy or loss_scale, both the sum of weight x "
                                "cross-entropy over --loss-scale's targets / their number (weight 1 unless a "
                                "weighted scale).",
                                choices=DPO_LOSS_TYPES + GRPO_LOSS_TYPES + SFT_LOSS_TYPES)
    rpo_alpha: float | None = opt(None, "DPO: add rpo_alpha x the chosen answers' token-mean NLL (RPO). Default: off.")
    label_smoothing: float = opt(0.0, "DPO sigmoid / SimPO / CPO: probability that a pair's preference is flipped "
                                 "(conservative DPO), in [0, 0.5).")
    cpo_alpha: float = opt(1.0, "SimPO / CPO: weight of the chosen answers' token-mean NLL added to the loss.")
    simpo_gamma: float = opt(1.0, "SimPO: target reward margin gamma.")
    desirable_weight: float = opt(1.0, "KTO: weight of the desirable rows' losses (to balance the labels).")
    undesirable_weight: float = opt(1.0, "KTO: weight of the undesirable rows' losses.")
    center_rewards_coefficient: float | None = opt(None, "RM: add this x mean((r_chosen + r_rejected)^2) to the loss "
                                                   "(rewards centred on 0; ms-swift suggests 0.01). Default: off.")
    ref_model: str | None = opt(None, "DPO/KTO reference model (preset, folder or hub id). Default: the starting weights "
                                "(LoRA/QLoRA: the base with the adapter disabled, no second copy).")
    precompute_ref_log_probs: bool = opt(False, "DPO: compute the reference log-probs of every pair in one pass "
                                         "before training (kept per row, saved in checkpoints) instead of a reference "
                                         "forward each step.")
    # GRPO (--rlhf_type grpo): ms-swift's names and defaults (swift/rlhf_trainers/args_mixin.py, rlhf_args.py).
    reward_funcs: list[str] = opt(help="GRPO: reward functions, built-in (accuracy, format, cosine, repetition, "
                                  "soft_overlong) or registered in `orms` by an --external-plugins file.",
                                  factory=list)
    reward_model: list[str] | None = opt(None, "GRPO: reward models (one-output classifiers; docs/rlhf.md).")
    reward_model_plugin: list[str] | None = opt(None, "GRPO, per --reward-model: default, genrm, or a plugin's.")
    reward_weights: list[float] | None = opt(None, "GRPO: one weight per reward function, then per reward model.")
    num_generations: int = opt(8, "GRPO: completions sampled per prompt (the group size G); at least 2.")
    max_completion_length: int = opt(512, "GRPO, GKD: most tokens generated per completion.")
    temperature: float = opt(0.9, "GRPO, GKD: sampling temperature (also divides the logits the loss scores).")
    top_p: float = opt(1.0, "GRPO, GKD: nucleus sampling mass (1: off).")
    top_k: int = opt(-1, "GRPO, GKD: sample among the k most likely tokens (-1: off).")
    epsilon: float = opt(0.2, "GRPO: lower clipping range of the token ratio (1 - epsilon).")
    epsilon_high: float | None = opt(None, "GRPO: upper clipping range (1 + epsilon_high; DAPO's clip-higher). "
                                     "Default: --epsilon.")
    num_iterations: int = opt(1, "GRPO: optimizer passes over each generation round (mu in the GRPO paper).")
    importance_sampling_level: str = opt("token", "GRPO: the importance ratio per token (token), per completion "
                                         "(sequence: GSPO, the mean token log-ratio), or GSPO-token (sequence_token: "
                                         "the completion's ratio with each token's gradient).",
                                         choices=("token", "sequence", "sequence_token"))
    scale_rewards: str | None = opt(None, "GRPO: divide the advantages by the reward std of the group (group), of "
                                    "the whole generation batch (batch), or not at all (none). Default, ms-swift's: "
                                    "group for --advantage-estimator grpo, none for rloo, batch for "
                                    "reinforce_plus_plus.", choices=("group", "batch", "none"))
    advantage_estimator: str = opt("grpo", "GRPO: the advantage of a completion, ms-swift's: grpo (its reward minus "
                                   "the group mean), rloo (minus the mean of the group's other completions), "
                                   "reinforce_plus_plus (minus the group mean, then scaled by the advantages' own "
                                   "std).", choices=("grpo", "rloo", "reinforce_plus_plus"))
    kl_in_reward: bool | None = opt(None, "GRPO: subtract beta x each completion's KL to the reference (the sum "
                                    "over its tokens of log p_policy - log p_ref at sampling) from its reward, "
                                    "instead of beta x the k3 KL in the loss. Default, ms-swift's: false for grpo, "
                                    "true for rloo and reinforce_plus_plus.")
    real_tau: float = opt(0.5, "GRPO --loss-type real (REAL): the temperature of its group loss (docs/rlhf.md).")
    overlong_filter: bool = opt(False, "GRPO: leave the completions cut at --max-completion-length (no EOS) out "
                                "of the loss and its metrics (their tokens masked; their rewards still shape the "
                                "group's advantages, and dapo's normalizer still counts them, as ms-swift).")
    log_completions: bool = opt(False, "GRPO, GKD: write every sampled completion to <output-dir>/completions."
                                "jsonl (step, prompt, completion; GRPO: rewards, advantage).")
    log_rollout_offpolicy_metrics: bool = opt(False, "GRPO: log rollout_correction/* (ms-swift's): the sampling "
                                              "log-probs (vLLM's or generate's) against the training policy's.")
    steps_per_generation: int | None = opt(None, "GRPO: micro-batch steps served by one generation round (its "
                                           "size is per-device x processes x this many completions). Default: "
                                           "--gradient-accumulation-steps (one round per optimizer step).")
    generation_batch_size: int | None = opt(None, "GRPO: completions per generation round (ms-swift's); sets the "
                                            "steps per generation to it / (per-device x processes). Give this or "
                                            "--steps-per-generation.")
    use_vllm: bool = opt(False, "GRPO, GKD: generate with vLLM (colocate: the vllm package and a GPU; otherwise "
                         "transformers' generate is used).")
    vllm_mode: str | None = opt(None, "GRPO, GKD with --use-vllm: colocate (vLLM in the training processes) or server "
                                "(a `swiftlite rollout` server).", choices=("colocate", "server"))
    cosine_min_len_value_wrong: float = opt(-0.5, "cosine reward: value of a wrong answer of length 0.")
    cosine_max_len_value_wrong: float = opt(0.0, "cosine reward: value of a wrong answer of the longest length.")
    cosine_min_len_value_correct: float = opt(1.0, "cosine reward: value of a correct answer of length 0.")
    cosine_max_len_value_correct: float = opt(0.5, "cosine reward: value of a correct answer of the longest length.")
    cosine_max_len: int | None = opt(None, "cosine reward: the longest length (default --max-completion-length).")
    repetition_n_grams: int = opt(3, "repetition reward: n-gram size.")
    repetition_max_penalty: float = opt(-1.0, "repetition reward: the penalty of a completion that is all repeats.")
    soft_max_length: int | None = opt(None, "soft_overlong reward: L_max (default --max-completion-length).")
    soft_cache_length: int | None = opt(None, "soft_overlong reward: L_cache, the penalised margin below "
                                        "--soft-max-length (required by soft_overlong).")


@dataclass(kw_only=True)
class RunConfig(Sealable):
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rlhf: RlhfConfig = field(default_factory=RlhfConfig)
    # Where the run came from ("sft", "pt" or "rlhf"); set by the command, not a flag.
    task: str = "sft"
    #: The flat keys the user set (config file or flags), as load_config saw them; not a field, so
    #: args.json does not hold it. Rules use it for "given explicitly" (LoRA flags on a full run).
    explicit: ClassVar[frozenset[str]] = frozenset()

    def seal(self) -> "RunConfig":
        """Make this config and its sections read-only (job.resolve_run's output); returns it."""
        for sec in SECTIONS:
            getattr(self, sec).__dict__["_sealed"] = True
        self.__dict__["_sealed"] = True
        return self

    @property
    def sealed(self) -> bool:
        return bool(self.__dict__.get("_sealed"))

    def with_values(self, **flat: Any) -> "RunConfig":
        """A copy with these flat fields replaced (a derived config: the reference model's, a resolved
        run's), as sealed as this one. Sections not named are shared, which is safe once sealed."""
        specs = field_specs()
        if not self.sealed:   # an open config: a deep copy, so that no section is shared with a writer
            import copy
            new = copy.deepcopy(self)
            for k, v in flat.items():
                setattr(getattr(new, specs[k].section), k, v)
            return new
        changes: dict[str, dict[str, Any]] = {}
        for k, v in flat.items():
            changes.setdefault(specs[k].section, {})[k] = v
        new = dataclasses.replace(self, **{s: dataclasses.replace(getattr(self, s), **c) for s, c in changes.items()})
        new.explicit = self.explicit
        return new.seal() if self.sealed else new

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (what args.json holds)."""
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Flat name -> value, the form flags and config files use."""
        out: dict[str, Any] = {}
        for sec in SECTIONS:
            for f in dataclasses.fields(getattr(self, sec)):
                out[f.name] = getattr(getattr(self, sec), f.name)
        return out

    @property
    def is_peft(self) -> bool:
        """A peft adapter on a frozen base (LoRA, QLoRA, BOFT, AdaLoRA, Bone): saved as adapter/, merged by export."""
        return self.train.train_type in PEFT_TYPES

    @property
    def is_lora(self) -> bool:
        """peft's LoRA adapter (lora, qlora): what the LoRA variants (DoRA, PiSSA, LoRA+, LoftQ) act on."""
        return self.train.train_type in LORA_TYPES

    @property
    def quant_method(self) -> str | None:
        """Who quantizes the base: "hqq" (--quant-method hqq), "bnb" (any other quantized run), None."""
        return None if self.quant_bits is None else ("hqq" if self.quant.quant_method == "hqq" else "bnb")

    @property
    def quant_bits(self) -> int | None:
        """Bits of the quantized base: --quant-bits, else 4 for --train-type qlora, else None
        (the one place that says "qlora means 4 bits")."""
        if self.quant.quant_bits is not None:
            return self.quant.quant_bits
        return 4 if self.train.train_type == "qlora" else None

    @property
    def learning_rate(self) -> float:
        if self.optim.learning_rate is not None:
            return self.optim.learning_rate
        return 1e-5 if self.train.train_type == "full" else 1e-4   # ms-swift: 1e-5 for full, else 1e-4


SECTIONS = ("model", "lora", "quant", "data", "parallel", "optim", "train", "checkpoint", "rlhf")


def section_classes() -> dict[str, type]:
    """Section name -> its dataclass (ModelConfig, LoraConfig, ...)."""
    hints = typing.get_type_hints(RunConfig)
    return {s: hints[s] for s in SECTIONS}


@dataclass(frozen=True)
class FieldSpec:
    """One flat config key: its section, type and CLI metadata."""
    name: str
    section: str
    type: Any
    default: Any
    help: str
    aliases: tuple[str, ...]
    choices: tuple
    cli: bool
    normalize: Callable[[Any], Any] | None = None

    @property
    def base_type(self) -> Any:
        """The type without Optional (int | None -> int)."""
        t = self.type
        if typing.get_origin(t) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(t) if a is not type(None)]
            return args[0]
        return t

    @property
    def is_switch(self) -> bool:
        """A flag that may stand alone (`--packing`, `--resume`): a bool, or a word field whose
        choices include true and false (`--resume auto`)."""
        return self.base_type is bool or {"true", "false"} <= set(self.choices)

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.base_type) is list

    @property
    def is_dict(self) -> bool:
        return typing.get_origin(self.base_type) is dict or self.base_type is dict

    @property
    def flags(self) -> list[str]:
        """Both spellings (``--max-length`` and ``--max_length``) plus aliases."""
        return list(dict.fromkeys([f"--{self.name.replace('_', '-')}", f"--{self.name}", *self.aliases]))


def field_specs() -> dict[str, FieldSpec]:
    """Every flat config key, in section order."""
    specs: dict[str, FieldSpec] = {}
    for sec, cls in section_classes().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            specs[f.name] = FieldSpec(
                name=f.name, section=sec, type=hints[f.name], default=default,
                help=f.metadata.get("help", ""), aliases=tuple(f.metadata.get("aliases", ())),
                choices=tuple(f.metadata.get("choices", ())), cli=f.metadata.get("cli", True),
                normalize=f.metadata.get("normalize"))
    return specs
