"""ms-swift's gym rollouts (`--multi_turn_scheduler gym_scheduler`, `--gym_env`, `--use_gym_env`:
msswift_api/rollout.GYMScheduler, msswift_api/gym_env.py) driven by the turn loop with a stand-in
generator: the environment's reset writes the first turn's prompt, its observations join the conversation
out of the loss, its done ends the trajectory, and the steps' rewards sum to the `gym_reward` the run trains on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swiftlite.errors import UserError
from swiftlite.rlhf.multi_turn import sample_turns

EOS, PAD = 258, 259

#: a plugin environment (ms-swift's imports): the row's `n` tells how many steps the episode lasts; each step
#: scores the answer's length, and the environment writes down the conversation each step was given
PLUGIN = '''
from swift.rollout.gym_env import Env, envs

SEEN = []


class Countdown(Env):
    async def reset(self, config):
        self.left = int(config.data_dict["n"])
        return f"count {self.left}", {}, ""

    async def step(self, action):
        SEEN.append([m["role"] for m in action])
        self.left -= 1
        return "next", float(len(action[-1]["content"])), self.left == 0, {}

    async def close(self):
        pass


envs["countdown"] = Countdown
'''


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


@pytest.fixture()
def countdown(tmp_path):
    from swiftlite.msswift_api.gym_env import envs
    from swiftlite.parallel.base import load_plugins
    p = tmp_path / "gym_plugin.py"
    p.write_text(PLUGIN)
    load_plugins([str(p)])
    yield envs["countdown"]
    envs.pop("countdown", None)


def _options(**kw):
    base = dict(multi_turn_scheduler="gym_scheduler", max_turns=5, use_vllm=False, vllm_mode=None,
                vllm_server_pass_dataset=False, gym_env="math_env", use_gym_env=True, max_completion_length=16,
                stop_words=[], completion_length_limit_scope="per_round")
    return SimpleNamespace(**{**base, **kw})


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _gen(tok, answers, asked):
    """A generator that answers each call's prompts with the next of `answers` (text), EOS-terminated."""
    from swiftlite.rlhf.vllm_gen import completion_layout
    it = iter(answers)

    def gen(micro_prompts, micro_seeds, n, first):
        asked.append(micro_prompts)
        comp = _enc(tok, next(it)) + [EOS]
        return [completion_layout(mb, [comp for _ in mb], pad_id=PAD, eos_ids=[EOS], device="cpu")
                for mb in micro_prompts]
    return gen


def _render(tok, messages):
    return _enc(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_math_env_writes_the_prompt_gives_its_tip_and_rewards_the_verified_answer(tok):
    from swiftlite.msswift_api.gym_env import SimpleMathEnv
    from swiftlite.rlhf.multi_turn import build
    o = _options()
    sched = build(o, tok)
    row = {"prompt": [{"role": "user", "content": "the dataset's prompt"}],
           "columns": {"problem": "What is 1+1?", "solution": "$2$"}}
    asked = []
    out, = sample_turns(sched, _gen(tok, ["<answer>3</answer>", "<answer>2</answer>", "never"], asked), o, tok,
                        [[_enc(tok, "ignored")]], [[7]], [[row]], eos_ids={EOS}, pad_id=PAD)
    env_prompt = [{"role": "system", "content": SimpleMathEnv.system_prompt}, {"role": "user", "content": "What is 1+1?"}]
    assert asked[0] == [[_render(tok, env_prompt)]]               # the first turn: the environment's conversation
    assert out["prompt_ids"][0].tolist()[-len(asked[0][0][0]):] == asked[0][0][0]
    # the wrong answer got the tip as the user's next message; the right one ended the episode: two turns
    assert len(asked) == 2
    second = env_prompt + [{"role": "assistant", "content": "<answer>3</answer>"},
                           {"role": "user", "content": SimpleMathEnv.tips_prompt}]
    assert tok.decode(asked[1][0][0]) == tok.apply_chat_template(second, tokenize=False, add_generation_prompt=True)
    assert out["gym_reward"].tolist() == [1.0]                    # 0 for the first step, 1 for the second
    t1, t2 = _enc(tok, "<answer>3</answer>") + [EOS], _enc(tok, "<answer>2</answer>") + [EOS]
    n = int(out["completion_mask"][0].sum())
    loss = out["loss_mask"][0, :n].tolist()
    assert out["completion_ids"][0, :len(t1)].tolist() == t1 and out["completion_ids"][0, n - len(t2):n].tolist() == t2
    assert loss == [1] * len(t1) + [0] * (n - len(t1) - len(t2)) + [1] * len(t2)   # the tip's turn out of the loss


def test_a_plugin_environment_by_a_rows_env_config_sums_its_steps_rewards(tok, countdown):
    from swiftlite.rlhf.multi_turn import build
    o = _options(gym_env="math_env", max_turns=9)
    sched = build(o, tok)
    rows = [{"prompt": [{"role": "user", "content": "q"}], "columns": {"n": n, "env_config": {"name": "countdown"}}}
            for n in (1, 3)]
    answers = ["ab", "abcd", "abcdef", "x"]
    asked = []
    countdown_seen = __import__("sys").modules[countdown.__module__].SEEN
    countdown_seen.clear()
    out, = sample_turns(sched, _gen(tok, answers, asked), o, tok, [[_enc(tok, "q"), _enc(tok, "q")]], [[1, 2]],
                        [rows], eos_ids={EOS}, pad_id=PAD)
    # the first trajectory stops after one step (reward len("ab")), the second after three: 2 + 4 + 6
    assert out["gym_reward"].tolist() == [2.0, 12.0]
    assert [len(a[0]) for a in asked] == [2, 1, 1]
    assert countdown_seen[-1] == ["user", "assistant", "user", "assistant", "user", "assistant"]


def test_max_turns_ends_an_episode_the_environment_did_not(tok):
    from swiftlite.rlhf.multi_turn import build
    o = _options(max_turns=2)
    row = {"prompt": [{"role": "user", "content": "p"}], "columns": {"problem": "What is 1+1?", "solution": "$2$"}}
    asked = []
    out, = sample_turns(build(o, tok), _gen(tok, ["no", "still no", "x"], asked), o, tok, [[_enc(tok, "p")]], [[3]],
                        [[row]], eos_ids={EOS}, pad_id=PAD)
    assert len(asked) == 2 and out["gym_reward"].tolist() == [0.0]


def test_the_gym_reward_is_the_runs_last_reward_and_needs_a_total():
    from swiftlite.rlhf.plugin_turns import gym_reward, gym_rewards
    r = SimpleNamespace(use_gym_env=None, gym_env="math_env")
    entry, = gym_rewards(r)                                       # --gym_env implies --use_gym_env (ms-swift)
    assert entry.name == "gym_reward" and entry(["a", "b"], gym_reward=[1.0, 0.5]) == [1.0, 0.5]
    assert gym_rewards(SimpleNamespace(use_gym_env=False, gym_env=None)) == []
    with pytest.raises(ValueError, match="no rollout_infos\\['total_reward'\\]"):
        gym_reward(["a"], gym_reward=[float("nan")])


def _cfg(*extra):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    return load_config(*parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo",
                                        *extra]), validate_paths=False, task="rlhf")


