"""Multi-turn GRPO rollouts (`--multi_turn_scheduler`, `--max_turns`, `--completion_length_limit_scope`;
ms-swift's colocate `run_multi_turn`, swift/rollout/agent_loop.py, with its built-in MathTipsScheduler,
swift/rollout/multi_turn.py).

A round's first turn is sampled as a one-turn round is (rlhf/grpo.py `_sample_round`: generate, the
colocated vLLM engine or the rollout server), from the prompts a scheduler's `start` wrote where it has one
(a gym scheduler's environments: rlhf/plugin_turns.py). Then, turn after turn, the scheduler looks at every
completion not yet finished, after every turn, the last included: it stops one that reached
--max_turns or that the scheduler judges done (as ms-swift's, a turn cut at the length limit, its
finish_reason 'length', is done unless a plugin's check_finished or on_turn_end says otherwise); it
extends the others (its `step`), and the same generator continues them, the prompt being the prompt's tokens followed by
the completion's so far. Every process takes part in every turn while any process has a completion
left (the vLLM paths gather across processes), with an empty share when it has none.

The completion trained on is every turn's tokens in order, the scheduler's insertions included: they
are in the sequence the policy attends to, but out of the loss (their loss mask is 0, ms-swift's
`response_loss_mask`), as they are out of the KL, the entropy, the token counts and dapo's normalizer.
The rewards see the whole completion's text, insertions included (ms-swift scores messages[-1]).

Tokens, not text: each turn continues from the token ids the policy produced (ms-swift's colocate path
re-encodes the messages for the next turn while training on the returned ids; the two agree except
where decode/encode is not the identity). The end-of-turn token of a completion that is continued is
dropped (ms-swift continues the message's text, which has none).

Randomness: turn t of completion c draws from a generator seeded by (its round seed, t), so the turns,
like the first, depend on (--seed, round, c) only: any process count, any resume.

Length: --completion_length_limit_scope per_round (ms-swift's default) gives every turn
--max_completion_length new tokens; total caps the whole completion (tips included) at it, as
ms-swift's colocate engine does.

math_tip_trick (`MathTips`): a completion finishes when its text verifies against the row's `solution`
(math_verify, as --reward_funcs accuracy) or already holds the tip; otherwise it is cut before its
first `<answer>` or `</think>` (the first tokens whose text reaches that point, as ms-swift) and
"But wait... It seems I made a mistake," is appended, then continued. The tip is given once, so a
completion takes two turns at most.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch

from swiftlite.errors import UserError
from swiftlite.rlhf.trajectory import Trajectory, ended, layout, turn_seed

#: MathTipsScheduler's tip (ms-swift's `tips_prompt`).
TIPS = "But wait... It seems I made a mistake,"
#: The column math_tip_trick verifies against (ms-swift's `infer_request.data_dict['solution']`).
SOLUTION = "solution"


class MathTips:
    """ms-swift's `math_tip_trick` scheduler (module docstring)."""
    name = "math_tip_trick"

    def __init__(self, tokenizer: Any):
        from swiftlite.plugin import MathAccuracy
        check_installed(self.name)
        self.tok = tokenizer
        self.accuracy = MathAccuracy()
        self.tips = tokenizer.encode(TIPS, add_special_tokens=False)

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def finished(self, t: "Trajectory", turn: int) -> bool:
        """Tipped once already, or verified correct, or (ms-swift's base rule) cut at the length limit."""
        text = self.text(t.ids)
        return TIPS in text or self.accuracy([text], [t.row["columns"][SOLUTION]])[0] == 1 or t.length_cut

    def step(self, t: "Trajectory", turn: int, eos_ids: set[int]) -> tuple[list[int], list[int]]:
        """The completion's tokens and loss mask after the step: cut before its first <answer> or </think>,
        its end-of-turn token dropped, then the tip (out of the loss)."""
        ids = t.ids
        text = self.text(ids)
        cut = min([text.index(m) for m in ("<answer>", "</think>") if m in text] or [len(text)])
        keep = len(ids)
        if cut < len(text):   # the fewest tokens whose text reaches the cut (decoded length grows with them)
            lo, hi = 1, len(ids)
            while lo < hi:
                mid = (lo + hi) // 2
                if len(self.text(ids[:mid])) >= cut:
                    hi = mid
                else:
                    lo = mid + 1
            keep = lo
        while keep and ids[keep - 1] in eos_ids:
            keep -= 1
        return ids[:keep] + self.tips, t.loss[:keep] + [0] * len(self.tips)


SCHEDULERS: dict[str, Callable[[Any], Any]] = {MathTips.name: MathTips}


def check_installed(name: str) -> None:
    """math_tip_trick verifies answers with math_verify: refused before launch without it."""
    if importlib.util.find_spec("math_verify") is None:
        raise UserError(f"--multi_turn_scheduler {name} verifies answers with the math_verify package (pip install "
                        "math-verify, or swiftlite's grpo extra), as in ms-swift")


