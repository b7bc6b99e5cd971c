"""Preference pairs: row formats -> (prompt, chosen, rejected) -> two tokenized sequences per pair.

Accepted rows (detected per row from its keys):

- ms-swift: any sft chat row (`messages`, `conversations`, query/response, ...) whose last assistant
  turn is the chosen answer, plus `rejected_response` (a string) holding the rejected one;
- TRL: `chosen` and `rejected`, both strings or both lists of {role, content} messages, with or
  without a separate `prompt` (a string or messages). Without a prompt, the prompt is the common
  beginning of chosen and rejected (TRL's `extract_prompt`: the shared leading messages, or the shared
  leading characters of two strings, a space before the answers going with them). A string prompt is the user turn and a string answer the
  assistant turn: every pair is rendered with the chat template, as ms-swift does.

Each side is tokenized as a whole conversation (data/tokenize.py's rule: one render, one tokenization)
and only the answer's assistant turn(s) are targets; the prompt, earlier turns and the system turn are
masked. Each sequence is held to --max-length: under `delete` a pair with a side that is longer is
dropped and counted (DataStats.deleted), under `left`/`right` each side is cut; a pair with a side
left without a target is dropped and counted (`no_target`). A row with no rejected answer, or whose
chosen and rejected answers are identical, is a one-line UserError naming the row, or (with
--skip-bad-rows) a counted skip. An optional numeric `margin` column (reward modelling, rlhf/rm.py) is
kept on each pair row (0.0 where a row has none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from swiftlite.data.formats import Message, _role_messages, no_answer_fields, to_messages
from swiftlite.data.pipeline import DataStats, Tokenized, train_and_validation
from swiftlite.data.sources import load_rows
from swiftlite.data.tokenize import IGNORE, assistant_spans, label_spans, render, system_prompt, with_system
from swiftlite.errors import UserError


@dataclass(frozen=True)
class Pair:
    prompt: list[Message]      # the turns before the answers (may be empty)
    chosen: list[Message]      # the preferred answer's turns (assistant)
    rejected: list[Message]


def _answer(v: Any, where: str, key: str) -> list[Message]:
    if isinstance(v, str):
        return [{"role": "assistant", "content": v}]
    return _role_messages(v, where, key)


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def to_pair(row: dict, where: str) -> Pair:
    """One row -> Pair (see the module docstring for the formats); a bad row raises a UserError."""
    if "chosen" in row or "rejected" in row:
        if "rejected" not in row or row["rejected"] in (None, "", []):
            raise UserError(f"{where}: no rejected answer (a TRL row needs 'chosen' and 'rejected')")
        if "chosen" not in row or row["chosen"] in (None, "", []):
            raise UserError(f"{where}: no chosen answer (a TRL row needs 'chosen' and 'rejected')")
        c, r = row["chosen"], row["rejected"]
        if isinstance(c, str) != isinstance(r, str):
            raise UserError(f"{where}: 'chosen' and 'rejected' must both be strings or both be message lists")
        prompt = row.get("prompt")
        if prompt is None:
            if isinstance(c, str):
                n = _common_prefix(list(c), list(r))
                if 0 < n and c[n - 1] == " ":       # the space goes with the answer, as TRL's extract_prompt
                    n -= 1
                p = [{"role": "user", "content": c[:n].strip()}] if c[:n].strip() else []
                pair = Pair(p, _answer(c[n:], where, "chosen"), _answer(r[n:], where, "rejected"))
            else:
                cm, rm = _answer(c, where, "chosen"), _answer(r, where, "rejected")
                n = _common_prefix(cm, rm)
                pair = Pair(cm[:n], cm[n:], rm[n:])
        else:
            p = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
                _role_messages(prompt, where, "prompt")
            pair = Pair(p, _answer(c, where, "chosen"), _answer(r, where, "rejected"))
    elif "rejected_response" in row:
        msgs = to_messages(row, where)
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        rej = row["rejected_response"]
        if not isinstance(rej, str) or not rej:
            raise UserError(f"{where}: 'rejected_response' must be a non-empty string")
        pair = Pair(msgs[:last], msgs[last:], [{"role": "assistant", "content": rej}, *msgs[last + 1:]])
    else:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise UserError(f"{where}: no rejected answer (found keys: {keys}; expected 'rejected_response' beside "
                        "the messages, or TRL's 'chosen' and 'rejected')")
    if not pair.chosen or not pair.rejected or not any(m["role"] == "assistant" for m in pair.chosen) \
            or not any(m["role"] == "assistant" for m in pair.rejected):
        raise UserError(f"{where}: chosen and rejected must each end in an assistant answer")
    if pair.chosen == pair.rejected:
        raise UserError(f"{where}: the chosen and rejected answers are identical (nothing to prefer)")
    no_answer_fields([*pair.prompt, *pair.chosen, *pair.rejected], where, "preference training")
    return pair


def encode_side(tokenizer: Any, prompt: list[Message], answer: list[Message], where: str = "",
                system: str | None = None) -> tuple[list[int], list[int]]:
    """input_ids and labels of prompt + answer: targets on the answer's assistant turns only."""
    msgs = with_system([*prompt, *answer], system)
    first_answer = len(msgs) - len(answer)
    full = render(tokenizer, msgs)
    spans = assistant_spans(tokenizer, msgs, full, where)
    roles = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    spans = [s for i, s in zip(roles, spans) if i >= first_answer]
    return label_spans(tokenizer, full, spans)


