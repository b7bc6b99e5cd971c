"""rlhf/kto.py: the KTO loss against TRL's formula written out by hand, the row formats and their
errors, the mismatched (KL) sequences, and the global batch order the KL rotation uses."""

from __future__ import annotations

import math

import pytest
import torch

from swiftlite.data.loader import BatchPlan
from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError
from swiftlite.rlhf.kto import KtoMethod, UnpairedBatches, kto_terms, mismatched, to_unpaired


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_kto_terms_match_the_formula_with_weights_and_kl():
    m = KtoMethod(beta=0.2, desirable_weight=1.3, undesirable_weight=0.7)
    p = torch.tensor([-10.0, -4.0, -7.5, -3.0])
    r = torch.tensor([-11.0, -4.5, -7.0, -3.0])
    lab = torch.tensor([True, False, True, False])
    kl = 0.25
    out = kto_terms(m, p, r, lab, kl)
    for i in range(4):
        ratio = (p[i] - r[i]).item()
        want = 1.3 * (1 - _sig(0.2 * (ratio - kl))) if lab[i] else 0.7 * (1 - _sig(0.2 * (kl - ratio)))
        assert out[i].item() == pytest.approx(want, abs=1e-7)
    # policy == reference and no KL: every row's loss is its weight x 1/2
    same = kto_terms(m, p, p, lab, 0.0)
    assert same.tolist() == pytest.approx([0.65, 0.35, 0.65, 0.35], abs=1e-7)


def test_rows_in_both_formats_and_bad_rows():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    u = to_unpaired({"messages": msgs, "label": True}, "f:1")
    assert u.prompt == msgs[:1] and u.completion == msgs[1:] and u.label is True
    t = to_unpaired({"prompt": "q", "completion": "a", "label": False}, "f:2")
    assert t.prompt == msgs[:1] and t.completion == msgs[1:] and t.label is False
    conv = to_unpaired({"prompt": msgs[:1], "completion": msgs[1:], "label": True}, "f:3")
    assert conv == u
    with pytest.raises(UserError, match=r"^f:4: no 'label' \(found keys: messages"):
        to_unpaired({"messages": msgs}, "f:4")
    with pytest.raises(UserError, match=r"^f:5: 'label' must be true or false, got 'yes'"):
        to_unpaired({"messages": msgs, "label": "yes"}, "f:5")
    with pytest.raises(UserError, match=r"^f:6: a TRL KTO row needs 'prompt'"):
        to_unpaired({"completion": "a", "label": True}, "f:6")


def test_mismatched_sequence_is_own_prompt_and_the_other_rows_completion_cut_at_its_end():
    a = {"input_ids": [1, 2, 3, 10, 11], "labels": [IGNORE, IGNORE, IGNORE, 10, 11], "start": 3}
    b = {"input_ids": [4, 5, 20, 21, 22], "labels": [IGNORE, IGNORE, 20, 21, 22], "start": 2}
    ab, ba = mismatched([a, b], [b, a], max_length=6)
    assert ab == {"input_ids": [1, 2, 3, 20, 21, 22], "labels": [IGNORE] * 3 + [20, 21, 22]}
    assert ba == {"input_ids": [4, 5, 10, 11], "labels": [IGNORE, IGNORE, 10, 11]}
    cut, = mismatched([a], [b], max_length=4)          # keep the start, as TRL's keep_start
    assert cut["input_ids"] == [1, 2, 3, 20] and cut["labels"] == [IGNORE] * 3 + [20]


@pytest.mark.parametrize("world,acc", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_global_order_is_the_same_rows_whatever_the_layout(world, acc):
    """The KL rotation runs over the global batch in the plan's order: the same list for any world
    size and accumulation with the same global batch, and the union of every rank's micro-batches."""
    per_device = 4 // (world * acc)
    plan = BatchPlan(12, per_device, world, acc, seed=3)
    ref = UnpairedBatches([], BatchPlan(12, 4, 1, 1, seed=3), 0, None, KtoMethod(), 64)
    b = UnpairedBatches([], plan, 0, None, KtoMethod(), 64)
    for step in range(5):                               # across an epoch boundary (3 steps per epoch)
        g = b.global_order(step)
        assert g == ref.global_order(step)
        assert sorted(g) == sorted(i for mb in plan.all_micro_batches(step) for i in mb)
