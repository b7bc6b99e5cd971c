"""KTO (`swiftlite rlhf --rlhf_type kto`): unpaired answers, each labelled desirable or not, against a
reference model, as TRL's KTOTrainer (loss_type "kto") computes it.

Rows (detected per row from its keys), each one answer and a boolean `label`:

- ms-swift: any sft chat row (`messages`, `conversations`, query/response, ...) whose last assistant
  turn is the answer, plus `label` (true: desirable);
- TRL: `prompt` and `completion` (strings, or lists of {role, content} messages) plus `label`.

A row is tokenized as sft's (rlhf/data.encode_side: one render, targets on the answer's assistant
turn(s) only); the tokens before the first target are its prompt, the rest its completion.

The loss of a global batch of G rows (policy log-prob p, reference r, summed over the completion):

    kl   = max(0, mean over the G rows of (p' - r'))   (no gradient)
    desirable:   w_d (1 - sigmoid(beta ((p - r) - kl)))
    undesirable: w_u (1 - sigmoid(beta (kl - (p - r))))
    loss = mean over the G rows

where p', r' are the log-probs of *mismatched* sequences: row i's prompt followed by the completion of
the row before it in the global batch (the first row takes the last row's), TRL's rotation of the
completions within a batch. swiftlite rotates within the global batch (all ranks, all micro-batches)
and takes the KL mean over it, so 1 or N processes and any accumulation see the same mismatches and
the same estimate; TRL rotates within each per-device batch and averages the per-rank means, which is
the same job when one process holds the whole batch. A mismatched sequence longer than --max_length is
cut at its end (TRL's keep_start). Validation estimates the KL over the whole validation set (each row
with the completion of the row before it).

Each step runs two passes over the rank's micro-batches: no_grad forwards of the mismatched sequences
(policy and reference) for the KL, then sft's forward + backward of the rows with the reference
forward before each. Logged (TRL's names): loss, kl, rewards/chosen and logps/chosen (means over the
desirable rows, summed log-probs), rewards/rejected and logps/rejected (the undesirable rows),
rewards/margins (chosen - rejected) where the batch has both; a step without desirable (or
undesirable) rows logs no chosen (rejected) metrics, as TRL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from swiftlite.data.formats import Message, _role_messages, no_answer_fields, to_messages
from swiftlite.data.loader import select
from swiftlite.data.pipeline import DataStats, Tokenized, train_and_validation
from swiftlite.data.sources import load_rows
from swiftlite.data.tokenize import IGNORE, system_prompt
from swiftlite.distributed import all_reduce_sum
from swiftlite.errors import UserError
from swiftlite.metrics import StepStats
from swiftlite.rlhf.data import encode_side
from swiftlite.rlhf.reference import sequence_logps


@dataclass(frozen=True)
class Unpaired:
    prompt: list[Message]
    completion: list[Message]
    label: bool


def to_unpaired(row: dict, where: str) -> Unpaired:
    """One KTO row -> Unpaired (formats in the module docstring); a bad row raises a UserError."""
    if "label" not in row:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise UserError(f"{where}: no 'label' (found keys: {keys}; a KTO row is one answer with a boolean "
                        "'label': messages + label, or prompt + completion + label)")
    label = row["label"]
    if not isinstance(label, bool):
        raise UserError(f"{where}: 'label' must be true or false, got {label!r}")
    if "completion" in row:
        if "prompt" not in row:
            raise UserError(f"{where}: a TRL KTO row needs 'prompt' beside 'completion'")
        p, c = row["prompt"], row["completion"]
        prompt = [{"role": "user", "content": p}] if isinstance(p, str) else _role_messages(p, where, "prompt")
        if isinstance(c, str):
            if not c:
                raise UserError(f"{where}: 'completion' is empty")
            comp = [{"role": "assistant", "content": c}]
        else:
            comp = _role_messages(c, where, "completion")
    else:
        rest = {k: v for k, v in row.items() if k != "label"}
        msgs = to_messages(rest, where)
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        prompt, comp = msgs[:last], msgs[last:]
    if not any(m["role"] == "assistant" for m in comp):
        raise UserError(f"{where}: the completion must hold an assistant answer")
    no_answer_fields([*prompt, *comp], where, "KTO")
    return Unpaired(prompt, comp, label)


def _start(labels: list[int]) -> int:
    return next((i for i, x in enumerate(labels) if x != IGNORE), len(labels))


def encode_unpaired(items: list[tuple[dict, str]], tokenizer: Any, max_length: int, truncation: str,
                    skip_bad_rows: bool, system: str | None = None) -> tuple[list[dict], DataStats]:
    """(row, where) items -> {input_ids, labels, start (first target), label}, held to max_length as sft's."""
    stats = DataStats()
    rows: list[dict] = []
    for row, where in items:
        try:
            u = to_unpaired(row, where)
            ids, labels = encode_side(tokenizer, u.prompt, u.completion, where, system)
        except UserError as e:
            if skip_bad_rows:
                stats.skipped.append(str(e))
                continue
            raise
        stats.rows += 1
        if len(ids) > max_length:
            if truncation == "delete":
                stats.deleted += 1
                continue
            stats.truncated += 1
            ids, labels = (ids[-max_length:], labels[-max_length:]) if truncation == "left" else \
                (ids[:max_length], labels[:max_length])
        if not any(x != IGNORE for x in labels[1:]):
            stats.no_target += 1
            continue
        rows.append({"input_ids": ids, "labels": labels, "start": _start(labels), "label": u.label})
    return rows, stats


