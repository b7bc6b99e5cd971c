"""Row formats -> one conversation form (a list of {"role", "content"} messages).

Formats are detected per row from its keys, through a registry of (name, detector, converter), so a
new format is one entry. Supported: messages (OpenAI / ms-swift), sharegpt (conversations with
from/value or role/content), alpaca (instruction/input/output, optional system/history),
query/response (optional system/history), TRL's prompt/completion (strings, or lists of
{role, content} messages), and plain text (for `swiftlite pt`).
"""

from __future__ import annotations

from typing import Any, Callable

from swiftlite.errors import UserError

Message = dict[str, str]
Converter = Callable[[dict[str, Any], str], list[Message]]

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                  "tool": "tool"}
ROLES = ("system", "user", "assistant", "tool")
#: ms-swift's agent roles (data/agent.py renders them, with --agent_template).
AGENT_ROLES = ("tool_call", "tool_response")


def _text(v: Any, where: str, key: str) -> str:
    if v is None:
        return ""
    if not isinstance(v, str):
        raise UserError(f"{where}: '{key}' must be a string, got {type(v).__name__}")
    return v


def _history(row: dict, where: str) -> list[Message]:
    out: list[Message] = []
    hist = row.get("history") or []
    if not isinstance(hist, list):
        raise UserError(f"{where}: 'history' must be a list of [query, response] pairs")
    for i, pair in enumerate(hist):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise UserError(f"{where}: history[{i}] must be a [query, response] pair")
        out += [{"role": "user", "content": _text(pair[0], where, f"history[{i}][0]")},
                {"role": "assistant", "content": _text(pair[1], where, f"history[{i}][1]")}]
    return out


def _system(row: dict, where: str) -> list[Message]:
    s = row.get("system")
    return [{"role": "system", "content": _text(s, where, "system")}] if s else []


#: ms-swift's per-message fields of an answer (its custom-dataset docs): "loss" true/false trains the turn
#: or not whatever --loss-scale's strategy says; "loss_scale" (a number >= 0) is the turn's weight
#: (config/loss_scale.py). null is the same as absent (HF datasets give every message every key).
ANSWER_FIELDS = ("loss", "loss_scale")


def _answer_fields(m: dict, where: str, key: str, i: int) -> dict:
    out = {}
    loss, scale = m.get("loss"), m.get("loss_scale")
    if loss is None and scale is None:
        return out
    if m["role"] not in ("assistant", "tool_call"):
        f = "loss" if loss is not None else "loss_scale"
        raise UserError(f"{where}: {key}[{i}].{f}: only an assistant turn (or a tool_call) is trained or weighted; "
                        f"this one is {m['role']!r} (ms-swift reads the field on answers only)")
    if loss is not None:
        if not isinstance(loss, bool):
            raise UserError(f"{where}: {key}[{i}].loss must be true, false or null, got {loss!r}")
        out["loss"] = loss
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0:
            raise UserError(f"{where}: {key}[{i}].loss_scale must be a number >= 0 or null, got {scale!r}")
        out["loss_scale"] = float(scale)
    return out


def no_answer_fields(msgs: list[Message], where: str, what: str) -> None:
    """Preference and RL rows have their own targets: an answer's "loss"/"loss_scale" would do nothing."""
    for m in msgs:
        f = next((k for k in ANSWER_FIELDS if k in m), None)
        if f:
            raise UserError(f"{where}: a message's '{f}' field chooses and weighs sft's targets; {what} trains on "
                            "its own answers: drop the field")


def _role_messages(msgs: Any, where: str, key: str) -> list[Message]:
    """A list of {role, content} messages (OpenAI form), checked; an answer's own "loss" / "loss_scale"
    fields are kept (ANSWER_FIELDS)."""
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f"{where}: '{key}' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"{where}: {key}[{i}] needs 'role' and 'content'")
        if m["role"] not in ROLES + AGENT_ROLES:
            raise UserError(f"{where}: {key}[{i}] has unknown role {m['role']!r} (use {', '.join(ROLES + AGENT_ROLES)})")
        out.append({"role": m["role"], "content": _text(m["content"], where, f"{key}[{i}].content"),
                    **_answer_fields(m, where, key, i)})
    return out


def from_messages(row: dict, where: str) -> list[Message]:
    return _role_messages(row["messages"], where, "messages")


