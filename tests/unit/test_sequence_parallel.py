"""parallel/sequence.py's pieces without a process group: how a micro-batch is cut (every target in
exactly one slice, shifted on the whole sequence), the whole sequence's mask, the data-parallel world,
and the refusals before launch. The training itself: tests/distributed/test_sequence_parallel.py."""

from __future__ import annotations

import shlex

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError
from swiftlite.parallel.sequence import SequenceParallel, data_world, full_mask, problem


def _slices(batch, n):
    return [SequenceParallel(n, r, None, pad_id=9).shard(batch) for r in range(n)]


def test_a_padding_free_batch_is_cut_with_its_targets_shifted_on_the_whole_sequence():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    labels = torch.tensor([[IGNORE, 2, 3, IGNORE, 5, 6, 7]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    parts = _slices({"input_ids": ids, "labels": labels, "position_ids": pos}, 2)
    assert [p[0]["input_ids"].tolist() for p in parts] == [[[1, 2, 3, 4]], [[5, 6, 7, 9]]]   # padded to 8
    shifted = torch.cat([p[0]["shift_labels"] for p in parts], dim=1)
    assert shifted.tolist() == [[2, 3, IGNORE, 5, 6, 7, IGNORE, IGNORE]]   # position t -> token t + 1
    assert torch.cat([p[0]["position_ids"] for p in parts], dim=1).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    full_pos, mask2d = parts[1][1], parts[1][2]
    assert mask2d is None and full_pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]   # every rank sees the whole


def test_a_padded_batch_keeps_its_mask_and_gets_positions():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    labels = torch.tensor([[1, 2, 3, 4], [5, 6, IGNORE, IGNORE]])
    parts = _slices({"input_ids": ids, "labels": labels, "attention_mask": mask}, 2)
    assert "attention_mask" not in parts[0][0]
    assert parts[1][0]["position_ids"].tolist() == [[2, 3], [2, 3]]
    assert parts[0][2].tolist() == mask.tolist() and parts[0][1] is None


def test_the_whole_sequence_mask_is_causal_within_rows():
    m = full_mask(torch.tensor([[0, 1, 0, 1, 2]]), None)[0, 0]
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert m.int().tolist() == want.tolist()
    m = full_mask(None, torch.tensor([[1, 1, 0]]))[0, 0]
    assert m.int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 0]]


def test_one_row_per_sequence_needs_no_mask_tensor():
    """sdpa's is_causal then: no n x n mask, which at 128k tokens would be 64 GiB in fp32."""
    assert full_mask(torch.tensor([[0, 1, 2, 3]]), None) is None
    assert full_mask(None, torch.ones(2, 4, dtype=torch.long)) is None
    assert full_mask(torch.tensor([[0, 1, 0, 1]]), None) is not None


def test_the_data_parallel_world():
    assert [data_world(r, 8, 2) for r in (0, 1, 2, 7)] == [(0, 4), (0, 4), (1, 4), (3, 4)]
    assert data_world(3, 4, 1) == (3, 4)


class _Conf:
    num_attention_heads = 12


def test_the_world_and_the_heads_must_divide():
    assert problem(1, 3, _Conf()) is None and problem(4, 8, _Conf()) is None
    assert "does not divide the 6 processes" in problem(4, 6, None)
    assert "12 attention heads are not divisible by 8" in problem(8, 8, _Conf())


@pytest.mark.parametrize("command, flags, words", [
    ("rlhf", "--rlhf_type dpo --sequence_parallel_size 2", "with --rlhf_type dpo: sequence parallelism is built for sft, "
                                                           "pt and grpo"),
    ("rlhf", "--rlhf_type grpo --reward_funcs format --chord_sft_dataset x.jsonl --sequence_parallel_size 2", "CHORD"),
    ("sft", "--train_type longlora --sequence_parallel_size 2", "S2-Attn"),
    ("sft", "--router_aux_loss_coef 0.01 --sequence_parallel_size 2", "load-balancing"),
])
def test_refused_where_it_cannot_run(command, flags, words):
    cf, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "x.jsonl", *shlex.split(flags)])
    with pytest.raises(UserError) as e:
        load_config(cf, values, validate_paths=False, task=command)
    assert words in str(e.value)
