"""The GRPO step (`swiftlite rlhf --rlhf_type grpo`): generation round -> rewards -> advantages -> the
clipped-ratio loss on the policy, with sft's contract (one `StepStats` per optimizer step, the same on
every rank; docs/rlhf.md "GRPO").

A round (rlhf/grpo_data.py's plan) runs when a step needs one that is not in memory: each rank samples
the completions of its own micro-batches (rlhf/generate.py, one `generate` call per micro-batch, the
weights gathered once for the round; with --use_vllm, rlhf/vllm_gen.py: one call to a colocated vLLM
engine, the weights synced to it for the round; with --vllm_mode server, rlhf/rollout_client.py: the
same from `swiftlite rollout` servers), scores them with every reward function, and the
[completions x functions] table is summed over ranks so that every rank forms the same group
advantages (rlhf/grpo_loss.py). The round also keeps, per micro-batch, the reference's per-token
log-probs (--beta > 0: the adapter disabled for LoRA, else the frozen copy of rlhf/frozen.py) and the
generating policy's (only when a round serves more than one optimizer step: --num-iterations > 1 or
--steps-per-generation > GA; otherwise the ratio is 1 and TRL uses the live log-probs, detached).
With --teacher_model (on-policy distillation, rlhf/teacher.py) the round also takes the teacher's
per-token log-probs, and each completion's advantage becomes one per token. With --chord_sft_dataset
(CHORD, rlhf/chord.py) each micro-batch is followed by one of expert rows, its SFT loss weighted by mu.

Normalisation: each micro-batch's loss is TRL's for its --loss-type; grpo, bnpo and dr_grpo
backpropagate loss / GA (TRL's accumulation scaling), dapo its token sum over the round's tokens x GA /
S / processes; the backends average over ranks, so the step's gradient is TRL's. The logged `loss` is
the mean over the step's micro-batches of all ranks (TRL's logged loss).

A reward function that raises stops the run with a UserError naming the function and the row (its
file and line), before the step's optimizer update: the checkpoints already written are untouched.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from swiftlite.checkpoint import layout
from swiftlite.distributed import all_reduce_sum, gather_objects
from swiftlite.errors import UserError
from swiftlite.metrics import StepStats
from swiftlite.plugin import call_reward
from swiftlite.rlhf.generate import completion_seed, gathered, sample, token_logps
from swiftlite.rlhf.grpo_loss import (ESTIMATOR_DEFAULTS, GrpoLoss, advantages, clip_stats, micro_batch_loss, real_terms,
                                      token_terms)
from swiftlite.rlhf.grpo_rows import at, collapse, last_rows, per_row, reward_entries, row_owner
from swiftlite.rlhf.chord import ChordData, mu_schedule, sft_loss
from swiftlite.rlhf.entropy import entropy_log, top_entropy_mask
from swiftlite.rlhf.multi_turn import scored
from swiftlite.rlhf.offpolicy import merge, offpolicy_metrics
from swiftlite.rlhf.teacher import k3_sum, token_advantages

#: The completions table of --log_completions and each rank's generation round in a checkpoint (a
#: resume inside a round continues with it): named in checkpoint/layout.py with the run's other files.
COMPLETIONS_FILE, ROUND_FILE = layout.COMPLETIONS_FILE, layout.ROUND_FILE
#: --dynamic_sample's resampling attempt a draws its completions from seed + a x this (generate.completion_seed),
#: apart from every round's own draws.
ATTEMPT_SEED_STRIDE = 7919


@dataclass
class Round:
    """One generation round in memory: per micro-batch (as `plan.rank_micro_batches` lists them) its
    tensors, and the round's statistics (the same on every rank)."""
    index: int
    micro: dict[tuple[int, ...], dict[str, torch.Tensor]]
    metrics: dict[str, float]
    tokens: float                      # completion tokens of the whole round (dapo's normalizer)


