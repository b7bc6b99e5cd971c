"""Every other option of ms-swift's argument dataclasses that swiftlite does not implement, with the
line that says so and what to use instead.

Written by hand from ms-swift's public source at commit 3602360a (2026-08-22): the fields of
`SftArguments`, `PretrainArguments`, `RLHFArguments` and `ExportArguments` with all their bases
(swift/arguments/**, swift/trainers/arguments.py, swift/ray_utils/arguments.py) and the fields of
transformers' `Seq2SeqTrainingArguments` they inherit (transformers 5.24). GRPO's own options
(`GRPOArgumentsMixin`, `RolloutTrainerArgumentsMixin`, `VllmArguments`, `GRPOArguments`) that
swiftlite's GRPO lacks are listed in config/grpo_unsupported.py and merged into this table.

Lookup order (config/load.py, cli/run_flags.py): a RunConfig field first (so an option implemented
later simply shadows its row here), then `config/msswift.NO_MEANING` (options accepted with some
values), then this table, then "unknown option". `tests/unit/test_msswift_refusals.py` walks a copy
of ms-swift's names and checks each gets a field, a NO_MEANING row or a row here. Import-light.
"""

from __future__ import annotations

from swiftlite.config.grpo_unsupported import GRPO_GROUPS

#: The ms-swift source this table was written from.
MSSWIFT_COMMIT = "3602360a56 (2026-08-22)"

_MM = "multimodal models are not supported (text causal LMs only): drop the flag"
_TUNER = "is an option of an ms-swift tuner swiftlite does not have (it trains full, lora, qlora, longlora, boft, adalora, bone, llamapro or adapter): drop the flag"
_GKD = ("an option of a teacher form swiftlite does not have (teacher adapters, CPU offloading of the teacher): "
        "the teacher of --rlhf_type gkd and of GRPO's on-policy distillation is --teacher_model M, a local frozen "
        "copy, or for GKD --teacher_model_server URL (docs/rlhf.md); drop the flag")
_PPO = "PPO (--rlhf_type ppo) is not available: the --rlhf_type choices are in `swiftlite rlhf --help`"
_TEMPLATE = ("ms-swift's Python templates are not used: conversations are rendered with the tokenizer's own chat "
             "template; to change the rendering pass a Jinja file (--template chat.jinja)")
_GEN = "training never generates; generation options belong to `swiftlite infer` (greedy, --max-new-tokens)"
_EVAL_GEN = ("validation is the loss on the validation rows (--val-dataset, --split-dataset-ratio); for generated "
             "answers use `swiftlite infer --dataset FILE --metric exact_match`")
_HUB = "nothing is uploaded: upload the run's folder yourself (huggingface-cli upload REPO DIR)"
_LOG = "logging.jsonl gets a record every --logging-steps steps on rank 0 (the first step included): use --logging-steps"
_DDP = ("DDP's settings are chosen by swiftlite (every parameter takes part, buffers are not broadcast); use "
        "--parallelism to pick the backend")
_QGALORE = ("Q-GaLore (int8 weights and projections, q-galore-torch on bitsandbytes 0.40) is not available; GaLore "
            "without quantization is: drop the Q-GaLore options and keep --use_galore true")
_RAY = "Ray is not used: processes are started by torchrun or forked (--nproc-per-node, --nnodes, --launcher)"
_TP = "tensor parallelism is not available: shard the model with --parallelism fsdp or zero3"
_FREEZE = ("freezing or training parameters by name is not available: --train-type full trains every parameter; "
           "with LoRA, --target-modules picks the adapted layers and --modules-to-save trains modules in full")
_DATA_MAP = ("columns are read by the row formats in docs/usage.md, \"Data\" (messages, conversations, query/response, "
             "instruction/input/output, prompt/chosen/rejected, text); --columns '{\"old\": \"new\"}' renames them")
_PREC = "the dtype is --torch-dtype (bfloat16, float16, float32) for training and validation alike"