def _margin(row: dict, where: str) -> float | None:
    """The optional `margin` column (reward modelling: the reward gap the chosen answer should clear)."""
    v = row.get("margin")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise UserError(f"{where}: 'margin' must be a number, got {v!r}")
    return float(v)


def _cut(ids: list[int], labels: list[int], n: int, truncation: str) -> tuple[list[int], list[int]]:
    if truncation == "left":
        return ids[-n:], labels[-n:]
    return ids[:n], labels[:n]


def encode_pairs(items: list[tuple[dict, str]], tokenizer: Any, max_length: int, truncation: str,
                 skip_bad_rows: bool, system: str | None = None) -> tuple[list[dict], DataStats]:
    """(row, where) items -> pair rows {chosen_ids, chosen_labels, rejected_ids, rejected_labels}."""
    stats = DataStats()
    rows: list[dict] = []
    for row, where in items:
        try:
            pair = to_pair(row, where)
            margin = _margin(row, where)
            sides = [encode_side(tokenizer, pair.prompt, ans, where, system) for ans in (pair.chosen, pair.rejected)]
        except UserError as e:
            if skip_bad_rows:
                stats.skipped.append(str(e))
                continue
            raise
        stats.rows += 1
        if any(len(ids) > max_length for ids, _ in sides):
            if truncation == "delete":
                stats.deleted += 1
                continue
            stats.truncated += 1
            sides = [_cut(ids, lab, max_length, truncation) for ids, lab in sides]
        if not all(any(x != IGNORE for x in lab[1:]) for _, lab in sides):
            stats.no_target += 1
            continue
        (ci, cl), (ri, rl) = sides
        # every row has a margin (0: none given), so that a cache entry keeps the column (its keys are a row's)
        rows.append({"chosen_ids": ci, "chosen_labels": cl, "rejected_ids": ri, "rejected_labels": rl,
                     "margin": 0.0 if margin is None else margin})
    return rows, stats


class PairData(Tokenized):
    """Tokenized pairs; `targets(i)` counts the chosen answer's target tokens (the NLL terms' unit).
    `packs` (--packing, set by prepare_pairs): the pair indices of each pack (rlhf/packing.py)."""

    packs: list[list[int]] | None = None

    def targets(self, i: int) -> int:
        return sum(1 for x in self.rows[i]["chosen_labels"][1:] if x != IGNORE)

    def for_facts(self) -> Tokenized:
        """The pairs as token rows (chosen then rejected), for checkpoint/state.run_facts' data hash."""
        return Tokenized([{"input_ids": r["chosen_ids"] + r["rejected_ids"],
                           "labels": r["chosen_labels"] + r["rejected_labels"]} for r in self.rows], self.stats)