class UnpairedData(Tokenized):
    def for_facts(self) -> Tokenized:
        """The rows with their label folded into the hashed labels (checkpoint/state.run_facts)."""
        return Tokenized([{"input_ids": r["input_ids"], "labels": r["labels"] + [-1 - int(r["label"])]}
                          for r in self.rows], self.stats)


def prepare_unpaired(cfg: Any, tokenizer: Any, world_size: int, *,
                     progress: Callable[[str, int], Any] | None = None) -> tuple[Any, Any, Any]:
    """rlhf/data.prepare_pairs for KTO rows: the same checks, and a global batch of at least 2 rows
    (the KL estimate pairs each row with another row's completion)."""
    import numpy as np

    from swiftlite.data.loader import BatchPlan
    d, t = cfg.data, cfg.train
    system = system_prompt(d.system)

    def tok(specs: list[str]) -> UnpairedData:
        stats, rows = DataStats(), []
        rng = np.random.RandomState(t.seed)
        for spec in specs:
            src = load_rows(spec, skip_bad_rows=d.skip_bad_rows, seed=rng, columns=d.columns)
            stats.skipped += src.skipped
            items = list(zip(src.rows, src.where))
            it = progress(f"tokenizing {spec}", len(items))(items) if progress is not None else items
            part, st = encode_unpaired(it, tokenizer, d.max_length, d.truncation_strategy, d.skip_bad_rows, system)
            rows += part
            stats.add(st)
        return UnpairedData(rows, stats)
    train, val = train_and_validation(d, tok, t.seed, unit="row")
    plan = BatchPlan(len(train.rows), t.per_device_train_batch_size, world_size,
                     t.gradient_accumulation_steps, t.seed, drop_last=t.dataloader_drop_last)
    if plan.global_batch < 2:
        raise UserError("--rlhf-type kto needs a global batch of at least 2 rows (per-device x processes x "
                        "accumulation): its KL estimate pairs each prompt with another row's completion")
    if plan.steps_per_epoch == 0:
        raise UserError(f"--dataset has {len(train.rows)} usable rows, fewer than one global batch of "
                        f"{plan.global_batch} (per-device {plan.per_device} x {plan.world_size} processes x "
                        f"accumulation {plan.accumulation})")
    return train, val, plan


@dataclass(frozen=True)
class KtoMethod:
    """--rlhf_type kto and its options (ms-swift's defaults: beta 0.1, weights 1)."""
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    kind: str = "kto"
    needs_reference: bool = True
    nll_weight: float = 0.0


