"""rlhf/own_rollout.py: a plugin scheduler that overrides ms-swift's `run` samples through the engine it is
given, with a stand-in generator. Shapes: a two-turn `run` (a user message between the turns), treepo's
(`async_infer` merges identical requests, `run` returns a list of trajectories per merged request and asks for
log-probabilities), and the refusals (one line each). Several rollouts per request: tests/unit/test_turn_rows.py."""

from __future__ import annotations

import math

import pytest
import torch

from swiftlite.errors import UserError

EOS, PAD = 258, 259

#: treepo's async_infer (a plugin class's method): a group's identical requests merged, the trees given back
#: to the requests' ids in order, the sampled tokens' log-probabilities asked for
MERGE = '''
    async def async_infer(self, infer_requests, request_config, *, use_tqdm=None, **kwargs):
        keep, seen, uuids = [], set(), []
        for req in infer_requests:
            uuids.append(req.uuid)
            key = json.dumps(req.messages, sort_keys=True)
            if key not in seen:
                seen.add(key)
                keep.append(req)
        request_config.logprobs = True
        outs = await super().async_infer(keep, request_config, use_tqdm=use_tqdm, **kwargs)
        assert len(outs) == len(uuids), 'width must equal num_generations'
        for i, o in enumerate(outs):
            o.response.id = uuids[i]
        return outs
'''

PLUGIN = '''
import json
from swift.rewards import MultiTurnScheduler, multi_turns
from swift.infer_engine.protocol import RolloutInferRequest, RolloutOutput


class Twice(MultiTurnScheduler):
    async def run(self, infer_request, request_config, **kwargs):
        first = await self.infer_engine.infer_async(infer_request, request_config)
        c1 = first.choices[0]
        infer_request.messages.append({'role': 'assistant', 'content': c1.message.content})
        infer_request.messages.append({'role': 'user', 'content': 'again'})
        second = await self.infer_engine.infer_async(infer_request, request_config)
        c2 = second.choices[0]
        infer_request.messages.append({'role': 'assistant', 'content': c2.message.content})
        return RolloutOutput(response=second, messages=infer_request.messages,
                             response_token_ids=[c1.token_ids, c2.token_ids],
                             response_loss_mask=[[1] * len(c1.token_ids), [0] + [1] * (len(c2.token_ids) - 1)],
                             rollout_infos={'total_reward': float(len(infer_request.data_dict['solution']))})


class Tree(MultiTurnScheduler):
    """treepo's shape: identical requests merged, every root grown into `width` trajectories, the outputs
    given the merged requests' ids in order."""
    width = 2
    seen = []

''' + MERGE + '''
    async def run(self, infer_request, request_config, **kwargs):
        import asyncio
        reqs = [RolloutInferRequest(messages=list(infer_request.messages), uuid=f'{infer_request.uuid}-{k}')
                for k in range(self.width)]
        outs = await asyncio.gather(*[self.infer_engine.infer_async(r, request_config) for r in reqs])
        result = []
        for r, o in zip(reqs, outs):
            c = o.choices[0]
            self.seen.append([item['logprob'] for item in c.logprobs['content']])
            result.append(RolloutOutput(response=o, messages=r.messages + [
                {'role': 'assistant', 'content': c.message.content}], response_token_ids=[c.token_ids]))
        return result


class Split(MultiTurnScheduler):
    async def run(self, infer_request, request_config, **kwargs):
        o = await self.infer_engine.infer_async(infer_request, request_config)
        return [o, o]


class Hot(MultiTurnScheduler):
    async def run(self, infer_request, request_config, **kwargs):
        request_config.temperature = 0.3
        return await self.infer_engine.infer_async(infer_request, request_config)


class Broken(MultiTurnScheduler):
    async def run(self, infer_request, request_config, **kwargs):
        raise KeyError('tool')


for _n, _c in (('twice', Twice), ('tree', Tree), ('split', Split), ('hot', Hot), ('broken', Broken)):
    multi_turns[_n] = _c
'''
NAMES = ("twice", "tree", "split", "hot", "broken")


class Opts:
    temperature, top_p, top_k = 1.0, 1.0, 50
    max_completion_length = 16
    stop_words: list = []
    log_rollout_offpolicy_metrics = False
    use_vllm, vllm_mode, vllm_server_pass_dataset = False, "colocate", False
    gym_env, use_gym_env = None, None
    max_turns = 4


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


