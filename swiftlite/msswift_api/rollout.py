"""ms-swift's multi-turn scheduler registry, its gym scheduler and its thinking-tips scheduler
(swift/rollout/multi_turn.py `RolloutScheduler`, `MultiTurnScheduler`, `GYMScheduler`,
`ThinkingModelTipsScheduler`, `multi_turns`); the gym environments are in msswift_api/gym_env.py
(swift/rollout/gym_env.py).

A plugin's scheduler that implements ms-swift's turn-by-turn hooks runs (rlhf/plugin_turns.py drives it):
the async `on_trajectory_start(requests)` (the prompts' conversations, which it may rewrite before the first
turn: a gym scheduler replaces them with its environment's first observation), `check_finished(infer_request,
response_choice, current_turn)` (this base's default is ms-swift's: stop at finish_reason 'length' or at
max_turns), `step(...)` (the next turn's request, optionally the turn's token ids and loss mask), and the
async `on_turn_end` hook (its 'done' decides, its 'rollout_infos' are kept: a gym trajectory's
'total_reward' is what --use_gym_env trains on). A scheduler that overrides `run` (its own whole rollout,
ms-swift's "full customization", e.g. examples/train/grpo/plugin/treepo's tree rollout) runs too: it gets an
engine whose `infer_async` samples a turn from the policy (rlhf/own_rollout.py), and `async_infer` (ms-swift's:
`run` for every request at once, through the engine's `_batch_infer_stream`) is called with the round's requests.
"""

from __future__ import annotations

from typing import Any

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

    async def async_infer(self, infer_requests: list, request_config: Any, *, use_tqdm: bool | None = None,
                          **kwargs: Any) -> list:
        """ms-swift's: `run` for each request concurrently, the results flattened (a run may return a list)."""
        from swiftlite.msswift_api.protocol import RolloutInferRequest
        assert request_config.n == 1

        async def one(req: Any) -> Any:
            return await self.run(RolloutInferRequest(**req) if isinstance(req, dict) else req, request_config,
                                  **kwargs)
        results = await self.infer_engine._batch_infer_stream([one(r) for r in infer_requests],
                                                              request_config.stream, bool(use_tqdm), None)
        return [x for r in results for x in (r if isinstance(r, list) else [r])]

    async def run(self, infer_request: Any, request_config: Any, **kwargs: Any) -> Any:
        """Not called here: the turns of a scheduler that keeps this `run` are driven by rlhf/plugin_turns.py
        (ms-swift's MultiTurnScheduler.run loop, hook by hook)."""
        raise NotImplementedError("the turn hooks of this scheduler are driven by swiftlite's turn loop")

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


def owns_rollout(cls: Any) -> bool:
    """The scheduler drives its own turns (it overrides `run`: rlhf/own_rollout.py), not the hooks."""
    return cls.run is not RolloutScheduler.run


def unsupported(cls: Any) -> str | None:
    """Why a registered scheduler class cannot run here, or None when it can."""
    if not (isinstance(cls, type) and issubclass(cls, MultiTurnScheduler)):
        return "is not a subclass of ms-swift's MultiTurnScheduler (swift.rollout.multi_turn)"
    if cls.async_infer is not RolloutScheduler.async_infer and not owns_rollout(cls):
        return ("overrides async_infer() but not run(): its requests would reach ms-swift's own turn loop "
                "(MultiTurnScheduler.run), which here is swiftlite's; override run() too, or neither")
    return None


class GYMScheduler(MultiTurnScheduler):
    """ms-swift's `gym_scheduler`: one environment per trajectory (`--gym_env NAME`, or the row's
    `env_config.name`; msswift_api/gym_env.envs). Its reset gives the trajectory's conversation (its system
    message and first observation, replacing the prompt's) before the first turn; after every turn its step
    scores the conversation, says whether the episode is done and gives the next observation, which `step`
    adds as the user's next message. The steps' rewards add up to the trajectory's 'total_reward'."""

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *args: Any, **kwargs: Any):
        super().__init__(infer_engine, max_turns, *args, **kwargs)
        self.gym_env_name = kwargs.get("gym_env")
        self._envs: dict[str, Any] = {}
        self._total_rewards: dict[str, float] = {}
        self._step_rewards: dict[str, list[float]] = {}
        self._pending_obs: dict[str, str | None] = {}

    async def _close_and_remove(self, uuid: str) -> None:
        env = self._envs.pop(uuid, None)
        if env is not None:
            try:
                await env.close()
            except Exception:    # ms-swift's: a failing close does not stop the rollout
                pass
        for d in (self._total_rewards, self._step_rewards, self._pending_obs):
            d.pop(uuid, None)

    async def on_trajectory_start(self, requests: list) -> None:
        for req in requests:
            if req.uuid in self._envs:
                await self._close_and_remove(req.uuid)
            env = self._create_env((req.data_dict or {}).get("env_config") or {})
            observation, _info, system = await env.reset(req)
            req.messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": observation}]
            self._envs[req.uuid] = env
            self._total_rewards[req.uuid], self._step_rewards[req.uuid] = 0.0, []
            self._pending_obs[req.uuid] = None

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        import copy
        uuid = infer_request.uuid
        env = self._envs.get(uuid)
        if env is None:
            return {"done": True, "rollout_infos": {}}
        next_obs, reward, done, _info = await env.step(copy.deepcopy(infer_request.messages))
        self._total_rewards[uuid] = self._total_rewards.get(uuid, 0.0) + float(reward)
        self._step_rewards.setdefault(uuid, []).append(float(reward))
        self._pending_obs[uuid] = None if done else next_obs
        infos = {"total_reward": self._total_rewards[uuid], "step_rewards": list(self._step_rewards[uuid]),
                 "gym_done": done}
        if done:
            await self._close_and_remove(uuid)
        return {"done": done, "rollout_infos": infos}

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        next_obs = self._pending_obs.get(infer_request.uuid)
        if next_obs is not None:
            infer_request.messages.append({"role": "user", "content": next_obs})
            self._pending_obs[infer_request.uuid] = None
        return {"infer_request": infer_request}

    def _create_env(self, env_config: dict) -> Any:
        from swiftlite.msswift_api.gym_env import SimpleMathEnv, envs
        name = env_config.get("name", self.gym_env_name)
        if name not in envs:
            raise ValueError(f"Environment '{name}' not found. Available: {list(envs)}")
        env = envs[name](env_config)
        if isinstance(env, SimpleMathEnv):    # it counts the conversation's tokens with the run's tokenizer
            env.tokenizer = self.tokenizer
        return env


