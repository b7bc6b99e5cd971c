"""The GRPO demo's reward (scripts/quickstart_grpo.sh): --external_plugins scripts/grpo_exact_reward.py
--reward_funcs exact. 1.0 when the completion is the row's `solution` (the string reversed), else 0.0."""
from swiftlite.plugin import ORM, orms
from swiftlite.rlhf.grpo_demo import exact_match


class ExactMatch(ORM):
    def __call__(self, completions, solution, **kwargs):
        return exact_match(completions, solution)


orms["exact"] = ExactMatch
