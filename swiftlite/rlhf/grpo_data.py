"""GRPO's prompts and its data plan: rows -> chat prompts (+ the columns reward functions read), and
which prompts and completions each optimizer step, rank and micro-batch takes.

Accepted rows (ms-swift's GRPO datasets): `messages` whose last turn is the user's, or `prompt` (a
string: the user turn, or a message list ending in a user turn), or `query` (with optional `history`
and `system`). Every column of the row (e.g. `solution`) is kept and handed to the reward functions
as a keyword list (swiftlite/plugin.py). A prompt is rendered with the chat template and the
generation prompt; one longer than --max-length is cut from the left (ms-swift's GRPO default when
--truncation-strategy is not given) or, under `delete`, dropped and counted.

Checked here, before any rank starts (preflight runs `prepare_data`): every reward name is known (a
plugin's after --external_plugins ran), every row has each column a reward requires, and the
generation round (per-device x processes x --steps-per-generation completions) divides into groups
of --num-generations.

The plan (`GrpoPlan`), with B = per-device completions, W processes, GA accumulation, S =
--steps-per-generation (a multiple of GA), K = --num-iterations, G = --num-generations:
a generation round takes B x W x S / G prompts of the epoch's seeded permutation and samples G
completions of each (completion c of the round is generation c % G of its prompt c // G); the round
serves (S / GA) x K optimizer steps: its S / GA slices of B x W x GA completions in order, K times.
A slice is cut into W x GA micro-batches of B completions and rank r takes micro-batches
r, r + W, ... (data/loader.BatchPlan's order): what a micro-batch holds depends only on W x GA.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from swiftlite.data.formats import _history, _role_messages, _system, _text, no_answer_fields
from swiftlite.data.pipeline import DataStats, Tokenized
from swiftlite.data.sources import load_rows
from swiftlite.data.agent import render_turns
from swiftlite.data.tokenize import IGNORE, render, system_prompt, with_system
from swiftlite.errors import UserError


def to_prompt(row: dict, where: str) -> list[dict]:
    """One GRPO row -> the prompt's messages (ending in a user turn)."""
    if "messages" in row:
        msgs = _role_messages(row["messages"], where, "messages")
    elif "prompt" in row:
        p = row["prompt"]
        msgs = _role_messages(p, where, "prompt") if isinstance(p, list) else \
            _system(row, where) + [{"role": "user", "content": _text(p, where, "prompt")}]
    elif "query" in row:
        msgs = _system(row, where) + _history(row, where) + \
            [{"role": "user", "content": _text(row["query"], where, "query")}]
    else:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise UserError(f"{where}: a GRPO row needs 'messages', 'prompt' or 'query' (found keys: {keys})")
    if not msgs or msgs[-1]["role"] != "user":
        last = msgs[-1]["role"] if msgs else "nothing"
        raise UserError(f"{where}: the prompt must end with a user turn (the model answers it), not {last}")
    no_answer_fields(msgs, where, "GRPO")
    return msgs


def _jsonable(row: dict) -> dict:
    """The row's columns as reward functions get them (a round trip through JSON: plain values)."""
    return json.loads(json.dumps(row, default=str))


class PromptData(Tokenized):
    """Tokenized prompts: rows {"input_ids", "labels" (all ignored: nothing is a target of the data
    itself), "prompt" (messages), "columns" (the row), "where"}."""

    #: CHORD's expert rows (--chord_sft_dataset, tokenized as sft's; rlhf/chord.py), or None
    sft: Tokenized | None = None

    def targets(self, i: int) -> int:
        return 0


