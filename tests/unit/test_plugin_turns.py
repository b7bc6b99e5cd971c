"""rlhf/plugin_turns.py: a plugin's ms-swift MultiTurnScheduler driven by the turn loop with a stand-in
generator. The schedulers are ms-swift's two shapes: ToolCallScheduler's (examples/train/grpo/plugin/plugin.py:
a ReAct tool call answered inside the assistant's message, the answer's tokens out of the loss, the turn
ended by the stop word "Observation:") and one that appends a user message (the chat template's text
between the turns out of the loss)."""

from __future__ import annotations

import pytest

from swiftlite.errors import UserError
from swiftlite.rlhf.multi_turn import rollout
from swiftlite.rlhf.stop_words import stop_length

EOS, PAD = 258, 259

PLUGIN = '''
import re
from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns


class ToolCalls(MultiTurnScheduler):
    """ms-swift's ToolCallScheduler, its calculator reduced to eval of digits and +."""
    def _calls(self, text):
        m = re.findall(r'Action:\\s*(.*?)\\s*\\nAction Input:\\s*(.*?)(?:\\n|$)', text, re.DOTALL)
        return m or None

    def check_finished(self, infer_request, response_choice, current_turn):
        if self._calls(response_choice.message.content) is None:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn):
        name, expr = self._calls(response_choice.message.content)[0]
        result = ' ' + str(sum(int(x) for x in expr.split('+')))
        infer_request.messages[-1]['content'] += result
        token_ids = response_choice.token_ids
        loss_mask = [1] * len(token_ids)
        extra = self.tokenizer.encode(result, add_special_tokens=False)
        token_ids.extend(extra)
        loss_mask.extend([0] * len(extra))
        self.seen.append((current_turn, infer_request.data_dict['solution'], response_choice.finish_reason))
        return {'infer_request': infer_request, 'response_token_ids': token_ids, 'response_loss_mask': loss_mask,
                'rollout_infos': {'num_turns': current_turn}}

    seen = []


class AskAgain(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'again'})
        return {'infer_request': infer_request}


class Record(MultiTurnScheduler):
    data = []

    def check_finished(self, infer_request, response_choice, current_turn):
        self.data.append(dict(infer_request.data_dict))
        return True


class Hooks(MultiTurnScheduler):
    ends = []

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        self.ends.append((current_turn, response_choice.finish_reason))
        return {}

    def check_finished(self, infer_request, response_choice, current_turn):
        return False      # never done by its own judgement: only --max_turns ends it

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'more'})
        return {'infer_request': infer_request}


class AsyncOnly(MultiTurnScheduler):
    async def async_infer(self, infer_requests, request_config, **kwargs):
        return await super().async_infer(infer_requests, request_config, **kwargs)


multi_turns['tool_calls'] = ToolCalls
multi_turns['ask_again'] = AskAgain
multi_turns['async_only'] = AsyncOnly
multi_turns['record'] = Record
multi_turns['hooks'] = Hooks
'''


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


@pytest.fixture()
def registered(tmp_path):
    from swiftlite.msswift_api.rollout import multi_turns
    from swiftlite.parallel.base import load_plugins
    p = tmp_path / "plugin.py"
    p.write_text(PLUGIN)
    load_plugins([str(p)])
    yield multi_turns
    for k in ("tool_calls", "ask_again", "async_only", "record", "hooks"):
        multi_turns.pop(k, None)


