"""GKD's options (`--rlhf_type gkd`, generalized knowledge distillation, Agarwal et al. 2024; ms-swift's
swift/rlhf_trainers/gkd_trainer.py and gkd_loss.py, its names and defaults from swift/arguments/rlhf_args.py).
A base of schema.RlhfConfig, kept here so that schema.py stays short; rlhf/gkd.py trains with them and
`gkd_problem` (config/rules_gkd.py) says which values run. Import-light (no torch).

GKD also reads options it shares with GRPO: --teacher_model (the teacher; none: the student itself, ms-swift's
self-distillation), --teacher_deepspeed, --beta (the JSD interpolation, ms-swift's default 0.5 for gkd),
--temperature (0.9), --max_completion_length (512), --top_p, --top_k, --log_completions, and GRPO's vLLM
options (--use_vllm true --vllm_mode colocate|server: the on-policy completions from GRPO's generators).
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt
from swiftlite.config.multi_turn_options import describe_turns


@dataclass(kw_only=True)
class GkdOptions(Section):
    lmbda: float = opt(0.5, "GKD: the probability that a step trains on completions the student samples for the "
                       "rows' prompts (on-policy) instead of the dataset's responses; drawn once per optimizer step "
                       "from (--seed, step), so every process takes the same branch. 0: the dataset only.")
    sft_alpha: float = opt(0.0, "GKD: add sft_alpha x the student's token cross-entropy on the dataset's responses "
                           "(steps that train on them; not on-policy steps), as ms-swift.")
    seq_kd: bool = opt(False, "GKD: ms-swift's deprecated sequence-level KD (teacher-generated responses), which it "
                       "no longer implements; true is refused (write the teacher's answers into the dataset first "
                       "and train with --lmbda 0).")
    gkd_logits_topk: int | None = opt(None, "GKD: the divergence over the teacher's k most likely tokens at each "
                                      "position (both distributions renormalised over them) instead of the whole "
                                      "vocabulary. Default: the whole vocabulary.")


#: The keys above (config/rules.py's RLHF_USES lists them for gkd).
GKD_KEYS = ("lmbda", "sft_alpha", "seq_kd", "gkd_logits_topk")
#: The options GKD shares with GRPO (schema.RlhfConfig, config/teacher_options.py).
GKD_SHARED = ("beta", "teacher_model", "teacher_model_server", "teacher_deepspeed", "max_completion_length", "temperature", "top_p", "top_k",
              "log_completions", "stop_words")   # and GRPO's vLLM options (config/vllm_options.py): --use_vllm generates there



def describe_gkd(r: object) -> str:
    """What `--dry-run` and the run line say about a GKD run's options."""
    beta = 0.5 if r.beta is None else r.beta
    kind = {0.0: "forward KL", 1.0: "reverse KL"}.get(beta, f"generalized JSD, beta {beta:g}")
    on = (f"on-policy with probability {r.lmbda:g} (completions of up to {r.max_completion_length} tokens)"
          if r.lmbda > 0 else "the dataset's responses only (--lmbda 0)")
    teacher = r.teacher_model or f"the teacher server {r.teacher_model_server}"
    return (f"{kind} to {teacher} at temperature {r.temperature:g}"
            + (f" over its top {r.gkd_logits_topk} tokens" if r.gkd_logits_topk else "")
            + f", {on}" + (f", + {r.sft_alpha:g} x cross-entropy" if r.sft_alpha else "") + describe_turns(r))


__all__ = ["GKD_KEYS", "GKD_SHARED", "GkdOptions", "describe_gkd"]
