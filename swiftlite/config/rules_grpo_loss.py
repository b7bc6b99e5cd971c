"""GRPO's rules about its rewards and loss that are not in config/rules.py's table itself (kept here so that
module stays short): --reward_model / --reward_model_plugin and --loss_type real. Import-light (no torch)."""

from __future__ import annotations

from swiftlite.config.schema import RunConfig


def _reward_model_problem(r) -> str | None:
    """--reward_model / --reward_model_plugin (rlhf/reward_model.py)."""
    models, plugins = r.reward_model or [], r.reward_model_plugin or []
    if plugins and not models:
        return "--reward-model-plugin applies to --reward-model: drop it"
    if plugins and len(plugins) != len(models):
        return (f"--reward-model-plugin has {len(plugins)} values for {len(models)} --reward-model (one plugin each)")
    # the names (a plugin file's are registered when it runs) and the folders are checked before launch
    # (rlhf/grpo_data.py: rlhf/reward_model.check_plugins, config_problem)
    return None


def _real_problem(c: RunConfig) -> str | None:
    """--loss_type real (REAL) and --real_tau: ms-swift's rules, and what this implementation needs (each round
    trains one optimizer step: rlhf/grpo_loss.py; the plan's check in rlhf/grpo_data.py)."""
    r = c.rlhf
    if "real_tau" in c.explicit and r.loss_type != "real":
        return f"--real-tau applies to --loss-type real (REAL); this run's loss is {r.loss_type or 'grpo'}: drop it"
    if r.loss_type != "real":
        return None
    if not r.real_tau > 0:
        return f"--real-tau {r.real_tau:g}: must be > 0"
    if r.scale_rewards not in (None, "none"):
        return (f"--scale-rewards {r.scale_rewards} with --loss-type real: REAL reads only the advantages' signs "
                "and takes them unscaled (ms-swift sets none); drop the flag")
    if r.teacher_model:
        return ("--loss-type real with --teacher-model: REAL needs one advantage per completion, the teacher gives "
                "one per token (ms-swift refuses it too)")
    if r.num_iterations > 1:
        return (f"--num-iterations {r.num_iterations} with --loss-type real: each generation round trains one "
                "optimizer step here (REAL's group scores are 0 at the sampling policy, which makes its group loss "
                "exact across micro-batches and processes); use 1")
    return None
