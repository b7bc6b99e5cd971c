"""ms-swift's reward-model plugins and the plugin-facing API they use (swiftlite/msswift_api): genrm's query and
reward parsing against ms-swift's own cases, the TransformersEngine's generation rules against transformers'
generate, seeded sampling that leaves the global random stream alone, a plugin class of ms-swift's shape scoring
as the default plugin, and ms-swift's plugin.py import block loading with its registrations landing here."""

from __future__ import annotations

import re

import pytest
import torch

from tests.unit.test_grpo_reward_model import CONVS, build_tiny_qwen2, build_tiny_rm


def build_tiny_judge(d, positions=96):
    """A tiny Qwen2 chat model (fp32, random weights) as a generative judge; `positions` bounds its answers
    (ms-swift's engine generates up to the model's length)."""
    return build_tiny_qwen2(d, "Qwen2ForCausalLM", max_position_embeddings=positions,
                            initializer_range=0.2)   # 0.02's logits barely depend on the prompt: every answer the same


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlite.msswift_api.template import Template
    d = build_tiny_judge(tmp_path_factory.mktemp("judge") / "tiny-judge", positions=480)   # genrm's prompt: ~430
    return AutoModelForCausalLM.from_pretrained(d).eval(), Template(AutoTokenizer.from_pretrained(d))


def test_genrm_query_and_reward_parsing_are_msswifts():
    from swiftlite.msswift_api.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage
    from swiftlite.msswift_api.rm_plugin import GenRMPlugin
    msgs = [{"role": "user", "content": "Hello, how are you?"},
            {"role": "assistant", "content": "I am fine, thank you! How can I assist you today?"},
            {"role": "system", "content": ""},                 # empty turns are left out
            {"role": "user", "content": "Can you help me with my homework?"}]
    assert GenRMPlugin.messages_to_query(msgs) == ("User: Hello, how are you?\nAssistant: I am fine, thank you! How "
                                                   "can I assist you today?\nUser: Can you help me with my homework?")
    assert GenRMPlugin.messages_to_query([{"role": "tool", "content": "42"}]) == "Tool: 42"
    for text, want in [("Reward: 0.85", 0.85), ("so.\nReward:1", 1.0), ("Reward: 0", 0.0), ("Reward: 0.3 Reward: 1", 0.3),
                       ("reward: 0.5", None), ("Reward: 2", None), ("Reward: .5", None), ("nothing", None)]:
        assert GenRMPlugin.extract_reward(text) == want, text

    def res(*texts):
        return ChatCompletionResponse("j", [ChatCompletionResponseChoice(i, ChatMessage("assistant", t))
                                            for i, t in enumerate(texts)])
    plugin = GenRMPlugin.__new__(GenRMPlugin)
    # the mean over a request's answers that have a reward; 0.0 when none has
    assert plugin.compute_rewards([res("Reward: 0.2", "Reward: 0.6"), res("x"), res("Reward: 1", "y")]) == \
        pytest.approx([0.4, 0.0, 1.0])


def test_the_engine_decodes_greedily_up_to_the_models_length_as_generate_does(judge):
    """A model whose generation_config does not sample, RequestConfig() (temperature None): greedy, up to
    max_position_embeddings minus the prompt; max_tokens caps it; each request of a batch answers as alone."""
    from swiftlite.msswift_api.engine import RequestConfig, TransformersEngine
    model, template = judge
    engine = TransformersEngine(model, template=template)
    reqs = [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "user", "content": "ho"}]}]
    got = engine.infer(reqs, RequestConfig())
    for req, res in zip(reqs, got):
        ids = torch.tensor([template.encode(req)["input_ids"]])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=480 - ids.shape[1], pad_token_id=259)[0, ids.shape[1]:].tolist()
        end = want.index(258) if 258 in want else len(want)
        assert res.choices[0].token_ids == want[:end]
        assert res.choices[0].finish_reason == ("stop" if end < len(want) else "length")
        assert res.choices[0].message.content == template.tokenizer.decode(want[:end], skip_special_tokens=True)
    short = engine.infer(reqs[:1], RequestConfig(max_tokens=5))[0].choices[0]
    assert len(short.token_ids) <= 5 and short.token_ids == got[0].choices[0].token_ids[:len(short.token_ids)]


