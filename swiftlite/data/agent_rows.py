"""Reading ms-swift's agent rows (its `tools` column and `tool_call` / `tool_response` roles, described in
data/agent.py), shared by the agent templates: hermes (data/agent.py) and ReAct (data/agent_react.py).
Each refusal names the row."""

from __future__ import annotations

import json
from typing import Any

from swiftlite.errors import UserError

#: ms-swift's roles of an agent row; `tool` is OpenAI's name for a tool response.
TOOL_CALL, TOOL_RESPONSES = "tool_call", ("tool_response", "tool")


def read_json(value: Any, where: str, what: str) -> Any:
    """A JSON string parsed (a value already parsed is returned as it is)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise UserError(f"{where}: {what} is not valid JSON: {value[:80]!r}") from None


def row_tools(row: dict, where: str) -> list[dict]:
    """The row's tools, each as OpenAI's {"type": "function", "function": {...}} (ms-swift's form)."""
    raw = read_json(row.get("tools"), where, "'tools'")
    if raw in (None, "", []):
        return []
    items = raw if isinstance(raw, list) else [raw]
    out = []
    for i, t in enumerate(items):
        t = read_json(t, where, f"tools[{i}]")
        if not isinstance(t, dict):
            raise UserError(f"{where}: tools[{i}] must be a JSON object describing a tool")
        out.append(t if ("type" in t or "function" in t) else {"type": "function", "function": t})
    return out


def parse_call(content: str, where: str) -> dict:
    """A tool_call message as {"name", "arguments"} (its `parameters` too, a JSON string parsed)."""
    obj = read_json(content, where, "a tool_call message")
    if not isinstance(obj, dict) or "name" not in obj:
        raise UserError(f"{where}: a tool_call message must be a JSON object with 'name' and 'arguments'")
    args = obj.get("arguments", obj.get("parameters"))
    args = read_json(args, where, f"the arguments of tool call {obj['name']!r}")
    if args is None:
        raise UserError(f"{where}: tool call {obj['name']!r} has no 'arguments'")
    return {"name": obj["name"], "arguments": args}


def is_agent_row(row: dict, messages: list[dict]) -> bool:
    """A row in ms-swift's agent format: a tools column or its tool_call / tool_response roles. (A row
    whose only tool turns are OpenAI's `tool` role is left to the chat template, as before.)"""
    return bool(row.get("tools")) or any(m["role"] in (TOOL_CALL, "tool_response") for m in messages)


def answer_fields(m: dict) -> dict:
    """An answer's own "loss" / "loss_scale" (data/formats.ANSWER_FIELDS)."""
    return {k: m[k] for k in ("loss", "loss_scale") if k in m}
