"""--agent_template react_en / react_zh: ms-swift's ReAct tool format (swift/agent_template/react.py and
base.py, ms-swift 3602360a).

What ms-swift writes, and so what is written here:
- the tools become the whole system text: "Answer the following questions as best you can. You have
  access to the following tools: ..." with each tool's name, description and parameters, then the
  Thought / Action / Action Input / Observation format. ms-swift's react templates ignore the row's
  system text and --system when the row has tools (they write the tool prompt in place of it);
- each group of consecutive tool calls becomes `Action: <name>\\nAction Input: <arguments>\\n` per call,
  then `Observation:`. The arguments are written as ms-swift's f-string writes the parsed JSON object,
  with Python's str() (`{'city': 'Paris'}`), not as JSON;
- a tool response is not a turn of its own: it is written into the same assistant turn, right after
  `Observation:`, and the answer goes on after it (`...Observation:{"temp": 20}\\nThought: ...Final
  Answer: ...`), so an assistant turn is made of pieces, answers (targets) and tool responses (not).
  When the answer before the responses is one message that holds `Action:` and `Action Input:`, each
  response is followed by a newline when it has none and the second and later ones are preceded by
  `Observation:`; when that answer was merged from several messages (an answer text, then its tool
  call), ms-swift's test is a list membership that fails, and the responses are joined as they are.
  That is ms-swift's text; it is kept so that a model trained here reads as one trained there;
- a tool response right after a user turn (no call before it) is appended to that turn as
  `\\nObservation:\\n<response>` (ms-swift's standalone tool responses).
A tool response must be followed by the assistant's answer (ms-swift pairs it with one); a row that
ends with one, or goes on with a user turn, is refused.

The pieces travel in the message's "pieces" list ({"text", "tool", and the answer's own "loss" /
"loss_scale"}); data/tokenize.py turns them into target ranges, where --loss-scale's strategy sees each
answer piece as a round of its own (last_round: the answer after the last tool response), as ms-swift
does. Each piece's own fields are its message's (a group of tool calls: the first call's that has one).
"""

from __future__ import annotations

import json
from typing import Any

from swiftlite.data.agent_rows import TOOL_CALL, TOOL_RESPONSES, answer_fields, parse_call, row_tools
from swiftlite.errors import UserError

ACTION, ACTION_INPUT, OBSERVATION = "Action:", "Action Input:", "Observation:"

_EN = ("Answer the following questions as best you can. You have access to the following tools:\n\n", """

Use the following format:

Question: the input question you must answer
Thought: you should always think about what to do
Action: the action to take, should be one of [{names}]
Action Input: the input to the action
Observation: the result of the action
... (this Thought/Action/Action Input/Observation can be repeated zero or more times)
Thought: I now know the final answer
Final Answer: the final answer to the original input question

Begin!
""")
#: react_grpo (ms-swift's ReactGRPOAgentTemplate, swift/agent_template/extra.py): the English tool lines, the
#: reasoning in <think></think> before each Action, for GRPO's format rewards (react_format)
_GRPO = ("A conversation for tool calling between User and Assistant. The user asks a question which may be solved "
         "by calling tools, and the Assistant solves it. The assistant first thinks about the reasoning process in "
         "the mind and then provides the user with the answer. The reasoning process should be enclosed within "
         "<think> </think>tags and answer should follow the ReACT format(Action:xxx\nAction Input:xxx), i.e., "
         "<think> reasoning process here </think> Action: action here\nAction Input: parameters here\n\n"
         "Answer the following questions as best as you can. You have access to the following tools:\n\n", """

Use the following format:

<think>you should always think about what to do</think>
Action: the action to take, should be one of [{names}]
Action Input: the input to the action
Observation: the result of the action, given by the actual calling
... (this Thought/Action/Action Input/Observation can be repeated zero or more times)
Final Answer: the final answer to the original input question

Begin!
""")
_ZH = ("尽可能地回答以下问题。你可以使用以下工具:\n\n", """

请按照以下格式进行:

Question: 需要你回答的输入问题
Thought: 你应该总是思考该做什么
Action: 需要使用的工具，应该是[{names}]中的一个
Action Input: 传入工具的内容
Observation: 行动的结果
... (这个Thought/Action/Action Input/Observation可以重复N次)
Thought: 我现在知道最后的答案
Final Answer: 对原始输入问题的最终答案

现在开始！
""")


def _describe(tool: dict, zh: bool, where: str, i: int) -> tuple[str, str]:
    """(name, description line) of one tool, as ms-swift's _parse_tool and _format_tools write them."""
    t = tool["function"] if "type" in tool and "function" in tool else tool
    name = t.get("name_for_model") or t.get("name")
    human = t.get("name_for_human") or name
    desc = t.get("description")
    if desc is None:
        desc = t.get("description_for_model")
    if name is None or desc is None:
        raise UserError(f"{where}: tools[{i}] needs a 'name' and a 'description' (react agent templates write both)")
    params = t.get("parameters") or {}
    params = params if isinstance(params, str) else json.dumps(params, ensure_ascii=False)
    if zh:
        line = (f"{name}: 调用此工具与 {human} API 进行交互。{human} 有什么用？{desc} 输入参数：{params} "
                "此工具的输入应为JSON对象。")
    else:
        line = (f"{name}: Call this tool to interact with the {human} API. What is the {human} API useful for? "
                f"{desc} Parameters: {params} Format the arguments as a JSON object.")
    return name, line