def test_sampling_is_seeded_by_the_batch_and_leaves_the_global_stream(judge):
    from swiftlite.msswift_api.engine import RequestConfig, TransformersEngine
    model, template = judge
    engine = TransformersEngine(model, template=template)
    reqs = [{"messages": [{"role": "user", "content": "hi"}]}]
    rc = RequestConfig(temperature=1.0, max_tokens=12, n=3)
    torch.manual_seed(5)
    a = engine.infer(reqs, rc)
    after = torch.rand(4)
    torch.manual_seed(5)
    want = torch.rand(4)
    assert torch.equal(after, want)                     # the judge drew nothing from the global stream
    b = engine.infer(reqs, rc)
    assert [c.token_ids for c in a[0].choices] == [c.token_ids for c in b[0].choices]
    assert len(a[0].choices) == 3 and len({tuple(c.token_ids) for c in a[0].choices}) > 1   # n samples differ
    c = engine.infer(reqs, RequestConfig(temperature=1.0, max_tokens=12, n=3, seed=7))
    assert [x.token_ids for x in c[0].choices] != [x.token_ids for x in a[0].choices]


def test_genrm_asks_the_judge_in_msswifts_words_and_scores_its_answers(judge, monkeypatch):
    from swiftlite.msswift_api.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage
    from swiftlite.msswift_api.rm_plugin import GENRM_SYSTEM, GenRMPlugin
    model, template = judge
    plugin = GenRMPlugin(model=model, template=template)
    rows = [{"messages": conv, "solution": "s"} for conv in CONVS]
    asked = plugin.prepare_rm_inputs(rows)
    assert asked[0]["messages"] == [{"role": "system", "content": GENRM_SYSTEM},
                                    {"role": "user", "content": "User: reverse: abcd\nAssistant: dcba"}]
    assert asked[0]["solution"] == "s" and rows[0]["messages"] == CONVS[0]      # the rows are not changed
    assert GENRM_SYSTEM.startswith("\nBased on the dialogue history") and "Reward: 0.85" in GENRM_SYSTEM
    assert plugin(rows).tolist() == [0.0, 0.0]          # a random judge writes no "Reward: x"
    seen = []
    monkeypatch.setattr(plugin.engine, "infer", lambda reqs, rc, **kw: seen.append(reqs) or [
        ChatCompletionResponse("j", [ChatCompletionResponseChoice(0, ChatMessage("assistant", f"Reward: 0.{i + 1}"))])
        for i in range(len(reqs))])
    assert plugin(rows).tolist() == pytest.approx([0.1, 0.2]) and seen[0] == asked


def test_a_plugin_class_of_msswifts_shape_scores_as_the_default_plugin(tmp_path, monkeypatch):
    """ms-swift's CustomizedRMPlugin (examples/train/grpo/plugin/plugin.py): Template.encode, data_collator,
    to_device, the classifier's first logit."""
    from swiftlite.parallel.base import load_plugins
    from swiftlite.plugin import rm_plugins
    from swiftlite.rlhf.reward_model import RewardModelScorer, check_plugins
    rm = build_tiny_rm(tmp_path / "tiny-rm")
    p = tmp_path / "rmp.py"
    p.write_text(RM_PLUGIN)
    monkeypatch.setitem(rm_plugins, "placeholder", None)
    load_plugins([str(p)])
    try:
        check_plugins(type("R", (), {"reward_model_plugin": ["default", "my_rmplugin"]})())
        mine = RewardModelScorer(str(rm), "cpu", torch.float32, plugin="my_rmplugin")
        default = RewardModelScorer(str(rm), "cpu", torch.float32)
        completions = [c[-1]["content"] for c in CONVS]
        assert mine(completions, messages=CONVS) == pytest.approx(default(completions, messages=CONVS), rel=1e-6)
    finally:
        del rm_plugins["my_rmplugin"]
    from swiftlite.errors import UserError
    with pytest.raises(UserError, match=re.escape("--reward_model_plugin my_rmplugin: unknown reward-model plugin "
                                                  "(registered: default, genrm, ") + r".*placeholder"):
        check_plugins(type("R", (), {"reward_model_plugin": ["my_rmplugin"]})())


RM_PLUGIN = '''import torch
from copy import deepcopy

from swift.rewards import rm_plugins
from swift.template import Template
from swift.utils import to_device


class CustomizedRMPlugin:
    def __init__(self, model, template):
        self.model = model
        self.template: Template = template

    def __call__(self, inputs, **kwargs):
        batched_inputs = [self.template.encode(deepcopy(infer_request)) for infer_request in inputs]
        reward_inputs = to_device(self.template.data_collator(batched_inputs), self.model.device)
        with torch.inference_mode():
            return self.model(**reward_inputs).logits[:, 0]


rm_plugins['my_rmplugin'] = CustomizedRMPlugin
'''

