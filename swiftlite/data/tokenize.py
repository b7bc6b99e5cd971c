"""Conversations -> input_ids + labels with the chat template; loss only on assistant tokens.

The whole conversation is rendered once with the template and tokenized once (so token boundaries
are exactly what inference sees). Assistant spans are found as character ranges by rendering the
prefixes: the text before assistant turn i is `render(messages[:i], add_generation_prompt=True)` and
the turn ends where `render(messages[:i+1])` ends. Tokens whose characters fall in an assistant span
keep their label; every other label is -100. The span includes the end-of-turn token, so the model
learns to stop.

A row longer than max_length is cut (`truncation`): "right" keeps its first max_length tokens, "left"
its last ones (ms-swift's left/right); "delete" (ms-swift's default) is decided by the caller, which
drops a row whose `truncated` is set (data/pipeline.py counts them). `--system` is the system turn of
rows that have none (`with_system`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swiftlite.config.loss_scale import LossScale
from swiftlite.errors import UserError

IGNORE = -100


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool
    #: each token's loss weight, only under a weighted --loss-scale (config/loss_scale.py); else None
    weights: list[float] | None = None


def system_prompt(value: str | None) -> str | None:
    """--system as text: a value ending in .txt is a file holding it (as in ms-swift)."""
    if value and value.endswith(".txt"):
        from pathlib import Path
        p = Path(value).expanduser()
        if not p.is_file():
            raise UserError(f"--system {value}: file not found (a value ending in .txt names a file)")
        return p.read_text(encoding="utf-8").strip("\n")
    return value


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    """The conversation with `system` as its first turn unless it already has a system turn."""
    if not system or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def cut(ids: list[int], labels: list[int], max_length: int, truncation: str,
        weights: list[float] | None = None) -> Encoded:
    if len(ids) <= max_length:
        return Encoded(ids, labels, False, weights)
    if truncation == "left":
        return Encoded(ids[-max_length:], labels[-max_length:], True,
                       None if weights is None else weights[-max_length:])
    return Encoded(ids[:max_length], labels[:max_length], True, None if weights is None else weights[:max_length])


def encode_prompt(tokenizer: Any, messages: list[dict], max_length: int, *, truncation: str = "right",
                  system: str | None = None) -> Encoded:
    """A conversation that ends with a user turn, up to the generation prompt, with no target: a row whose
    response is sampled (GKD, --lmbda 1)."""
    text = render(tokenizer, with_system(messages, system), add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return cut(ids, [IGNORE] * len(ids), max_length, truncation)


def render(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer: Any, messages: list[dict], full: str, where: str = "") -> list[tuple[int, int]]:
    """Character ranges of each assistant turn in `full` (the rendered conversation)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        end_text = render(tokenizer, messages[: i + 1])
        end = len(end_text)
        if full.startswith(start_text) and end_text.startswith(start_text) and not full.startswith(end_text):
            # A template that ends the last turn otherwise than a middle one (ms-swift's `default`:
            # the eos token after the last answer, "\n\n" between rounds): the turn ends where the two
            # renderings part, provided the whole answer lies before that point.
            lim = min(len(full), end)
            end = next((k for k in range(len(start_text), lim) if full[k] != end_text[k]), lim)
            if str(m.get("content", "")).strip() not in full[len(start_text):end]:
                end = -1
        if end < 0 or not full.startswith(end_text[:end]) or not end_text.startswith(start_text):
            raise UserError(f"{where}: the chat template does not render conversations prefix by prefix; "
                            "pass a --template that does")
        spans.append((len(start_text), end))
    return spans


def encode_messages(tokenizer: Any, messages: list[dict], max_length: int, where: str = "", *,
                    truncation: str = "right", system: str | None = None,
                    loss_scale: LossScale | None = None) -> Encoded:
    """Tokenize one conversation; labels are -100 except on assistant turns. `system`: the system turn
    of a conversation that has none (--system); `loss_scale` (--loss-scale, config/loss_scale.py): which
    turns and parts of them are targets instead."""
    messages = with_system(messages, system)
    full = render(tokenizer, messages)
    spans = assistant_spans(tokenizer, messages, full, where)
    if any("pieces" in m for m in messages):
        messages, spans = piece_turns(messages, spans, full, where)
    if loss_scale is None:
        loss_scale = LossScale()   # the default scale still reads the messages' own "loss"/"loss_scale"
    if loss_scale.splits(messages):
        pieces = loss_scale.weighted_spans(messages, spans, full)
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        labels = _labels(ids, offsets, _merge([(a, b) for a, b, _ in pieces]))
        weights = None if loss_scale.is_binary else _token_weights(offsets, pieces, labels)
        return cut(ids, labels, max_length, truncation, weights)
    ids, labels = label_spans(tokenizer, full, loss_scale.spans(messages, spans, full))
    return cut(ids, labels, max_length, truncation)


