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

Length: the row (the student's view) is held to --max_length by --truncation_strategy as any row is; the
teacher's view is not, as in ms-swift: its GKD trainer encodes both views of a batch inside
`_template_context(template)`, which sets the template's max_length to None (swift/rlhf_trainers/
gkd_trainer.py `_encode_samples`), so a teacher prompt longer than the student's makes a longer teacher
sequence, never a cut or dropped row. (Nor is a sampled response held to it: ms-swift encodes the sampled
rows the same way.)
"""

from __future__ import annotations

from typing import Any

from swiftlite.data.tokenize import IGNORE, render, response_start, with_system
from swiftlite.errors import UserError

#: the column ms-swift's preprocessors keep for OPSD (swift/dataset/preprocessor/core.py standard_keys)
COLUMN = "teacher_prompt"


def teacher_prompt_ids(tokenizer: Any, messages: list[dict], teacher_prompt: Any, input_ids: list[int],
                       labels: list[int], where: str, system: str | None = None) -> list[int]:
    """The teacher's prompt tokens for a row whose conversation is `messages` and tokens `input_ids` /
    `labels` (module docstring)."""
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
    return mine + list(input_ids[len(own):start])


__all__ = ["COLUMN", "teacher_prompt_ids"]