def tools_prompt(tools: list[dict], name: str, where: str) -> str:
    """The system text of a row with tools (module docstring)."""
    head, tail = {"react_zh": _ZH, "react_grpo": _GRPO}.get(name, _EN)
    described = [_describe(t, name == "react_zh", where, i) for i, t in enumerate(tools)]
    return head + "\n\n".join(d for _, d in described) + tail.format(names=",".join(n for n, _ in described))


def _calls_text(group: list[dict], where: str) -> str:
    text = ""
    for m in group:
        c = parse_call(m["content"], where)
        text += f"{ACTION} {c['name']}\n{ACTION_INPUT} {c['arguments']}\n"
    return text + OBSERVATION


def _responses_text(answer: list[dict], group: list[dict]) -> str:
    """The tool responses after `answer` (the pieces since the turn's start or its last response),
    ms-swift's _format_tool_responses; may end the answer with `Observation:` as ms-swift does."""
    texts = [str(m["content"]) for m in group]
    if len(answer) == 1:   # one message: ms-swift tests its text
        last = answer[0]
        with_action = ACTION in last["text"] and ACTION_INPUT in last["text"]
    else:                  # merged messages: ms-swift tests membership in the list of their texts
        with_action = ACTION in [p["text"] for p in answer] and ACTION_INPUT in [p["text"] for p in answer]
    if not with_action:
        return "".join(texts)
    last = answer[-1]
    if not last["text"].endswith(OBSERVATION):
        last["text"] += ("" if last["text"].endswith("\n") else "\n") + OBSERVATION
    out = ""
    for i, t in enumerate(texts):
        out += (OBSERVATION if i else "") + t + ("" if t.endswith("\n") else "\n")
    return out


def render_react(row: dict, messages: list[dict], name: str, where: str) -> list[dict]:
    """The row's messages in ms-swift's ReAct form (module docstring): plain turns, the assistant ones
    with their "pieces" when tool responses are written into them."""
    tools = row_tools(row, where)
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m, role = messages[i], messages[i]["role"]
        j = i + 1
        if role == TOOL_CALL:
            while j < len(messages) and messages[j]["role"] == TOOL_CALL:
                j += 1
            group = messages[i:j]
            fields = {k: v for g in reversed(group) for k, v in answer_fields(g).items()}
            _answer(out, {"text": _calls_text(group, where), "tool": False, **fields})
        elif role in TOOL_RESPONSES:
            while j < len(messages) and messages[j]["role"] in TOOL_RESPONSES:
                j += 1
            group = messages[i:j]
            if out and out[-1]["role"] == "assistant":
                pieces = out[-1]["pieces"]
                k = max((n + 1 for n, p in enumerate(pieces) if p["tool"]), default=0)
                pieces.append({"text": _responses_text(pieces[k:], group), "tool": True})
                if j == len(messages) or messages[j]["role"] not in ("assistant", TOOL_CALL):
                    raise UserError(f"{where}: a {role} turn must be followed by the assistant's answer "
                                    f"(--agent_template {name} writes the response into the answer's turn)")
            elif out and out[-1]["role"] == "user":
                out[-1]["content"] += "".join(f"\n{OBSERVATION}\n{g['content']}" for g in group)
            else:
                raise UserError(f"{where}: a {role} turn must follow a user turn or an answer")
        elif role == "assistant":
            _answer(out, {"text": str(m["content"]), "tool": False, **answer_fields(m)})
        else:
            out.append(dict(m))
        i = j
    if tools:
        out = [m for m in out if m["role"] != "system"]
        out.insert(0, {"role": "system", "content": tools_prompt(tools, name, where)})
    return [_finish(m) for m in out]


def _answer(out: list[dict], piece: dict) -> None:
    """An answer piece: joined to the assistant turn before it (ms-swift merges consecutive answers and
    writes tool responses into the turn), else a new turn."""
    if out and out[-1]["role"] == "assistant":
        out[-1]["pieces"].append(piece)
    else:
        out.append({"role": "assistant", "pieces": [piece]})


def _finish(m: dict) -> dict:
    if m["role"] != "assistant":
        return {"role": m["role"], "content": m["content"], **answer_fields(m)}
    pieces = m["pieces"]
    text = "".join(p["text"] for p in pieces)
    if len(pieces) == 1:
        return {"role": "assistant", "content": text, **answer_fields(pieces[0])}
    return {"role": "assistant", "content": text, "pieces": pieces}
