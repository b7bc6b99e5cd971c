"""A GRPO round's training rows: what the reward functions get for each, and how a round holds the rows of a
scheduler that splits a trajectory into several (ms-swift's dynamic_num_samples: its `run` returns one
rollout per turn, e.g. thinking_tips_scheduler; rlhf/own_rollout.py matches them to their requests).

Such a micro-batch keeps its completions (the requests) as its key, as every micro-batch does, and its
tensors hold one row per rollout: `row_of` gives each row's completion (its slot in the key), a
completion's rows side by side, its last row the trajectory's final one. What ms-swift keeps per request
stays per completion here, so the group arithmetic is GRPO's own (G completions per prompt):

- the reward: the functions are called on every row (ms-swift's reward rows: the row's last assistant
  message as its completion, the dataset's columns, the row's conversation as `messages`, its `request_id`,
  and with a multi-turn scheduler `trajectory_inputs`,
  every row of each request by its id); the rows of one trajectory must get the same value (ms-swift's
  fail-fast rule), which is the completion's;
- the advantage: ms-swift's request-aware form (one reward per request, grouped by prompt) is GRPO's group
  advantage over the completions, given to each of a completion's rows;
- the completion metrics and the completions log: its last row (ms-swift's clipped_ratio and num_turns take
  each request's last row too);
- per row: the loss (each row one sequence of the micro-batch, which holds more rows than
  --per_device_train_batch_size when a request has several), its KL and --overlong_filter's truncation; the
  --kl_in_reward KL of a completion is its last row's (ms-swift's deduplication keeps the last).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from swiftlite.errors import UserError


def last_rows(t: dict) -> list[int]:
    """Each completion's last row in a micro-batch's tensors (its slot, where each has one row)."""
    if "row_of" not in t:
        return list(range(int(t["completion_ids"].shape[0])))
    last: dict[int, int] = {}
    for r, j in enumerate(t["row_of"].tolist()):
        last[j] = r
    return [last[j] for j in range(len(last))]


def per_row(values: torch.Tensor, t: dict) -> torch.Tensor:
    """Per-completion values (the micro-batch's key order) given to each of its rows."""
    return values[t["row_of"].to(values.device)] if "row_of" in t else values


def at(micro: dict, c: int) -> tuple[dict, int]:
    """The micro-batch tensors that hold completion `c`, and its (last) row in them."""
    for key, t in micro.items():
        if c in key:
            return t, last_rows(t)[key.index(c)]
    raise KeyError(c)


def completion_ids(micro: dict, c: int) -> list[int]:
    t, j = at(micro, c)
    return t["completion_ids"][j, :int(t["completion_mask"][j].sum())].tolist()


def row_owner(t: dict, slots: int) -> list[int]:
    """Each row's slot in the micro-batch's key."""
    return t["row_of"].tolist() if "row_of" in t else list(range(slots))


def reward_entries(b: Any, micro: dict, texts: dict, frags: dict, rows: list[dict], mine_c: list[int], step: int
                   ) -> tuple[list[str], dict[str, list], list[str], list[int]]:
    """The reward functions' call for this rank's completions `mine_c` (their dataset `rows`): one entry per
    training row, as (completions, kwargs, wheres, owner: each entry's index in `mine_c`). `frags[c]`: the
    rows of completion c that a scheduler's own rollout gave (their text, token ids, conversation, request
    id, place in the micro-batch), else the completion is one row of the prompt and its text."""
    owner, comps, ids, msgs, rids, gym, src = [], [], [], [], [], [], []
    for k, (c, row) in enumerate(zip(mine_c, rows)):
        for f in frags.get(c) or [None]:
            owner.append(k)
            src.append(row)
            if f is None:
                t, j = at(micro, c)
                comps.append(texts[c])
                ids.append(completion_ids(micro, c))
                msgs.append(row["prompt"] + [{"role": "assistant", "content": texts[c]}])
                rids.append(f"{step}-{c}")
            else:
                t, j = micro[f["key"]], f["row"]
                conv = f["messages"] or row["prompt"] + [{"role": "assistant", "content": f["text"]}]
                # ms-swift's completion: the conversation's last message (a rollout's last turn)
                comps.append(conv[-1]["content"] if conv[-1]["role"] == "assistant" else f["text"])
                ids.append(f["ids"])
                msgs.append(conv)
                rids.append(f["request_id"])
            if "gym_reward" in t:   # --use_gym_env: each trajectory's environment reward
                gym.append(float(t["gym_reward"][j]))
    kwargs: dict[str, Any] = {}
    for key in sorted({k for r in src for k in r["columns"]}):
        kwargs[key] = [r["columns"].get(key) for r in src]
    if gym:
        kwargs["gym_reward"] = gym
    kwargs.update(prompts=[r["prompt"] for r in src], completion_ids=ids, response_token_ids=ids, messages=msgs,
                  request_id=rids, trainer_state=type("TrainerState", (), {"global_step": step})())
    if b.turns is not None:   # ms-swift's trajectory_inputs: every row of each request, by its id
        traj: dict[str, list[dict]] = {}
        for e, rid in enumerate(rids):
            traj.setdefault(rid, []).append({**src[e]["columns"], "messages": msgs[e], "request_id": rid,
                                             "response_token_ids": ids[e], "completion": comps[e]})
        kwargs["trajectory_inputs"] = traj
    return comps, kwargs, [r["where"] for r in src], owner


def collapse(values: list[float], owner: list[int], n: int, name: str, wheres: list[str]) -> list[float]:
    """One reward per completion from its rows' (the last row's); rows of one trajectory that got different
    values stop the run naming the function and the row (ms-swift's rule for a split trajectory)."""
    out: list[float | None] = [None] * n
    for v, k, where in zip(values, owner, wheres):
        prev = out[k]
        if prev is not None and not (math.isclose(prev, v, abs_tol=1e-6) or (math.isnan(prev) and math.isnan(v))):
            raise UserError(f"{where}: the reward function {name} gave the rows of one trajectory different values "
                            f"({prev} and {v}); a scheduler that splits a trajectory into several rows trains each "
                            "with the trajectory's reward, the same for all (ms-swift's rule: score the trajectory, "
                            "e.g. its last row in kwargs['trajectory_inputs'][request_id])")
        out[k] = v
    return [float(v) for v in out]


__all__ = ["at", "collapse", "completion_ids", "last_rows", "per_row", "reward_entries", "row_owner"]
