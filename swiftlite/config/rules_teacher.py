"""The rules of GRPO's teacher options (config/teacher_options.py; rlhf/teacher.py): what a teacher
changes in GRPO's own rules (rewards and groups become optional, as in ms-swift's OPD-RL) and where
--teacher_deepspeed applies. Called by config/rules.py's GRPO rule. Import-light (no torch)."""

from __future__ import annotations

from pathlib import Path

from swiftlite.config.multi_turn_options import gym_on
from swiftlite.config.schema import RunConfig
from swiftlite.config.teacher_options import TEACHER_DS_PRESETS


def is_deepspeed_run(c: RunConfig) -> bool:
    """The run asked for DeepSpeed by name (--deepspeed, a zero* preset or a DeepSpeed JSON)."""
    p = c.parallel.parallelism or ""
    return bool(c.parallel.deepspeed) or p.startswith("zero") or p.endswith(".json")


def same_model(cfg: RunConfig) -> bool:
    """--teacher_model names the run's own --model (the same string, or the same local folder): with
    LoRA the teacher is then the policy's base with the adapter disabled (rlhf/teacher.py)."""
    t, m = cfg.rlhf.teacher_model, cfg.model.model
    if t is None:
        return False
    if t == m:
        return True
    try:
        return Path(t).exists() and Path(t).expanduser().resolve() == Path(m).expanduser().resolve()
    except OSError:
        return False


#: GRPO without anything to score its completions
NO_REWARDS = ("--rlhf-type grpo needs --reward-funcs (built-in: accuracy, format, cosine, repetition, soft_overlong), "
              "--reward-model, --use-gym-env (a gym scheduler's environment rewards) or --teacher-model (on-policy "
              "distillation)")


def teacher_problem(c: RunConfig) -> str | None:
    """GRPO's reward/group rules with or without --teacher_model, and --teacher_deepspeed's place."""
    r = c.rlhf
    if r.teacher_model is None:
        if not r.reward_funcs and not r.reward_model and not gym_on(r) and not (r.use_vllm and
                                                                           r.vllm_mode == "server"):
            # (in --vllm-mode server the rollout server may give gym rewards: asked before launch, server_turns.py)
            return NO_REWARDS
        if r.num_generations < 2:
            return (f"--num-generations {r.num_generations}: GRPO needs at least 2 completions per prompt (the "
                    "advantages are relative to the group); 1 is for on-policy distillation (--teacher-model)")
        for k in ("teacher_deepspeed", "teacher_kl_coef"):
            if k in c.explicit:
                return f"--{k.replace('_', '-')} applies to --teacher-model (on-policy distillation): drop it"
        return None
    if r.num_generations < 1:
        return f"--num-generations {r.num_generations}: out of range"
    return teacher_ds_problem(c)


def teacher_ds_problem(c: RunConfig) -> str | None:
    """--teacher_deepspeed (GRPO's and GKD's teacher): a preset or a file, on a DeepSpeed run."""
    ds = c.rlhf.teacher_deepspeed
    if ds is None:
        return None
    if ds not in TEACHER_DS_PRESETS and not ds.endswith(".json"):
        return f"--teacher-deepspeed {ds}: not one of {', '.join(TEACHER_DS_PRESETS)} or a DeepSpeed .json file"
    if ds.endswith(".json") and not Path(ds).is_file():
        return f"--teacher-deepspeed {ds}: no such file"
    if not is_deepspeed_run(c):
        return (f"--teacher-deepspeed {ds} applies to a DeepSpeed run (--deepspeed zero2, ...): with --parallelism "
                f"{c.parallel.parallelism} the teacher is laid out like the policy's reference copy; drop the flag")
    return None


__all__ = ["is_deepspeed_run", "same_model", "teacher_ds_problem", "teacher_problem"]
