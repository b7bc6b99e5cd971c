"""GKD's teacher behind a server (`--teacher_model_server URL`, ms-swift's; the server is `swiftlite deploy`,
ms-swift's `swift deploy`, or any server of vLLM's OpenAI API such as `vllm serve M --max-logprobs K`).

A teacher too large to hold next to the student is served elsewhere; the run sends each micro-batch's
sequences (prompt and completion token ids, so the teacher scores exactly the tokens the student sees)
to `/v1/completions` with `prompt_logprobs: k` (--gkd_logits_topk), `max_tokens: 1`, `temperature: 0`, and
gets, for every position, the teacher's k most likely next tokens and their log-probabilities. They
stand in for the teacher's logits: a [B, T, V] tensor holding those log-probabilities at their tokens
and -inf elsewhere. GKD's top-k divergence (rlhf/gkd_loss.py) takes the teacher's k largest entries and
renormalises both sides over them, after dividing by --temperature; a log-probability is its logit less
the position's log-normaliser, a constant there, so the divergence equals the one a local teacher of the
same weights gives (tests/e2e/test_gkd_teacher_server_e2e.py). The token of the sequence itself, which
vLLM adds when it is not among the k, is dropped (ms-swift's parse_prompt_logprobs).

Each process asks for its own micro-batches (the server answers requests as they come). A server that
does not answer, or answers something else, stops the run with one line naming the URL.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import torch

from swiftlite.errors import UserError

#: seconds one request may take (a long batch on a busy teacher)
TIMEOUT_S = 600.0


def base_url(url: str) -> str:
    """http://host:port (a trailing /v1 or / taken off: the paths here are vLLM's)."""
    u = url.rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise UserError(f"--teacher_model_server {url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise UserError(f"--teacher_model_server {url}: no answer ({e})") from None


def wait_for_server(url: str, timeout_s: float) -> str:
    """The served model's name, once GET /v1/models answers (polled for `timeout_s`), before launch."""
    import time
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            with urllib.request.urlopen(f"{base_url(url)}/v1/models", timeout=10) as r:
                data = json.loads(r.read()).get("data") or [{}]
                return str(data[0].get("id", ""))
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = str(e)
        if time.monotonic() >= deadline:
            raise UserError(f"--teacher_model_server {url}: no teacher server answered GET /v1/models within "
                            f"{timeout_s:g} s ({last}); start it first (swiftlite deploy --model M --port P, or "
                            "vllm serve M --max-logprobs K)")
        time.sleep(1.0)


def segments(batch: dict) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sequence of a collated micro-batch: the unmasked span of each padded row,
    or the spans of a padding-free row, where the position ids restart at 0."""
    if "attention_mask" not in batch:
        pos = batch["position_ids"][0].tolist()
        starts = [j for j, p in enumerate(pos) if p == 0] + [len(pos)]
        return [(0, a, b) for a, b in zip(starts, starts[1:])]
    out = []
    for i, row in enumerate(batch["attention_mask"]):
        idx = row.nonzero().flatten()
        if len(idx):
            out.append((i, int(idx[0]), int(idx[-1]) + 1))
    return out


class ServerTeacher:
    """batch -> the teacher server's top-k log-probabilities and their token ids, [B, T, k] each (positions
    the server scores nothing at: -inf and id 0). Kept sparse: spread over a 151,936-token vocabulary as
    [B, T, V] float32 they would take 600 KB a position (5 GB for 8k tokens) where k = 64 takes 768 bytes."""

    def __init__(self, url: str, topk: int, vocab: int, model_name: str = ""):
        self.url, self.topk, self.vocab, self.model_name = base_url(url), topk, vocab, model_name

    def scores(self, prompts: list[list[int]]) -> list[list[dict[int, float]]]:
        """Per sequence, per position j >= 1: {token id: log-probability} of the k most likely tokens after
        tokens[:j]."""
        body = {"model": self.model_name, "prompt": prompts, "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": self.topk}
        ans = _post(f"{self.url}/v1/completions", body, TIMEOUT_S)
        choices = sorted(ans.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise UserError(f"--teacher_model_server {self.url}: {len(choices)} answers for {len(prompts)} sequences")
        out = []
        for p, c in zip(prompts, choices):
            rows = c.get("prompt_logprobs") or []
            if len(rows) != len(p):
                raise UserError(f"--teacher_model_server {self.url}: prompt_logprobs for {len(rows)} of a sequence's "
                                f"{len(p)} tokens (a server of vLLM's OpenAI API is expected)")
            seq = []
            for d in rows[1:]:
                items = sorted(((int(t), float(v["logprob"] if isinstance(v, dict) else v)) for t, v in d.items()),
                               key=lambda x: -x[1])[:self.topk]
                if len(items) < min(self.topk, self.vocab):   # the divergence renormalises over exactly k
                    raise UserError(f"--teacher_model_server {self.url}: {len(items)} log-probabilities at a "
                                    f"position, not --gkd_logits_topk {self.topk} (the server's --max_logprobs?)")
                seq.append(dict(items))
            out.append(seq)
        return out

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ids = batch["input_ids"]
        k = min(self.topk, self.vocab)      # what scores() holds at every position
        vals = torch.full((*ids.shape, k), float("-inf"), dtype=torch.float32, device=ids.device)
        idx = torch.zeros((*ids.shape, k), dtype=torch.long, device=ids.device)
        segs = segments(batch)
        got = self.scores([ids[r, a:b].tolist() for r, a, b in segs])
        rows, cols, toks, lps = [], [], [], []
        for (r, a, b), seq in zip(segs, got):
            for j, d in enumerate(seq):     # position a + j predicts token a + j + 1
                rows.append(r)
                cols.append(a + j)
                toks.append(list(d)[:k])
                lps.append(list(d.values())[:k])
        top = max((max(t) for t in toks if t), default=-1)
        if top >= self.vocab:
            raise UserError(f"--teacher_model_server {self.url}: token id {top} beyond the student's "
                            f"vocabulary of {self.vocab} (a teacher with another tokenizer?)")
        if rows:   # one assignment for the batch (each position holds k entries: scores() checked)
            dev = ids.device
            at = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
            idx[at] = torch.tensor(toks, dtype=torch.long, device=dev)
            vals[at] = torch.tensor(lps, dtype=torch.float32, device=dev)
        return vals, idx


__all__ = ["ServerTeacher", "TIMEOUT_S", "base_url", "segments", "wait_for_server"]
