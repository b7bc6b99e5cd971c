"""rlhf/multi_turn.py: math_tip_trick's cut and tip, and the turn loop with a stand-in generator (what each
later turn is asked for, with which seeds and budgets, and the tensors it hands to the loss)."""

from __future__ import annotations

import pytest
import torch

from swiftlite.rlhf.multi_turn import TIPS, MathTips, rollout, scored, turn_seed

EOS, PAD = 258, 259


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


def _traj(ids, row=None):
    from swiftlite.rlhf.multi_turn import Trajectory
    return Trajectory([1], row or {}, 0, list(ids), [1] * len(ids), None)


def test_the_tip_follows_the_text_before_the_first_answer_tag_and_drops_the_eos(tok):
    s = MathTips(tok)
    tips = tok.encode(TIPS, add_special_tokens=False)
    ids = tok.encode("so it is <answer>7</answer>", add_special_tokens=False) + [EOS]
    out, loss = s.step(_traj(ids), 1, {EOS})
    keep = len(out) - len(tips)
    assert tok.decode(out[:keep]) == "so it is " and out[keep:] == tips
    assert loss == [1] * keep + [0] * len(tips)                      # the tip is out of the loss
    plain = tok.encode("no tags here", add_special_tokens=False)
    assert s.step(_traj(plain + [EOS]), 1, {EOS})[0] == plain + tips  # nothing to cut: only the EOS goes
    think = tok.encode("hmm</think> x <answer>", add_special_tokens=False)
    assert tok.decode(s.step(_traj(think), 1, {EOS})[0][:-len(tips)]) == "hmm"      # the earlier of the two tags


def test_a_completion_finishes_when_it_verifies_or_already_has_the_tip(tok):
    s = MathTips(tok)
    row = {"columns": {"solution": "$4$"}}
    assert s.finished(_traj(tok.encode("<answer>4</answer>", add_special_tokens=False), row), 1)
    assert not s.finished(_traj(tok.encode("<answer>5</answer>", add_special_tokens=False), row), 1)
    assert s.finished(_traj(tok.encode("x " + TIPS + " y", add_special_tokens=False), row), 1)


class Tips:
    """A scheduler that tips every completion once (insert [7, 7]) and keeps all its tokens."""
    def finished(self, t, turn):
        return 7 in t.ids or t.length_cut      # ms-swift's base rule: a turn cut at the length limit is done

    def step(self, t, turn, eos_ids):
        keep = len(t.ids) - (1 if t.ids and t.ids[-1] in eos_ids else 0)
        return t.ids[:keep] + [7, 7], t.loss[:keep] + [0, 0]


def _layout(prompts, comps):
    from swiftlite.rlhf.vllm_gen import completion_layout
    return completion_layout(prompts, comps, pad_id=PAD, eos_ids=[EOS], device="cpu")