@dataclass
class GrpoBatches:
    rows: list[dict]
    plan: Any                          # rlhf/grpo_data.GrpoPlan
    pad_id: int
    world: Any
    rewards: list = field(default_factory=list)
    loss: GrpoLoss = field(default_factory=GrpoLoss)
    form: Any = None                   # padded, or --padding_free true's form (models/loading.batch_form)
    # set by `setup` (train/tasks.GrpoTask.setup_engine)
    model: Any = None                  # what generate runs on (the policy, with its adapter)
    tokenizer: Any = None
    reference: Any = None              # callable(prompt_ids, prompt_mask, completion_ids, completion_mask)
    reference_kind: str = ""
    teacher: Any = None                # --teacher_model (rlhf/teacher.py): the same call, the teacher's log-probs
    teacher_kind: str = ""
    chord: Any = None                  # rlhf/chord.ChordData (--chord_sft_dataset): the expert rows
    options: Any = None                # cfg.rlhf
    log_path: Any = None               # completions.jsonl (main rank, --log_completions)
    vllm: Any = None                   # vllm_gen.VllmGenerator or rollout_client.ServerGenerator (--use_vllm)
    current: Round | None = None
    table: Any = None                  # the round's completions table, until its first step returns it
    sp: Any = None                     # parallel/sequence.SequenceParallel (--sequence_parallel_size > 1; run.py)
    turns: Any = None                  # --multi_turn_scheduler's scheduler (rlhf/multi_turn.py), else None

    @property
    def needs_old(self) -> bool:
        return self.plan.steps_per_round > 1

    @property
    def data_rank(self) -> int:
        """This rank's share of a round: the ranks of a sequence-parallel group share theirs (rlhf/grpo_sp.py)."""
        return self.world.rank // (self.sp.size if self.sp is not None else 1)

    @property
    def scores(self) -> bool:
        """Whether this rank scores (rewards, completions log) its share: one rank of each group, not N."""
        return self.sp is None or self.sp.rank == 0

    @property
    def eos_ids(self) -> list[int]:
        """The tokenizer's end-of-sequence id(s), as a list (transformers gives an int or a list)."""
        eos = self.tokenizer.eos_token_id
        return list(eos) if isinstance(eos, list) else [eos]

    @property
    def padding_free(self) -> bool:
        """--padding_free true: the policy's (and its reference's) log-probs from one padding-free sequence."""
        return bool(self.form is not None and self.form.padding_free)


