"""GKD's rules (`--rlhf_type gkd`: config/gkd_options.py, rlhf/gkd.py): ms-swift's value ranges and what this
implementation runs. A rule of config/rules.py's table, kept here so that module stays short. Import-light."""

from __future__ import annotations

from swiftlite.config.rule_table import rule
from swiftlite.config.schema import RunConfig
from swiftlite.config.tasks import task_spec



def gkd_run(c: RunConfig) -> bool:
    return task_spec(c.task).own_options == "rlhf" and c.rlhf.rlhf_type == "gkd"


@rule("gkd teacher")
def gkd_teacher(c: RunConfig) -> str | None:
    r = c.rlhf
    if r.teacher_model_server is not None:   # rlhf/teacher_server.py; ms-swift's rules
        if not gkd_run(c):
            return ("--teacher-model-server: a teacher server is GKD's here (--rlhf-type gkd); GRPO's on-policy "
                    "distillation scores with a local --teacher-model")
        if r.teacher_model is not None:
            return "--teacher-model and --teacher-model-server: one teacher, local or served (ms-swift refuses both)"
        if r.gkd_logits_topk is None:
            return ("--teacher-model-server needs --gkd-logits-topk K: a server returns the teacher's K most likely "
                    "tokens at each position (its --max_logprobs at least), not whole distributions")
        if r.teacher_deepspeed is not None:
            return "--teacher-deepspeed lays out a local teacher; a served one has none: drop it"
        if not r.teacher_model_server.startswith(("http://", "https://")):
            return f"--teacher-model-server {r.teacher_model_server}: a URL (http://host:port)"
        return None
    if not gkd_run(c) or r.teacher_model is not None:
        return None
    return ("--rlhf-type gkd needs --teacher-model (the model to distil: a preset, folder or hub id sharing the "
            "student's tokenizer; the student's own --model with LoRA is its base with the adapter disabled) or "
            "--teacher-model-server URL. ms-swift's teacher-less self-distillation (the policy as its own teacher "
            "on the rows' teacher_prompt) is not here; OPSD with --teacher-model reads the teacher_prompt column")


@rule("gkd values")
def gkd_values(c: RunConfig) -> str | None:
    if not gkd_run(c):
        return None
    r = c.rlhf
    if r.beta is not None and not 0.0 <= r.beta <= 1.0:
        return (f"--beta {r.beta:g}: GKD's beta interpolates the divergence (0: forward KL(teacher || student), 1: "
                "reverse KL, between: the generalized JSD); give a value in [0, 1]")
    if not 0.0 <= r.lmbda <= 1.0:
        return f"--lmbda {r.lmbda:g}: the on-policy probability, in [0, 1]"
    if r.sft_alpha < 0:
        return f"--sft-alpha must be >= 0, got {r.sft_alpha:g}"
    if r.gkd_logits_topk is not None and r.gkd_logits_topk < 1:
        return f"--gkd-logits-topk must be >= 1, got {r.gkd_logits_topk}"
    if not r.temperature > 0:
        return f"--temperature must be > 0, got {r.temperature:g} (it divides both models' logits)"
    if r.lmbda > 0 and r.max_completion_length < 1:
        return (f"--max-completion-length must be >= 1 for on-policy steps (--lmbda {r.lmbda:g}), got "
                f"{r.max_completion_length}")
    return None


@rule("gkd seq_kd")
def gkd_seq_kd(c: RunConfig) -> str | None:
    if not gkd_run(c) or not c.rlhf.seq_kd:
        return None
    return ("--seq-kd true: sequence-level KD (responses the teacher generates while training) is deprecated and "
            "not implemented in ms-swift either; write the teacher's answers into the dataset (`swiftlite infer "
            "--model TEACHER --dataset D --result-path new.jsonl`) and train on it with --lmbda 0")


@rule("gkd generation")
def gkd_generation(c: RunConfig) -> str | None:
    if not gkd_run(c):
        return None
    from swiftlite.config.multi_turn_options import multi_turn_problem   # GRPO's turns, GRPO's rules
    why = multi_turn_problem(c.rlhf, c.explicit)
    if why:
        return why
    if c.rlhf.multi_turn_scheduler is not None and c.rlhf.lmbda == 0:
        return (f"--multi-turn-scheduler {c.rlhf.multi_turn_scheduler} with --lmbda 0: no step samples completions "
                "to continue; give --lmbda > 0 or drop the scheduler")
    from swiftlite.config.rules_vllm import vllm_problem   # --use_vllm: GRPO's engines, GRPO's rules
    return vllm_problem(c)


@rule("gkd layout")
def gkd_layout(c: RunConfig) -> str | None:
    if not gkd_run(c):
        return None
    r = c.rlhf
    if c.data.streaming:
        return "--streaming with --rlhf-type gkd: GKD reads its rows by index; drop --streaming"
    if c.data.packing and r.lmbda > 0:
        return (f"--packing with --lmbda {r.lmbda:g}: an on-policy step replaces each row's response by a sampled one "
                "of another length, so rows cannot be packed ahead; use --padding-free true, or --lmbda 0")
    from swiftlite.config.rules_teacher import teacher_ds_problem
    return teacher_ds_problem(c)


__all__ = ["gkd_generation", "gkd_layout", "gkd_run", "gkd_seq_kd", "gkd_teacher", "gkd_values"]