def test_later_turns_continue_the_tokens_with_their_own_seeds_and_the_tip_out_of_the_loss():
    prompts = [[[1, 2], [3]], [[4, 5, 6]]]
    seeds = [[10, 11], [12]]
    first = [_layout(prompts[0], [[20, 21, EOS], [22, 23, 24, 25]]), _layout(prompts[1], [[26, EOS]])]
    calls = []

    def gen(micro_prompts, micro_seeds, n):
        calls.append((micro_prompts, micro_seeds, n))
        return [_layout(mb, [[30 + k, EOS] for k in range(len(mb))]) for mb in micro_prompts]

    out = rollout(Tips(), gen, first, prompts, [[{}, {}], [{}]], seeds, max_new_tokens=4, per_round=True,
                  max_turns=None, eos_ids={EOS}, pad_id=PAD, any_pending=lambda mine: mine)
    # completion [22..25] hit the 4-token limit (no EOS): finished; the others continue once after the tip
    assert calls == [([[[1, 2, 20, 21, 7, 7]], [[4, 5, 6, 26, 7, 7]]], [[turn_seed(10, 2)], [turn_seed(12, 2)]], 4)]
    a, b = out
    assert a["completion_ids"].tolist() == [[20, 21, 7, 7, 30, EOS], [22, 23, 24, 25, PAD, PAD]]
    assert a["completion_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert a["loss_mask"].tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert scored(a).tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert torch.equal(a["prompt_ids"], first[0][0]) and b["completion_ids"].tolist() == [[26, 7, 7, 30, EOS]]


def test_total_scope_budgets_the_whole_completion_and_max_turns_stops_early():
    prompts, seeds = [[[1], [2]]], [[5, 6]]
    first = [_layout(prompts[0], [[20, EOS], [21, 22, 23, EOS]])]
    asked = []

    def gen(micro_prompts, micro_seeds, n):
        asked.append(n)
        return [_layout(mb, [[40, 41, 42, 43, 44, 45][:n] for _ in mb]) for mb in micro_prompts]

    out = rollout(Tips(), gen, first, prompts, [[{}, {}]], seeds, max_new_tokens=6, per_round=False,
                  max_turns=None, eos_ids={EOS}, pad_id=PAD, any_pending=lambda mine: mine)
    # row 0 keeps [20] + tip = 3 tokens: 3 left; row 1 keeps 3 + tip = 5: 1 left; the call asks the most left
    assert asked == [3]
    assert out[0]["completion_ids"].tolist() == [[20, 7, 7, 40, 41, 42], [21, 22, 23, 7, 7, 40]]
    none = rollout(Tips(), gen, first, prompts, [[{}, {}]], seeds, max_new_tokens=6, per_round=False, max_turns=1,
                   eos_ids={EOS}, pad_id=PAD, any_pending=lambda mine: mine)
    assert asked == [3] and none[0]["completion_ids"].tolist() == first[0][2].tolist()


def test_a_process_with_nothing_left_still_takes_part_while_another_has():
    prompts, seeds = [[[1]]], [[5]]
    first = [_layout(prompts[0], [[20, 21]])]        # cut at the limit: finished at once
    calls, flags = [], iter([True, False])

    def gen(micro_prompts, micro_seeds, n):
        calls.append(micro_prompts)
        return []

    rollout(Tips(), gen, first, prompts, [[{}]], seeds, max_new_tokens=2, per_round=True, max_turns=None,
            eos_ids={EOS}, pad_id=PAD, any_pending=lambda mine: next(flags))
    assert calls == [[]]                              # one turn with an empty share, then the loop ends


def test_the_planner_counts_every_turn_a_completion_can_take():
    """math_tip_trick's two turns double the completion under per_round; total keeps one's worth."""
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.planner import workload_from_config

    def workload(*extra):
        argv = ["--rlhf_type", "grpo", "--model", "tiny-llama-2l", "--dataset", "x.jsonl", "--reward_funcs", "format",
                "--max_length", "100", "--max_completion_length", "50", "--per_device_train_batch_size", "4", *extra]
        config_file, values = parse_run_args(argv)
        return workload_from_config(load_config(config_file, values, task="rlhf", validate_paths=False), 1,
                                    80 * 2**30)

    def length(*extra):
        return workload(*extra).generation_length
    assert length() == 150
    assert length("--multi_turn_scheduler", "math_tip_trick") == 200
    assert length("--multi_turn_scheduler", "math_tip_trick", "--max_turns", "1") == 150
    assert length("--multi_turn_scheduler", "math_tip_trick", "--completion_length_limit_scope", "total") == 150
    # thinking_tips_scheduler: two turns, and each a row of the micro-batch of its own
    assert workload().micro_batch == 4 and workload("--multi_turn_scheduler", "math_tip_trick").micro_batch == 4
    tips = workload("--multi_turn_scheduler", "thinking_tips_scheduler")
    assert (tips.generation_length, tips.micro_batch) == (200, 8)
    assert workload("--multi_turn_scheduler", "thinking_tips_scheduler", "--max_turns", "1").micro_batch == 4


def test_in_lockstep_every_micro_batch_is_asked_for_at_every_turn():
    """FSDP1's forward all-gathers: a micro-batch with nothing left is asked for with its first prompt (the
    answer unused), so every process makes the same generate calls."""
    prompts, seeds = [[[1]], [[2]]], [[5], [6]]
    first = [_layout(prompts[0], [[20, 21]]), _layout(prompts[1], [[22, EOS]])]   # the first is cut: finished
    calls = []

    def gen(micro_prompts, micro_seeds, n):
        calls.append((micro_prompts, micro_seeds))
        return [_layout(mb, [[30, EOS]] * len(mb)) for mb in micro_prompts]

    out = rollout(Tips(), gen, first, prompts, [[{}], [{}]], seeds, max_new_tokens=2, per_round=True, max_turns=None,
                  eos_ids={EOS}, pad_id=PAD, any_pending=lambda mine: mine, lockstep=True)
    assert calls == [([[[1]], [[2, 22, 7, 7]]], [[0], [turn_seed(6, 2)]])]
    assert out[0]["completion_ids"].tolist() == [[20, 21]] and out[1]["completion_ids"].tolist() == [[22, 7, 7, 30, EOS]]
