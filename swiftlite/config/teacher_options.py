"""GRPO's teacher options (on-policy distillation, ms-swift's "OPD-RL": `--teacher_model`,
`--teacher_kl_coef`, `--teacher_deepspeed`), with ms-swift's names and defaults
(swift/arguments/rlhf_args.py TeacherModelArguments, swift/rlhf_trainers/args_mixin.py). A base of
schema.RlhfConfig, kept here so that schema.py stays short; rlhf/teacher.py loads the teacher and
turns its log-probs into per-token advantages, config/rules.py says which combinations run.
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt

#: ms-swift's --teacher_deepspeed preset names (swift/arguments/rlhf_args.py _init_teacher_deepspeed);
#: a .json file is taken too.
TEACHER_DS_PRESETS = ("zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")


@dataclass(kw_only=True)
class TeacherOptions(Section):
    teacher_model: str | None = opt(None, "GRPO, GKD: a frozen teacher (preset, folder or hub id; its tokenizer must "
                                    "be the policy's). GKD distils its next-token distributions. GRPO: each "
                                    "completion token's advantage gets --teacher-kl-coef x (log p_teacher - log "
                                    "p_policy) of the sampled token (on-policy distillation); with it --reward-funcs "
                                    "may be empty and --num-generations 1. The policy's own model with LoRA: the "
                                    "base with the adapter disabled (no second copy).")
    teacher_model_server: str | None = opt(None, "GKD: the teacher behind a server (URL, e.g. http://localhost:8000) "
                                           "of vLLM's OpenAI API: `swiftlite deploy --model M`, ms-swift's `swift "
                                           "deploy`, or `vllm serve M --max-logprobs K`. The run sends each "
                                           "sequence's token ids and distils the teacher's --gkd-logits-topk (needed) "
                                           "most likely tokens at every position; instead of --teacher-model.")
    teacher_kl_coef: float = opt(1.0, "GRPO with --teacher-model: weight of the teacher's per-token log-ratio in "
                                 "the advantages.")
    teacher_deepspeed: str | None = opt(None, "GRPO or GKD with --teacher-model on DeepSpeed: the teacher's own ZeRO config "
                                        "(zero0, zero1, zero2, zero3, zero2_offload, zero3_offload or a JSON file); "
                                        "stage 3 partitions the teacher over the ranks, the others keep a replica. "
                                        "Default: laid out like the policy's reference copy.")


#: The keys above (config/rules.py lists them among GRPO's own).
TEACHER_KEYS = ("teacher_model", "teacher_model_server", "teacher_kl_coef", "teacher_deepspeed")

__all__ = ["TEACHER_DS_PRESETS", "TEACHER_KEYS", "TeacherOptions"]
