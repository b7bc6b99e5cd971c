"""ms-swift's multi-turn scheduler and gym environment registries (swift/rollout/multi_turn.py
`MultiTurnScheduler`, `multi_turns`; swift/rollout/gym_env.py `Env`, `envs`), so that a plugin file that
defines and registers one loads, and the rewards and reward-model plugins it also registers can be used.

swiftlite does not run these classes: its multi-turn rollouts are its own (rlhf/multi_turn.py, the
built-in math_tip_trick), and ms-swift's scheduler API drives ms-swift's inference engines and request
objects turn by turn. A run naming a registered scheduler or an environment is refused before launch
(config/multi_turn_options.py, the --use_gym_env refusal); building one here raises the same reason.
"""

from __future__ import annotations

from typing import Any

WHY = ("ms-swift's multi-turn schedulers and gym environments drive its own inference engines turn by turn; "
       "swiftlite's multi-turn rollouts are --multi_turn_scheduler math_tip_trick (docs/rlhf.md)")


class MultiTurnScheduler:
    """The base class a plugin's scheduler subclasses; registering works, running does not."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(WHY)


class Env:
    """The base class a plugin's gym environment subclasses; registering works, running does not."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(WHY)


#: name -> scheduler class (ms-swift's built-ins are named in config/multi_turn_options.py)
multi_turns: dict[str, Any] = {}
#: name -> environment class
envs: dict[str, Any] = {}

__all__ = ["Env", "MultiTurnScheduler", "WHY", "envs", "multi_turns"]