def test_the_options_rules():
    cfg = _cfg("--multi_turn_scheduler", "gym_scheduler", "--gym_env", "math_env")   # no --reward_funcs needed
    assert cfg.rlhf.gym_env == "math_env"
    with pytest.raises(UserError, match="--use-gym-env trains on the total reward of a gym scheduler"):
        _cfg("--use_gym_env", "true")
    with pytest.raises(UserError, match="--gym-env math_env with --use-gym-env false"):
        _cfg("--multi_turn_scheduler", "gym_scheduler", "--gym_env", "math_env", "--use_gym_env", "false",
             "--reward_funcs", "format")
    with pytest.raises(UserError, match=r"--reward-weights has 1 values .* and the gym reward"):
        _cfg("--multi_turn_scheduler", "gym_scheduler", "--gym_env", "math_env", "--reward_funcs", "format",
             "--reward_weights", "1")
    with pytest.raises(UserError, match="needs --reward-funcs .*--use-gym-env"):
        _cfg("--multi_turn_scheduler", "gym_scheduler")
    # --loss_scale default (ms-swift's GRPO default with a scheduler; the same targets for one turn) is what GRPO
    # trains; last_round with a scheduler would train the last turn only in ms-swift
    assert _cfg("--reward_funcs", "format", "--loss_scale", "default").data.loss_scale == "default"
    _cfg("--reward_funcs", "format", "--loss_scale", "last_round")
    with pytest.raises(UserError, match="--loss-scale last_round with --multi-turn-scheduler gym_scheduler: GRPO "
                                        "trains every turn"):
        _cfg("--multi_turn_scheduler", "gym_scheduler", "--gym_env", "math_env", "--loss_scale", "last_round")
    # a scheduler that gives its rollouts' messages trains their last turn (rlhf/own_rollout.py)
    assert _cfg("--multi_turn_scheduler", "thinking_tips_scheduler", "--reward_funcs", "format", "--loss_scale",
                "last_round").data.loss_scale == "last_round"
    with pytest.raises(UserError, match="--loss-scale all: rlhf trains on the answer"):
        _cfg("--reward_funcs", "format", "--loss_scale", "all")
    # in server mode the server's answer decides (launch/server_turns.py): accepted here
    _cfg("--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1")


def test_math_env_rows_need_their_columns_and_a_server_needs_them_passed(tok):
    from swiftlite.rlhf.multi_turn import check_rows
    data = SimpleNamespace(rows=[{"where": "d.jsonl:1", "columns": {"solution": "1"}}])
    with pytest.raises(UserError, match=r"^d.jsonl:1: no 'problem' column, which --gym_env math_env reads"):
        check_rows(_options(), data)
    with pytest.raises(UserError, match="--vllm_server_pass_dataset true"):
        check_rows(_options(use_vllm=True, vllm_mode="server"), data)


def test_an_unknown_environment_is_refused_in_one_line():
    from swiftlite.rlhf.plugin_turns import check_gym_env
    check_gym_env("math_env")
    with pytest.raises(UserError, match=r"--gym_env nope: no environment of that name; built in: math_env"):
        check_gym_env("nope")