def piece_turns(messages: list[dict], spans: list[tuple[int, int]], full: str, where: str
                ) -> tuple[list[dict], list[tuple[int, int]]]:
    """An assistant turn made of pieces (data/agent_react.py: answers with tool responses written into the
    turn) as one message per piece, with the character range of each answer piece: a tool piece becomes a
    `tool` message, so the loss scale's strategy sees each answer after it as a round of its own (ms-swift's
    rounds). The first piece starts where the turn starts, the last ends where it ends (its end-of-turn
    token is a target, as ms-swift's suffix)."""
    out: list[dict] = []
    turns: list[tuple[int, int]] = []
    at = 0
    for m in messages:
        if m["role"] != "assistant":
            out.append(m)
            continue
        a, b = spans[at]
        at += 1
        pieces = m.get("pieces")
        if not pieces:
            out.append(m)
            turns.append((a, b))
            continue
        pos = full.find(m["content"], a, b)
        if pos < 0:
            raise UserError(f"{where}: the chat template changes the text of an answer that holds tool responses; "
                            "react agent templates need it written as it is")
        for k, p in enumerate(pieces):
            lo = a if k == 0 else pos
            pos += len(p["text"])
            hi = b if k == len(pieces) - 1 else pos
            fields = {f: p[f] for f in ("loss", "loss_scale") if f in p}
            out.append({"role": "tool" if p["tool"] else "assistant", "content": p["text"], **fields})
            if not p["tool"]:
                turns.append((lo, hi))
    return out, turns


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Touching ranges joined: a token across two weighted pieces of one answer stays a target."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


def _token_weights(offsets: list[tuple[int, int]], pieces: list[tuple[int, int, float]], labels: list[int]
                   ) -> list[float]:
    """Each token's weight: that of the piece its first character lies in (config/loss_scale.py), 0 for a
    token without a target."""
    weights = [0.0] * len(offsets)
    pi = 0
    for t, (a, _) in enumerate(offsets):
        if labels[t] == IGNORE:
            continue
        while pi < len(pieces) and a >= pieces[pi][1]:
            pi += 1
        weights[t] = pieces[pi][2] if pi < len(pieces) and a >= pieces[pi][0] else 1.0
    return weights


def label_spans(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Tokenize `text`; labels are the token ids inside the character `spans` (assistant turns), -100
    elsewhere. The fast tokenizer's offsets place every token, so a turn boundary never splits one."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    return ids, _labels(ids, enc["offset_mapping"], spans)


def _labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    labels = [IGNORE] * len(ids)
    si = 0
    for t, (a, b) in enumerate(offsets):
        while si < len(spans) and a >= spans[si][1]:
            si += 1
        if si < len(spans) and a >= spans[si][0] and b <= spans[si][1] and b > a:
            labels[t] = ids[t]
    return labels


def encode_text(tokenizer: Any, text: str, max_length: int, *, truncation: str = "right") -> Encoded:
    """Pre-training: every token is a target; EOS appended so documents end."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return cut(ids, list(ids), max_length, truncation)


def prompt_ids(tokenizer: Any, messages: list[dict], response_prefix: str = "") -> list[int]:
    """Token ids of a prompt ready for generation (used by eval accuracy and `infer`), ending with
    `response_prefix` (--response_prefix: the start of the answer, tokenized with the prompt)."""
    text = render(tokenizer, messages, add_generation_prompt=True) + response_prefix
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def response_start(labels: list[int]) -> int:
    """Where a row's last response begins: the first position of its last run of targets (the whole row
    when it has none: a sampled completion is then its only target). GKD replaces that response by a
    sampled one and (OPSD, data/teacher_view.py) gives the teacher its own prompt before it."""
    end = len(labels)
    while end > 0 and labels[end - 1] == IGNORE:
        end -= 1
    if end == 0:
        return len(labels)
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return start
