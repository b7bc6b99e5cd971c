"""GKD: generalized knowledge distillation (`rlhf --rlhf_type gkd`; Agarwal et al. 2024, ms-swift's
swift/rlhf_trainers/gkd_trainer.py on TRL's GKDTrainer). The student learns the teacher's next-token
distributions on the target tokens of sft rows (conversations whose assistant turns are the targets).

Each optimizer step draws its branch once from (--seed, step), every process alike (ms-swift's
`_get_random_num`: seed + global step): with probability --lmbda the step is *on-policy*, and each row's
last response is replaced by a completion the student samples for the row's prompt (the tokens before
that response; transformers' generate on the gathered weights, or with --use_vllm GRPO's colocated vLLM
engine or rollout server with the student's weights synced first, up to --max_completion_length tokens,
--temperature/--top_p/--top_k, the draw of row i at step s seeded by (--seed, s, i): the same completions
for any number of processes and after a resume); otherwise the rows train as the dataset gives them.
The teacher (rlhf/teacher.py `teacher_module`: a frozen copy laid out like the policy, or by
--teacher_deepspeed; the policy's base with the adapter disabled when --teacher_model is the run's own
model with LoRA) and the student score the same tokens, and the loss is

    (sum over the global batch's target tokens of jsd(student, teacher)
      + sft_alpha x the student's cross-entropy of the targets, on steps that train on the dataset)
    / (the global batch's target tokens)

with rlhf/gkd_loss.jsd_sum's divergence. ms-swift takes each micro-batch's token mean and averages those
over accumulation and processes; here the normalisation is sft's (train/step.py): the token mean of the
whole global batch, the same for any world size or accumulation. Every process backpropagates its
micro-batches' share scaled by world_size; on-policy steps count their targets (which the sampling
decides) with one all-reduce before the first backward.

Validation (`evaluate_gkd`), as ms-swift's (its `_prepare_inputs` in eval mode): after optimizer step s the
branch is drawn as step s's is, from (--seed + s): with probability --lmbda each validation row's response
is the student's sampled completion (row i of the validation set seeded by (--seed, s, i)), otherwise the
row's own response; eval_loss and eval_jsd over its targets. Prompt-only validation rows (OPSD's, with
--lmbda 1) are therefore always sampled; with --lmbda below 1 they are refused as training rows are.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from swiftlite.data.collate import collate, count_targets, real_tokens
from swiftlite.data.loader import select
from swiftlite.data.tokenize import IGNORE, response_start
from swiftlite.distributed import all_reduce_sum, gather_objects
from swiftlite.metrics import StepStats
from swiftlite.rlhf.generate import completion_seed, gathered, sample
from swiftlite.rlhf.gkd_loss import jsd_sum

#: the completions log (--log_completions), in the run folder, as GRPO's
COMPLETIONS_FILE = "completions.jsonl"


@dataclass
class GkdBatches:
    rows: Any                          # tokenized sft rows (input_ids, labels; packs carry position_ids)
    plan: Any                          # data.loader.BatchPlan over rows
    pad_id: int
    world: Any
    options: Any                       # cfg.rlhf
    seed: int
    form: Any = None                   # padded, or --padding_free true's form (models/loading.batch_form)
    # set by `setup` (train/tasks.GkdTask.setup_engine)
    model: Any = None                  # what generate runs on (the policy, with its adapter)
    tokenizer: Any = None
    teacher: Callable[[dict], torch.Tensor] | None = None   # batch -> logits [.., V], no grad
    teacher_kind: str = ""
    log_path: Any = None
    vllm: Any = None                   # --use_vllm: vllm_gen.VllmGenerator or rollout_client.ServerGenerator
    turns: Any = None                  # --multi_turn_scheduler's scheduler (rlhf/multi_turn.py), else None

    @property
    def padding_free(self) -> bool:
        return bool(self.form is not None and self.form.padding_free)

    @property
    def beta(self) -> float:
        return 0.5 if self.options.beta is None else self.options.beta

    def on_policy(self, step: int) -> bool:
        """Whether optimizer step `step` (0-based) samples its responses: (--seed + step)'s draw <= --lmbda."""
        return random.Random(self.seed + step).random() <= self.options.lmbda


