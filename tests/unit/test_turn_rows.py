"""A scheduler that gives several training rows per request (ms-swift's dynamic_num_samples): ms-swift's
thinking_tips_scheduler through rlhf/own_rollout.py with a stand-in generator (its rows, their conversations,
--loss_scale last_round), a plugin's split matched to its requests by id, and rlhf/grpo_rows.py's per-row
bookkeeping (last rows, advantages per row, the rule that a trajectory's rows get one reward)."""

from __future__ import annotations

import math

import pytest
import torch

from swiftlite.errors import UserError
from tests.unit.test_own_rollout import EOS, PAD, Gen, Opts, _build, _enc, _sample, registered, tok  # noqa: F401

FIRST = "<think>hmm</think> <answer>3</answer>"
SECOND = "<answer>4</answer>"


def _rows(tok, solutions):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "columns": {"solution": s}}
            for i, s in enumerate(solutions)]
    prompts = [_enc(tok, tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True))
               for r in rows]
    return rows, prompts


class Long(Opts):
    max_completion_length = 64


def _tips(tok, last_round):
    sched = _build("thinking_tips_scheduler", {}, tok, Long)
    sched.last_round = last_round
    return sched


def test_thinking_tips_gives_a_wrong_answer_a_second_turn_and_each_turn_a_row(tok):
    from swiftlite.msswift_api.rollout import ThinkingModelTipsScheduler
    from swiftlite.rlhf.own_rollout import OwnRollout
    sched = _tips(tok, last_round=True)
    assert isinstance(sched, OwnRollout) and isinstance(sched.sched, ThinkingModelTipsScheduler)
    # q0's first answer (3) verifies: one turn, one row; q1's (solution 5) does not: the tip, a second turn
    rows, prompts = _rows(tok, ["$3$", "$5$"])
    t1, t2 = _enc(tok, FIRST) + [EOS], _enc(tok, SECOND) + [EOS]
    gen = Gen([t1, t2])
    out, = _sample(sched, gen, rows, prompts, options=Long)
    assert len(gen.calls) == 2 and [len(mb) for mb in gen.calls[1][0]] == [1]    # only q1 asked again
    assert out["row_of"].tolist() == [0, 1, 1]
    info = out["rows_info"]
    assert info[1]["request_id"] == info[2]["request_id"] != info[0]["request_id"]
    tips = ThinkingModelTipsScheduler.TIPS
    assert info[0]["messages"] == rows[0]["prompt"] + [{"role": "assistant", "content": FIRST}]
    # the second row's conversation: the first answer without its reasoning, the tip, the second answer
    assert info[2]["messages"] == rows[1]["prompt"] + [{"role": "assistant", "content": "<answer>3</answer>"},
                                                       {"role": "user", "content": tips},
                                                       {"role": "assistant", "content": SECOND}]
    # the tip's turn was sampled from the whole first answer (ms-swift's request keeps it; its row drops it)
    asked = tok.decode(gen.calls[1][0][0][0])
    assert asked.endswith(tok.apply_chat_template(rows[1]["prompt"] + [{"role": "assistant", "content": FIRST},
                                                                       {"role": "user", "content": tips}],
                                                  tokenize=False, add_generation_prompt=True))
    # rows 0 and 1 are the first turn as sampled, all trained; row 2: the stripped answer and the template's text
    # out of the loss (last_round), the second turn in it
    for r in (0, 1):
        n = int(out["completion_mask"][r].sum())
        assert out["completion_ids"][r, :n].tolist() == t1 and out["loss_mask"][r, :n].tolist() == [1] * n
    n = int(out["completion_mask"][2].sum())
    ids, loss = out["completion_ids"][2, :n].tolist(), out["loss_mask"][2, :n].tolist()
    assert ids[-len(t2):] == t2
    assert tok.decode(ids).startswith("<answer>3</answer>")
    assert sum(loss) >= len(t2) - 1 and loss[:n - len(t2)] == [0] * (n - len(t2))
    assert out["prompt_ids"].shape[0] == 3       # each row with its request's prompt
    assert out["prompt_ids"][2].tolist()[-len(prompts[1]):] == prompts[1]

    # without last_round (ms-swift's default with a scheduler) the first answer in row 2 is trained too
    out_all, = _sample(_tips(tok, last_round=False), Gen([t1, t2]), rows, prompts, options=Long)
    loss_all = out_all["loss_mask"][2, :n].tolist()
    k = len(_enc(tok, "<answer>3</answer>"))
    assert loss_all[:k] == [1] * k and loss[:k] == [0] * k
    assert loss_all[n - len(t2):] == loss[n - len(t2):]


def test_the_tip_is_given_once_and_max_turns_ends_a_trajectory(tok):
    rows, prompts = _rows(tok, ["$5$"])
    t = _enc(tok, FIRST) + [EOS]
    gen = Gen([t])
    out, = _sample(_tips(tok, last_round=True), gen, rows, prompts, mb=1, options=Long)
    assert len(gen.calls) == 2 and out["row_of"].tolist() == [0, 0]      # wrong twice: still two turns
    sched = _tips(tok, last_round=True)
    sched.sched.max_turns = 1
    out, = _sample(sched, Gen([t]), rows, prompts, mb=1, options=Long)
    assert "row_of" not in out and out["completion_ids"].shape[0] == 1


def test_a_plugins_split_is_matched_by_id_or_refused_naming_why(tok, registered):  # noqa: F811
    row = {"prompt": [{"role": "user", "content": "hi"}], "columns": {}}
    prompt = _enc(tok, tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True))
    t = _enc(tok, "x") + [EOS]
    split = _build("split", registered, tok)         # its run returns its one response twice
    out, = _sample(split, Gen([t]), [row, row], [prompt, prompt])
    assert out["row_of"].tolist() == [0, 0, 1, 1]
    split.split_refusal = "--padding-free true is not supported with them"
    with pytest.raises(UserError, match=r"--multi_turn_scheduler split: its rollout returned 4 rollouts for 2 requests "
                                        r"\(several training rows per request.*\): --padding-free true"):
        _sample(split, Gen([t]), [row, row], [prompt, prompt])


def test_rows_bookkeeping_and_one_reward_per_trajectory():
    from swiftlite.rlhf.grpo_rows import at, collapse, completion_ids, last_rows, per_row
    t = {"completion_ids": torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 1]]),
         "completion_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]), "row_of": torch.tensor([0, 1, 1])}
    assert last_rows(t) == [0, 2]
    assert per_row(torch.tensor([0.5, -1.0]), t).tolist() == [0.5, -1.0, -1.0]
    micro = {(4, 9): t}
    assert at(micro, 9) == (t, 2) and completion_ids(micro, 9) == [8, 9, 1] and completion_ids(micro, 4) == [5, 6]
    plain = {"completion_ids": torch.zeros(2, 3)}
    assert last_rows(plain) == [0, 1] and per_row(torch.tensor([1.0, 2.0]), plain).tolist() == [1.0, 2.0]
    nan = float("nan")
    got = collapse([1.0, 2.0, 2.0, nan, nan], [0, 1, 1, 2, 2], 3, "acc", ["a:1", "b:2", "b:2", "c:3", "c:3"])
    assert got[:2] == [1.0, 2.0] and math.isnan(got[2])
    with pytest.raises(UserError, match=r"^b:2: the reward function acc gave the rows of one trajectory different "
                                        r"values \(2.0 and 0.0\)"):
        collapse([1.0, 2.0, 0.0], [0, 1, 1], 2, "acc", ["a:1", "b:2", "b:2"])
