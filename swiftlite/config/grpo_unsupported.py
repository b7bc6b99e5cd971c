"""ms-swift's GRPO options (GRPOArgumentsMixin, RolloutTrainerArgumentsMixin, VllmArguments,
GRPOArguments at ms-swift 3602360a) that swiftlite's GRPO does not have, each with the line that says
so and what to use instead; config/msswift_unsupported.py merges them into its table (the options
swiftlite has are RlhfConfig fields, schema.py, and shadow these rows). Import-light, no imports.
"""

from __future__ import annotations

_DP = ("vLLM data parallelism is an option of the rollout server (`swiftlite rollout --data_parallel_size N`: N "
       "copies of its engine), not of the run; a colocated engine is one per process already: drop the flag")
_FLAT = ("the weights always reach the rollout server tensor by tensor over the weight-sync group (NCCL on GPUs, "
         "gloo on CPUs), one bucket being what the flag would change: drop the flag")
_ENGINE = ("is not passed to swiftlite's colocated vLLM engine (the options it takes: docs/rlhf.md \"vLLM\"): drop "
           "the flag")
_VARIANT = ("is an option of a GRPO variant swiftlite does not have (its GRPO: --loss-type grpo, bnpo, dr_grpo, "
            "dapo, real or fipo, --delta, --dynamic-sample; docs/rlhf.md): drop the flag")

#: (reason, names), as config/msswift_unsupported.GROUPS.
GRPO_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (_DP, ("vllm_data_parallel_size",)),
    (_FLAT, ("enable_flattened_weight_sync",)),
    (f"this vLLM option {_ENGINE}",
     ("vllm_disable_cascade_attn", "vllm_disable_custom_all_reduce", "vllm_enable_expert_parallel",
      "vllm_engine_kwargs",
      "vllm_limit_mm_per_prompt", "vllm_mm_processor_cache_gb", "vllm_pipeline_parallel_size", "vllm_quantization",
      "vllm_reasoning_parser", "vllm_speculative_config", "vllm_use_async_engine")),
    ("vLLM gets the merged weights every round (base + B@A x scale), no LoRA adapter inside vLLM: drop the flag",
     ("vllm_max_lora_rank",)),
    (f"this {_VARIANT}",
     ("off_policy_sequence_mask_delta", "rollout_importance_sampling_mode",
      "rollout_importance_sampling_threshold", "advantage_reweight", "tau_pos", "tau_neg",
      "sdar_gate_beta", "sdar_loss_coef",
      "rlsd_lambda", "rlsd_lambda_decay_steps", "rlsd_lambda_warmup_steps", "rlsd_negative_only",
      "rlsd_reweight_clip_range", "teacher_tag_key", "ref_model_sync_steps", "ref_model_mixup_alpha", "sync_ref_model")),
    ("sampling takes --temperature, --top-p and --top-k only: drop the flag", ("min_p",)),
    ("GRPO has no validation yet (the training metrics log every round's rewards): drop the flag",
     ("num_generations_eval",)),
    ("completions go to <output-dir>/completions.jsonl (--log-completions), one line each: drop the flag",
     ("wandb_log_unique_prompts",)),
)

__all__ = ["GRPO_GROUPS"]
