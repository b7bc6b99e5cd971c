"""ms-swift's gym environments (swift/rollout/gym_env.py at 3602360a): the `Env` base a plugin's environment
subclasses, the built-in `math_env` (SimpleMathEnv) and the `envs` registry `--gym_env NAME` (or a row's
`env_config.name`) picks from. `gym_scheduler` (msswift_api/rollout.GYMScheduler) drives them turn by turn.

An environment's `reset(request)` gives the trajectory's first observation (its user message), a dict of
information and its system message; `step(messages)` (the conversation so far, the policy's answer last)
gives the next observation, the step's reward, whether the episode is done and a dict of information. The
rewards of a trajectory's steps are summed into the `total_reward` that `--use_gym_env` trains on.
"""

from __future__ import annotations

from typing import Any


class Env:
    """The base a gym environment subclasses (ms-swift's abstract methods: async reset, step, close)."""

    def __init__(self, env_config: Any):
        self.env_config = env_config

    async def reset(self, config: Any) -> tuple[str, dict, str]:
        raise NotImplementedError("a gym environment implements async reset(config) -> (observation, info, system)")

    async def step(self, action: list[dict]) -> tuple[str, float, bool, dict]:
        raise NotImplementedError("a gym environment implements async step(messages) -> (observation, reward, done, "
                                  "info)")

    async def close(self) -> None:
        raise NotImplementedError("a gym environment implements async close()")


#: ms-swift's SimpleMathEnv length bound: a conversation of this many tokens or more ends the episode.
MATH_ENV_MAX_TOKENS = 2048


class SimpleMathEnv(Env):
    """ms-swift's `math_env`: the row's `problem` is the first observation (the columns it reads are checked
    before launch: config/multi_turn_options.scheduler_columns); an answer that verifies against
    the row's `solution` (math_verify, as --reward_funcs accuracy) ends the episode with reward 1, any other
    gets the tip below as the next user message and reward 0; a conversation of 2048 tokens or more ends it.

    One difference: ms-swift counts the conversation's tokens with Qwen2.5-3B-Instruct's tokenizer, fetched
    from ModelScope at every step (without the network its count is 0 and the bound never applies); here the
    run's own tokenizer counts them (`tokenizer`, which the scheduler sets), with its chat template."""

    tips_prompt = 'The answer is not correct, It seems You made a mistake, you need to recheck very carefully.'
    system_prompt = """A conversation between User and Assistant.
        The user asks a question, and the Assistant solves it.
        The assistant first thinks about the reasoning process in the mind and then provides the user with the answer.
        The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags,
        respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>
        """

    def __init__(self, env_config: Any):
        super().__init__(env_config)
        from swiftlite.math_answers import accuracy, check_installed
        check_installed("--gym_env math_env")
        self.acc_func = lambda completions, solutions: [accuracy(c, s) for c, s in zip(completions, solutions)]
        self.solution = ''
        self.tokenizer: Any = None

    async def reset(self, config: Any) -> tuple[str, dict, str]:
        self.solution = config.data_dict['solution']
        return config.data_dict['problem'], {}, self.system_prompt

    def _too_long(self, messages: list[dict]) -> bool:
        if self.tokenizer is None:
            return False
        from swiftlite.data.tokenize import render
        text = render(self.tokenizer, [{k: m[k] for k in ("role", "content")} for m in messages])
        return len(self.tokenizer.encode(text, add_special_tokens=False)) >= MATH_ENV_MAX_TOKENS

    async def step(self, action: list[dict]) -> tuple[str, float, bool, dict]:
        reward, done, info = 0.0, False, {}
        acc = self.acc_func([action[-1]['content']], [self.solution])[0]
        if self._too_long(action):
            done, info['stop_reason'] = True, 'Exceeded maximum length'
        if acc == 1:
            done, reward, info['stop_reason'] = True, 1.0, 'Correct'
        info['math_reward'] = reward
        return self.tips_prompt, reward, done, info

    async def close(self) -> None:
        pass


#: name -> environment class (a plugin file adds its own: envs['name'] = Cls)
envs: dict[str, Any] = {'math_env': SimpleMathEnv}

__all__ = ["Env", "MATH_ENV_MAX_TOKENS", "SimpleMathEnv", "envs"]
