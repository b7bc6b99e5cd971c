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