def from_sharegpt(row: dict, where: str) -> list[Message]:
    conv = row["conversations"]
    if not isinstance(conv, list) or not conv:
        raise UserError(f"{where}: 'conversations' must be a non-empty list")
    out = _system(row, where)
    for i, m in enumerate(conv):
        # ShareGPT's from/value, or the OpenAI role/content that many ShareGPT-named files use
        if isinstance(m, dict) and "from" in m and "value" in m:
            speaker, text, key = m["from"], m["value"], "value"
        elif isinstance(m, dict) and "role" in m and "content" in m:
            speaker, text, key = m["role"], m["content"], "content"
        else:
            raise UserError(f"{where}: conversations[{i}] needs 'from' and 'value' (or 'role' and 'content')")
        role = SHAREGPT_ROLES.get(str(speaker).lower())
        if role is None:
            raise UserError(f"{where}: conversations[{i}] has unknown speaker {speaker!r}")
        out.append({"role": role, "content": _text(text, where, f"conversations[{i}].{key}")})
    return out


def from_prompt_completion(row: dict, where: str) -> list[Message]:
    """TRL's prompt-completion rows. Standard: `prompt` and `completion` strings (a user turn and
    the assistant's answer, with an optional `system`). Conversational: lists of {role, content}
    messages, the conversation being prompt + completion. Every assistant turn is trained on, as in
    any other format (so an assistant turn inside a conversational prompt is too; TRL trains on the
    completion only)."""
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list):
        head = _role_messages(prompt, where, "prompt")
    else:
        head = _system(row, where) + [{"role": "user", "content": _text(prompt, where, "prompt")}]
    if isinstance(completion, list):
        tail = _role_messages(completion, where, "completion")
    else:
        tail = [{"role": "assistant", "content": _text(completion, where, "completion")}]
    return head + tail


def from_alpaca(row: dict, where: str) -> list[Message]:
    instruction = _text(row.get("instruction"), where, "instruction")
    inp = _text(row.get("input"), where, "input")
    query = f"{instruction}\n{inp}" if inp else instruction
    return (_system(row, where) + _history(row, where)
            + [{"role": "user", "content": query},
               {"role": "assistant", "content": _text(row.get("output"), where, "output")}])


def from_query_response(row: dict, where: str) -> list[Message]:
    return (_system(row, where) + _history(row, where)
            + [{"role": "user", "content": _text(row.get("query"), where, "query")},
               {"role": "assistant", "content": _text(row.get("response"), where, "response")}])


# (name, detector, converter): the first detector that accepts a row wins.
FORMATS: list[tuple[str, Callable[[dict], bool], Converter]] = [
    ("messages", lambda r: "messages" in r, from_messages),
    ("sharegpt", lambda r: "conversations" in r, from_sharegpt),
    ("alpaca", lambda r: "instruction" in r and "output" in r, from_alpaca),
    ("query_response", lambda r: "query" in r and "response" in r, from_query_response),
    ("prompt_completion", lambda r: "prompt" in r and "completion" in r, from_prompt_completion),
]


def detect_format(row: dict) -> str | None:
    for name, det, _conv in FORMATS:
        if det(row):
            return name
    return None


def to_messages(row: dict, where: str, *, agent_roles: bool = False, prompts: bool = False) -> list[Message]:
    """Convert one row (any chat format) to messages; a row that fits no format is an error naming its keys.
    `agent_roles`: the caller renders ms-swift's tool_call / tool_response turns (sft: data/agent.py);
    elsewhere they are refused. `prompts`: a conversation ending with a user turn is a prompt (GKD when
    every step samples its response), not an error."""
    for _name, det, conv in FORMATS:
        if det(row):
            msgs = conv(row, where)
            if not agent_roles and any(m["role"] in AGENT_ROLES for m in msgs):
                raise UserError(f"{where}: tool_call / tool_response turns are read by `swiftlite sft` with "
                                "--agent_template")
            if not any(m["role"] in ("assistant", "tool_call") for m in msgs) and not (prompts and msgs and
                                                                                 msgs[-1]["role"] == "user"):
                raise UserError(f"{where}: the conversation has no assistant turn to learn from")
            return msgs
    keys = ", ".join(sorted(map(str, row))) or "none"
    raise UserError(f"{where}: row matches no known format (found keys: {keys}; expected messages, "
                    "conversations, instruction+output, query+response, prompt+completion, or text for pt)")


def to_text(row: dict, where: str) -> str:
    """Pre-training rows: {"text": ...}; chat rows are flattened by the caller's template instead."""
    if "text" in row:
        return _text(row["text"], where, "text")
    keys = ", ".join(sorted(map(str, row))) or "none"
    raise UserError(f"{where}: pre-training row needs a 'text' field (found keys: {keys})")