#: (reason, names): one reason for each group of ms-swift options.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # swift/arguments/sft_args.py: SwanlabArguments
    ("SwanLab is configured by its own environment variables (SWANLAB_PROJ_NAME, SWANLAB_WORKSPACE, SWANLAB_MODE, "
     "SWANLAB_API_KEY): set those and pass --report-to swanlab",
     ("swanlab_token", "swanlab_project", "swanlab_workspace", "swanlab_exp_name", "swanlab_notification_method",
      "swanlab_webhook_url", "swanlab_secret", "swanlab_sender_email", "swanlab_receiver_email",
      "swanlab_smtp_server", "swanlab_smtp_port", "swanlab_email_language", "swanlab_mode")),
    # swift/arguments/tuner_args.py: TunerArguments
    (_FREEZE, ("freeze_parameters", "freeze_parameters_regex", "freeze_parameters_ratio", "trainable_parameters",
               "trainable_parameters_regex", "target_parameters")),
    (_TUNER, ("fourier_n_frequency", "fourier_scaling", "vera_rank", "vera_projection_prng_key", "vera_dropout",
              "vera_d_initial", "reft_layer_key", "reft_layers",
              "reft_intervention_type", "reft_args")),   # reft_rank is Bone's rank (config/tuner_options.py)
    # swift/arguments/base_args/generation_args.py: GenerationArguments
    (_GEN, ("repetition_penalty", "num_beams", "stream", "logprobs",
            "top_logprobs", "structured_outputs_regex")),
    # data_args.py: DataArguments
    ("validation rows are read in file order (a loss over all of them does not depend on it): drop the flag",
     ("val_dataset_shuffle",)),
    ("several --dataset files are concatenated (each sampled by its own #N): interleaving is not available; "
     "use #N per file to set the mix", ("interleave_prob", "stopping_strategy")),
    ("no shuffle buffer: the training rows are shuffled as a whole (a permutation per epoch seeded by --seed), "
     "and --streaming reads them in file order (which keeps its resume exact): drop the flag",
     ("shuffle_buffer_size",)),
    ("nothing is downloaded for datasets: --dataset takes local files or saved HF dataset folders",
     ("download_mode",)),
    (_DATA_MAP, ("remove_unused_columns", "disable_auto_column_mapping")),
    ("ms-swift's dataset registry is not used: pass the files to --dataset (docs/usage.md, \"Data\")", ("custom_dataset_info",)),
    # template_args.py: TemplateArguments
    (_TEMPLATE, ("norm_bbox", "use_chat_template", "template_backend",
                 "preserve_thinking", "add_non_thinking_prefix", "disable_ignore_empty_think")),
    # model_args.py: ModelArguments
    ("the model's own modules run (transformers' implementation for the architecture): drop the flag",
     ("init_strategy",)),
    ("swiftlite trains causal language models only (no classification heads): drop the flag", ("num_labels", "problem_type")),
    ("one process per GPU (--nproc-per-node); to spread a model over GPUs use --parallelism fsdp or zero3",
     ("max_memory",)),
    ("--model takes a local folder, a preset or a hub id directly", ("local_repo_path",)),
    # base_args.py: BaseArguments
    ("to go on training a LoRA checkpoint use --resume-from CKPT (--resume-only-model for its weights alone); to "
     "train on top of merged weights, `swiftlite export --merge-lora` and pass the folder to --model",
     ("adapters", "use_swift_lora")),
    ("Ascend NPUs are not supported (CUDA/ROCm GPUs and CPU): drop the flag", ("enable_npu_model_patch",)),
    ("a run's options come from flags and --config FILE (YAML/JSON); resume reads the run's args.json itself",
     ("load_args", "load_data_args", "ignore_args_error")),
    ("packing runs in --dataset-num-proc processes", ("packing_num_proc",)),
    ("packs are filled in order to --max-length tokens; other packing strategies are not available",
     ("packing_strategy",)),
    ("hub credentials come from the environment (HF_TOKEN) or `huggingface-cli login`", ("hub_token",)),
    # swift/trainers/arguments.py: TrainArgumentsMixin
    (_MM, ("vit_gradient_checkpointing", "aligner_lr", "vit_lr")),
    (_LOG, ("logging_first_step", "logging_strategy", "log_on_each_node", "logging_nan_inf_filter", "log_level",
            "log_level_replica", "include_num_input_tokens_seen")),
    ("channel losses are not available: the loss is the token cross-entropy (--loss-impl picks how it is "
     "computed; --enable-dft-loss weights it)", ("enable_channel_loss",)),
    ("weights are always written as safetensors: drop the flag", ("safe_serialization",)),
    ("the shard size of an exported model is `swiftlite export --max-shard-size`", ("max_shard_size",)),
    ("token accuracy is not computed: logging.jsonl records the loss, learning rate, gradient "
     "norm and speed; drop the flag",
     ("acc_strategy",)),
    ("rows are not grouped by length; --padding-free (on by default where the model allows it) or --packing "
     "removes the padding that grouping would save", ("group_by_length", "length_column_name",
                                                     "train_sampling_strategy")),
    ("use --num-train-epochs (or --max-steps)", ("max_epochs",)),
    ("training never generates, so nothing is gathered for generation: drop the flag",
     ("ds3_gather_for_generation",)),
    ("HF's per-optimizer target modules are not read: GaLore's are --galore_target_modules (--use_galore); the "
     "other optimizers update every trainable parameter (see --optim)", ("optim_target_modules",)),
    ("embedding training (Matryoshka dims) is not available: swiftlite trains causal LMs; drop the flag", ("mrl_dims",)),
    (_EVAL_GEN, ("eval_metric", "eval_use_evalscope", "eval_dataset", "eval_dataset_args", "eval_limit",
                 "eval_generation_config", "extra_eval_args", "predict_with_generate", "generation_max_length",
                 "generation_num_beams", "generation_config", "sortish_sampler", "include_for_metrics",
                 "batch_eval_metrics", "eval_do_concat_batches", "eval_use_gather_object", "prediction_loss_only",
                 "do_predict")),
    ("training callbacks are not loaded; a plugin (--external_plugins) can register a backend", ("callbacks",)),
    (_QGALORE, ("galore_quantization", "galore_proj_quant", "galore_proj_bits", "galore_proj_group_size",
                "galore_cos_threshold", "galore_gamma_proj", "galore_queue_size")),
    ("checkpoints are written atomically to disk (a partial one is never taken for the latest); flash/async "
     "checkpointing is not available: drop the flag", ("use_flash_ckpt", "enable_jit_checkpoint")),
    # swift/arguments/sft_args.py: SftArguments
    ("ZeRO++'s hpZ partition is set by the zero3pp preset (--parallelism zero3pp) or your DeepSpeed JSON "
     "(zero_hpz_partition_size)", ("zero_hpz_partition_size",)),
    (_TP, ("deepspeed_autotp_size",)),
    # swift/arguments/rlhf_args.py: TeacherModelArguments, PPOArguments, RewardModelArguments, RLHFArguments
    (_GKD, ("teacher_adapters", "teacher_model_type", "teacher_model_revision", "offload_teacher_model")),
    (_PPO, ("num_ppo_epochs", "whiten_rewards", "kl_coef", "cliprange", "vf_coef", "cliprange_value", "gamma", "lam",
            "num_mini_batches", "local_rollout_forward_batch_size", "num_sample_generations", "response_length",
            "missing_eos_penalty")),
    ("a --reward-model is read as its folder (or hub id) is: its config.json's architecture, its tokenizer's chat "
     "template, its weights merged (export an rm run's adapter with `swiftlite export --merge-lora`): drop the flag",
     ("reward_adapters", "reward_model_type", "reward_model_revision", "reward_template")),
    ("the reference model is --ref-model (a preset, folder or hub id) or, by default, the starting weights "
     "(with LoRA: the base with the adapter disabled); merge an adapter into a folder with `swiftlite export "
     "--merge-lora` to use it as the reference", ("ref_adapters", "ref_model_type", "ref_model_revision")),
    ("DPO's loss variants here are --loss-type sigmoid, ipo or hinge (with --rpo-alpha, --label-smoothing); "
     "LD-DPO, DiscoPOP and weighted loss mixes are not available", ("ld_alpha", "discopop_tau", "loss_weights")),
    # swift/arguments/merge_args.py, export_args.py: options of `swift export`
    ("merging is `swiftlite export --ckpt CKPT --merge-lora` after training", ("merge_lora",)),
    ("quantized export (GPTQ/AWQ/bnb/FP8) is not available: `swiftlite export` writes a 16-bit HF folder; quantize "
     "it with the serving engine's own tools", ("quant_n_samples", "quant_batch_size", "group_size")),
    ("ms-swift's export targets are not available: `swiftlite export` writes a 16-bit HF folder (safetensors, "
     "peft adapters as peft writes them)",
     ("to_mcore", "to_hf", "mcore_model", "mcore_adapter",
      "thread_count", "test_convert_precision", "test_convert_dtype", "save_missing_weights", "to_peft_format")),
    ("this option belongs to `swiftlite export` (--to_ollama: a Modelfile next to the exported folder)",
     ("to_ollama",)),
    ("this option belongs to `swiftlite export --to_cached_dataset true` (sft rows; pt rows with "
     "--use_chat_template false)", ("template_mode",)),
    (_HUB, ("hub_private_repo", "commit_message", "hub_strategy", "hub_always_push", "hub_revision")),
    ("`swiftlite export` refuses an existing --output unless --overwrite is given", ("exist_ok",)),
    # swift/ray_utils/arguments.py
    (_RAY, ("use_ray", "ray_exp_name", "device_groups")),
    # transformers' Seq2SeqTrainingArguments (inherited by ms-swift's sft/pt/rlhf arguments)
    ("the loss has no label smoothing (DPO's --label-smoothing is a different thing): drop the flag",
     ("label_smoothing_factor",)),
    (_PREC, ("bf16_full_eval", "fp16_full_eval")),
    ("TF32 matmuls follow torch's default (off for matmuls): set NVIDIA_TF32_OVERRIDE or torch's settings in a "
     "plugin if you need them", ("tf32",)),
    ("activation checkpointing is --gradient-checkpointing (with --gradient-checkpointing-kwargs)",
     ("activation_checkpointing", "activation_checkpointing_kwargs")),
    ("compilation is --compile (torch.compile of each decoder layer, default backend and mode)",
     ("torch_compile", "torch_compile_backend", "torch_compile_mode")),
    ("Liger's kernels are --use-liger-kernel (RMSNorm, RoPE, SwiGLU) and --loss-impl liger (its fused loss); "
     "per-kernel settings are not available", ("liger_kernel_config",)),
    ("the KV cache is never used in training: drop the flag", ("use_cache",)),
    ("swiftlite does not empty the CUDA cache during training: drop the flag", ("torch_empty_cache_steps",)),
    ("the batch size is --per-device-train-batch-size; `swiftlite estimate` says what fits", ("auto_find_batch_size",)),
    ("the console shows one line per logged step; --report-to picks the loggers", ("disable_tqdm",)),
    ("runs are named by their --output-dir (TensorBoard/W&B/SwanLab run name)", ("run_name", "project")),
    ("Trackio is not a logger here: --report-to tensorboard, wandb or swanlab",
     ("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")),
    ("validation starts at --eval-steps / the checkpoints (--eval-strategy); there is no delay or run at step 0",
     ("eval_delay", "eval_on_start")),
    ("validation runs one micro-batch of --per-device-eval-batch-size at a time; drop the flag",
     ("eval_accumulation_steps",)),
    ("checkpoints are written by rank 0 (and each rank's shards of a sharded backend); drop the flag",
     ("save_on_each_node",)),
    ("the final checkpoint is the last step's: pick another by its validation loss in logging.jsonl and pass "
     "it to export --ckpt",
     ("load_best_model_at_end", "restore_callback_states_from_checkpoint")),
    ("--seed fixes data order, weights and dropout; deterministic kernels are torch's "
     "(torch.use_deterministic_algorithms in a plugin)", ("full_determinism",)),
    ("a run uses the GPUs when torch sees one, else the CPU: hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPU",
     ("use_cpu",)),
    ("accelerate is not used: ranks are torch.distributed processes (--parallelism picks the backend)",
     ("accelerator_config", "parallelism_config")),
    ("batches are built in the training process in dataset order of the shuffled permutation: drop the flag",
     ("dataloader_multiprocessing_context", "dataloader_in_order")),
    ("labels are built from the row format (assistant turns for sft, every token for pt): drop the flag",
     ("label_names",)),
    (_DDP, ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph")),
    ("HF Trainer's debug modes are not available; --dry-run prints the plan, logs/ keeps each rank's log",
     ("debug",)),
    ("memory is recorded every run (logs/, the planner's estimate beside the measured peak): drop the flag",
     ("skip_memory_metrics",)),
    ("the command says what runs: sft/pt/rlhf train (validating when given validation data), export and infer "
     "are their own commands: drop the flag", ("do_train", "do_eval")),
    ("set by the launcher (LOCAL_RANK): drop the flag", ("local_rank",)),
    ("the DataLoader workers (--dataloader-num-workers) already live for the whole run (one pass over every "
     "step, all epochs), so there is nothing to keep between epochs: drop the flag",
     ("dataloader_persistent_workers",)),
    ("the loss is always averaged over the target tokens of the global batch (every rank and micro-batch), "
     "which is what this flag asks for: drop the flag", ("average_tokens_across_devices",)),
)