@pytest.fixture()
def registered(tmp_path):
    from swiftlite.msswift_api.rollout import multi_turns
    from swiftlite.parallel.base import load_plugins
    p = tmp_path / "own_plugin.py"
    p.write_text(PLUGIN)
    load_plugins([str(p)])
    yield multi_turns
    for k in NAMES:
        multi_turns.pop(k, None)


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


class Gen:
    """A stand-in generator: the k-th call answers every prompt with `turns[k]` (and log-probabilities
    -0.5, -1.5, ... when asked); records each call's prompts, seeds and `first`."""

    def __init__(self, turns, echo=None):
        self.turns, self.calls, self.echo = turns, [], echo

    def __call__(self, micro_prompts, micro_seeds, n, first, logprobs=False):
        from swiftlite.rlhf.vllm_gen import completion_layout
        ids = self.turns[min(len(self.calls), len(self.turns) - 1)]
        self.calls.append((micro_prompts, micro_seeds, first, logprobs))
        outs = []
        for mb in micro_prompts:    # echo=k: each answer starts with its prompt's token at k (the question's)
            lay = completion_layout(mb, [([p[self.echo]] if self.echo else []) + ids for p in mb], pad_id=PAD,
                                    eos_ids=[EOS], device="cpu")
            if logprobs:
                lay = (*lay, torch.tensor([[-0.5 - k for k in range(lay[2].shape[1])] for _ in mb]))
            outs.append(lay)
        return outs


def _sample(sched, gen, rows, prompts, mb=2, options=Opts):
    micro_rows = [rows[i:i + mb] for i in range(0, len(rows), mb)]
    micro_prompts = [prompts[i:i + mb] for i in range(0, len(prompts), mb)]
    seeds = [[11 + i + j for j in range(len(m))] for i, m in enumerate(micro_rows)]
    return sched.sample(gen, options, micro_prompts, seeds, micro_rows, eos_ids={EOS}, pad_id=PAD, lockstep=False,
                        any_pending=lambda mine: mine)


def _build(name, registered, tok, options=Opts):
    from swiftlite.rlhf.multi_turn import build

    class O(options):
        multi_turn_scheduler = name
    return build(O, tok)


def test_a_run_that_samples_two_turns_trains_both_with_the_template_between_them(tok, registered):
    from swiftlite.rlhf.own_rollout import OwnRollout

    class Gym(Opts):
        use_gym_env = True
    sched = _build("twice", registered, tok, Gym)
    assert isinstance(sched, OwnRollout)
    row = {"prompt": [{"role": "user", "content": "hi"}], "columns": {"solution": "abc"}}
    prompt = _enc(tok, tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True))
    t1, t2 = _enc(tok, "yo") + [EOS], _enc(tok, "ok then") + [EOS]
    gen = Gen([t1, t2])
    out, = _sample(sched, gen, [row, row], [prompt, prompt])
    # both requests' first turns in one call (the engine waits until every coroutine has asked), then both second ones
    assert len(gen.calls) == 2 and [len(c[0][0]) for c in gen.calls] == [2, 2]
    assert [c[2] for c in gen.calls] == [True, False]            # the weights are synced before the first call only
    assert gen.calls[0][0][0][0] == prompt
    second = tok.apply_chat_template(row["prompt"] + [{"role": "assistant", "content": "yo"},
                                                      {"role": "user", "content": "again"}],
                                     tokenize=False, add_generation_prompt=True)
    assert tok.decode(gen.calls[1][0][0][0]) == second           # the conversation as the scheduler left it
    bridge = _enc(tok, "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    n = len(t1) + len(bridge) + len(t2)
    for j in range(2):
        assert out["completion_ids"][j, :n].tolist() == t1 + bridge + t2
        assert int(out["completion_mask"][j].sum()) == n
        # the run's loss masks, the template's text out of the loss
        assert out["loss_mask"][j, :n].tolist() == [1] * len(t1) + [0] * len(bridge) + [0] + [1] * (len(t2) - 1)
    assert out["prompt_ids"][0].tolist()[-len(prompt):] == prompt
    assert out["gym_reward"].tolist() == [3.0, 3.0]              # rollout_infos' total_reward
    # seeds differ between the calls and between the completions of one call
    s = [x for c in gen.calls for mb in c[1] for x in mb]
    assert len(set(s)) == len(s)


def test_treepos_shape_merges_a_group_grows_it_back_and_gets_log_probabilities(tok, registered):
    sched = _build("tree", registered, tok)
    registered["tree"].seen.clear()
    rows = [{"prompt": [{"role": "user", "content": q}], "columns": {}} for q in ("a", "a", "b", "b")]
    prompts = [_enc(tok, tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True))
               for r in rows]
    t = _enc(tok, "x y") + [EOS]
    gen = Gen([t])
    outs = _sample(sched, gen, rows, prompts)
    assert len(gen.calls) == 1 and gen.calls[0][3] is True       # one batch: 2 roots x 2 branches, logprobs asked
    assert sum(len(mb) for mb in gen.calls[0][0]) == 4
    assert registered["tree"].seen == [[-0.5 - k for k in range(len(t))]] * 4
    for out in outs:
        assert out["completion_ids"][:, :len(t)].tolist() == [t, t]
        assert "rollout_logps" not in out         # the run did not ask for them (--log_rollout_offpolicy_metrics)

    # a process's micro-batches may interleave two groups: the requests go grouped (ms-swift's order), and each
    # trajectory comes back to its own completion
    mixed = [rows[0], rows[2], rows[1], rows[3]]
    at = -2 - len(_enc(tok, tok.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False,
                                                     add_generation_prompt=True).split("a<|im_end|>")[1]))
    outs = _sample(sched, Gen([t], echo=at), mixed, [prompts[0], prompts[2], prompts[1], prompts[3]])
    firsts = [int(out["completion_ids"][j, 0]) for out in outs for j in range(2)]
    assert [tok.decode([x]) for x in firsts] == ["a", "b", "a", "b"]

    class Offpolicy(Opts):
        log_rollout_offpolicy_metrics = True
    sched = _build("tree", registered, tok, Offpolicy)
    outs = _sample(sched, Gen([t]), rows, prompts, options=Offpolicy)
    assert outs[0]["rollout_logps"][0, :len(t)].tolist() == [-0.5 - k for k in range(len(t))]