def tokenize_pairs(specs: list[str], tokenizer: Any, *, max_length: int, truncation: str, skip_bad_rows: bool,
                   system: str | None, seed: int, progress: Callable[[str, int], Any] | None = None,
                   columns: dict[str, str] | None = None) -> PairData:
    import numpy as np
    stats = DataStats()
    rows: list[dict] = []
    rng = np.random.RandomState(seed)
    for spec in specs:
        src = load_rows(spec, skip_bad_rows=skip_bad_rows, seed=rng, columns=columns)
        stats.skipped += src.skipped
        items = list(zip(src.rows, src.where))
        it = progress(f"tokenizing {spec}", len(items))(items) if progress is not None else items
        part, st = encode_pairs(it, tokenizer, max_length, truncation, skip_bad_rows, system)
        rows += part
        stats.add(st)
    return PairData(rows, stats)


def prepare_pairs(cfg: Any, tokenizer: Any, world_size: int, *,
                  progress: Callable[[str, int], Any] | None = None) -> tuple[PairData, PairData | None, Any]:
    """data.pipeline.prepare_datasets for `swiftlite rlhf`: the same checks (some usable pairs, at least
    one global batch of pairs), with pairs as the samples."""
    from swiftlite.data.loader import BatchPlan
    d, t = cfg.data, cfg.train
    system = system_prompt(d.system)

    def tok(specs: list[str]) -> PairData:
        # through the tokenization cache, as sft/pt rows (--load-from-cache-file: data/pipeline.cached)
        from swiftlite.data.pipeline import _fingerprint, cached
        key = _fingerprint(specs, tokenizer, {"task": "rlhf-pairs", "max_length": d.max_length, "system": system,
                                              "truncation": d.truncation_strategy, "skip": d.skip_bad_rows,
                                              "seed": t.seed, **({"columns": d.columns} if d.columns else {})})
        return cached(key, lambda: tokenize_pairs(specs, tokenizer, max_length=d.max_length,
                                                  truncation=d.truncation_strategy, skip_bad_rows=d.skip_bad_rows,
                                                  system=system, seed=t.seed, progress=progress,
                                                  columns=d.columns),
                      kind=PairData, load_from_cache_file=d.load_from_cache_file)
    train, val = train_and_validation(d, tok, t.seed, unit="pair")
    samples, unit = len(train.rows), "pairs"
    if d.packing:   # whole pairs packed into --max-length sequences; a pack is the plan's sample
        from swiftlite.rlhf.packing import pack_pairs
        for data in (train, val):
            if data is not None:
                data.packs = pack_pairs(data.rows, d.max_length)
        samples, unit = len(train.packs), f"packs of pairs ({len(train.rows)} pairs)"
    plan = BatchPlan(samples, t.per_device_train_batch_size, world_size,
                     t.gradient_accumulation_steps, t.seed, drop_last=t.dataloader_drop_last)
    if plan.steps_per_epoch == 0:
        raise UserError(f"--dataset has {samples} usable {unit}, fewer than one global batch of "
                        f"{plan.global_batch} (per-device {plan.per_device} x {plan.world_size} processes x "
                        f"accumulation {plan.accumulation})")
    if d.packing:
        from swiftlite.rlhf.packing import PackedPlan
        plan = PackedPlan(plan, train.packs)
    return train, val, plan


def collate_pairs(rows: list[dict], pad_id: int, padding_free: bool = False) -> dict:
    """n pairs -> one batch of 2n sequences: the n chosen, then the n rejected (a pair's two sides
    always share a micro-batch and a forward), right-padded, or (padding_free) concatenated into one
    sequence with position ids restarting per sequence (data/collate.concat_rows; rlhf/packing.py)."""
    from swiftlite.data.collate import concat_rows, pad_batch
    seqs = [{"input_ids": r["chosen_ids"], "labels": r["chosen_labels"]} for r in rows] + \
           [{"input_ids": r["rejected_ids"], "labels": r["rejected_labels"]} for r in rows]
    return concat_rows(seqs) if padding_free else pad_batch(seqs, pad_id)


__all__ = ["Pair", "PairData", "collate_pairs", "encode_pairs", "encode_side", "prepare_pairs", "to_pair",
           "tokenize_pairs"]
