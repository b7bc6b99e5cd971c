"""ms-swift's ReAct rewards (swiftlite/plugin.py): `toolbench` (ReactORM) and `react_format` (ReActFormat),
case by case as ms-swift's code decides them (swift/rewards/orm.py), and --agent_template react_grpo's system
text, word for word ms-swift's ReactGRPOAgentTemplate's."""

from __future__ import annotations

import pytest

from swiftlite.plugin import ReActFormat, ReactORM, orms

REF = 'Action: get_weather\nAction Input: {"city": "Paris", "unit": "C"}'


@pytest.mark.parametrize("completion,want", [
    ('<think>x</think>\nAction: get_weather\nAction Input: {"city": "Paris", "unit": "C"}', 1.0),
    ('Action: get_weather\nAction Input: {"unit": "C", "city": "Paris"}\nObservation:', 1.0),   # key order, trailer
    ('Action: get_weather\nAction Input: {"city": "Paris", "unit": "C"}<|im_end|>', 1.0),
    ('Action: get_weather\nAction Input: {"city": "Rome", "unit": "C"}', 0.0),      # a value differs: F1 0.75
    ('Action: get_weather\nAction Input: {"city": "Paris"}', 0.0),                  # a key missing
    ('Action: get_time\nAction Input: {"city": "Paris", "unit": "C"}', 0.0),        # another action
    ('Action: get_weather\nAction Input: city=Paris', 0.0),                         # not JSON, the reference is
    ('no action at all', 0.0),
])
def test_toolbench_matches_ms_swift(completion, want):
    assert ReactORM()([completion], [REF]) == [want]


def test_toolbench_empty_and_non_json_inputs():
    empty = "Action: ping\nAction Input: {}"
    assert ReactORM()(["Action: ping", "Action: ping\nAction Input: {\"a\": 1}"], [empty, empty]) == [1.0, 0.0]
    text = "Action: search\nAction Input: weather in Paris"   # ms-swift's ROUGE-L branch never reaches its bar
    assert ReactORM()([text], [text]) == [0.0]
    assert ReactORM.parse("Action: a\nAction Input: {}\nAction: b\nAction Input: {\"x\": 1}") == ("b", '{"x": 1}')


def test_react_format_and_the_registry():
    ok = "<think>plan</think>\nAction: get_weather\nAction Input: {}"
    assert ReActFormat()([ok, "Action: get_weather\nAction Input: {}", "<think>p</think> Final Answer: 3"]) == \
        [1.0, 0.0, 0.0]
    assert orms["toolbench"] is ReactORM and orms["react_format"] is ReActFormat


def test_react_grpo_system_text():
    from swiftlite.data.agent_react import tools_prompt
    tool = {"name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    text = tools_prompt([tool], "react_grpo", "row 1")
    assert text.startswith("A conversation for tool calling between User and Assistant.")
    assert "<think> </think>tags and answer should follow the ReACT format(Action:xxx\nAction Input:xxx)" in text
    assert "get_weather: Call this tool to interact with the get_weather API." in text
    assert "Action: the action to take, should be one of [get_weather]" in text and text.endswith("Begin!\n")