def check_rows(r: Any, data: Any) -> None:
    """Every prompt row has the columns the run's built-in scheduler reads (config/multi_turn_options.
    scheduler_columns: math_tip_trick's `solution`, math_env's `problem` and `solution`), and a gym scheduler
    on a rollout server gets them (--vllm_server_pass_dataset); one line naming the row."""
    from swiftlite.config.multi_turn_options import scheduler_columns
    name, need = r.multi_turn_scheduler, scheduler_columns(r)
    gym = name == "gym_scheduler"
    if name not in SCHEDULERS and r.use_vllm and r.vllm_mode == "server" and not r.vllm_server_pass_dataset:
        who = f"--gym_env {r.gym_env}" if gym else f"--multi_turn_scheduler {name}"
        raise UserError(f"{who} reads each row's {' and '.join(need)}, which the scheduler of a run in "
                        "--vllm_mode server gets only with --vllm_server_pass_dataset true (ms-swift's rule): add it")
    for row in data.rows:
        missing = [c for c in need if c not in row["columns"]]
        if missing:
            what = (f"--gym_env {r.gym_env} reads from each row" if gym
                    else f"--multi_turn_scheduler {name} verifies each completion against")
            raise UserError(f"{row['where']}: no '{missing[0]}' column, which {what}")


def build(options: Any, tokenizer: Any) -> Any:
    """The run's scheduler, or None for one-turn rounds: a built-in, or a plugin's (rlhf/plugin_turns.py)."""
    name = options.multi_turn_scheduler
    if name is None:
        return None
    if name in SCHEDULERS:
        return SCHEDULERS[name](tokenizer)
    from swiftlite.config.multi_turn_options import gym_on
    from swiftlite.msswift_api.rollout import multi_turns, owns_rollout
    from swiftlite.rlhf.plugin_turns import PluginTurns, check_scheduler
    check_scheduler(name)
    server = options.use_vllm and options.vllm_mode == "server"
    kind = PluginTurns
    if owns_rollout(multi_turns[name]):     # its own run(): it samples through an engine (rlhf/own_rollout.py)
        from swiftlite.rlhf.own_rollout import OwnRollout
        kind = OwnRollout
    return kind(name, multi_turns[name], tokenizer, options.max_turns,
                columns=not server or options.vllm_server_pass_dataset, gym_env=options.gym_env,
                use_gym_env=gym_on(options))


def _unpack(first: list[tuple[torch.Tensor, ...]], micro_prompts: list[list[list[int]]],
            micro_rows: list[list[dict]], micro_seeds: list[list[int]], eos_ids: set[int],
            stop: Callable[[list[int]], int | None], states: list[list[Any]] | None = None) -> list[list[Trajectory]]:
    out = []
    for m, ((_, _, c_ids, c_mask, *lp), prompts, rows, seeds) in enumerate(zip(first, micro_prompts, micro_rows,
                                                                            micro_seeds)):
        mb = []
        for j, (p, row, s) in enumerate(zip(prompts, rows, seeds)):
            ids, cut = ended(c_ids[j, :int(c_mask[j].sum())].tolist(), eos_ids, stop)
            logps = lp[0][j, :len(ids)].tolist() if lp else None
            mb.append(Trajectory(p, row, s, ids, [1] * len(ids), logps, length_cut=cut,
                                 state=states[m][j] if states else None))
        out.append(mb)
    return out


#: the tensors of a generator's micro-batch, in the order it returns them (rlhf/generate.sample)
FIRST_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "rollout_logps")


def sample_turns(sched: Any, gen: Callable[..., list[tuple[torch.Tensor, ...]]], options: Any, tokenizer: Any,
                 micro_prompts: list[list[list[int]]], micro_seeds: list[list[int]], micro_rows: list[list[dict]], *,
                 eos_ids: set[int], pad_id: int, lockstep: bool = False, device: Any = None) -> list[dict]:
    """GRPO's and GKD's sampling of this process's micro-batches: `gen`'s first turn (`gen(prompts, seeds,
    max_new_tokens, first)`), each completion cut after its first --stop_words word (rlhf/stop_words.py), or
    with `sched` (--multi_turn_scheduler) the scheduler's later turns (`rollout`). One dict of tensors per
    micro-batch, FIRST_KEYS (and `loss_mask` after turns)."""
    from swiftlite.distributed import all_reduce_sum
    from swiftlite.rlhf.stop_words import stop_length
    o = options
    words = list(o.stop_words or [])
    stop = (lambda ids: stop_length(tokenizer, ids, words)) if words else None
    if getattr(sched, "owns_rollout", False):     # the scheduler's own run() samples every turn
        return sched.sample(gen, o, micro_prompts, micro_seeds, micro_rows, eos_ids=set(eos_ids), pad_id=pad_id,
                            lockstep=lockstep, any_pending=lambda mine: all_reduce_sum([float(mine)])[0] > 0,
                            device=device, stop=stop)
    states = None
    if sched is not None and hasattr(sched, "start"):   # a scheduler that writes the prompts (a gym's reset)
        micro_prompts, states = sched.start(micro_prompts, micro_rows)
    first = gen(micro_prompts, micro_seeds, o.max_completion_length, True)
    if sched is None:
        from swiftlite.rlhf.stop_words import cut
        return [cut(dict(zip(FIRST_KEYS, f)), tokenizer, o.stop_words, pad_id) for f in first]
    return rollout(sched, lambda p, s, n: gen(p, s, n, False), first, micro_prompts, micro_rows, micro_seeds,
                   max_new_tokens=o.max_completion_length, per_round=o.completion_length_limit_scope == "per_round",
                   max_turns=o.max_turns, eos_ids=set(eos_ids), pad_id=pad_id,
                   any_pending=lambda mine: all_reduce_sum([float(mine)])[0] > 0, lockstep=lockstep,
                   stop=stop, states=states)