def grpo_batches(cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> GrpoBatches:
    from swiftlite.plugin import build_rewards
    r = cfg.rlhf
    beta = 0.04 if r.beta is None else r.beta
    loss = GrpoLoss(r.loss_type or "grpo", beta, r.epsilon, r.epsilon if r.epsilon_high is None else r.epsilon_high,
                    r.max_completion_length, r.importance_sampling_level, estimator_choices(r)[1], r.real_tau,
                    r.delta, r.fipo_decay_rate, r.fipo_clip_range, r.fipo_clip_high_only, r.fipo_safety_threshold)
    sft = getattr(train, "sft", None)
    chord = None if sft is None else ChordData(sft.rows, r.chord_sft_per_device_train_batch_size, cfg.train.seed,
                                               world.rank, tokenizer.pad_token_id)
    form = None
    if cfg.data.padding_free:   # rlhf is padded unless asked (ms-swift's default); refused where rows would mix
        from swiftlite.models.loading import batch_form
        form = batch_form(cfg)
    from swiftlite.rlhf.multi_turn import build
    if r.multi_turn_scheduler:   # a rollout server's plugin files, taken with its scheduler (launch/server_turns.py)
        from swiftlite.parallel.base import load_missing_plugins
        load_missing_plugins(list(cfg.parallel.external_plugins))
    turns = build(r, tokenizer)
    if getattr(turns, "owns_rollout", False):   # its rollouts' turns and rows (rlhf/own_rollout.py)
        from swiftlite.config.multi_turn_options import split_problem
        turns.last_round = cfg.data.loss_scale == "last_round"
        turns.split_refusal = split_problem(cfg)
    return GrpoBatches(train.rows, plan, tokenizer.pad_token_id, world, build_rewards(r.reward_funcs, r), loss,
                       form=form, options=r, tokenizer=tokenizer, chord=chord, turns=turns)


def estimator_choices(r: Any) -> tuple[str, bool]:
    """(--scale_rewards, --kl_in_reward) as given, else ms-swift's defaults for --advantage_estimator
    (group and false for grpo, none and true for rloo, batch and true for reinforce_plus_plus)."""
    scale, in_reward = ESTIMATOR_DEFAULTS[r.advantage_estimator]
    if getattr(r, "loss_type", None) == "real":   # ms-swift's: REAL takes the advantages unscaled
        scale = "none"
    return (r.scale_rewards or scale), (in_reward if r.kl_in_reward is None else bool(r.kl_in_reward))


def setup(run: Any) -> Any:
    """Attach the policy, the reference (beta > 0) and the completions log to run.batches."""
    from swiftlite.rlhf.reference import adapters_disabled, peft_model, root_module
    b, cfg, engine = run.batches, run.cfg, run.engine
    b.model = run.model
    if b.loss.beta != 0.0:
        temp = cfg.rlhf.temperature
        if cfg.rlhf.ref_model or not cfg.is_peft:
            from swiftlite.rlhf.frozen import build_frozen
            frozen = build_frozen(run)
            free = b.padding_free and not cfg.rlhf.ref_model   # another --ref_model: padded (its attention unchecked)
            b.reference = lambda *t: token_logps(frozen.module, *t, temp, frozen.autocast(), padding_free=free)[0]
            b.reference_kind = "a frozen copy"
        else:
            peft = peft_model(engine.module)

            def ref(*t):
                module, ctx = root_module(engine)
                with adapters_disabled(peft):
                    return token_logps(module, *t, temp, ctx, padding_free=b.padding_free)[0]
            b.reference = ref
            b.reference_kind = "the base model with the adapter disabled"
    from swiftlite.rlhf.teacher import setup_teacher
    b.teacher, b.teacher_kind = setup_teacher(run)
    if cfg.rlhf.reward_model:   # after the reward functions, as ms-swift orders them (rlhf/reward_model.py)
        from swiftlite.models.loading import torch_dtype
        from swiftlite.rlhf.reward_model import build_reward_models
        b.rewards = [*b.rewards, *build_reward_models(cfg.rlhf, run.world.device, torch_dtype(cfg.model.torch_dtype),
                                                      cfg.model.trust_remote_code, cfg.data.max_length)]
    from swiftlite.rlhf.plugin_turns import gym_rewards
    b.rewards = [*b.rewards, *gym_rewards(cfg.rlhf)]   # last, as ms-swift's `gym_reward` column
    from swiftlite.rlhf.generators import build_generator   # --use_vllm: a rollout server's client or colocated
    b.vllm = build_generator(run, per_device=b.plan.per_device, steps_per_generation=b.plan.steps_per_generation)
    if cfg.rlhf.log_completions and run.world.is_main:
        b.log_path = run.run_dir / COMPLETIONS_FILE
    if run.resume_path is not None and not cfg.checkpoint.resume_only_model \
            and run.start_step % b.plan.steps_per_round:
        b.current = _load_round(run.resume_path, run.world, b.plan.round_of(run.start_step)[0])
    return GrpoEngine(engine, b, run.world)


class GrpoEngine:
    """The backend's engine, plus this rank's generation round written into every checkpoint (before
    its manifest is taken): a run resumed inside a round (--num-iterations > 1 or --steps-per-generation
    > GA) continues on the same completions, advantages and old log-probs. A resume at a round's start
    samples the round again: the same completions, as they depend on the weights and (seed, round)."""

    def __init__(self, engine: Any, batches: GrpoBatches, world: Any):
        self._engine, self._batches, self._world = engine, batches, world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def save(self, path: str, *, model_only: bool = False) -> None:
        """The engine's state (`model_only`, --save_only_model: its weights only), then the round, which
        only a full checkpoint's resume reads."""
        from pathlib import Path
        self._engine.save(path, model_only=model_only)
        cur = self._batches.current
        if cur is not None and not model_only:
            torch.save({"index": cur.index, "micro": [(list(k), {n: t.cpu() for n, t in v.items()})
                                                      for k, v in cur.micro.items()],
                        "metrics": cur.metrics, "tokens": cur.tokens},
                       Path(path) / layout.round_file(self._world.rank))


def _load_round(ckpt: Any, world: Any, rnd: int) -> Round:
    f = ckpt / layout.round_file(world.rank)
    state = ckpt / layout.TRAINER_STATE
    if not f.is_file() and state.is_file() and json.loads(state.read_text()).get("save_only_model"):
        raise UserError(f"{ckpt.name}: resuming inside GRPO generation round {rnd} needs that round's completions, "
                        "which a --save_only_model checkpoint does not keep; resume a full checkpoint, or one saved "
                        "at a round's start (--save-steps a multiple of the steps per round), or start a new run "
                        "from its weights")
    if not f.is_file():
        raise UserError(f"{ckpt.name}: resuming inside GRPO generation round {rnd} needs {f.name}, which this "
                        "checkpoint lacks (saved with another number of processes?); resume with the world size "
                        "it was saved with")
    d = torch.load(f, map_location="cpu", weights_only=True)
    if d["index"] != rnd:
        raise UserError(f"{ckpt.name}/{f.name} holds generation round {d['index']}, not {rnd}: the checkpoint does "
                        "not match this run's --steps-per-generation/--num-iterations")
    micro = {tuple(k): {n: t.to(world.device) for n, t in v.items()} for k, v in d["micro"]}
    return Round(rnd, micro, d["metrics"], d["tokens"])


def generate_round(engine: Any, b: GrpoBatches, rnd: int, step: int) -> Round:
    """Sample and score round `rnd` (with --dynamic_sample, resample its groups without a reward signal:
    rlhf/dynamic_sample.py), then take the old, reference and teacher log-probs where needed."""
    plan, world, o = b.plan, b.world, b.options
    prompts = plan.prompts(rnd)
    G = plan.num_generations
    mine = plan.rank_micro_batches(b.data_rank)
    mine_c = [c for mb in mine for c in mb] if b.scores else []   # a group's other ranks add nothing
    got = _collect(b, mine, _sample_round(engine, b, rnd, prompts))
    rewards_table = _rewards(b, got, prompts, mine_c, step)
    resampled: dict[str, float] = {}
    if o.dynamic_sample:
        from swiftlite.rlhf.dynamic_sample import dynamic_round

        def attempt(p: list[int], a: int) -> tuple[tuple, list[float]]:   # resampling a: sampled, scored
            again = _collect(b, mine, _sample_round(engine, b, rnd, p, a))
            return again, _rewards(b, again, p, mine_c, step)
        prompts, sampled, rewards_table, resampled = dynamic_round(b, rnd, prompts, got, rewards_table, mine, attempt)
        if sampled is not None:
            got = _collect(b, mine, sampled)
    micro, texts, lengths, truncated, _ = got
    rollout_of = {key: t.pop("rollout_logps") for key, t in micro.items() if "rollout_logps" in t}
    offp = bool(o.log_rollout_offpolicy_metrics)
    # the reference's and the sampling policy's log-probs (the old ones: --num_iterations > 1 or
    # --steps_per_generation > GA; both: --kl_in_reward, whose KL goes into the rewards below), and the
    # teacher's (--teacher_model: its log-ratio to the sampling policy joins the advantages below)
    in_reward = b.loss.kl_in_reward and b.loss.beta != 0.0
    kl_of: dict[int, float] = {}
    distil: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}   # key -> (teacher, old) log-probs
    k3 = [0.0, 0.0]
    offpolicy: list[dict[str, float]] = []
    for key, t in micro.items():
        args = (t["prompt_ids"], t["prompt_mask"], t["completion_ids"], t["completion_mask"])
        if b.loss.beta != 0.0:
            with torch.no_grad():
                t["ref_logps"] = b.reference(*args)
        if b.needs_old or in_reward or b.teacher is not None or offp:
            from swiftlite.rlhf.reference import root_module
            module, ctx = root_module(engine)
            with torch.no_grad():
                old = token_logps(module, *args, o.temperature, ctx, padding_free=b.padding_free)[0]
            if b.needs_old:
                t["old_logps"] = old
            if offp:
                offpolicy.append(offpolicy_metrics(old, rollout_of[key], scored(t)))
            if in_reward:   # ms-swift's per-completion KL: sum over its tokens of log p_policy - log p_ref
                kl = ((old - t["ref_logps"]) * scored(t)).sum(-1)
                kl_of.update(zip(key, kl[last_rows(t)].tolist()))
            if b.teacher is not None:
                with torch.no_grad():
                    teacher = b.teacher(*args)
                distil[key] = (teacher, old)
                part = k3_sum(teacher, old, scored(t))
                k3 = [k3[0] + part[0], k3[1] + part[1]]
    # the whole round's lengths, truncation flags and KLs on every rank (its rewards: `_rewards`)
    N, F = plan.round_completions, len(b.rewards)
    # completion lengths, truncated flags, KL, turns; rows' further tokens, completions with turns; teacher k3
    table = [0.0] * (4 * N + 4)
    for c in mine_c:
        table[c] = float(lengths[c])
        table[N + c] = truncated[c]
        table[2 * N + c] = kl_of.get(c, 0.0)
    if b.scores:
        for key, t in micro.items():   # a multi-turn trajectory's turns (its last row's), where known
            turns = t["num_turns"][last_rows(t)].tolist() if "num_turns" in t else []
            for c, v in zip(key, turns):
                if not math.isnan(v):
                    table[3 * N + c], table[4 * N + 1] = v, table[4 * N + 1] + 1
        # the tokens of a split trajectory's rows before its last (dapo's normalizer counts every row)
        table[4 * N] = float(sum(scored(t).sum() - scored(t)[last_rows(t)].sum() for t in micro.values()))
    table[-2:] = k3 if b.scores else [0.0, 0.0]
    table = all_reduce_sum(table) if world.world_size > 1 else table
    rpf = torch.tensor(rewards_table, dtype=torch.float32).view(N, F)
    lens = torch.tensor(table[:N], dtype=torch.float32)
    cut = torch.tensor(table[N:2 * N], dtype=torch.float32)
    kl = torch.tensor(table[2 * N:3 * N], dtype=torch.float32) if in_reward else None
    weights = torch.tensor(o.reward_weights or [1.0] * F, dtype=torch.float32)
    adv, rewards, std_zero = advantages(rpf, weights, G, estimator_choices(o)[0], o.advantage_estimator, kl,
                                        b.loss.beta)
    real = b.loss.loss_type == "real"
    if real:   # REAL's per-completion coefficients and value shares (rlhf/grpo_loss.py)
        real_coef, real_value = real_terms(adv, G, b.loss.real_tau)
    for key, t in micro.items():   # a completion's advantage, given to each of its rows (rlhf/grpo_rows.py)
        t["advantages"] = per_row(adv[torch.tensor(key)], t).to(world.device)
        if real:
            t["advantages"] = real_coef[torch.tensor(key)].to(world.device)
            t["real_value"] = real_value[torch.tensor(key)]
        if key in distil:     # [completions, tokens]: + coef x (log p_teacher - log p_old) per token
            t["advantages"] = token_advantages(t["advantages"], *distil[key], scored(t),
                                               o.teacher_kl_coef)
    from swiftlite.rlhf.grpo_loss import nanstd
    metrics = {"reward": float(torch.nanmean(rewards)), "reward_std": float(nanstd(rewards)),
               "frac_reward_zero_std": float(std_zero.float().mean()),
               "completions/mean_length": float(lens.mean()), "completions/min_length": float(lens.min()),
               "completions/max_length": float(lens.max()),
               "completions/clipped_ratio": float(cut.mean()), **resampled}
    if table[4 * N + 1] == N:   # ms-swift's num_turns: every trajectory's turns known (a multi-turn round)
        metrics["num_turns"] = sum(table[3 * N:4 * N]) / N
    if kl is not None:   # ms-swift's kl metric under --kl_in_reward: the completions' mean summed KL
        metrics["kl"] = float(kl.mean())
    if b.teacher is not None:   # ms-swift's teacher_kl: the k3 token mean (rlhf/teacher.py)
        metrics["teacher_kl"] = table[-2] / max(1.0, table[-1])
    if offp:
        metrics.update(merge([m for part in gather_objects(offpolicy, world.world_size) for m in part]))
    for f, r in enumerate(b.rewards):
        metrics[f"rewards/{r.name}/mean"] = float(torch.nanmean(rpf[:, f]))
        metrics[f"rewards/{r.name}/std"] = float(nanstd(rpf[:, f]))
    if o.log_completions:
        _log_completions(b, step, micro, mine_c, [texts[c] for c in mine_c], rpf, adv, world)
    return Round(rnd, micro, metrics, float(lens.sum()) + table[4 * N])