def gkd_batches(cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> GkdBatches:
    form = None
    if cfg.data.padding_free or cfg.data.packing:   # rlhf is padded unless asked (ms-swift's default)
        from swiftlite.models.loading import batch_form
        form = batch_form(cfg)
    from swiftlite.rlhf.multi_turn import build
    return GkdBatches(train.rows, plan, tokenizer.pad_token_id, world, cfg.rlhf, cfg.train.seed, form=form,
                      tokenizer=tokenizer, turns=build(cfg.rlhf, tokenizer))


def check_columns(r: Any, rows: Any, which: Any = None) -> None:
    """Every training row (or those in `which`) has the columns --multi_turn_scheduler reads (one line naming
    how many lack one, and the first)."""
    from swiftlite.config.multi_turn_options import scheduler_columns
    from swiftlite.errors import UserError
    need = scheduler_columns(r)
    idx = range(len(rows)) if which is None else which
    bad = [i for i in idx if any(k not in rows[i].get("columns", {}) for k in need)]
    if bad:
        raise UserError(f"--multi-turn-scheduler {r.multi_turn_scheduler} verifies each sampled completion against "
                        f"the row's '{need[0]}' column: {len(bad)} training row(s) have none (the first: row "
                        f"{bad[0] + 1} of the training rows); add it to every row of --dataset")


def setup(run: Any) -> Any:
    """Attach the policy, the teacher and the completions log to run.batches; returns the engine."""
    from swiftlite.rlhf.teacher import teacher_module
    b = run.batches
    b.model = run.model
    b.teacher, b.teacher_kind = teacher_module(run)
    from swiftlite.rlhf.generators import build_generator   # --use_vllm: every micro-batch of a step in one call
    b.vllm = build_generator(run, per_device=b.plan.per_device, steps_per_generation=b.plan.accumulation)
    if run.cfg.rlhf.log_completions and run.world.is_main:
        b.log_path = run.run_dir / COMPLETIONS_FILE
    return run.engine


def _sampled_rows(engine: Any, b: GkdBatches, micro: list[list[int]], step: int,
                  source: Any = None) -> tuple[list[list[dict]], list]:
    """Each micro-batch's rows (of `source`, default the training rows) with their last response replaced by
    the student's completion (its targets: the completion's tokens, less a multi-turn scheduler's insertions),
    and (row index, completion ids, trained tokens) for the length metric and the log (decoded only there)."""
    source = b.rows if source is None else source
    if b.turns is not None:
        check_columns(b.options, source, [i for mb in micro for i in mb])
    rows = [select(source, mb) for mb in micro]
    starts = [[response_start(list(r["labels"])) for r in rs] for rs in rows]
    prompts = [[list(r["input_ids"][:s]) for r, s in zip(rs, ss)] for rs, ss in zip(rows, starts)]
    seeds = [[completion_seed(b.seed, step, i) for i in mb] for mb in micro]
    out, sampled = [], []
    for rs, ss, mb, (comp, cmask, lmask) in zip(rows, starts, micro, _generate(engine, b, prompts, seeds, rows)):
        new = []
        for j, (r, s, i) in enumerate(zip(rs, ss, mb)):
            n = int(cmask[j].sum())
            c = comp[j, :n].tolist()
            keep = [1] * n if lmask is None else lmask[j, :n].tolist()
            new.append({"input_ids": list(r["input_ids"][:s]) + c,
                        "labels": list(r["labels"][:s]) + [t if k else IGNORE for t, k in zip(c, keep)],
                        "response_from": s, **{k: r[k] for k in ("teacher_prompt_ids",) if k in r}})
            sampled.append((i, c, sum(keep)))
        out.append(new)
    return out, sampled


def _generate(engine: Any, b: GkdBatches, prompts: list[list[list[int]]], seeds: list[list[int]],
              rows: list[list[dict]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(completion ids, completion mask, loss mask or None) of each micro-batch: transformers' generate on the
    gathered weights, or (--use_vllm) one call to the colocated engine or the rollout server(s) for all of them,
    the student's weights synced first (GRPO's generators, rlhf/vllm_gen.py, rlhf/rollout_client.py); with
    --multi_turn_scheduler, one such call per turn (rlhf/multi_turn.py, GRPO's rollouts), the loss mask 0 on
    the scheduler's insertions."""
    o = b.options
    kw = dict(pad_id=b.pad_id, eos_id=b.tokenizer.eos_token_id, temperature=o.temperature, top_p=o.top_p,
              top_k=o.top_k, device=b.world.device)
    if b.vllm is not None:
        from swiftlite.parallel.offload import offloaded
        off = None if o.vllm_mode == "server" else offloaded(engine, model=o.offload_model, optim=o.offload_optimizer,
                                                            device=b.world.device)
        return _turns(b, lambda p, s, n, first, logprobs=False: b.vllm.generate_round(
            b.model, engine.root(), gathered, p, s, offload=off, max_new_tokens=n, sync=first, logprobs=logprobs, **kw),
            prompts, seeds, rows)
    from swiftlite.parallel.gather import lockstep
    synced = lockstep(engine.root())          # FSDP1: the same generate calls on every process
    with gathered(engine.root()):
        return _turns(b, lambda p, s, n, first, logprobs=False: [
            sample(b.model, pp, sd, autocast=engine.autocast(), synced=synced, max_new_tokens=n, logprobs=logprobs,
                   stop_words=o.stop_words, tokenizer=b.tokenizer, **kw) for pp, sd in zip(p, s)],
                      prompts, seeds, rows, synced)


def _turns(b: GkdBatches, gen: Callable[..., list], prompts: list, seeds: list, rows: list, lockstep: bool = False
           ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """`gen`'s first turn of every micro-batch, then (--multi_turn_scheduler) the scheduler's next turns."""
    from swiftlite.rlhf.multi_turn import sample_turns
    eos = b.tokenizer.eos_token_id
    outs = sample_turns(b.turns, gen, b.options, b.tokenizer, prompts, seeds, rows,
                        eos_ids=set(eos if isinstance(eos, list) else [eos]), pad_id=b.pad_id, lockstep=lockstep,
                        device=b.world.device)
    return [(t["completion_ids"], t["completion_mask"], t.get("loss_mask")) for t in outs]


def teacher_rows(rows: list[dict]) -> list[dict] | None:
    """OPSD (data/teacher_view.py): the teacher's rows, its own prompt followed by each row's response (the
    dataset's or the sampled one, the same targets), when a row of the micro-batch has a teacher prompt;
    None when none has (the teacher reads the student's rows). A row without one keeps its own prompt."""
    if not any("teacher_prompt_ids" in r for r in rows):
        return None
    out = []
    for r in rows:
        s = r.get("response_from", response_start(list(r["labels"])))
        prompt = list(r.get("teacher_prompt_ids", r["input_ids"][:s]))
        out.append({"input_ids": prompt + list(r["input_ids"][s:]), "labels": [IGNORE] * len(prompt) +
                    list(r["labels"][s:])})
    return out


def micro_terms(engine: Any, b: GkdBatches, batch: dict[str, torch.Tensor], sft: bool,
                teacher_batch: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed divergence, summed student cross-entropy or 0) over the batch's targets: the teacher's
    forward first (no grad; on `teacher_batch`, OPSD's teacher view with the same targets, when given),
    then the student's."""
    from swiftlite.rlhf.reference import root_module
    from swiftlite.rlhf.teacher import logits_of
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE
    with torch.no_grad():
        seen = batch if teacher_batch is None else teacher_batch
        out = b.teacher(seen)      # logits [B, T, V], or a teacher server's top-k (values, ids) [B, T, k] each
        at = seen["labels"][:, 1:] != IGNORE
        teacher = tuple(x[:, :-1][at] for x in out) if isinstance(out, tuple) else out[:, :-1][at]
    module, ctx = root_module(engine)
    logits = logits_of(module, ctx, batch)[:, :-1][keep]
    jsd = jsd_sum(logits, teacher, b.beta, b.options.temperature, b.options.gkd_logits_topk)
    nll = F.cross_entropy(logits.float(), labels[keep], reduction="sum") if sft else jsd.new_zeros(())
    return jsd, nll


def gkd_step(engine: Any, batches: GkdBatches, step: int, *, data_step: int | None = None,
             before_optimizer: Callable[[Any], None] | None = None) -> StepStats:
    """Optimizer step `step` (0-based) on the rows of global batch `data_step` (default: `step`)."""
    b, world = batches, batches.world
    k = step if data_step is None else data_step
    micro = b.plan.micro_batches(k, world.rank)
    on_policy = b.on_policy(step)
    sampled: list = []
    if on_policy:
        rows, sampled = _sampled_rows(engine, b, micro, step)
    else:
        rows = [select(b.rows, mb) for mb in micro]
    sft = b.options.sft_alpha > 0 and not on_policy
    collated = [_on(collate(r, b.pad_id, padding_free=b.padding_free), world.device) for r in rows]
    teachers = [None if t is None else _on(collate(t, b.pad_id, padding_free=b.padding_free), world.device)
                for t in map(teacher_rows, rows)]
    local_targets = sum(count_targets(x) for x in collated)
    targets = max(1.0, all_reduce_sum([float(local_targets)])[0])
    scale = world.world_size / targets
    jsd_total, nll_total, tokens = 0.0, 0.0, 0
    for m, batch in enumerate(collated):
        tokens += real_tokens(batch)
        with engine.micro_batch(last=m == len(collated) - 1):
            jsd, nll = micro_terms(engine, b, batch, sft, teachers[m])
            engine.backward((jsd + b.options.sft_alpha * nll) * scale)   # nll is 0 unless sft
        jsd_total += float(jsd.detach())
        nll_total += float(nll.detach())
    if before_optimizer is not None:
        before_optimizer(engine)
    grad_norm = engine.step()
    jsd_all, nll_all, tokens_all, n_comp, len_comp = all_reduce_sum(
        [jsd_total, nll_total, float(tokens), float(len(sampled)), float(sum(k for _, _, k in sampled))])
    metrics = {"jsd": jsd_all / targets, "on_policy": float(on_policy)}
    if on_policy:
        metrics["completions/mean_length"] = len_comp / max(1.0, n_comp)
    if sft:
        metrics["sft_loss"] = nll_all / targets
    stats = StepStats(step=step + 1, loss=(jsd_all + b.options.sft_alpha * nll_all) / targets,
                      grad_norm=float(grad_norm), tokens=int(tokens_all), target_tokens=int(targets), metrics=metrics)
    if on_policy and b.options.log_completions:
        _log(b, step, sampled)
    return stats


def _on(batch: dict[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _log(b: GkdBatches, step: int, sampled: list) -> None:
    """The step's sampled completions, every process's, into completions.jsonl (main rank)."""
    parts = gather_objects(sampled, b.world.world_size)
    if b.log_path is None:
        return
    with open(b.log_path, "a") as f:
        for i, ids, _ in sorted(x for part in parts for x in part):
            row = b.rows[i]
            prompt = b.tokenizer.decode(list(row["input_ids"][:response_start(list(row["labels"]))]))
            f.write(json.dumps({"step": step + 1, "prompt": prompt, "completion": b.tokenizer.decode(ids)}) + "\n")


def evaluate_gkd(run: Any) -> dict[str, float]:
    """eval_loss (and eval_jsd) after step `run.eval_step`: the validation rows' own responses, or on a sampled
    branch the student's completions (module docstring); each rank its share, every rank the same number of
    generate calls and forwards (`per_device_eval_batch_size` rows each)."""
    import math
    b, world, val = run.batches, run.world, run.val_data
    on_policy = b.on_policy(run.eval_step)
    bs = run.cfg.train.per_device_eval_batch_size
    n = len(val.rows)
    mine = list(range(world.rank, n, world.world_size))
    rounds = math.ceil(math.ceil(n / world.world_size) / bs)
    sft = b.options.sft_alpha > 0
    jsd_sum_, nll_sum, count = 0.0, 0.0, 0
    run.engine.eval()
    with torch.no_grad():
        for r in range(rounds):
            idx = mine[r * bs:(r + 1) * bs]
            if on_policy:
                rows = _sampled_rows(run.engine, b, [idx or [0]], run.eval_step, val.rows)[0][0]
            else:
                rows = select(val.rows, idx or [0])
            batch = _on(collate(rows, b.pad_id, padding_free=b.padding_free), world.device)
            view = teacher_rows(rows)
            jsd, nll = micro_terms(run.engine, b, batch, sft, None if view is None else
                                   _on(collate(view, b.pad_id, padding_free=b.padding_free), world.device))
            if idx:           # a rank that ran out joined the collectives only
                jsd_sum_ += float(jsd)
                nll_sum += float(nll)
                count += count_targets(batch)
    run.engine.train()
    jsd_all, nll_all, cnt = all_reduce_sum([jsd_sum_, nll_sum, float(count)])
    cnt = max(1.0, cnt)
    return {"eval_loss": round((jsd_all + b.options.sft_alpha * nll_all) / cnt, 6), "eval_jsd": round(jsd_all / cnt, 6)}


__all__ = ["COMPLETIONS_FILE", "GkdBatches", "evaluate_gkd", "gkd_batches", "gkd_step", "micro_terms",
           "response_start", "setup", "teacher_rows"]
