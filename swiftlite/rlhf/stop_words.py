"""--stop_words for the completions GRPO and GKD sample (ms-swift's RolloutTrainerArgumentsMixin.stop_words,
passed to its engines as their `stop`).

A completion ends at the first token that completes one of the strings: its text up to that token contains a
stop word, its text one token earlier does not. The token is kept (ms-swift trains on the token ids its
engine returns, which hold the stop string's tokens), every later one is dropped (padding, out of the mask).
The cut is made on the sampled tokens after generation, for every generator alike (transformers' generate,
the colocated vLLM engine, a rollout server): each token is drawn from the tokens before it and its own
noise only (rlhf/generate.py), so the tokens up to the stop are the ones an engine that stopped there
would have drawn; the tokens past it cost generation time, not a different result. A completion cut here
is finished, not truncated (ms-swift's finish_reason `stop`): --overlong_filter keeps it and
`completions/clipped_ratio` does not count it. A multi-turn completion is judged by its last turn (`at_limit`).
"""

from __future__ import annotations

from typing import Any

import torch


def stop_length(tokenizer: Any, ids: list[int], words: list[str]) -> int | None:
    """How many of `ids` a stop word keeps (up to and including the token that completes the first one), or
    None when the text holds none. The text is decoded without special tokens (vLLM's default for its stop
    strings: `<|im_start|>` holds no "a"). The text of a prefix grows with it, so the fewest tokens whose
    text holds a stop word are found by bisection (log2(len) decodes)."""
    def has(n: int) -> bool:
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        return any(w in text for w in words)
    if not ids or not has(len(ids)):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if has(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def stopping(tokenizer: Any, words: list[str], start: int) -> Any:
    """A transformers StoppingCriteria for generate: a row is done once its completion (its tokens from
    `start`) holds a stop word as `stop_length` reads it, so that generation ends when every row has one.
    transformers' own stop strings match token strings, which for a byte-level vocabulary are not the
    decoded text this module cuts on. Each step decodes a row's last tokens only (a stop word first found
    ends in the newest token), and a hit there is confirmed on the whole completion's text."""
    from transformers import StoppingCriteria
    width = max(len(w.encode()) for w in words) + 8      # tokens that cover any stop word (>= 1 byte each)

    class _Stop(StoppingCriteria):
        def __init__(self) -> None:
            self.done: torch.Tensor | None = None

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if self.done is None:
                self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            for b in (~self.done).nonzero().flatten().tolist():
                row = input_ids[b, start:]
                tail = tokenizer.decode(row[-width:].tolist(), skip_special_tokens=True)
                if any(w in tail for w in words):
                    text = tokenizer.decode(row.tolist(), skip_special_tokens=True)
                    self.done[b] = any(w in text for w in words)
            return self.done.clone()

    return _Stop()


def cut(t: dict[str, torch.Tensor], tokenizer: Any, words: list[str], pad_id: int) -> dict[str, torch.Tensor]:
    """A sampled micro-batch (generate.sample's tensors) with each completion cut after its first stop word,
    in place: the completion-wide tensors past the cut are reset (ids to pad_id, masks to 0, log-probs to nan).
    Whether a completion ended at a stop word is `ended(...)`, asked again wherever it matters (a micro-batch
    is relaid out by sequence parallelism and dynamic sampling, a flag would not travel)."""
    if not words:
        return t
    c_ids, c_mask = t["completion_ids"], t["completion_mask"]
    for j in range(c_ids.shape[0]):
        n = int(c_mask[j].sum())
        k = stop_length(tokenizer, c_ids[j, :n].tolist(), words)
        if k is None:
            continue
        for key, fill in (("completion_ids", pad_id), ("completion_mask", 0), ("loss_mask", 0),
                          ("rollout_logps", float("nan"))):
            if key in t:
                t[key][j, k:] = fill
    return t


def ended(tokenizer: Any, ids: list[int], words: list[str]) -> bool:
    """Whether a (cut) completion ends at a stop word: its last token completes the first one."""
    return bool(words) and stop_length(tokenizer, ids, words) == len(ids)


def at_limit(tokenizer: Any, ids: list[int], loss: list[int] | None, eos_ids: set[int], words: list[str]) -> bool:
    """Whether a completion was cut at the length limit: ms-swift's finish_reason 'length' of its last turn
    (`completions/clipped_ratio`, --overlong_filter). Its last turn is the tokens after its last insertion
    (`loss`: a multi-turn completion's loss mask, 0 on a scheduler's insertions; None: one turn), cut at the
    limit when it ends in a token that is neither EOS nor completes a stop word of that turn. A completion
    that ends in an insertion (the budget ran out after a step) ended its last turn before it."""
    if not ids:
        return True
    last = ids
    if loss is not None:
        k = len(ids)
        while k > 0 and loss[k - 1]:
            k -= 1
        last = ids[k:]
    return bool(last) and ids[-1] not in eos_ids and not ended(tokenizer, last, words)


__all__ = ["at_limit", "cut", "ended", "stop_length", "stopping"]