#: the import block of ms-swift's examples/train/grpo/plugin/plugin.py (and its kinds of registration)
MSSWIFT_IMPORTS = '''import asyncio
from swift.infer_engine import RequestConfig, TransformersEngine
from swift.infer_engine.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutInferRequest
from swift.rewards import ORM, AsyncORM, orms, rm_plugins
from swift.rewards.rm_plugin import DefaultRMPlugin
from swift.rollout.gym_env import Env, envs
from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns
from swift.template import Template
from swift.utils import get_logger, to_device

logger = get_logger()


class AsyncLen(AsyncORM):
    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]


class MyScheduler(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        return infer_request


class MyEnv(Env):
    pass


class Judge(DefaultRMPlugin):
    pass


orms['async_len'] = AsyncLen
multi_turns['my_scheduler'] = MyScheduler
envs['my_env'] = MyEnv
rm_plugins['my_judge'] = Judge
'''


def test_msswifts_plugin_imports_load_and_register_here(tmp_path):
    import asyncio
    import sys

    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.errors import UserError
    from swiftlite.msswift_api.rollout import envs, multi_turns
    from swiftlite.parallel.base import load_plugins
    from swiftlite.plugin import build_rewards, orms, rm_plugins
    p = tmp_path / "plugin.py"
    p.write_text(MSSWIFT_IMPORTS)
    load_plugins([str(p)])
    try:
        assert not [k for k in sys.modules if k == "swift" or k.startswith("swift.")]
        r, = build_rewards(["async_len"], None)
        assert r(["ab", "abcd"]) == [2.0, 4.0]             # an AsyncORM is awaited
        assert "my_judge" in rm_plugins and "my_scheduler" in multi_turns and "my_env" in envs
        env = envs["my_env"]({"name": "my_env"})                           # builds; its hooks are the plugin's own
        assert env.env_config == {"name": "my_env"}
        with pytest.raises(NotImplementedError, match="implements async reset"):
            asyncio.run(env.reset(None))
        assert multi_turns["my_scheduler"](max_turns=3).max_turns == 3      # a step scheduler runs (plugin_turns)
        config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo",
                                              "--reward_funcs", "async_len", "--multi_turn_scheduler", "my_scheduler"])
        cfg = load_config(config_file, values, validate_paths=False, task="rlhf")
        from swiftlite.train.tasks import task_of
        task_of(cfg).check(cfg)                                            # registered, and runs here
        gkd = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "gkd",
                              "--teacher_model", "tiny-llama-2l", "--multi_turn_scheduler", "my_scheduler"])
        with pytest.raises(UserError, match=r"--multi-turn-scheduler my_scheduler: runs in GRPO"):
            load_config(*gkd, validate_paths=False, task="rlhf")
    finally:
        for reg, key in ((orms, "async_len"), (rm_plugins, "my_judge"), (multi_turns, "my_scheduler"),
                         (envs, "my_env")):
            reg.pop(key, None)


def test_the_planner_counts_a_judges_answers(tmp_path):
    """genrm's scoring call keeps a KV cache of BATCH rows up to the judge's length: a phase of its own after
    the generation round (the larger of the two counts), none for the default plugin."""
    from swiftlite.models.source import resolve_model
    from swiftlite.planner.memory import Workload, estimate
    from swiftlite.planner.recommend import _judge_kv_elems
    from swiftlite.rlhf.reward_model import BATCH
    judge = str(build_tiny_judge(tmp_path / "judge", positions=480))
    shape = resolve_model(judge).shape()
    n = _judge_kv_elems([judge], ["genrm"])
    assert n == 2 * shape.layers * shape.kv_heads * shape.head_dim * 480 * BATCH > 0
    assert _judge_kv_elems([judge], ["default"]) == 0 and _judge_kv_elems(None, None) == 0
    policy = resolve_model("tiny-llama-2l").shape()
    w = Workload(dtype="bf16")
    base = estimate(policy, w, "ddp")
    with_judge = estimate(policy, Workload(dtype="bf16", judge_kv_elems=n), "ddp")
    assert base.generation == 0 and with_judge.generation == n * 2
    big = estimate(policy, Workload(dtype="bf16", judge_kv_elems=10 ** 9), "ddp")   # larger than the backward
    assert big.generation == 2 * 10 ** 9 and big.total - base.total > 10 ** 9
