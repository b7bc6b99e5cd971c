"""A multi-turn round's trajectories and their tensors, shared by the turn loop (rlhf/multi_turn.py) and a
scheduler's own rollout (rlhf/own_rollout.py): a trajectory's state, how a turn's tokens end, the seed of a
later turn, and one micro-batch's tensors (the first turn's prompt tensors, the whole completions, their
mask and loss mask, the sampling log-probabilities, and with --use_gym_env each trajectory's reward)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


def turn_seed(seed: int, turn: int) -> int:
    """The generator seed of a completion's turn `turn` (>= 2), from its round seed."""
    return (seed * 1_000_003 + turn * 7_919) % (2 ** 63 - 1)


@dataclass
class Trajectory:
    prompt: list[int]
    row: dict
    seed: int
    ids: list[int]
    loss: list[int]
    logps: list[float] | None
    done: bool = False
    turns: float = 1              # turns taken (a scheduler's own rollout: its rollout_infos['num_turns'], else NaN)
    last: int = 0                 # where the latest turn's tokens begin in `ids`
    length_cut: bool = False      # the latest turn ended at the length limit (ms-swift's finish_reason 'length')
    state: Any = None             # a plugin scheduler's conversation (rlhf/plugin_turns.py)


def ended(ids: list[int], eos_ids: set[int], stop: Callable[[list[int]], int | None]) -> tuple[list[int], bool]:
    """A turn's tokens cut after its first stop word, and whether it ended at the length limit (neither an
    end-of-turn token nor a stop word)."""
    k = stop(ids)
    if k is not None:
        return ids[:k], False
    return ids, not ids or ids[-1] not in eos_ids


def layout(first: tuple[torch.Tensor, ...], trajs: list[Trajectory], pad_id: int, logprobs: bool,
            reward_of: Callable[[Trajectory], float] | None = None) -> dict:
    """One micro-batch's tensors: the first turn's prompt tensors, the whole completions (padded to the
    longest), their mask (a prefix: what attention sees) and loss mask (0 on insertions); with
    `reward_of` (--use_gym_env) each trajectory's environment reward, `gym_reward`; each trajectory's turns,
    `num_turns` (ms-swift's metric; NaN where a scheduler's own rollout gave no rollout_infos['num_turns'])."""
    p_ids, p_mask = first[0], first[1]
    device = p_ids.device
    n = max(1, max(len(t.ids) for t in trajs))
    c_ids = torch.full((len(trajs), n), pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(trajs), n), dtype=torch.long)
    loss = torch.zeros((len(trajs), n), dtype=torch.long)
    lp = torch.full((len(trajs), n), float("nan"), dtype=torch.float32)
    for j, t in enumerate(trajs):
        c_ids[j, :len(t.ids)] = torch.tensor(t.ids, dtype=torch.long)
        c_mask[j, :len(t.ids)] = 1
        loss[j, :len(t.ids)] = torch.tensor(t.loss, dtype=torch.long)
        if t.logps is not None:
            lp[j, :len(t.logps)] = torch.tensor(t.logps, dtype=torch.float32)
    out = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids.to(device),
           "completion_mask": c_mask.to(device), "loss_mask": loss.to(device)}
    if logprobs:
        out["rollout_logps"] = lp.to(device)
    out["num_turns"] = torch.tensor([float(t.turns) for t in trajs], dtype=torch.float32, device=device)
    if reward_of is not None:
        out["gym_reward"] = torch.tensor([reward_of(t) for t in trajs], dtype=torch.float32, device=device)
    return out



__all__ = ["Trajectory", "ended", "layout", "turn_seed"]