def _collect(b: GrpoBatches, mine: list[list[int]], sampled: list[dict[str, torch.Tensor]]) -> tuple:
    """(micro, texts, lengths, truncated, rows) of this rank's sampled micro-batches: each micro-batch's tensors
    keyed by its completions (with a `truncated` flag per row), and per completion its text, the tokens the
    loss counts (a multi-turn round's insertions out) and 1.0 where it was cut at the limit (ms-swift's
    finish_reason 'length' of its last turn: it ends in a sampled token that is neither EOS nor completes a
    stop word; a multi-turn completion that ends in a scheduler's insertion ended its last turn before it);
    a completion of several rows (rlhf/grpo_rows.py) by its last. `rows`: per completion of a scheduler's own
    rollout, its rows (text, token ids, conversation, request id, place) for the reward functions."""
    from swiftlite.rlhf.stop_words import at_limit
    micro: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
    texts: dict[int, str] = {}
    lengths: dict[int, int] = {}
    truncated: dict[int, float] = {}
    rows: dict[int, list[dict]] = {}
    eos_ids = set(b.eos_ids)
    for mb, t in zip(mine, sampled):
        info = t.pop("rows_info", None)
        micro[tuple(mb)] = t
        c_ids, c_mask, counted = t["completion_ids"], t["completion_mask"], scored(t).sum(-1).tolist()
        cut = []
        for r, j in enumerate(row_owner(t, len(mb))):
            c, n = mb[j], int(c_mask[r].sum())
            ids = c_ids[r, :n].tolist()
            loss = t["loss_mask"][r, :n].tolist() if "loss_mask" in t else None
            cut.append(float(at_limit(b.tokenizer, ids, loss, eos_ids, b.options.stop_words)))
            lengths[c], truncated[c] = int(counted[r]), cut[-1]          # the last row's, once all are seen
            texts[c] = b.tokenizer.decode(ids, skip_special_tokens=True)
            if info is not None:
                rows.setdefault(c, []).append({**info[r], "text": texts[c], "ids": ids, "key": tuple(mb), "row": r})
        t["truncated"] = torch.tensor(cut, device=c_mask.device)
    return micro, texts, lengths, truncated, rows


