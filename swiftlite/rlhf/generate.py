"""GRPO's sampling: transformers' `generate` on the policy, with each completion's randomness its own.

Sampling is Gumbel-max: temperature, top-k and top-p are transformers' own logits warpers, then
each row adds Gumbel noise drawn from a torch.Generator of its own and `generate` takes the argmax
(greedy search). argmax(logits + Gumbel) is an exact draw from softmax(logits), so this is sampling
with --temperature/--top-p/--top-k; what it adds is that the draw of completion c of round k depends
only on (--seed, k, c): the same completions for any number of processes, any micro-batch layout and
after a resume, with no RNG state to save (the generators are rebuilt from the round's index, which
the checkpointed step gives) and none of the global torch RNG consumed (dropout's stays as it was).

Sharded engines gather the weights for the round (swiftlite/parallel/gather.py `gathered`).
LoRA policies generate with the adapter on (peft's generate on the PeftModel).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from swiftlite.parallel.gather import gathered


class GumbelSampler:
    """A logits processor adding per-row Gumbel noise (-log(-log U)), U from the row's generator.
    `record` (a list): each step appends the [B] log-probabilities, under the processed distribution
    (temperature, top-k, top-p: the scores this processor receives), of the tokens greedy decoding then
    picks, the argmax of scores + noise (vLLM's processed_logprobs; --log_rollout_offpolicy_metrics)."""

    def __init__(self, generators: list[torch.Generator], record: list | None = None):
        self.generators = generators
        self.record = record

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        noise = torch.empty_like(scores, dtype=torch.float32)
        for b, g in enumerate(self.generators):
            u = torch.rand(scores.shape[-1], generator=g, device=g.device, dtype=torch.float32)
            noise[b] = -torch.log(-torch.log(u.clamp(min=1e-20, max=1 - 1e-7)))
        noisy = scores.float() + noise
        if self.record is not None:
            pick = noisy.argmax(-1, keepdim=True)
            self.record.append(torch.log_softmax(scores.float(), -1).gather(-1, pick).squeeze(-1))
        return noisy


def completion_seed(seed: int, rnd: int, c: int) -> int:
    """The generator seed of completion `c` of round `rnd` (a fixed mixing of the three numbers)."""
    return (seed * 1_000_003 + rnd * 10_007 + c) % (2 ** 63 - 1)


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids [B, P] left-padded to the longest with `pad_id`, and their mask (CPU): every prompt ends
    where the completions begin (`sample`, vLLM's completion layout, dynamic sampling's rebuilt batches)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def sample(model: Any, prompts: list[list[int]], seeds: list[int], *, pad_id: int, eos_id: int | list[int],
           max_new_tokens: int, temperature: float, top_p: float, top_k: int, device: Any, autocast: Any = None,
           logprobs: bool = False, synced: bool = False, stop_words: list[str] | None = None,
           tokenizer: Any = None) -> tuple[torch.Tensor, ...]:
    """Sample one completion per prompt: (prompt_ids [B, P] left-padded, prompt_mask, completion_ids [B, C]
    (pad after the first EOS), completion_mask [B, C] (1 up to and including the first EOS)), and with
    `logprobs` the sampled tokens' log-probabilities at generation [B, C] (GumbelSampler's record).
    `synced`: transformers' synced_gpus, for engines whose forward runs collectives (parallel/gather.py
    `lockstep`); off otherwise, also where transformers would turn it on for a sharded model whose
    weights `gathered` already holds, so that each process generates on its own.
    `stop_words` (with `tokenizer`): --stop_words end a row's generation once its text holds one, and
    generation ends when every row is done (transformers pads a finished row; rlhf/stop_words.stopping);
    the caller still cuts each completion at its first stop word (rlhf/stop_words.cut), and the tokens up to
    it are those drawn without stopping (each row's noise is its own generator's, drawn for every row at
    every step)."""
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    ids, mask = left_padded(prompts, pad_id)
    width = ids.shape[1]
    ids, mask = ids.to(device), mask.to(device)
    gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    procs = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    record: list | None = [] if logprobs else None
    procs.append(GumbelSampler(gens, record))
    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=pad_id,
                          eos_token_id=eos_id, temperature=None, top_p=None, top_k=None, use_cache=True)
    stops = {}
    if stop_words:
        from transformers import StoppingCriteriaList

        from swiftlite.rlhf.stop_words import stopping
        stops["stopping_criteria"] = StoppingCriteriaList([stopping(tokenizer, list(stop_words), width)])
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), (autocast if autocast is not None else contextlib.nullcontext()):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc,
                                 logits_processor=LogitsProcessorList(procs), synced_gpus=synced, **stops)
    finally:
        model.train(was_training)
    completion = out[:, width:]
    eos = torch.tensor(eos_id if isinstance(eos_id, list) else [eos_id], device=completion.device)
    is_eos = torch.isin(completion, eos)
    n = completion.shape[1]
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full((len(prompts),), n,
                                                                                  device=completion.device))
    cmask = (torch.arange(n, device=completion.device).unsqueeze(0) <= first.unsqueeze(1)).long()
    completion = torch.where(cmask.bool(), completion, torch.full_like(completion, pad_id))
    if not logprobs:
        return ids, mask, completion, cmask
    lp = torch.stack(record, dim=1)[:, :n] if record else torch.zeros(len(prompts), 0, device=completion.device)
    return ids, mask, completion, cmask, lp