def rollout(sched: Any, gen: Callable[..., list[tuple[torch.Tensor, ...]]], first: list[tuple[torch.Tensor, ...]],
            micro_prompts: list[list[list[int]]], micro_rows: list[list[dict]], micro_seeds: list[list[int]], *,
            max_new_tokens: int, per_round: bool, max_turns: int | None, eos_ids: set[int], pad_id: int,
            any_pending: Callable[[bool], bool], lockstep: bool = False,
            stop: Callable[[list[int]], int | None] | None = None, states: list[list[Any]] | None = None
            ) -> list[dict]:
    """The turns after `first` (this process's micro-batches of the first turn, as the generator returned
    them): `gen(micro_prompts, micro_seeds, max_new_tokens)` samples a turn. Returns one dict of tensors per
    micro-batch (rlhf/trajectory.layout). `lockstep` (parallel/gather.py): every turn asks for every micro-batch, one
    with nothing left standing in with its first prompt (the answer unused), so that every process makes
    the same generate calls. `stop(ids)`: how many of a turn's tokens its first stop word keeps (--stop_words,
    rlhf/stop_words.py), a turn so cut ending as at its end-of-turn token (finish_reason 'stop').

    A scheduler has `finished(t, turn)`, asked after every turn (`t.length_cut`: the turn ended at the
    length limit, which ms-swift's base rule finishes), and `step(t, turn, eos_ids)` -> the completion's tokens and loss mask
    after the step (MathTips here; a plugin's, rlhf/plugin_turns.py)."""
    stop = stop or (lambda ids: None)
    trajs = _unpack(first, micro_prompts, micro_rows, micro_seeds, eos_ids, stop, states)
    logprobs = any(len(f) > 4 for f in first)
    turn = 1
    while True:
        for t in (t for mb in trajs for t in mb if not t.done):
            # the scheduler is asked after every turn, the last included (a plugin's on_turn_end runs each turn,
            # as in ms-swift's MultiTurnScheduler.run); --max_turns ends the trajectory whatever it answers
            if sched.finished(t, t.turns) or (max_turns is not None and t.turns >= max_turns):
                t.done = True
                continue
            ids, loss = sched.step(t, t.turns, eos_ids)
            if not per_round and len(ids) >= max_new_tokens:   # no budget left for another turn
                t.done = True
                continue
            if t.logps is not None:   # tokens the step changed or added were not sampled: no sampling log-prob
                same = next((i for i, (a, b) in enumerate(zip(ids, t.ids)) if a != b), min(len(ids), len(t.ids)))
                t.logps = t.logps[:same] + [float("nan")] * (len(ids) - same)
            t.ids, t.loss = ids, loss
        pending = [[t for t in mb if not t.done] for mb in trajs]
        if not any_pending(any(pending)):
            break
        turn += 1
        budget = max_new_tokens if per_round else max((max_new_tokens - len(t.ids) for mb in pending for t in mb),
                                                     default=1)
        asks = [(m, mb) for m, mb in enumerate(pending) if mb or lockstep]
        outs = gen([[t.prompt + t.ids for t in mb] or [trajs[m][0].prompt] for m, mb in asks],
                   [[turn_seed(t.seed, turn) for t in mb] or [0] for m, mb in asks], max(1, budget))
        for (_, mb), (_, _, c_ids, c_mask, *lp) in zip(asks, outs):
            for j, t in enumerate(mb):
                n = int(c_mask[j].sum())
                room = n if per_round else min(n, max_new_tokens - len(t.ids))
                new, cut = ended(c_ids[j, :room].tolist(), eos_ids, stop)
                t.last, t.length_cut = len(t.ids), cut
                t.ids, t.loss, t.turns = t.ids + new, t.loss + [1] * len(new), t.turns + 1
                if t.logps is not None:
                    t.logps = t.logps + (lp[0][j, :len(new)].tolist() if lp else [float("nan")] * len(new))
    reward_of = sched.trajectory_reward if getattr(sched, "gym", False) else None
    return [layout(f, mb, pad_id, logprobs, reward_of) for f, mb in zip(first, trajs)]


def scored(t: dict) -> torch.Tensor:
    """A micro-batch's completion tokens the loss and its metrics count: the completion mask, less a
    multi-turn round's insertions."""
    mask = t["completion_mask"]
    return mask * t["loss_mask"] if "loss_mask" in t else mask


__all__ = ["MathTips", "SCHEDULERS", "TIPS", "build", "check_installed", "check_rows", "rollout", "scored",
           "turn_seed"]
