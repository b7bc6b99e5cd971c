"""--template: a Jinja chat template file, or the name of one of ms-swift's templates kept here.

A conversation is rendered with the tokenizer's own chat template unless --template replaces it. A
value that names a file is that file's Jinja text. The names below are ms-swift templates that a base
model without a chat template needs (ms-swift's examples/train/base_to_chat), written as Jinja with
the same text ms-swift's template produces (swift/template/templates/llm.py), so that the rest of the
pipeline (assistant spans, --loss-scale, generation prompts) treats them like any chat template.

- `default`: ms-swift's `default` template: "{system}\\n\\n### Human:\\n{query}\\n\\n### Assistant:\\n{response}",
  rounds joined by a blank line, the eos token after the last answer, the tokenizer's bos token first
  where it has one (ms-swift's auto_add_bos), and ms-swift's default system prompt ("You are a helpful
  assistant.") for a conversation without one. Only the last answer's eos token and the answers are
  targets, as in ms-swift (the blank line between rounds is not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swiftlite.errors import UserError

DEFAULT_SYSTEM = "You are a helpful assistant."

_DEFAULT = (
    "{{- bos_token if bos_token else '' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}{%- set rest = messages[1:] -%}"
    "{%- else -%}"
    "{{- '" + DEFAULT_SYSTEM + "\\n\\n' -}}{%- set rest = messages -%}"
    "{%- endif -%}"
    "{%- for m in rest -%}"
    "{%- if m['role'] == 'user' -%}"
    "{{- '### Human:\\n' + m['content'] + '\\n\\n### Assistant:\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- m['content'] -}}{%- if loop.last -%}{{- eos_token -}}{%- else -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- raise_exception('the default template has system, user and assistant turns only, not ' + m['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

#: ms-swift template names -> their Jinja text (the names are config's TEMPLATE_NAMES, which the rules read).
BUILTIN: dict[str, str] = {"default": _DEFAULT}


def is_builtin(value: str | None) -> bool:
    """A --template value that names a template kept here (and no file of that name exists)."""
    return bool(value) and value in BUILTIN and not Path(value).is_file()


def chat_template(value: str) -> str:
    """The Jinja text --template `value` stands for: a file's text, or a built-in template."""
    if is_builtin(value):
        return BUILTIN[value]
    p = Path(value)
    if not p.is_file():
        raise UserError(f"--template: file not found: {value}")
    return p.read_text(encoding="utf-8")


# -- one exchange of a chat template, in pieces (export --to_ollama's TEMPLATE; the default system) --

#: The probe texts: markers no chat template writes itself.
S, Q, R = "SYSTEMQZXW", "PROMPTQZXW", "RESPONSEQZXW"


def _common_end(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n:] if n else ""


def template_pieces(tokenizer: Any, where: str) -> dict[str, str]:
    """One exchange of `tokenizer`'s chat template cut into pieces, by rendering probe conversations
    with marker texts (export/ollama.py explains the cut): system_prefix + SYSTEM + system_suffix, or
    `prefix` (the template's own default system turn, if any), then opening + PROMPT + generation (the
    generation prompt), then the answer and `suffix`. A template that cannot be cut so (it rewrites the
    texts, or opens an answer otherwise than its generation prompt) is a UserError naming `where`."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where}: the tokenizer has no chat template (pass one with --template)")

    def render(msgs: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    sys_, user, answer = {"role": "system", "content": S}, {"role": "user", "content": Q}, {"role": "assistant", "content": R}
    a, b, c = render([sys_, user], True), render([user], True), render([sys_, user, answer], False)
    if a.count(S) != 1 or a.count(Q) != 1 or b.count(Q) != 1 or c.count(R) != 1:
        raise UserError(f"{where}: the chat template changes or repeats the message texts, so its turns cannot be "
                        "cut into pieces")
    a0, rest = a.split(S)
    a1, a2 = rest.split(Q)
    b0, b2 = b.split(Q)
    head = a0 + S + a1 + Q
    if b2 != a2 or not c.startswith(head) or c[len(head):].split(R, 1)[0] != a2:
        raise UserError(f"{where}: the chat template opens an answer differently from its generation prompt (or "
                        "with and without a system turn), so one exchange of it cannot be cut into pieces")
    suffix = c[len(head):].split(R, 1)[1]
    opening = _common_end(a1, b0)
    return {"system_prefix": a0, "system_suffix": a1[:len(a1) - len(opening)], "prefix": b0[:len(b0) - len(opening)],
            "opening": opening, "generation": a2, "suffix": suffix}


def default_system(tokenizer: Any, where: str) -> str | None:
    """The system text the chat template puts in a conversation that has none (Qwen2.5's "You are
    Qwen, ..."), or None: the no-system prefix read as system_prefix + TEXT + system_suffix."""
    p = template_pieces(tokenizer, where)
    head, tail, prefix = p["system_prefix"], p["system_suffix"], p["prefix"]
    if prefix and prefix.startswith(head) and prefix.endswith(tail) and len(prefix) >= len(head) + len(tail):
        return prefix[len(head):len(prefix) - len(tail)]
    return None