def token_logps(module: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                completion_mask: torch.Tensor, temperature: float, ctx: Any = None, entropy: bool = False,
                padding_free: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, C] of the completion tokens (logits / temperature, fp32, as TRL), and
    the per-token entropy when asked. Positions follow the attention mask (as `generate` placed them).
    `padding_free` (--padding_free true): the rows' real tokens (the prompt's, the completion's up to its
    mask's end) in one sequence with positions restarting per row, no pad token computed; the values are
    the padded forward's, and 0 past each completion's mask."""
    if padding_free:
        return _packed_logps(module, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, ctx,
                             entropy)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attn = torch.cat([prompt_mask, completion_mask], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    C = completion_ids.shape[1]
    with ctx if ctx is not None else contextlib.nullcontext():
        out = module(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=False,
                     logits_to_keep=C + 1)
    logits = (out.logits if hasattr(out, "logits") else out[0])[:, -(C + 1):-1].float() / temperature
    rows, ents = [], []
    for b in range(logits.shape[0]):     # one row at a time: one [C, V] fp32 log-softmax alive
        lse = torch.logsumexp(logits[b], dim=-1)
        rows.append(logits[b].gather(-1, completion_ids[b].unsqueeze(-1)).squeeze(-1) - lse)
        if entropy:
            with torch.no_grad():
                p = torch.softmax(logits[b], dim=-1)
                ents.append(lse - (p * logits[b]).sum(-1))
    return torch.stack(rows), (torch.stack(ents) if entropy else None)


def packed_layout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(input ids [1, N], position ids [1, N], the positions that predict a completion token, each row's
    completion length): the rows' real tokens (left-padded prompts' tails, completions up to the end of
    their mask, which is a prefix) in one sequence, positions restarting per row."""
    B = completion_ids.shape[0]
    lengths = [int(n) for n in completion_mask.sum(-1)]
    pieces, pos, keep, start = [], [], [], 0
    for b in range(B):
        prompt = prompt_ids[b][prompt_mask[b].bool()]
        row = torch.cat([prompt, completion_ids[b, :lengths[b]]])
        pieces.append(row)
        pos.append(torch.arange(row.numel(), device=row.device))
        keep.append(torch.arange(start + prompt.numel() - 1, start + prompt.numel() - 1 + lengths[b],
                                 device=row.device))
        start += row.numel()
    return torch.cat(pieces)[None], torch.cat(pos)[None], torch.cat(keep), lengths


def _packed_logps(module: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor, temperature: float, ctx: Any, entropy: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logps` on one padding-free sequence: logits only at the positions that predict a completion
    token (transformers' logits_to_keep as indices), one row's [c, V] log-softmax alive at a time."""
    B, C = completion_ids.shape
    ids, pos, keep_idx, lengths = packed_layout(prompt_ids, prompt_mask, completion_ids, completion_mask)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = module(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep_idx)
    logits = (out.logits if hasattr(out, "logits") else out[0])[0].float() / temperature   # [K, V]
    rows, ents, at = [], [], 0
    for b in range(B):
        part, at = logits[at:at + lengths[b]], at + lengths[b]
        lse = torch.logsumexp(part, dim=-1)
        rows.append(part.gather(-1, completion_ids[b, :lengths[b]].unsqueeze(-1)).squeeze(-1) - lse)
        if entropy:
            with torch.no_grad():
                ents.append(lse - (torch.softmax(part, dim=-1) * part).sum(-1))
    return spread(torch.cat(rows), lengths, C), (spread(torch.cat(ents), lengths, C) if entropy else None)


def spread(flat: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """Each row's completion values, consecutive in `flat`, as [rows, width] with 0 past each row's length."""
    out, at = [], 0
    for n in lengths:
        out.append(torch.cat([flat[at:at + n], flat.new_zeros(width - n)]))
        at += n
    return torch.stack(out)


__all__ = ["GumbelSampler", "completion_seed", "gathered", "left_padded", "sample", "token_logps"]
