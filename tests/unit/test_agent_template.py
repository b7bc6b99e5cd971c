"""--agent_template hermes (data/agent.py): ms-swift's agent rows (tools, tool_call, tool_response) written as
the turns ms-swift's hermes agent template gives (swift/agent_template/hermes.py, 3602360a, written out
here), rendered by the chat template; the calls and answers are targets, the responses not; and the
refusals, each naming the row or the flag."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from swiftlite.data.agent import Agent, render_turns
from swiftlite.data.formats import to_messages
from swiftlite.data.templates import default_system
from swiftlite.data.tokenize import IGNORE, encode_messages
from swiftlite.errors import UserError
from swiftlite.models.presets import TINY_TOKENIZER

QWEN_DEFAULT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
#: Qwen2.5's chat template reduced to its turn structure (its default system included).
QWEN_LIKE = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\n" + QWEN_DEFAULT + "<|im_end|>\\n' }}"
             "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>'"
             " + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TOOL = {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
WRAPPED = json.dumps({"type": "function", "function": TOOL})


def _tools_block(system: str) -> str:
    """ms-swift's HermesAgentTemplate._format_tools, written out."""
    return (f"{system}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{WRAPPED}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def _call(city: str) -> str:
    return json.dumps({"name": "get_weather", "arguments": {"city": city}})


ROW = {"tools": json.dumps([TOOL]), "messages": [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Checking."},
    {"role": "tool_call", "content": _call("Paris")},
    {"role": "tool_call", "content": json.dumps({"name": "get_weather", "parameters": '{"city": "Rome"}'})},
    {"role": "tool_response", "content": "18C"},
    {"role": "tool_response", "content": "21C"},
    {"role": "assistant", "content": "Paris 18C, Rome 21C."}]}


@pytest.fixture(scope="module")
def tok():
    t = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    t.chat_template = QWEN_LIKE
    return t


def _turns(row, agent=Agent("hermes", QWEN_DEFAULT), system=None):
    return render_turns(row, to_messages(row, "r:1", agent_roles=True), agent, system, "r:1")


def test_hermes_turns_are_ms_swifts(tok):
    assert default_system(tok, "x") == QWEN_DEFAULT   # read off the chat template
    calls = (f"<tool_call>\n{_call('Paris')}\n</tool_call>\n"
             f"<tool_call>\n{_call('Rome')}\n</tool_call>")
    assert _turns(ROW) == [
        {"role": "system", "content": _tools_block(QWEN_DEFAULT)},   # the template's default system, then tools
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking." + calls},      # merged without a separator, as ms-swift
        {"role": "user", "content": "<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response>"},
        {"role": "assistant", "content": "Paris 18C, Rome 21C."}]
    # the row's own system wins, then --system, as ms-swift's system / default_system
    own = {**ROW, "messages": [{"role": "system", "content": "Be brief."}, *ROW["messages"]]}
    assert _turns(own)[0]["content"] == _tools_block("Be brief.")
    assert _turns(ROW, system="From flag.")[0]["content"] == _tools_block("From flag.")


def test_targets_are_calls_and_answers(tok):
    enc = encode_messages(tok, _turns(ROW), 4096, "r:1")
    target = tok.decode([i for i, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE])
    assert "<tool_call>" in target and "Paris 18C, Rome 21C." in target
    assert "<tool_response>" not in target and "# Tools" not in target and "Weather in" not in target


def test_rows_without_tools_are_unchanged():
    plain = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert _turns(plain) == plain["messages"]
    assert _turns(plain, agent=None) == plain["messages"]


@pytest.mark.parametrize("row,words", [
    ({**ROW}, "pass --agent_template hermes"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool_response", "content": "x"},
                   {"role": "assistant", "content": "a"}]}, "must follow a tool_call"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool_call", "content": "{not json"},
                   {"role": "assistant", "content": "a"}]}, "a tool_call message is not valid JSON"),
    ({"tools": "[1]", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "tools[0] must be a JSON object"),
])
def test_refusals_name_the_row(row, words):
    agent = None if words.startswith("pass") else Agent("hermes")
    with pytest.raises(UserError, match="r:1") as e:
        _turns(row, agent=agent)
    assert words in str(e.value)


def test_agent_roles_refused_where_not_rendered():
    with pytest.raises(UserError, match="read by `swiftlite sft` with --agent_template"):
        to_messages(ROW, "r:1")


@pytest.mark.parametrize("argv,words", [
    (["--agent_template", "glm4"], "--agent_template glm4: not available; hermes, react_en, react_zh, react_grpo are"),
])
def test_rules(argv, words):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", *argv])
    with pytest.raises(UserError, match=words):
        load_config(config_file, values, validate_paths=False)
    with pytest.raises(UserError, match=r"applies to tool-calling chat rows \(sft, rlhf grpo and gkd\)"):
        load_config(*parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--agent_template",
                                     "hermes"]), task="pt", validate_paths=False)