#: ms-swift option name -> the line that refuses it (built from GROUPS).
UNSUPPORTED: dict[str, str] = {name: why for why, names in GROUPS for name in names}
# ms-swift's GRPO options that swiftlite's GRPO does not have (config/grpo_unsupported.py)
UNSUPPORTED.update({name: why for why, names in GRPO_GROUPS for name in names})

#: The options of ms-swift's `swift export` (ExportArguments and its bases, GRPO excluded) that
#: `swiftlite export` refuses: a training option names the run's args.json; the rest use UNSUPPORTED.
EXPORT_FROM_RUN = ("`swiftlite export` reads the run's settings (model, template, dtype, LoRA) from the "
                   "checkpoint's args.json: drop the flag (--base-model overrides the model)")


def refusal(name: str) -> str | None:
    """The reason an ms-swift option is refused, or None when it is not one swiftlite knows of."""
    return UNSUPPORTED.get(name.lstrip("-").replace("-", "_"))


def _distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def misspelling_of(name: str, known: list[str]) -> str | None:
    """The known name `name` is a misspelling of: at most two letters off (one for names under 8
    letters), dashes and underscores folded. Only a typo is a suggestion: a different word that looks
    alike (--use_galore, --use_rslora) is a different option, and ms-swift's own names have their rows."""
    key = name.lstrip("-").replace("-", "_")
    folded = [k.lstrip("-").replace("-", "_") for k in known]
    if key in folded:   # a known name is nobody's typo (--vllm_server_port is not --vllm_server_host)
        return None
    limit = 1 if len(key) < 8 else 2
    best = None
    for k, f in zip(known, folded):
        d = _distance(key, f)
        if d <= limit:
            rank = (d, _distance(name, k))  # a tie goes to the user's own spelling (--lora_rank for --lora_rnak)
            if best is None or rank < best[0]:
                best = (rank, k)
    return best[1] if best else None