class ThinkingModelTipsScheduler(MultiTurnScheduler):
    """ms-swift's `thinking_tips_scheduler`: a trajectory whose answer does not verify against the row's
    `solution` (math_verify, ms-swift's MathAccuracy) gets ms-swift's tip as the user's next message, once, and
    is answered again. Every turn is a training row of its own (ms-swift's dynamic_num_samples: `run` returns
    one RolloutOutput per turn, whose messages are the conversation up to that turn, each earlier assistant
    answer without its reasoning: only the text after its last `</think>`, as a thinking model's chat template
    keeps history). With --loss_scale last_round each row trains its own turn. A trajectory ends when the
    answer verifies, after the tip's answer, at finish_reason 'length' or at --max_turns."""

    TIPS = "The answer is not correct, It seems You made a mistake, you need to recheck very carefully."

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *args: Any, **kwargs: Any):
        super().__init__(infer_engine, max_turns, *args, **kwargs)
        from swiftlite.math_answers import accuracy
        self.acc_func = kwargs.get("acc_function") or (
            lambda completions, solutions: [accuracy(c, s) for c, s in zip(completions, solutions)])
        self.tips_prompt = self.TIPS

    async def run(self, infer_request: Any, request_config: Any, **kwargs: Any) -> list:
        from swiftlite.msswift_api.protocol import RolloutOutput
        request, turn, outputs = infer_request, 1, []
        while True:
            response = await self.infer_engine.infer_async(request, request_config, **kwargs)
            choice = response.choices[0]
            request.messages.append({"role": "assistant", "content": choice.message.content})
            outputs.append(RolloutOutput(response=response, messages=self._build_messages(request.messages),
                                         response_token_ids=choice.token_ids, rollout_infos={"num_turns": turn}))
            if self.check_finished(request, choice, turn):
                return outputs
            request = self.step(request, choice, turn)["infer_request"]
            turn += 1

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        msgs = infer_request.messages
        if len(msgs) >= 2 and self.tips_prompt in str(msgs[-2]["content"]):    # the tip is given once
            return True
        solution = infer_request.data_dict["solution"]
        if self.acc_func([response_choice.message.content], [solution])[0] == 1:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        infer_request.messages.append({"role": "user", "content": self.tips_prompt})
        return {"infer_request": infer_request}

    @staticmethod
    def _build_messages(messages: list[dict]) -> list[dict]:
        """The conversation as this turn's row trains it: the earlier assistant answers without their reasoning."""
        import copy
        out = copy.deepcopy(messages)
        for m in out[:-1]:
            if m["role"] == "assistant" and isinstance(m["content"], str):
                m["content"] = m["content"].split("</think>")[-1].strip()
        return out


#: name -> scheduler class: ms-swift's gym_scheduler and thinking_tips_scheduler, and what plugin files register
#: (math_tip_trick is swiftlite's own, rlhf/multi_turn.py; openenv_scheduler is refused: config/multi_turn_options.py)
multi_turns: dict[str, Any] = {"gym_scheduler": GYMScheduler, "thinking_tips_scheduler": ThinkingModelTipsScheduler}

from swiftlite.msswift_api.gym_env import Env, envs  # noqa: E402  (ms-swift's gym_env names, for plugins that
#                                                       import them from multi_turn)

__all__ = ["Env", "GYMScheduler", "MultiTurnScheduler", "RolloutScheduler", "ThinkingModelTipsScheduler", "envs",
           "multi_turns", "owns_rollout", "unsupported"]