def test_other_sampling_settings_and_a_failing_run_are_refused(tok, registered):
    row = {"prompt": [{"role": "user", "content": "hi"}], "columns": {}}
    prompt = _enc(tok, tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True))
    t = _enc(tok, "x") + [EOS]
    with pytest.raises(UserError, match=r"asked for temperature 0.3 \(the run's --temperature 1.0\)"):
        _sample(_build("hot", registered, tok), Gen([t]), [row], [prompt])
    with pytest.raises(UserError, match=r"--multi_turn_scheduler broken: its rollout raised KeyError: 'tool'"):
        _sample(_build("broken", registered, tok), Gen([t]), [row], [prompt])


def test_fsdp1_lockstep_and_async_infer_alone_are_refused_before_launch(tok, registered):
    from swiftlite.rlhf.own_rollout import OWN_LOCKSTEP
    sched = _build("twice", registered, tok)
    with pytest.raises(UserError, match="fsdp1 samples in lockstep"):
        sched.sample(Gen([[EOS]]), Opts, [[[1]]], [[1]], [[{"prompt": [], "columns": {}}]], eos_ids={EOS},
                     pad_id=PAD, lockstep=True, any_pending=lambda mine: mine)
    assert "fsdp1" in OWN_LOCKSTEP


def test_the_rollout_engine_path_of_the_server_returns_log_probabilities(tok):
    """The rollout server's transformers engine with Sampling.logprobs: (ids, log-probabilities) pairs that are
    the generator's own (rlhf/generate.sample's record)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftlite.rlhf.generate import sample
    from swiftlite.rollout.engines import Sampling, TransformersEngine
    torch.manual_seed(0)
    conf = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                num_key_value_heads=2, num_hidden_layers=2, vocab_size=300, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa").eval()
    e = TransformersEngine(model)
    s = Sampling(max_tokens=6, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[EOS], pad_id=PAD, logprobs=True)
    (pair,), = e.generate([[[1, 2, 3]]], [[5]], s)
    ids, lps = pair
    _, _, cids, cmask, lp = sample(model, [[1, 2, 3]], [5], pad_id=PAD, eos_id=[EOS], max_new_tokens=6,
                                   temperature=1.0, top_p=1.0, top_k=0, device="cpu", logprobs=True)
    assert ids == cids[0, :int(cmask[0].sum())].tolist() and len(lps) == len(ids)
    assert all(math.isfinite(v) and v <= 0 for v in lps)
    assert lps == pytest.approx(lp[0, :len(ids)].tolist(), abs=1e-6)
    plain = e.generate([[[1, 2, 3]]], [[5]], Sampling(6, 1.0, 1.0, 0, [EOS], PAD))
    assert plain == [[ids]]
