"""GRPO's data plan and sampler: which completions each rank trains on (a function of processes x
accumulation only), how rounds map to optimizer steps, and Gumbel-max draws following the softmax."""

from __future__ import annotations

import torch

from swiftlite.rlhf.generate import GumbelSampler, completion_seed
from swiftlite.rlhf.grpo_data import GrpoPlan


def _plan(world, ga, S=None, K=1, per_device=2, n=12, G=4):
    return GrpoPlan(n, per_device, world, ga, 7, G, S or ga, K)


def test_micro_batches_depend_on_processes_times_accumulation_only():
    one, two = _plan(1, 4), _plan(2, 2)
    assert one.global_batch == two.global_batch == 8 and one.round_prompts == two.round_prompts == 2
    a = one.micro_batches(0, 0)
    b = [mb for m in range(2) for mb in (two.micro_batches(0, 0)[m], two.micro_batches(0, 1)[m])]
    assert a == b == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # each round's completions are trained on once, split over the ranks
    mine = [c for r in range(2) for mb in two.rank_micro_batches(r) for c in mb]
    assert sorted(mine) == list(range(two.round_completions))


def test_rounds_serve_steps_per_generation_over_ga_times_iterations_steps():
    p = _plan(1, 2, S=4, K=2, per_device=2, n=12, G=4)      # a round: 8 completions = 2 prompts, 2 slices
    assert p.steps_per_round == 4 and p.rounds_per_epoch == 6 and p.steps_per_epoch == 24
    assert [p.round_of(s) for s in range(6)] == [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert p.micro_batches(1, 0) == [[4, 5], [6, 7]]
    assert p.prompts(0) == p.order(0)[:2] and p.prompts(6) == p.order(1)[:2]   # round 6 starts epoch 2


def test_gumbel_max_draws_follow_the_softmax_and_are_per_completion():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]])
    want = torch.softmax(logits[0], -1)
    g = torch.Generator().manual_seed(completion_seed(7, 0, 3))
    s = GumbelSampler([g])
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[int(s(None, logits).argmax())] += 1
    assert counts[4] == 0 and torch.allclose(counts / 4000, want, atol=0.025)
    # a completion's draws depend on its own seed only, not on the rows beside it
    alone = GumbelSampler([torch.Generator().manual_seed(11)])(None, logits)
    pair = GumbelSampler([torch.Generator().manual_seed(5), torch.Generator().manual_seed(11)])(None, logits.repeat(2, 1))
    assert torch.equal(alone[0], pair[1]) and not torch.equal(pair[0], pair[1])
