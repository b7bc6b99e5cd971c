"""ms-swift's multi-turn scheduler and gym environment registries (swift/rollout/multi_turn.py
`RolloutScheduler`, `MultiTurnScheduler`, `multi_turns`; swift/rollout/gym_env.py `Env`, `envs`).

A plugin's scheduler that implements ms-swift's turn-by-turn hooks runs (rlhf/plugin_turns.py drives it):
`check_finished(infer_request, response_choice, current_turn)` (this base's default is ms-swift's: stop at
finish_reason 'length' or at max_turns), `step(...)` (the next turn's request, optionally the turn's
token ids and loss mask), and the async `on_turn_end` hook. A scheduler that overrides `run` (its own
whole rollout, ms-swift's "full customization", which calls ms-swift's inference engine itself) or
`on_trajectory_start` (which rewrites the prompt before the first turn, that swiftlite samples before any
scheduler sees it) is refused before launch with that reason (`unsupported`). Gym environments do not
run: `Env` registers, building one raises WHY.
"""

from __future__ import annotations

from typing import Any

WHY = ("ms-swift's gym environments drive an environment server turn by turn, which swiftlite does not have; "
       "its multi-turn rollouts are --multi_turn_scheduler math_tip_trick or a plugin's MultiTurnScheduler with "
       "step/check_finished (docs/rlhf.md)")


class RolloutScheduler:
    """ms-swift's base: the inference engine (None here: swiftlite samples the turns), max_turns, and the
    tokenizer a scheduler reads (`self.tokenizer`, passed as a keyword as ms-swift's colocate mode does)."""

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *args: Any, **kwargs: Any):
        self.infer_engine = infer_engine
        self._tokenizer = kwargs.get("tokenizer")
        self.max_turns = max_turns

    async def on_trajectory_start(self, requests: list) -> None:
        pass

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        return {}

    async def run(self, infer_request: Any, request_config: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a scheduler's run() drives ms-swift's inference engine, which is not here")

    @property
    def engine(self) -> Any:
        return self.infer_engine

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer


class MultiTurnScheduler(RolloutScheduler):
    """The base a plugin's scheduler subclasses: `step` is its own, `check_finished` ms-swift's default."""

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        raise NotImplementedError("Please implement the `step` method in your MultiTurnScheduler subclass")

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        if response_choice.finish_reason == "length":
            return True
        return bool(self.max_turns and current_turn >= self.max_turns)


def unsupported(cls: Any) -> str | None:
    """Why a registered scheduler class cannot run here, or None when it can."""
    if not (isinstance(cls, type) and issubclass(cls, MultiTurnScheduler)):
        return "is not a subclass of ms-swift's MultiTurnScheduler (swift.rollout.multi_turn)"
    if cls.run is not RolloutScheduler.run:
        return ("overrides run(): its whole rollout calls ms-swift's inference engine itself; a scheduler that "
                "implements step (and check_finished) runs here")
    if cls.on_trajectory_start is not RolloutScheduler.on_trajectory_start:
        return ("overrides on_trajectory_start(), which rewrites the prompt before the first turn; swiftlite samples "
                "the first turn before a scheduler sees it")
    return None


class Env:
    """The base class a plugin's gym environment subclasses; registering works, running does not."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(WHY)


#: name -> scheduler class (ms-swift's built-ins are named in config/multi_turn_options.py)
multi_turns: dict[str, Any] = {}
#: name -> environment class
envs: dict[str, Any] = {}

__all__ = ["Env", "MultiTurnScheduler", "RolloutScheduler", "WHY", "envs", "multi_turns", "unsupported"]