def tokenize_prompts(specs: list[str], tokenizer: Any, *, max_length: int, truncation: str, skip_bad_rows: bool,
                     system: str | None, seed: int, progress: Callable[[str, int], Any] | None = None,
                     columns: dict[str, str] | None = None, agent: Any = None) -> PromptData:
    """GRPO's prompt rows; a row with tools is written by `agent` (--agent_template: data/agent.py, the tools in
    the system turn as sft writes them), and refused without one."""
    import numpy as np
    stats = DataStats()
    rows: list[dict] = []
    rng = np.random.RandomState(seed)
    for spec in specs:
        src = load_rows(spec, skip_bad_rows=skip_bad_rows, seed=rng, columns=columns)
        stats.skipped += src.skipped
        items = list(zip(src.rows, src.where))
        it = progress(f"tokenizing {spec}", len(items))(items) if progress is not None else items
        for row, where in it:
            try:
                msgs = with_system(render_turns(row, to_prompt(row, where), agent, system, where), system)
            except UserError as e:
                if skip_bad_rows:
                    stats.skipped.append(str(e))
                    continue
                raise
            stats.rows += 1
            ids = tokenizer(render(tokenizer, msgs, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            if len(ids) > max_length:
                if truncation == "delete":
                    stats.deleted += 1
                    continue
                stats.truncated += 1
                ids = ids[-max_length:]
            rows.append({"input_ids": ids, "labels": [IGNORE] * len(ids), "prompt": msgs,
                         "columns": _jsonable(row), "where": where})
    return PromptData(rows, stats)


@dataclass(frozen=True)
class GrpoPlan:
    """The round/step/micro-batch layout of the module docstring (samples are prompts)."""
    n_samples: int            # prompts
    per_device: int           # completions per micro-batch
    world_size: int
    accumulation: int
    seed: int
    num_generations: int
    steps_per_generation: int
    num_iterations: int

    @property
    def global_batch(self) -> int:
        """Completions per optimizer step."""
        return self.per_device * self.world_size * self.accumulation

    @property
    def round_completions(self) -> int:
        return self.per_device * self.world_size * self.steps_per_generation

    @property
    def round_prompts(self) -> int:
        return self.round_completions // self.num_generations

    @property
    def steps_per_round(self) -> int:
        return self.steps_per_generation // self.accumulation * self.num_iterations

    @property
    def rounds_per_epoch(self) -> int:
        return self.n_samples // self.round_prompts

    @property
    def steps_per_epoch(self) -> int:
        return self.rounds_per_epoch * self.steps_per_round

    def order(self, epoch: int) -> list[int]:
        import torch
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(self.n_samples, generator=g).tolist()

    def round_of(self, step: int) -> tuple[int, int]:
        """(generation round, slice of the round) of optimizer step `step` (0-based)."""
        rnd, pos = divmod(step, self.steps_per_round)
        return rnd, pos % (self.steps_per_generation // self.accumulation)

    def prompts(self, rnd: int) -> list[int]:
        """Prompt indices of round `rnd`, in completion order (completion c is of prompt c // G)."""
        epoch, pos = divmod(rnd, self.rounds_per_epoch)
        return self.order(epoch)[pos * self.round_prompts:(pos + 1) * self.round_prompts]

    def micro_batches(self, slice_index: int, rank: int) -> list[list[int]]:
        """Completion indices (within the round) of `rank`'s micro-batches in slice `slice_index`."""
        base = slice_index * self.global_batch
        chunks = [list(range(base + i * self.per_device, base + (i + 1) * self.per_device))
                  for i in range(self.world_size * self.accumulation)]
        return [chunks[m * self.world_size + rank] for m in range(self.accumulation)]

    def rank_micro_batches(self, rank: int) -> list[list[int]]:
        """Every micro-batch `rank` trains on in a round (what it generates)."""
        return [mb for j in range(self.steps_per_generation // self.accumulation) for mb in self.micro_batches(j, rank)]


def check_rewards(rewards: list, data: PromptData, flag: str) -> None:
    """Every row has each column a reward requires (one line naming the function, column and row)."""
    for r in rewards:
        for row in data.rows:
            missing = [c for c in r.needs if c not in row["columns"]]
            if missing:
                raise UserError(f"{row['where']}: no '{missing[0]}' column, which reward function {r.key} "
                                f"({r.name}) needs ({flag})")


def prepare_prompts(cfg: Any, tokenizer: Any, world_size: int, *,
                    progress: Callable[[str, int], Any] | None = None) -> tuple[PromptData, None, GrpoPlan]:
    """The GRPO task's `prepare_data`: prompts, no validation split, the plan; every check of the
    module docstring."""
    from swiftlite.data.pipeline import train_and_validation
    from swiftlite.plugin import build_rewards
    d, t, r = cfg.data, cfg.train, cfg.rlhf
    if d.val_dataset or d.split_dataset_ratio > 0:
        raise UserError(f"{'--val-dataset' if d.val_dataset else '--split-dataset-ratio'}: validation is not "
                        "available for GRPO (the training metrics log the rewards of every round)")
    rewards = build_rewards(r.reward_funcs, r)
    from swiftlite.rlhf.reward_model import check_plugins, config_problem
    check_plugins(r)
    plugins = r.reward_model_plugin or ["default"] * len(r.reward_model or [])
    why = next((w for w in map(config_problem, r.reward_model or [], plugins) if w), None)
    if why:
        raise UserError(why)
    S = r.steps_per_generation or t.gradient_accumulation_steps
    if r.generation_batch_size is not None:   # ms-swift's other spelling of the round's size
        per_step = t.per_device_train_batch_size * world_size
        S = r.generation_batch_size // per_step
        if r.generation_batch_size % per_step or S % t.gradient_accumulation_steps:
            raise UserError(f"--generation-batch-size {r.generation_batch_size}: must be a multiple of per-device "
                            f"{t.per_device_train_batch_size} x {world_size} processes x --gradient-accumulation-steps "
                            f"{t.gradient_accumulation_steps} (a round serves whole optimizer steps)")
    per_round = t.per_device_train_batch_size * world_size * S
    if per_round % r.num_generations:
        raise UserError(f"--num-generations {r.num_generations}: the generation round of {per_round} completions "
                        f"(per-device {t.per_device_train_batch_size} x {world_size} processes x steps per generation "
                        f"{S}) does not divide into groups of {r.num_generations}")
    truncation = d.truncation_strategy if "truncation_strategy" in cfg.explicit else "left"

    from swiftlite.data.pipeline import run_agent
    agent = run_agent(cfg, tokenizer)

    def tok(specs: list[str]) -> PromptData:
        return tokenize_prompts(specs, tokenizer, max_length=d.max_length, truncation=truncation,
                                skip_bad_rows=d.skip_bad_rows, system=system_prompt(d.system), seed=t.seed,
                                progress=progress, columns=d.columns, agent=agent)
    train, _ = train_and_validation(d, tok, t.seed, unit="prompt")
    check_rewards(rewards, train, "--reward_funcs")
    from swiftlite.config.multi_turn_options import scheduler_columns
    if scheduler_columns(r):   # a built-in's columns (a plugin's reads what it reads)
        from swiftlite.rlhf.multi_turn import check_rows
        check_rows(r, train)
    if r.chord_sft_dataset:
        train.sft = _chord_rows(cfg, tokenizer, progress)
    plan = GrpoPlan(len(train.rows), t.per_device_train_batch_size, world_size, t.gradient_accumulation_steps,
                    t.seed, r.num_generations, S, r.num_iterations)
    if r.loss_type == "real" and plan.steps_per_round > 1:
        raise UserError(f"--loss-type real: a generation round of {per_round} completions serves {plan.steps_per_round} "
                        "optimizer steps; REAL needs one (its group loss is exact here at the sampling policy: "
                        "rlhf/grpo_loss.py): make --steps-per-generation / --generation-batch-size one step's worth")
    if plan.steps_per_epoch == 0:
        raise UserError(f"--dataset has {len(train.rows)} usable prompts, fewer than one generation round of "
                        f"{plan.round_prompts} prompts ({per_round} completions / --num-generations {r.num_generations})")
    return train, None, plan


def _chord_rows(cfg: Any, tokenizer: Any, progress: Callable[[str, int], Any] | None) -> Tokenized:
    """CHORD's expert rows: --chord_sft_dataset tokenized as sft's rows (the chat template, the answers
    the targets), with the run's --max-length, --system and --truncation-strategy (ms-swift's sft default,
    delete, unless given)."""
    from swiftlite.data.pipeline import tokenize_specs
    d, t = cfg.data, cfg.train
    sft = tokenize_specs(cfg.rlhf.chord_sft_dataset, tokenizer, task="sft", max_length=d.max_length, packing=False,
                         skip_bad_rows=d.skip_bad_rows, num_proc=d.dataset_num_proc, progress=progress,
                         truncation_strategy=d.truncation_strategy if "truncation_strategy" in cfg.explicit else "delete",
                         system=system_prompt(d.system), seed=t.seed, load_from_cache_file=d.load_from_cache_file,
                         columns=d.columns)
    if not sft.rows:
        raise UserError(f"--chord-sft-dataset {' '.join(cfg.rlhf.chord_sft_dataset)}: no usable row (every row "
                        "lacks an answer to learn or is longer than --max-length)")
    return sft


__all__ = ["GrpoPlan", "PromptData", "check_rewards", "prepare_prompts", "to_prompt", "tokenize_prompts"]
