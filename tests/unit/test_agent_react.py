"""--agent_template react_en / react_zh (data/agent_react.py): ms-swift's ReAct rows (swift/agent_template/
react.py and base.py, 3602360a; the expected texts are written out here from that source), which turn
parts are targets under the default, `react` and `last_round` loss scales, and the refusals."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from swiftlite.config.loss_scale import parse
from swiftlite.data.agent import Agent, render_turns
from swiftlite.data.formats import to_messages
from swiftlite.data.tokenize import IGNORE, encode_messages
from swiftlite.errors import UserError
from swiftlite.models.presets import TINY_TOKENIZER

TOOL = {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
PARAMS = json.dumps(TOOL["parameters"])
#: ms-swift's ReactEnAgentTemplate._format_tools for TOOL, written out
EN_SYSTEM = (
    "Answer the following questions as best you can. You have access to the following tools:\n\n"
    f"get_weather: Call this tool to interact with the get_weather API. What is the get_weather API useful for? "
    f"Weather of a city Parameters: {PARAMS} Format the arguments as a JSON object.\n\n"
    "Use the following format:\n\nQuestion: the input question you must answer\n"
    "Thought: you should always think about what to do\n"
    "Action: the action to take, should be one of [get_weather]\n"
    "Action Input: the input to the action\nObservation: the result of the action\n"
    "... (this Thought/Action/Action Input/Observation can be repeated zero or more times)\n"
    "Thought: I now know the final answer\nFinal Answer: the final answer to the original input question\n\n"
    "Begin!\n")
QWEN_LIKE = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>'"
             " + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CALLS = ("Action: get_weather\nAction Input: {'city': 'Paris'}\n"
         "Action: get_weather\nAction Input: {'city': 'Rome'}\nObservation:")


def _call(city: str) -> str:
    return json.dumps({"name": "get_weather", "arguments": {"city": city}})


def _row(*messages, tools=True, system=None):
    ms = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Weather in Paris and Rome?"}, *messages]
    return {**({"tools": json.dumps([TOOL])} if tools else {}), "messages": ms}


CALL_ROW = _row({"role": "assistant", "content": "Thought: look both up\n"},
                {"role": "tool_call", "content": _call("Paris")},
                {"role": "tool_call", "content": json.dumps({"name": "get_weather", "parameters": '{"city": "Rome"}'})},
                {"role": "tool_response", "content": "18C"}, {"role": "tool_response", "content": "21C"},
                {"role": "assistant", "content": "Thought: I now know the final answer\nFinal Answer: 18C, 21C."})
#: the call as one assistant message, as ms-swift's own react data (function-calling-chatml) writes it
ONE_ROW = _row({"role": "assistant", "content": "Thought: look both up\n" + CALLS},
               {"role": "tool_response", "content": "18C"}, {"role": "tool_response", "content": "21C"},
               {"role": "assistant", "content": "Final Answer: 18C, 21C."})


@pytest.fixture(scope="module")
def tok():
    t = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    t.chat_template = QWEN_LIKE
    return t


def _turns(row, name="react_en", system=None):
    return render_turns(row, to_messages(row, "r:1", agent_roles=True), Agent(name, "Default sys."), system, "r:1")


def test_system_is_ms_swifts_tool_prompt():
    # the tool prompt replaces the row's system and --system (ms-swift's react templates write it alone)
    for row, system in ((CALL_ROW, None), (_row({"role": "assistant", "content": "a"}, system="Be brief."), None),
                        (CALL_ROW, "From flag.")):
        assert _turns(row, system=system)[0] == {"role": "system", "content": EN_SYSTEM}
    zh = _turns(CALL_ROW, "react_zh")[0]["content"]
    assert zh.startswith("尽可能地回答以下问题。你可以使用以下工具:\n\nget_weather: 调用此工具与 get_weather API 进行交互。")
    assert "Action: 需要使用的工具，应该是[get_weather]中的一个\n" in zh and zh.endswith("现在开始！\n")


def test_merged_answer_joins_responses_as_they_are():
    """An answer text then its calls (two messages merged): ms-swift's list-membership test fails, so the
    responses are joined without `Observation:` between them."""
    turns = _turns(CALL_ROW)
    answer = turns[-1]
    assert [m["role"] for m in turns] == ["system", "user", "assistant"]
    assert answer["content"] == ("Thought: look both up\n" + CALLS + "18C21C"
                                 + "Thought: I now know the final answer\nFinal Answer: 18C, 21C.")
    assert [(p["text"], p["tool"]) for p in answer["pieces"]] == [
        ("Thought: look both up\n", False), (CALLS, False), ("18C21C", True),
        ("Thought: I now know the final answer\nFinal Answer: 18C, 21C.", False)]


def test_single_call_message_gets_observation_between_responses():
    answer = _turns(ONE_ROW)[-1]
    assert answer["content"] == "Thought: look both up\n" + CALLS + "18C\nObservation:21C\nFinal Answer: 18C, 21C."
    # a call text without the trailing `Observation:` gets it, as ms-swift adds it
    bare = _row({"role": "assistant", "content": "Action: get_weather\nAction Input: {}"},
                {"role": "tool_response", "content": "18C\n"}, {"role": "assistant", "content": "Done."})
    assert _turns(bare)[-1]["content"] == "Action: get_weather\nAction Input: {}\nObservation:18C\nDone."


def test_standalone_response_goes_into_the_user_turn():
    row = _row({"role": "tool_response", "content": "18C"}, {"role": "assistant", "content": "It is 18C."},
               tools=False)
    assert _turns(row) == [{"role": "user", "content": "Weather in Paris and Rome?\nObservation:\n18C"},
                           {"role": "assistant", "content": "It is 18C."}]


@pytest.mark.parametrize("messages,words", [
    ([{"role": "tool_call", "content": _call("Paris")}, {"role": "tool_response", "content": "18C"}],
     "must be followed by the assistant's answer"),
    ([{"role": "tool_call", "content": _call("Paris")}, {"role": "tool_response", "content": "18C"},
      {"role": "user", "content": "and?"}], "must be followed by the assistant's answer"),
    ([{"role": "tool_call", "content": "{not json"}, {"role": "assistant", "content": "a"}], "not valid JSON"),
])
def test_refusals_name_the_row(messages, words):
    with pytest.raises(UserError, match="r:1") as e:
        _turns(_row(*messages))
    assert words in str(e.value)


def _targets(tok, row, scale=None):
    enc = encode_messages(tok, _turns(row), 4096, "r:1", loss_scale=parse(scale))
    text = tok.decode([i for i, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE])
    weights = None
    if enc.weights is not None:
        weights = {}
        for i, lab, w in zip(enc.input_ids, enc.labels, enc.weights):
            if lab != IGNORE:
                weights.setdefault(w, []).append(i)
        weights = {w: tok.decode(ids) for w, ids in weights.items()}
    return text, weights


def test_targets_are_answers_not_tool_responses(tok):
    text, _ = _targets(tok, ONE_ROW)
    assert "Action Input: {'city': 'Paris'}" in text and "Final Answer: 18C, 21C." in text
    assert "18C\nObservation:21C" not in text and "Answer the following" not in text and "Paris and Rome?" not in text
    assert text.rstrip().endswith("<|im_end|>")   # the turn's end token, as ms-swift's suffix


def test_react_scale_weighs_actions_twice(tok):
    _, weights = _targets(tok, ONE_ROW, "react")
    assert "get_weather" in weights[2.0] and "Action Input:" in weights[2.0]
    assert "Final Answer: 18C, 21C." in weights[1.0]
    assert "21C\n" not in "".join(weights.values()).replace("Final Answer: 18C, 21C.", "")


def test_last_round_trains_the_answer_after_the_last_response(tok):
    text, _ = _targets(tok, ONE_ROW, "last_round")
    assert "Final Answer: 18C, 21C." in text and "Action:" not in text and "look both up" not in text


def test_per_piece_loss_field(tok):
    row = _row({"role": "tool_call", "content": _call("Paris"), "loss": False},
               {"role": "tool_response", "content": "18C"}, {"role": "assistant", "content": "Done.", "loss": True})
    pieces = _turns(row)[-1]["pieces"]
    assert [(p["tool"], p.get("loss")) for p in pieces] == [(False, False), (True, None), (False, True)]
    text, _ = _targets(tok, row)
    assert "Done." in text and "Action:" not in text   # the call's own loss: false holds inside the turn
