"""OPSD's teacher view of a row (On-Policy Self-Distillation; ms-swift's `teacher_prompt` column,
swift/rl_core/data.py `build_teacher_view`, used by its GKD): the teacher scores the same response as the
student, after a prompt of its own, the conversation with its last user message replaced by the row's
`teacher_prompt` (privileged information: the problem with a reference solution).

Here the teacher's prompt is tokenized once, with the row (data/pipeline.py `_encode_rows`, for a GKD run,
whose rows keep the column): `teacher_prompt_ids`, the tokens the teacher reads before the response. A GKD
step puts the row's response (the dataset's, or the student's sampled one) after them (rlhf/gkd.py). The
student's own prompt is the row's tokens before its last response (`response_start`); the teacher's
differs only in the replaced message, so it is the chat template's rendering of the replaced conversation
up to the generation prompt, followed by whatever tokens the student's prompt holds between its own
generation prompt and the response (a template's empty think block, for instance).

Length: the teacher's view (its prompt and the row's response) is held to --max_length as the row is,
by --truncation_strategy (ms-swift encodes the view with the same template, so with the same rule):
delete drops the row (counted with the rows deleted), left keeps the view's end, i.e. cuts the start of
the teacher's prompt and leaves the response whole; right would cut the response the teacher scores,
out of step with the student's, and is refused with the row. A sampled response is not known here: a
prompt row's bound is its teacher prompt alone.
"""

from __future__ import annotations

from typing import Any

from swiftlite.data.tokenize import IGNORE, render, response_start, with_system
from swiftlite.errors import UserError

#: the column ms-swift's preprocessors keep for OPSD (swift/dataset/preprocessor/core.py standard_keys)
COLUMN = "teacher_prompt"


def teacher_prompt_ids(tokenizer: Any, messages: list[dict], teacher_prompt: Any, input_ids: list[int],
                       labels: list[int], where: str, system: str | None = None, max_length: int | None = None,
                       truncation: str = "delete") -> list[int] | None:
    """The teacher's prompt tokens for a row whose conversation is `messages` and tokens `input_ids` /
    `labels` (module docstring); None when its view is over `max_length` under truncation "delete"."""
    if not isinstance(teacher_prompt, str) or not teacher_prompt:
        raise UserError(f"{where}: '{COLUMN}' must be a non-empty string (the teacher's last user message, OPSD)")
    msgs = with_system([dict(m) for m in messages], system)
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs))
    users = [i for i in range(last) if msgs[i]["role"] == "user"]
    if not users:
        raise UserError(f"{where}: '{COLUMN}' replaces the last user message before the response, and the row has "
                        "none")
    start = response_start(labels)
    if any(x != IGNORE for x in labels[:start]):
        raise UserError(f"{where}: '{COLUMN}' gives the teacher its own prompt before the last response, and this row "
                        "has targets before it too (--loss_scale trains earlier turns); use GKD's default --loss_scale "
                        "last_round")
    own = tokenizer(render(tokenizer, msgs[:last], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    if input_ids[:len(own)] != own or len(own) > start:
        raise UserError(f"{where}: the row's prompt is not its conversation rendered up to the generation prompt "
                        f"(truncated, or a template that renders it otherwise), so '{COLUMN}' cannot be put in its "
                        "place; shorten the row or drop the column")
    msgs[users[-1]] = {**msgs[users[-1]], "content": teacher_prompt}
    mine = tokenizer(render(tokenizer, msgs[:last], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    ids = mine + list(input_ids[len(own):start])
    over = len(ids) + len(input_ids) - start - (max_length or 1 << 62)
    if over <= 0:
        return ids
    if truncation == "delete":
        return None
    if truncation == "left":
        return ids[over:]
    raise UserError(f"{where}: the teacher's view ('{COLUMN}' and the response) is {over} tokens over --max_length "
                    f"{max_length}; --truncation_strategy {truncation} would cut the response the teacher scores; use "
                    "delete or left, or raise --max_length")


__all__ = ["COLUMN", "teacher_prompt_ids"]
