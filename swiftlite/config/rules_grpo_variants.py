"""The rules of GRPO's variant options (config/grpo_variant_options.py): ms-swift's ranges and combinations
(swift/arguments/rlhf_args.py), each a rule of config/rules.py's table, kept here so that module stays short.
Import-light."""

from __future__ import annotations

from swiftlite.config.grpo_variant_options import FIPO_KEYS
from swiftlite.config.multi_turn_options import gym_on
from swiftlite.config.rule_table import rule
from swiftlite.config.schema import RunConfig
from swiftlite.config.tasks import task_spec


def _grpo_run(c: RunConfig) -> bool:
    return task_spec(c.task).own_options == "rlhf" and c.rlhf.rlhf_type == "grpo"


@rule("grpo dynamic sampling")
def grpo_dynamic_sample(c: RunConfig) -> str | None:
    r = c.rlhf
    if not _grpo_run(c):
        return None
    if "max_resample_times" in c.explicit and not r.dynamic_sample:
        return "--max-resample-times applies to --dynamic-sample true (DAPO's dynamic sampling): drop it or add that"
    if not r.dynamic_sample:
        return None
    if r.max_resample_times < 1:
        return f"--max-resample-times {r.max_resample_times}: must be >= 1 (the resampling rounds per generation round)"
    if not r.reward_funcs and not r.reward_model and not gym_on(r):
        return ("--dynamic-sample true needs --reward-funcs or --reward-model: it replaces the groups whose rewards "
                "are all equal, and a run without rewards (on-policy distillation alone) has no reward variance "
                "(ms-swift refuses it too)")
    return None


@rule("grpo turn rows")
def grpo_turn_rows(c: RunConfig) -> str | None:
    """thinking_tips_scheduler makes each turn a training row (rlhf/grpo_rows.py): what cannot count them is
    refused here; a plugin's scheduler that does the same is told at its first round (rlhf/own_rollout.py)."""
    from swiftlite.config.multi_turn_options import TURN_ROWS, split_problem
    if not _grpo_run(c) or c.rlhf.multi_turn_scheduler != TURN_ROWS:
        return None
    why = split_problem(c)
    return f"--multi-turn-scheduler {TURN_ROWS} trains each turn as a row of its own: {why}" if why else None


@rule("grpo fipo and delta")
def grpo_fipo_delta(c: RunConfig) -> str | None:
    r = c.rlhf
    if not _grpo_run(c):
        return None
    loss = r.loss_type or "grpo"
    given = [k for k in FIPO_KEYS if k in c.explicit]
    if given and loss != "fipo":
        return (f"--{given[0].replace('_', '-')} applies to --loss-type fipo (FIPO's influence weights); this run's "
                f"loss is {loss}: drop it")
    if r.delta is not None:
        if loss == "real":
            return "--delta with --loss-type real: REAL's group loss has no clipped ratio to cap; drop it"
        high = r.epsilon if r.epsilon_high is None else r.epsilon_high
        if not r.delta > 1 + high:
            return (f"--delta {r.delta:g}: the cap of the unclipped ratio must be above the clip range's top, 1 + "
                    f"--epsilon-high = {1 + high:g} (INTELLECT-2's two-sided clipping; ms-swift advises it)")
    if loss != "fipo":
        return None
    if r.teacher_model:
        return ("--loss-type fipo with --teacher-model: FIPO needs one advantage per completion, the teacher gives one "
                "per token (ms-swift refuses it too)")
    if not r.fipo_decay_rate > 0:
        return f"--fipo-decay-rate {r.fipo_decay_rate:g}: the half-life in tokens, must be > 0"
    if r.fipo_clip_range is not None and not 0 <= r.fipo_clip_range < 1:
        return f"--fipo-clip-range {r.fipo_clip_range:g}: must be in [0, 1) (the weight is clamped to [1 - r, 1 + r])"
    if r.fipo_safety_threshold is not None and not r.fipo_safety_threshold > 0:
        return f"--fipo-safety-threshold {r.fipo_safety_threshold:g}: an importance ratio, must be > 0"
    return None


@rule("grpo top entropy quantile")
def grpo_top_entropy(c: RunConfig) -> str | None:
    r = c.rlhf
    if not _grpo_run(c) or r.top_entropy_quantile == 1.0:
        return None
    if not 0 < r.top_entropy_quantile <= 1:
        return (f"--top-entropy-quantile {r.top_entropy_quantile:g}: the fraction of tokens that keep their policy "
                "term, must be in (0, 1] (1: all)")
    if (r.loss_type or "grpo") == "real":
        return ("--top-entropy-quantile with --loss-type real: REAL's group loss has no per-token policy term to "
                "mask; drop it")
    return None


@rule("stop words")
def stop_words(c: RunConfig) -> str | None:
    r = c.rlhf
    if task_spec(c.task).own_options != "rlhf" or r.rlhf_type not in ("grpo", "gkd") or not r.stop_words:
        return None
    if any(not w for w in r.stop_words):
        return "--stop-words: an empty string would stop every completion at its first token; drop it"
    return None


__all__ = ["grpo_dynamic_sample", "grpo_fipo_delta", "grpo_top_entropy", "stop_words"]