def _rewards(b: GrpoBatches, got: tuple, prompts: list[int], mine_c: list[int], step: int) -> list[float]:
    """The round's [completions x reward functions] table, flat, the same on every rank: each rank scores
    its own completions (`mine_c`) with every reward function and the table is summed over ranks."""
    G, N, F = b.plan.num_generations, b.plan.round_completions, len(b.rewards)
    rows = [b.rows[prompts[c // G]] for c in mine_c]
    # one entry per training row (a scheduler's split trajectory: several, which must agree: rlhf/grpo_rows.py)
    comps, kwargs, wheres, owner = reward_entries(b, got[0], got[1], got[4], rows, mine_c, step)
    table = [0.0] * (N * F)
    for f, r in enumerate(b.rewards if mine_c else ()):
        values = collapse(call_reward(r, comps, kwargs, wheres), owner, len(mine_c), r.name, wheres)
        for c, v in zip(mine_c, values):
            table[c * F + f] = v
    return all_reduce_sum(table) if b.world.world_size > 1 else table


def _sample_round(engine: Any, b: GrpoBatches, rnd: int, prompts: list[int], attempt: int = 0
                  ) -> list[dict[str, torch.Tensor]]:
    """prompt_ids, prompt_mask, completion_ids, completion_mask (and rollout_logps, loss_mask where they
    apply) of each of this rank's micro-batches of round `rnd` (`attempt` > 0: --dynamic_sample's resampling
    of other `prompts`, seeded apart and on the weights already synced): transformers' generate per micro-batch on
    the gathered weights, or (--use_vllm) one call to the colocated vLLM engine, the weights synced to it
    for the round (rlhf/vllm_gen.py), or (--vllm_mode server) to the rollout server(s)
    (rlhf/rollout_client.py); with --multi_turn_scheduler, one such call per turn (rlhf/multi_turn.py)."""
    plan, world, o = b.plan, b.world, b.options
    G = plan.num_generations
    mine = plan.rank_micro_batches(b.data_rank)
    ids = [[b.rows[prompts[c // G]]["input_ids"] for c in mb] for mb in mine]
    seed = plan.seed + ATTEMPT_SEED_STRIDE * attempt
    seeds = [[completion_seed(seed, rnd, c) for c in mb] for mb in mine]
    rows = [[b.rows[prompts[c // G]] for c in mb] for mb in mine]
    kw = dict(pad_id=b.pad_id, eos_id=b.tokenizer.eos_token_id, temperature=o.temperature, top_p=o.top_p,
              top_k=o.top_k, device=world.device)
    if b.vllm is not None:
        from swiftlite.parallel.offload import offloaded
        off = None if o.vllm_mode == "server" else offloaded(engine, model=o.offload_model, optim=o.offload_optimizer,
                                                            device=world.device)
        return _turns(b, lambda p, s, n, first, logprobs=False: b.vllm.generate_round(
            b.model, engine.root(), gathered, p, s, offload=off, max_new_tokens=n, sync=first and not attempt,
            logprobs=logprobs, **kw), ids, seeds, rows)
    from swiftlite.parallel.gather import lockstep
    synced = lockstep(engine.root())          # FSDP1: the same generate calls on every process
    with gathered(engine.root()):            # the wrapper (FSDP1's root, the DeepSpeed engine) or the model
        return _turns(b, lambda p, s, n, first, logprobs=False: [
            sample(b.model, pp, ss, autocast=engine.autocast(), logprobs=bool(o.log_rollout_offpolicy_metrics) or logprobs,
                   max_new_tokens=n, synced=synced, stop_words=o.stop_words, tokenizer=b.tokenizer, **kw)
            for pp, ss in zip(p, s)], ids, seeds, rows, synced)


def _turns(b: GrpoBatches, gen: Callable[..., list], ids: list, seeds: list, rows: list,
           lockstep: bool = False) -> list[dict[str, torch.Tensor]]:
    """The first turn of every micro-batch, then (--multi_turn_scheduler) the scheduler's next turns; under
    --sequence_parallel_size, each rank of the group its share (rlhf/grpo_sp.split_sampling), unless the
    processes generate in `lockstep` (parallel/gather.py), where every rank samples every completion."""
    if b.sp is not None and not lockstep:
        from swiftlite.rlhf.grpo_sp import split_sampling
        return split_sampling(b.sp, lambda i, s, r: _share(b, gen, i, s, r), ids, seeds, rows, pad_id=b.pad_id,
                              device=b.world.device)
    return _share(b, gen, ids, seeds, rows, lockstep)


def _share(b: GrpoBatches, gen: Callable[..., list], ids: list, seeds: list, rows: list,
           lockstep: bool = False) -> list[dict[str, torch.Tensor]]:
    """This process's share of the round: `gen`'s first turn of each micro-batch, then the later turns."""
    from swiftlite.rlhf.multi_turn import sample_turns
    return sample_turns(b.turns, gen, b.options, b.tokenizer, ids, seeds, rows, eos_ids=set(b.eos_ids),
                        pad_id=b.pad_id, lockstep=lockstep, device=b.world.device)


def _log_completions(b: GrpoBatches, step: int, micro: dict, mine_c: list[int], comps: list[str],
                     rpf: torch.Tensor, adv: torch.Tensor, world: Any) -> None:
    """The round's completions, each with the prompt it was sampled from (the tokens sampled from: a gym
    scheduler's environment writes its own)."""
    def prompt_of(c: int) -> str:
        t, j = at(micro, c)
        return b.tokenizer.decode(t["prompt_ids"][j][t["prompt_mask"][j].bool()].tolist())
    parts = gather_objects([(c, text, prompt_of(c)) for c, text in zip(mine_c, comps)], world.world_size)
    if b.log_path is None:
        return
    names = [r.name for r in b.rewards]
    table = []
    with open(b.log_path, "a") as f:
        for c, text, prompt in sorted(x for part in parts for x in part):
            rew = {n: (None if math.isnan(v) else v) for n, v in zip(names, rpf[c].tolist())}
            f.write(json.dumps({"step": step + 1, "prompt": prompt, "completion": text,
                                "rewards": rew, "advantage": float(adv[c])}) + "\n")
            table.append([step + 1, prompt, text, *rew.values(), float(adv[c])])
    # the same rows for the --report-to loggers (TRL's and ms-swift's `completions` table), sent with
    # the round's first step (grpo_step hands them to the loop in StepStats.tables)
    b.table = (["step", "prompt", "completion", *names, "advantage"], table)


def grpo_step(engine: Any, batches: GrpoBatches, step: int, *, data_step: int | None = None,
              before_optimizer: Callable[[Any], None] | None = None) -> StepStats:
    """Optimizer step `step` (0-based) on slice `data_step` (default `step`) of its generation round."""
    b, world, o = batches, batches.world, batches.loss
    k = step if data_step is None else data_step
    rnd, j = b.plan.round_of(k)
    if b.current is None or b.current.index != rnd:
        b.current = None                                     # the previous round's tensors go first
        b.current = generate_round(engine, b, rnd, step)
    cur = b.current
    ga, S = b.plan.accumulation, b.plan.steps_per_generation
    temp = b.options.temperature
    micro = b.plan.micro_batches(j, b.data_rank)
    loss_sum, tokens, comp_tokens = 0.0, 0, 0
    sums = {"kl": 0.0, "entropy": 0.0, "low": 0.0, "high": 0.0, "region": 0.0, "clip_n": 0.0, "kept": 0.0,
            "chord": 0.0, "future_kl": 0.0, "influence_weight": 0.0, "safety": 0.0}
    r = b.options
    elog = entropy_log(r)      # --top_entropy_quantile, --log_entropy (rlhf/entropy.py)
    mu = 0.0 if b.chord is None else mu_schedule(step, r.chord_mu_warmup_steps, r.chord_mu_decay_steps,
                                                 r.chord_mu_peak, r.chord_mu_valley)
    from swiftlite.rlhf.reference import root_module
    for i, mb in enumerate(micro):
        t = cur.micro[tuple(mb)]
        mask, counted = t["completion_mask"], scored(t)   # attention sees `mask`; the loss, `counted`
        # --overlong_filter: the loss and its metrics leave out completions cut at the length limit
        # (ms-swift masks them after the round is scored: advantages and dapo's normalizer keep them)
        lmask = counted * (t["truncated"] == 0).to(mask.dtype)[:, None] if b.options.overlong_filter else counted
        last = i == len(micro) - 1
        whole: Any = contextlib.nullcontext()
        if b.sp is not None:   # this rank's slice of every sequence; forward and backward see the whole
            from swiftlite.rlhf.grpo_sp import shard, sharded_logps
            local, positions, full_mask, pick = shard(b.sp, t, b.padding_free)
            whole = b.sp.active(positions, full_mask)
        with engine.micro_batch(last=last and not mu), whole:
            module, ctx = root_module(engine)
            if b.sp is not None:
                logps, ent = sharded_logps(module, b.sp, local, pick, t["completion_ids"], temp, ctx, entropy=True)
            else:
                logps, ent = token_logps(module, t["prompt_ids"], t["prompt_mask"], t["completion_ids"], mask, temp,
                                         ctx, entropy=True, padding_free=b.padding_free)
            keep, thr = top_entropy_mask(ent, lmask, elog.quantile)
            terms = token_terms(o, logps, t.get("old_logps"), t.get("ref_logps"), t["advantages"], lmask, keep)
            real = None if o.loss_type != "real" else \
                (float(t["real_value"].sum()), b.plan.per_device * ga / b.plan.num_generations, terms.kl)
            objective = micro_batch_loss(o, terms.per_token_loss, lmask, accumulation=ga, round_tokens=cur.tokens,
                                         steps_per_generation=S, world_size=b.plan.world_size, real=real)
            if b.chord is not None:            # CHORD: (1 - mu) x GRPO's + mu x SFT / GA (rlhf/chord.py)
                objective = (1.0 - mu) * objective
            engine.backward(objective)
        loss_sum += float(objective.detach())
        if mu:   # the expert batch: a micro-batch of its own in the step's accumulation
            batch = b.chord.batch(step * len(micro) + i, world.device)
            with engine.micro_batch(last=last):
                module, ctx = root_module(engine)
                sft, _ = sft_loss(module, batch, ctx, r.chord_enable_phi_function)
                part = mu * sft / ga
                engine.backward(part)
            loss_sum += float(part.detach())
            sums["chord"] += float(sft.detach())
            tokens += int(batch["attention_mask"].sum())
        m = lmask.float()
        sums["kept"] += float(m.sum())   # the tokens the loss and its metrics see
        tokens += int(t["prompt_mask"].sum() + mask.sum())
        comp_tokens += int(counted.sum())
        if terms.kl is not None:
            sums["kl"] += float((terms.kl.detach() * m).sum())
        sums["entropy"] += float((ent * m).sum())
        elog.add(ent, lmask, thr)
        for name, v in (terms.fipo or {}).items():   # FIPO's token means (ms-swift's fipo/* metrics)
            sums[name] += float((v.to(m.dtype) * m).sum())
        cs = clip_stats(o, terms.ratio.detach(), t["advantages"], lmask)
        for name in ("low", "high", "region"):
            sums[name] += float(cs[name].sum())
        sums["clip_n"] += float(cs["tokens"].sum())   # tokens, or completions for a sequence-level ratio
    if before_optimizer is not None:
        before_optimizer(engine)
    grad_norm = engine.step()
    names = sorted(sums)
    totals = all_reduce_sum([loss_sum, float(tokens), float(comp_tokens), *[sums[n] for n in names]])
    loss_total, tok_total, comp_total = totals[:3]
    if b.sp is not None:   # the ranks of a group counted the same micro-batches' tokens
        tok_total, comp_total = tok_total / b.sp.size, comp_total / b.sp.size
    agg = dict(zip(names, totals[3:]))
    denom = max(1.0, agg["kept"])
    out = dict(cur.metrics)
    if o.beta != 0.0 and not o.kl_in_reward:   # else the round's own (in its rewards)
        out["kl"] = agg["kl"] / denom
    out["entropy"] = agg["entropy"] / denom
    out.update(elog.metrics(world.world_size, b.scores))
    clip_n = max(1.0, agg["clip_n"])
    out["clip_ratio/low_mean"] = agg["low"] / clip_n
    out["clip_ratio/high_mean"] = agg["high"] / clip_n
    out["clip_ratio/region_mean"] = agg["region"] / clip_n
    if o.loss_type == "fipo":
        out.update({"fipo/future_kl_mean": agg["future_kl"] / denom,
                    "fipo/influence_weight_mean": agg["influence_weight"] / denom,
                    "fipo/safety_keep_ratio": agg["safety"] / denom})
    if b.chord is not None:   # mu of this step; the expert batches' mean cross-entropy (0 when mu is 0)
        out["chord_mu"] = mu
        out["chord_sft_loss"] = agg["chord"] / (len(micro) * world.world_size)
    # loss: the sum over ranks of what each backpropagated, over the ranks (the backends' average): the
    # mean micro-batch loss (grpo, bnpo, dr_grpo), dapo's token sum over its normalizer
    tables, b.table = ({"completions": b.table} if b.table is not None else {}), None
    return StepStats(step=step + 1, loss=loss_total / world.world_size, grad_norm=float(grad_norm), tokens=int(tok_total),
                     target_tokens=int(comp_total), metrics=out, tables=tables)


__all__ = ["COMPLETIONS_FILE", "GrpoBatches", "GrpoEngine", "ROUND_FILE", "Round", "generate_round", "grpo_batches", "grpo_step", "setup"]
