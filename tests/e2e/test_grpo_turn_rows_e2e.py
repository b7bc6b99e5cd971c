"""GRPO with ms-swift's `--multi_turn_scheduler thinking_tips_scheduler` through the CLI, as ms-swift's
examples/train/grpo/external/vllm_multi_turn.sh runs it (its reward scores each trajectory from
`trajectory_inputs`, `--loss_scale last_round`): a wrong answer gets the tip and a second turn, each turn is a
training row (rlhf/grpo_rows.py), the reward functions see every row with its request id, rows of one
trajectory that get different rewards stop the run, and what cannot count such rows is refused before launch.

The model answers at random (tests/e2e/test_grpo_multi_turn_e2e.build_eos_prone: it often ends its answer
early), so no answer verifies: a trajectory that ends its first turn gets the tip, one cut at the length limit
does not."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, run_cli
# `server`: test_grpo_multi_turn_e2e's module fixture, a rollout server on this module's `files` model
from tests.e2e.test_grpo_multi_turn_e2e import COMMON, math_files, server  # noqa: F401

TIPS = "The answer is not correct, It seems You made a mistake, you need to recheck very carefully."
#: ms-swift's example reward's contract: each row's request_id, the whole trajectory in trajectory_inputs; this one
#: writes down what it saw and gives each trajectory its number of rows (the same for all of them, with spread)
PLUGIN = '''import json, os
from swift.rewards import ORM, orms


class Rows(ORM):
    def __call__(self, completions, request_id, trajectory_inputs, **kwargs):
        with open(os.environ["ROWS_LOG"], "a") as f:
            for rid in request_id:
                f.write(json.dumps({"rid": rid, "rows": [r["messages"] for r in trajectory_inputs[rid]]}) + "\\n")
        return [float(len(trajectory_inputs[rid])) for rid in request_id]


orms["rows"] = Rows
orms["row_length"] = lambda completions, **kwargs: [float(len(c)) for c in completions]
'''
TURNS = ["--multi_turn_scheduler", "thinking_tips_scheduler", "--loss_scale", "last_round",
         "--max-completion-length", "4"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return math_files(tmp_path_factory.mktemp("rows"), PLUGIN)


def _run(files, out, *extra, check=True):
    env = cli_env()
    env["ROWS_LOG"] = str(out.parent / f"{out.name}.rows.jsonl")
    return run_cli(["rlhf", *COMMON, "--model", files / "model", "--dataset", files / "data.jsonl",
                    "--external-plugins", files / "plugin.py", *TURNS, *extra, "--output-dir", out], env=env,
                   check=check)


def _seen(out):
    return [json.loads(x) for x in (out.parent / f"{out.name}.rows.jsonl").read_text().splitlines()]


def _steps(out):
    return [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines() if '"step"' in x]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_wrong_answer_gets_the_tip_and_each_turn_trains_as_a_row(files, tmp_path, nproc):
    out = tmp_path / f"p{nproc}"
    _run(files, out, "--reward_funcs", "rows", "--max-steps", "2",
         *(["--parallelism", "fsdp", "--nproc-per-node", "2", "--per-device-train-batch-size", "2"]
           if nproc == 2 else []))
    seen = _seen(out)
    by_rid: dict[str, list] = {}
    for s in seen:      # every row of a trajectory was scored, each seeing the whole trajectory
        by_rid.setdefault(s["rid"], []).append(s["rows"])
    assert all(len(v) == len(v[0]) and all(x == v[0] for x in v) for v in by_rid.values())
    two = [v[0] for v in by_rid.values() if len(v[0]) == 2]
    one = [v[0] for v in by_rid.values() if len(v[0]) == 1]
    assert two and one, (len(two), len(one))     # tipped and cut trajectories both occur with this model
    for first, second in two:
        # the first row: the prompt and the first answer; the second: that answer without its reasoning, the tip,
        # the second answer
        assert [m["role"] for m in first] == ["user", "assistant"]
        assert [m["role"] for m in second] == ["user", "assistant", "user", "assistant"]
        assert second[2]["content"] == TIPS and second[0] == first[0]
        assert second[1]["content"] == first[1]["content"].split("</think>")[-1].strip()
    steps = _steps(out)
    assert [s["step"] for s in steps] == [1, 2]
    # the reward is the trajectory's (1 or 2), and its spread within a group trains the policy
    assert all(1.0 <= s["reward"] <= 2.0 for s in steps) and any(s["reward_std"] > 0 for s in steps)
    assert all(s["num_turns"] == pytest.approx(s["reward"]) for s in steps)   # a trajectory's rows: its turns
    assert any(s["grad_norm"] > 0 for s in steps)
    # each scored request is one completion of the round: 8 a round, two rounds (GA 2 x 4, one step each)
    assert len(by_rid) == 16


def test_against_a_rollout_server_the_rows_are_the_in_process_ones(files, server, tmp_path):
    """ms-swift's script's mode: two FSDP2 processes, `--vllm_mode server` with the rows' columns passed; the
    first process drives every request's turns through the server (ms-swift's server mode) and each process
    trains its own requests' rows. One process sampling in-process drives the same requests in the same
    order: the same trajectories, as the reward functions saw them, and the same rewards and turns."""
    from tests.e2e.test_rollout_server import _port
    two = ["--parallelism", "fsdp", "--nproc-per-node", "2", "--per-device-train-batch-size", "2"]
    _run(files, tmp_path / "srv", "--reward_funcs", "rows", "--max-steps", "2", *two, "--use_vllm", "true",
         "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port", str(server["port"]),
         "--vllm_server_group_port", str(_port()), "--vllm_server_pass_dataset", "true")
    _run(files, tmp_path / "local", "--reward_funcs", "rows", "--max-steps", "2")

    def trajectories(out):
        return sorted(json.dumps(s["rows"]) for s in _seen(out))
    assert trajectories(tmp_path / "srv") == trajectories(tmp_path / "local")
    for x, y in zip(_steps(tmp_path / "srv"), _steps(tmp_path / "local")):
        assert (x["reward"], x["reward_std"], x["num_turns"]) == (y["reward"], y["reward_std"], y["num_turns"])


def test_a_resume_inside_a_round_trains_the_rows_it_saved(files, tmp_path):
    """--num_iterations 2: steps 1 and 2 share a round, whose rows (several per request) checkpoint-1 keeps;
    the run resumed from it logs step 2 as the uninterrupted run does."""
    args = ["--reward_funcs", "rows", "--num-iterations", "2", "--lr-scheduler", "constant", "--max-steps", "2",
            "--save-steps", "1"]
    _run(files, tmp_path / "whole", *args)
    cut = tmp_path / "cut"
    _run(files, cut, *args[:-4], "--max-steps", "1", "--save-steps", "1")
    import torch
    saved = torch.load(cut / "checkpoint-1" / "grpo_round_rank0.pt", weights_only=True)
    assert any("row_of" in t for _, t in saved["micro"])
    proc = _run(files, cut, *args, "--resume", "auto")
    assert "resuming from checkpoint-1" in proc.stdout
    whole, resumed = _steps(tmp_path / "whole"), {s["step"]: s for s in _steps(cut)}
    assert resumed[2]["loss"] == whole[1]["loss"] and resumed[2]["grad_norm"] == whole[1]["grad_norm"]


def test_rows_of_one_trajectory_with_different_rewards_stop_the_run(files, tmp_path):
    out = tmp_path / "differ"
    proc = _run(files, out, "--reward_funcs", "row_length", "--max-steps", "1", check=False)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert any("the reward function row_length gave the rows of one trajectory different values" in x for x in err)
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra,words", [
    (["--padding-free", "true"], "--multi-turn-scheduler thinking_tips_scheduler trains each turn as a row of its "
                                 "own: --padding-free true is not supported with them"),
    (["--dynamic-sample", "true"], "trains each turn as a row of its own: --dynamic-sample true replaces groups"),
    (["--dataset", "NOSOL"], "no 'solution' column, which --multi_turn_scheduler thinking_tips_scheduler verifies"),
])
def test_what_cannot_count_the_rows_is_refused_before_launch(files, tmp_path, extra, words):
    if "NOSOL" in extra:
        bad = tmp_path / "nosol.jsonl"
        bad.write_text(json.dumps({"prompt": "1+1", "solution": "2"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
        extra = [bad if e == "NOSOL" else e for e in extra]
    out = tmp_path / "out"
    proc = _run(files, out, "--reward_funcs", "rows", *extra, "--max-steps", "1", check=False)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and words in err and "Traceback" not in err, err
    assert not out.exists()