def kto_method(cfg: Any) -> KtoMethod:
    r = cfg.rlhf
    return KtoMethod(0.1 if r.beta is None else r.beta, r.desirable_weight, r.undesirable_weight)


def kto_terms(m: KtoMethod, logps: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor, kl: float
              ) -> torch.Tensor:
    """Per-row weighted KTO losses [n] (TRL's eqn 7 of the KTO paper), `kl` the batch's estimate."""
    ratio = logps.float() - ref.float()
    desirable = m.desirable_weight * (1 - torch.sigmoid(m.beta * (ratio - kl)))
    undesirable = m.undesirable_weight * (1 - torch.sigmoid(m.beta * (kl - ratio)))
    return torch.where(labels, desirable, undesirable)


def mismatched(rows: list[dict], prev: list[dict], max_length: int) -> list[dict]:
    """Row i's prompt + prev[i]'s completion (labels: the completion's), cut at max_length (keep start)."""
    out = []
    for r, p in zip(rows, prev):
        s, ps = r["start"], p["start"]
        ids = r["input_ids"][:s] + p["input_ids"][ps:]
        labels = [IGNORE] * s + p["labels"][ps:]
        out.append({"input_ids": ids[:max_length], "labels": labels[:max_length]})
    return out


@dataclass
class UnpairedBatches:
    rows: list[dict]
    plan: Any
    pad_id: int
    world: Any
    method: KtoMethod
    max_length: int
    reference: Any = None
    form: Any = None

    def global_order(self, step: int) -> list[int]:
        """The global batch of `step` in the plan's order, whatever the world size (data/loader.BatchPlan:
        the epoch order's slice that micro_batches() deals out to ranks)."""
        return self.plan.global_order(step)