def _layout(prompts, comps):
    from swiftlite.rlhf.vllm_gen import completion_layout
    return completion_layout(prompts, comps, pad_id=PAD, eos_ids=[EOS], device="cpu")


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_a_tool_call_is_answered_inside_the_message_out_of_the_loss_and_continued(tok, registered):
    from swiftlite.rlhf.plugin_turns import PluginTurns
    sched = PluginTurns("tool_calls", registered["tool_calls"], tok, max_turns=5)
    row = {"prompt": [{"role": "user", "content": "2+3?"}], "columns": {"solution": "5"}}
    prompt = tok.encode(tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    # the first turn runs past its stop word: the stop cut keeps it up to "Observation:"
    t1 = _enc(tok, "Action: calculator\nAction Input: 2+3\nObservation:") + _enc(tok, " junk")
    t2 = _enc(tok, " so 5") + [EOS]
    asked = []

    def gen(micro_prompts, micro_seeds, n):
        asked.append(micro_prompts)
        return [_layout(mb, [t2 for _ in mb]) for mb in micro_prompts]

    out, = rollout(sched, gen, [_layout([prompt], [t1])], [[prompt]], [[row]], [[7]], max_new_tokens=64,
                   per_round=True, max_turns=5, eos_ids={EOS}, pad_id=PAD, any_pending=lambda mine: mine,
                   stop=lambda ids: stop_length(tok, ids, ["Observation:"]))
    kept = t1[:stop_length(tok, t1, ["Observation:"])]
    answer = _enc(tok, " 5")
    # the second turn continues the prompt, the first turn and the tool's answer, token for token
    assert asked == [[[prompt + kept + answer]]]
    n = len(kept) + len(answer) + len(t2)
    assert out["completion_ids"][0, :n].tolist() == kept + answer + t2
    assert out["loss_mask"][0, :n].tolist() == [1] * len(kept) + [0] * len(answer) + [1] * len(t2)
    # the scheduler saw the turn number, the row's columns and a stop (not length) finish
    assert registered["tool_calls"].seen[-1] == (1, "5", "stop")




def test_a_step_that_adds_a_user_turn_inserts_the_templates_text_out_of_the_loss(tok, registered):
    from swiftlite.rlhf.plugin_turns import PluginTurns
    sched = PluginTurns("ask_again", registered["ask_again"], tok, max_turns=2)
    row = {"prompt": [{"role": "user", "content": "hi"}], "columns": {}}
    text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    prompt = _enc(tok, text)
    t1, t2 = _enc(tok, "yo") + [EOS], _enc(tok, "ok") + [EOS]
    asked = []

    def gen(micro_prompts, micro_seeds, n):
        asked.append(micro_prompts[0][0])
        return [_layout(mb, [t2 for _ in mb]) for mb in micro_prompts]

    out, = rollout(sched, gen, [_layout([prompt], [t1])], [[prompt]], [[row]], [[7]], max_new_tokens=64,
                   per_round=True, max_turns=2, eos_ids={EOS}, pad_id=PAD, any_pending=lambda mine: mine)
    whole = tok.apply_chat_template(row["prompt"] + [{"role": "assistant", "content": "yo"},
                                                    {"role": "user", "content": "again"}],
                                    tokenize=False, add_generation_prompt=True)
    assert tok.decode(asked[0]) == whole        # the next turn's prompt is the template's rendering
    bridge = _enc(tok, "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    n = len(t1) + len(bridge) + len(t2)
    assert out["completion_ids"][0, :n].tolist() == t1 + bridge + t2
    assert out["loss_mask"][0, :n].tolist() == [1] * len(t1) + [0] * len(bridge) + [1] * len(t2)


def test_on_turn_end_runs_after_every_turn_and_a_length_cut_turn_continues_when_the_scheduler_says_so(tok, registered):
    """ms-swift's MultiTurnScheduler.run: on_turn_end and check_finished after every turn, the one --max_turns
    ends included; a turn cut at the length limit is finished by the base check_finished only, so a scheduler
    that says otherwise continues it."""
    from swiftlite.rlhf.plugin_turns import PluginTurns
    registered["hooks"].ends.clear()
    sched = PluginTurns("hooks", registered["hooks"], tok, max_turns=3)
    row = {"prompt": [{"role": "user", "content": "hi"}], "columns": {}}
    prompt = _enc(tok, tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True))
    cut, done = _enc(tok, "yo yo"), _enc(tok, "ok") + [EOS]      # no end-of-turn token: cut at the length limit

    def gen(micro_prompts, micro_seeds, n):
        return [_layout(mb, [done for _ in mb]) for mb in micro_prompts]

    out, = rollout(sched, gen, [_layout([prompt], [cut])], [[prompt]], [[row]], [[7]], max_new_tokens=64,
                   per_round=True, max_turns=3, eos_ids={EOS}, pad_id=PAD, any_pending=lambda mine: mine)
    assert registered["hooks"].ends == [(1, "length"), (2, "stop"), (3, "stop")]
    assert int(out["completion_mask"][0].sum()) > len(cut) + 2 * len(done)      # three turns and the bridges
    # the base scheduler's rule: a length cut finishes the trajectory after one turn
    from swiftlite.msswift_api.rollout import MultiTurnScheduler
    base = PluginTurns("base", MultiTurnScheduler, tok, max_turns=3)
    out, = rollout(base, gen, [_layout([prompt], [cut])], [[prompt]], [[row]], [[7]], max_new_tokens=64,
                   per_round=True, max_turns=3, eos_ids={EOS}, pad_id=PAD, any_pending=lambda mine: mine)
    assert out["completion_ids"][0].tolist()[:len(cut)] == cut and int(out["completion_mask"][0].sum()) == len(cut)


def test_schedulers_that_cannot_run_here_are_refused_with_the_reason(registered):
    from swiftlite.rlhf.plugin_turns import check_scheduler
    check_scheduler("tool_calls")
    with pytest.raises(UserError, match=r"--multi_turn_scheduler async_only: AsyncOnly overrides async_infer\(\) "
                                        r"but not run\(\)"):
        check_scheduler("async_only")
    with pytest.raises(UserError, match=r"--multi_turn_scheduler nope: no scheduler of that name.*ask_again"):
        check_scheduler("nope")


@pytest.mark.parametrize("mode,passed,columns", [(None, False, True), ("server", False, False),
                                                 ("server", True, True)])
def test_the_scheduler_sees_the_rows_columns_as_msswift_passes_them(tok, registered, mode, passed, columns):
    """ms-swift's --vllm_server_pass_dataset: its server gets the rows' columns only when true; colocated (and
    with transformers' generate here) the scheduler always has them."""
    from types import SimpleNamespace

    from swiftlite.rlhf.multi_turn import build
    o = SimpleNamespace(multi_turn_scheduler="record", max_turns=2, use_vllm=mode is not None, vllm_mode=mode,
                        vllm_server_pass_dataset=passed, gym_env=None, use_gym_env=None)
    sched = build(o, tok)
    row = {"prompt": [{"role": "user", "content": "q"}], "columns": {"solution": "5"}}
    prompt = _enc(tok, "q")
    rollout(sched, lambda *a: [], [_layout([prompt], [_enc(tok, "a") + [EOS]])], [[prompt]], [[row]], [[1]],
            max_new_tokens=8, per_round=True, max_turns=2, eos_ids={EOS}, pad_id=PAD,
            any_pending=lambda mine: mine)
    assert registered["record"].data[-1] == ({"solution": "5"} if columns else {})
