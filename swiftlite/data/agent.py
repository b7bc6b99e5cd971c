"""--agent_template: tool-calling rows (ms-swift's agent format) rendered as plain turns before the chat
template renders them.

The rows: `messages` with ms-swift's roles `tool_call` (the content a JSON object with `name` and
`arguments`, or `parameters`) and `tool_response` (or OpenAI's `tool`), and a `tools` column (a list of
tool descriptions, JSON objects or JSON strings, or a JSON string of that list). ms-swift's
AI-ModelScope/function-calling-chatml is in this form after its preprocessing.

`hermes` (swift/agent_template/hermes.py, ms-swift 3602360a; Qwen2.5's and Qwen3's own tool format):
- the tools go into the system turn: the conversation's system text (the row's, else --system, else
  the chat template's own default system, e.g. Qwen2.5's "You are Qwen, ..."), a blank line, then the
  `# Tools` block listing each tool as JSON inside <tools></tools>;
- consecutive tool calls become one assistant turn, `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`
  joined by newlines, appended without a separator to an assistant text just before them (ms-swift
  merges consecutive assistant messages so);
- consecutive tool responses become one user turn, each `<tool_response>\\n...\\n</tool_response>`, joined by
  newlines: the turn ms-swift's hermes template writes with the chat template's user prompt.
The assistant turns (tool calls included) are the targets, the tool responses not, as in ms-swift.

`react_en` / `react_zh`: ms-swift's ReAct format, data/agent_react.py (tool responses written into the
answer's own turn).

A tool-calling row without --agent_template is refused, naming the choice: ms-swift picks its default
from its own template table, which swiftlite does not have. Other agent templates (glm4, llama3, ...)
are refused by the rules, with these as the alternatives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from swiftlite.data.agent_rows import (TOOL_CALL, TOOL_RESPONSES, answer_fields, is_agent_row, parse_call,
                                       row_tools)
from swiftlite.errors import UserError

_HERMES_TOOLS = """

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class Agent:
    """The run's --agent_template and the chat template's default system text (for a tools row
    without a system turn)."""
    name: str
    default_system: str | None = None


def render_turns(row: dict, messages: list[dict], agent: Agent | None, system: str | None,
                 where: str) -> list[dict]:
    """The row's messages with its tools, tool calls and tool responses written as system, assistant
    and user turns (`agent`: --agent_template; `system`: --system). Rows without any are returned as
    they are."""
    if not is_agent_row(row, messages):
        return messages
    if agent is None:
        raise UserError(f"{where}: a tool-calling row (tools, tool_call or tool_response): pass --agent_template "
                        "hermes (the tool format of Qwen2.5's and Qwen3's chat templates, ms-swift's default for them) "
                        "or react_en / react_zh / react_grpo (ReAct: Action / Action Input / Observation)")
    if agent.name != "hermes":
        from swiftlite.data.agent_react import render_react
        return render_react(row, messages, agent.name, where)
    tools = row_tools(row, where)
    out: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == TOOL_CALL:
            text = f"<tool_call>\n{json.dumps(parse_call(m['content'], where), ensure_ascii=False)}\n</tool_call>"
            if out and out[-1]["role"] == "assistant":
                # joined into the answer before it: each of "loss"/"loss_scale" from the first message
                # that has it (ms-swift: the first tool_call's)
                sep = "\n" if out[-1].get("tool_call") else ""
                fields = {**answer_fields(m), **answer_fields(out[-1])}
                out[-1] = {"role": "assistant", "content": out[-1]["content"] + sep + text, "tool_call": True,
                           **fields}
            else:
                out.append({"role": "assistant", "content": text, "tool_call": True, **answer_fields(m)})
        elif role in TOOL_RESPONSES:
            if not out or not (out[-1].get("tool_call") or out[-1].get("tool_response")):
                raise UserError(f"{where}: a {role} turn must follow a tool_call (the call it answers)")
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_response"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text, "tool_response": True}
            else:
                out.append({"role": "user", "content": text, "tool_response": True})
        else:
            out.append(dict(m))
    if tools:
        block = _HERMES_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + block}
        else:
            base = system if system is not None else (agent.default_system or "")
            out.insert(0, {"role": "system", "content": base + block})
    return [{"role": m["role"], "content": m["content"], **answer_fields(m)} for m in out]