def unpaired_batches(cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> UnpairedBatches:
    return UnpairedBatches(train.rows, plan, tokenizer.pad_token_id, world, kto_method(cfg), cfg.data.max_length)


def _collate(rows: list[dict], pad_id: int, device: Any) -> dict:
    from swiftlite.data.collate import pad_batch
    return {k: v.to(device) for k, v in pad_batch([{"input_ids": r["input_ids"], "labels": r["labels"]}
                                                    for r in rows], pad_id).items()}


def _kl_sum(engine: Any, b: Any, micro: list[list[dict]]) -> float:
    """Sum over the given micro-batches of (policy - reference) log-probs of their mismatched sequences."""
    total = 0.0
    with torch.no_grad():
        for seqs in micro:
            batch = _collate(seqs, b.pad_id, b.world.device)
            total += float((sequence_logps(engine, batch)[0] - b.reference.logps(batch)).sum())
    return total


def _forward(engine: Any, b: Any, rows: list[dict], kl: float) -> tuple[torch.Tensor, dict[str, float]]:
    batch = _collate(rows, b.pad_id, b.world.device)
    ref = b.reference.logps(batch)                 # before the policy forward (no_grad)
    logps, _ = sequence_logps(engine, batch)
    labels = torch.tensor([r["label"] for r in rows], device=logps.device)
    terms = kto_terms(b.method, logps, ref, labels, kl)
    rew = b.method.beta * (logps.detach().float() - ref.float())
    lp = logps.detach().float()
    sums = {"n_chosen": float(labels.sum()), "n_rejected": float((~labels).sum()),
            "rewards/chosen": float(rew[labels].sum()), "rewards/rejected": float(rew[~labels].sum()),
            "logps/chosen": float(lp[labels].sum()), "logps/rejected": float(lp[~labels].sum())}
    return terms, sums


_SUMS = ("n_chosen", "n_rejected", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def _metrics(totals: list[float], kl: float) -> dict[str, float]:
    s = dict(zip(_SUMS, totals))
    out = {"kl": kl}
    for side in ("chosen", "rejected"):
        if s[f"n_{side}"] > 0:
            out[f"rewards/{side}"] = s[f"rewards/{side}"] / s[f"n_{side}"]
            out[f"logps/{side}"] = s[f"logps/{side}"] / s[f"n_{side}"]
    if s["n_chosen"] > 0 and s["n_rejected"] > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def kto_step(engine: Any, batches: UnpairedBatches, step: int, *, data_step: int | None = None,
             before_optimizer: Callable[[Any], None] | None = None) -> StepStats:
    """Optimizer step `step` (0-based) on the rows of global batch `data_step` (default: `step`)."""
    b, world = batches, batches.world
    k = step if data_step is None else data_step
    g = b.global_order(k)
    prev = {g[i]: g[i - 1] for i in range(len(g))}           # the rotation: row i takes row i-1's completion
    micro = b.plan.micro_batches(k, world.rank)
    kl_micro = [mismatched(select(b.rows, mb), select(b.rows, [prev[i] for i in mb]), b.max_length) for mb in micro]
    kl = max(0.0, all_reduce_sum([_kl_sum(engine, b, kl_micro)])[0] / len(g))
    loss_sum, tokens = 0.0, 0
    sums = [0.0] * len(_SUMS)
    for i, mb in enumerate(micro):
        rows = select(b.rows, mb)
        tokens += sum(len(r["input_ids"]) for r in rows)
        with engine.micro_batch(last=i == len(micro) - 1):
            terms, s = _forward(engine, b, rows, kl)
            engine.backward(terms.sum() * (world.world_size / len(g)))
        loss_sum += float(terms.detach().sum())
        sums = [a + s[n] for a, n in zip(sums, _SUMS)]
    if before_optimizer is not None:
        before_optimizer(engine)
    grad_norm = engine.step()
    totals = all_reduce_sum([loss_sum, float(tokens), *sums])
    return StepStats(step=step + 1, loss=totals[0] / len(g), grad_norm=float(grad_norm), tokens=int(totals[1]),
                     target_tokens=len(g), metrics=_metrics(totals[2:], kl))


def evaluate_unpaired(run: Any) -> dict[str, float]:
    """Validation: the KL over the whole validation set (row i with row i-1's completion, cyclic), then
    the row-mean loss and metrics (each rank its share, every rank the same number of forwards)."""
    b, world, val = run.batches, run.world, run.val_data
    bs = run.cfg.train.per_device_eval_batch_size
    n = len(val.rows)
    mine = list(range(world.rank, n, world.world_size))
    rounds = math.ceil(math.ceil(n / world.world_size) / bs)
    chunks = [mine[r * bs:(r + 1) * bs] for r in range(rounds)]
    run.engine.eval()
    with torch.no_grad():
        kl_micro = [mismatched(select(val.rows, c or [0]), select(val.rows, [(i - 1) % n for i in c or [0]]),
                               b.max_length) for c in chunks]
        kl_parts = []
        for c, seqs in zip(chunks, kl_micro):       # every rank runs `rounds` forwards
            part = _kl_sum(run.engine, b, [seqs])
            kl_parts.append(part if c else 0.0)
        kl = max(0.0, all_reduce_sum([sum(kl_parts)])[0] / n)
        loss_sum, sums = 0.0, [0.0] * len(_SUMS)
        for c in chunks:
            terms, s = _forward(run.engine, b, select(val.rows, c or [0]), kl)
            if not c:
                continue
            loss_sum += float(terms.sum())
            sums = [a + s[k] for a, k in zip(sums, _SUMS)]
    run.engine.train()
    totals = all_reduce_sum([loss_sum, *sums])
    out = {"eval_loss": round(totals[0] / n, 6)}
    out.update({f"eval_{k}": round(v, 6) for k, v in _metrics(totals[1:], kl).items()})
    return out


__all__ = ["KtoMethod", "UnpairedBatches", "UnpairedData", "encode_unpaired", "evaluate_unpaired", "kto_method",
           "kto_step", "kto_terms", "mismatched", "prepare_unpaired", "to_unpaired", "unpaired_batches"]
