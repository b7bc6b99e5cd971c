"""`swiftlite rlhf --rlhf_type grpo` through the CLI: a LoRA run with a built-in and a plugin reward
(the plugin sees the completions and the dataset's columns), its metrics and completions table, a
resume inside a generation round (and a second run with the same seed) giving the same losses bit for
bit, and the bad inputs that stop before anything is
written (one line, exit 2), including a reward that raises mid-run (no checkpoint written)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from tests.conftest import run_cli

TENSORBOARD = importlib.util.find_spec("tensorboard") is not None

COMMON = ["--rlhf-type", "grpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--parallelism", "single",
          "--seed", "3", "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2",
          "--num-generations", "4", "--max-completion-length", "6", "--logging-steps", "1", "--save-hf-model", "false"]
PLUGIN = '''import json, os
from swiftlite.plugin import ORM, orms

class ExactMatch(ORM):
    def __call__(self, completions, solution, **kwargs):
        with open(os.environ["GRPO_CALLS"], "a") as f:
            f.write(json.dumps({"n": len(completions), "solution": solution, "keys": sorted(kwargs),
                                "step": kwargs["trainer_state"].global_step}) + "\\n")
        return [float(c.strip() == s) for c, s in zip(completions, solution)]

def boom(completions, **kwargs):
    if any(q.endswith("dcba") for q in (m[-1]["content"] for m in kwargs["prompts"])):
        raise ValueError("no dcba here")
    return [0.0] * len(completions)

orms["exact"] = ExactMatch
orms["boom"] = boom
orms["length"] = lambda completions, **kwargs: [len(c) / 10 for c in completions]
'''


def write_reverse_rows(path):
    """8 GRPO prompts ("reverse: abcd", ...) with their answers as the `solution` column."""
    words = ["abcd", "bcda", "cdab", "dabc", "abdc", "badc", "cadb", "dcba"]
    path.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"}], "solution": w[::-1]}) + "\n"
        for w in words))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo")
    write_reverse_rows(d / "data.jsonl")
    (d / "plugin.py").write_text(PLUGIN)
    return d


def _env(files):
    from tests.conftest import cli_env
    env = cli_env()
    env["GRPO_CALLS"] = str(files / "calls.jsonl")
    return env


def _steps(run):
    return [json.loads(x) for x in (run / "logging.jsonl").read_text().splitlines() if '"loss"' in x]


def test_grpo_lora_run_logs_trl_metrics_and_completions(files, tmp_path):
    args = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "exact", "repetition", "length", "--reward-weights", "1", "0.5", "1",
            "--log-completions", "true", "--learning-rate", "1e-3",
            "--max-steps", "2", *(["--report-to", "tensorboard"] if TENSORBOARD else [])]
    proc = run_cli([*args, "--output-dir", tmp_path / "a"], env=_env(files))
    assert "grpo (grpo loss, beta 0.04, reference: the base model with the adapter disabled" in proc.stdout
    steps = _steps(tmp_path / "a")
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        for k in ("loss", "reward", "reward_std", "rewards/ExactMatch/mean", "rewards/RepetitionPenalty/mean",
                  "rewards/length/mean", "completions/mean_length", "kl", "entropy", "clip_ratio/region_mean"):
            assert math.isfinite(s[k]), k
        assert 1 <= s["completions/mean_length"] <= 6 and s["clip_ratio/region_mean"] == 0.0   # one step per round
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 0.0           # the policy moved away from the reference
    rows = [json.loads(x) for x in (tmp_path / "a" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {r["step"] for r in rows} == {1, 2}   # 2 steps x 2 prompts x 4 completions
    assert set(rows[0]["rewards"]) == {"ExactMatch", "RepetitionPenalty", "length"} and "reverse:" in rows[0]["prompt"]
    if TENSORBOARD:   # the same table, step by step, as TensorBoard text (a markdown table per round)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        ev = EventAccumulator(str(tmp_path / "a" / "runs"), size_guidance={"tensors": 0})
        ev.Reload()
        texts = ev.Tensors("completions/text_summary")
        assert [t.step for t in texts] == [1, 2]
        md = texts[1].tensor_proto.string_val[0].decode().splitlines()
        assert md[0] == "| step | prompt | completion | ExactMatch | RepetitionPenalty | length | advantage |"
        assert len(md) == 2 + 8 and all(x.startswith("| 2 | ") for x in md[2:])
        done = [r for r in rows if r["step"] == 2]
        assert [float(x.rsplit("|", 2)[1]) for x in md[2:]] == pytest.approx([r["advantage"] for r in done], abs=1e-3)
    calls = [json.loads(x) for x in (files / "calls.jsonl").read_text().splitlines()]
    assert [c["n"] for c in calls] == [8, 8] and [c["step"] for c in calls] == [0, 1]
    assert {"prompts", "messages", "completion_ids", "trainer_state"} <= set(calls[0]["keys"])
    assert len(set(calls[0]["solution"][:4])) == 1                  # a prompt's 4 completions share its row


@pytest.mark.parametrize("extra,words", [
    (["--reward-funcs", "nope"], "--reward_funcs nope: unknown reward function"),
    (["--reward-funcs", "nope", "--dry-run"], "--reward_funcs nope: unknown reward function"),   # before launch
    (["--reward-funcs", "exact", "--num-generations", "1"], "--num-generations 1: GRPO needs at least 2"),
    (["--reward-funcs", "exact", "--num-generations", "3"], "does not divide into groups of 3"),
    (["--reward-funcs", "exact", "--dataset", "NOSOL"], "no 'solution' column, which reward function exact"),
])
def test_bad_inputs_stop_before_anything_is_written(files, tmp_path, extra, words):
    if "NOSOL" in extra:
        bad = tmp_path / "nosol.jsonl"
        bad.write_text(json.dumps({"prompt": "reverse: ab", "solution": "ba"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
        extra = [bad if e == "NOSOL" else e for e in extra]
    out = tmp_path / "out"
    proc = run_cli(["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
                    *extra, "--max-steps", "1", "--output-dir", out], check=False, env=_env(files))
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and words in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_reward_that_raises_names_the_function_and_row_and_saves_nothing(files, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
                    "--reward-funcs", "boom", "--max-steps", "4", "--save-steps", "1", "--output-dir", out],
                   check=False, env=_env(files))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    err = [x for x in proc.stderr.splitlines() if x.startswith("error:")]   # (library warnings aside)
    assert len(err) == 1 and "reward function boom (boom) raised ValueError: no dcba here on " in err[0]
    assert err[0].endswith(f"{files / 'data.jsonl'}:8")              # the row: file and line (dcba is line 8)
    done = sorted(p.name for p in out.glob("checkpoint-*"))
    assert all((out / d / "trainer_state.json").exists() for d in done)   # only whole checkpoints


def test_resume_inside_a_generation_round_continues_the_same_losses(files, tmp_path):
    """--num-iterations 2: steps 3 and 4 share a round. A run SIGKILLed in the middle of writing
    checkpoint-4 resumes (--resume auto) from checkpoint-3, on the round that checkpoint holds
    (grpo_round_rank0.pt), and logs step 4 as the uninterrupted run does."""
    args = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "length", "--num-iterations", "2", "--learning-rate", "1e-3", "--lr-scheduler", "constant",
            "--max-steps", "4", "--save-steps", "1"]
    run_cli([*args, "--output-dir", tmp_path / "whole"], env=_env(files))
    killed = run_cli([*args, "--output-dir", tmp_path / "cut"], check=False,
                     env={**_env(files), "SWIFTLITE_FAULT": "step=4,phase=checkpoint,kind=kill"})
    assert killed.returncode != 0 and not (tmp_path / "cut" / "checkpoint-4").exists()
    assert (tmp_path / "cut" / "checkpoint-3" / "grpo_round_rank0.pt").is_file()
    proc = run_cli([*args, "--resume", "auto", "--output-dir", tmp_path / "cut"], env=_env(files))
    assert "resuming from checkpoint-3" in proc.stdout
    # two fresh runs with one seed agree bit for bit (steps 1-3), and so does the resumed step 4
    whole = [s["loss"] for s in _steps(tmp_path / "whole")]
    cut = {s["step"]: s["loss"] for s in _steps(tmp_path / "cut")}   # step 4 logged before the kill, then again
    assert whole[3] != whole[2] and [cut[k] for k in sorted(cut)] == whole


def test_grpo_qlora_trains_the_adapter_against_the_4bit_base(files, tmp_path):
    """QLoRA: the policy is the 4-bit base + adapter, the reference the same base with the adapter off;
    the adapter moves (kl > 0 at step 2) and the run checkpoints as a LoRA run does."""
    args = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--train-type", "qlora", "--reward-funcs", "length", "--learning-rate", "1e-2", "--max-steps", "2",
            "--save-steps", "2", "--output-dir", tmp_path / "q"]
    proc = run_cli(args, env=_env(files))
    assert "reference: the base model with the adapter disabled" in proc.stdout
    steps = _steps(tmp_path / "q")
    assert [s["step"] for s in steps] == [1, 2] and all(math.isfinite(s["loss"]) for s in steps)
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 0.0
    args_json = json.loads((tmp_path / "q" / "args.json").read_text())
    assert args_json["quant"]["quant_bits"] == 4
    assert (tmp_path / "q" / "checkpoint-2" / "trainer_state.json").is_file()


def test_gspo_sequence_level_ratio_trains_over_two_passes(files, tmp_path):
    """--importance_sampling_level sequence (GSPO) with --num_iterations 2: the second pass over a round
    has a ratio off 1 per completion; the run trains and records its level."""
    args = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "exact", "length", "--importance_sampling_level", "sequence", "--num_iterations", "2",
            "--epsilon", "3e-4", "--epsilon_high", "4e-4", "--beta", "0", "--learning-rate", "1e-3",
            "--max-steps", "2"]
    run_cli([*args, "--output-dir", tmp_path / "g"], env=_env(files))
    steps = _steps(tmp_path / "g")
    assert [s["step"] for s in steps] == [1, 2] and all(math.isfinite(s["loss"]) for s in steps)
    # pass 1 of the round is on-policy (ratio 1); pass 2 follows an update of lr 1e-3, far outside GSPO's
    # 3e-4 / 4e-4 clip range for some completions (a completion-level fraction)
    assert steps[0]["clip_ratio/region_mean"] == 0.0 and 0.0 < steps[1]["clip_ratio/region_mean"] <= 1.0
    assert json.loads((tmp_path / "g" / "args.json").read_text())["rlhf"]["importance_sampling_level"] == "sequence"


def test_overlong_filter_leaves_cut_completions_out_of_the_loss(files, tmp_path):
    """--overlong_filter (ms-swift's): completions cut at --max_completion_length (no EOS) are masked out
    of the loss and its metrics. The same seed samples the same first round with and without it; a tiny
    random model rarely ends a 6-token completion, so the filtered run's loss and entropy see only the
    completions that ended (none: both are exactly 0)."""
    base = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "exact", "length", "--learning-rate", "1e-3", "--max-steps", "1"]
    run_cli([*base, "--output-dir", tmp_path / "plain"], env=_env(files))
    run_cli([*base, "--overlong_filter", "true", "--output-dir", tmp_path / "filtered"], env=_env(files))
    plain, filtered = _steps(tmp_path / "plain")[0], _steps(tmp_path / "filtered")[0]
    assert plain["completions/clipped_ratio"] == filtered["completions/clipped_ratio"] > 0.0
    assert plain["reward"] == filtered["reward"]                     # the same samples, scored the same
    assert plain["entropy"] > 0.0
    if filtered["completions/clipped_ratio"] == 1.0:
        assert filtered["entropy"] == 0.0 and filtered["loss"] == 0.0
    else:
        assert filtered["entropy"] != plain["entropy"]
    assert json.loads((tmp_path / "filtered" / "args.json").read_text())["rlhf"]["overlong_filter"] is True


def test_rloo_puts_the_kl_into_the_rewards(files, tmp_path):
    """--advantage_estimator rloo (ms-swift's defaults with it: --scale_rewards none, --kl_in_reward true):
    the first line says so; the first round's policy is the reference (LoRA starts at B = 0), so its
    KL is 0; after an update it is not, and it is logged from the rewards, not the loss."""
    args = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "exact", "length", "--advantage_estimator", "rloo", "--learning-rate", "5e-2",
            "--max-steps", "2"]
    proc = run_cli([*args, "--output-dir", tmp_path / "r"], env=_env(files))
    assert "rloo advantages, scaled by none, KL in the rewards" in proc.stdout
    steps = _steps(tmp_path / "r")
    assert [s["step"] for s in steps] == [1, 2] and all(math.isfinite(s["loss"]) for s in steps)
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] != 0.0
    rlhf = json.loads((tmp_path / "r" / "args.json").read_text())["rlhf"]
    assert rlhf["advantage_estimator"] == "rloo" and rlhf["kl_in_reward"] is None


def test_generation_batch_size_sets_the_round(files, tmp_path):
    """--generation_batch_size (ms-swift's): 16 completions per round at per-device 4 x 1 process is 4
    micro-batch steps per generation, so with accumulation 2 one round serves both optimizer steps (the
    same round metrics twice); a size that is not whole steps is refused before anything is written."""
    base = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "exact", "length", "--learning-rate", "1e-3", "--max-steps", "2"]
    run_cli([*base, "--generation_batch_size", "16", "--output-dir", tmp_path / "g"], env=_env(files))
    steps = _steps(tmp_path / "g")
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["reward"] == steps[1]["reward"] and steps[0]["completions/mean_length"] == \
        steps[1]["completions/mean_length"]
    proc = run_cli([*base, "--generation_batch_size", "12", "--output-dir", tmp_path / "bad"], env=_env(files),
                   check=False)
    assert proc.returncode == 2 and "--generation-batch-size 12: must be a multiple of per-device 4 x 1 processes" \
        in proc.stderr and not (tmp_path / "bad").exists()


def test_real_loss_is_its_group_formula(files, tmp_path):
    """--loss_type real (REAL, ms-swift's examples/train/grpo/internal/real.sh): the first step's loss is
    sum over the groups with both signs of log(1 + n_non-positive) + log(1 + n_positive), / the groups
    (every score is 0 at the sampling policy; the first round's KL to the reference is 0), read back from
    the completions table's advantages (unscaled: ms-swift's --scale_rewards none); a round that serves two
    optimizer steps is refused before anything is written."""
    base = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "length", "--loss_type", "real", "--real_tau", "0.5", "--log-completions", "true",
            "--learning-rate", "1e-2", "--max-steps", "2"]
    run_cli([*base, "--output-dir", tmp_path / "r"], env=_env(files))
    steps = _steps(tmp_path / "r")
    assert [s["step"] for s in steps] == [1, 2] and math.isfinite(steps[1]["loss"])
    rows = [json.loads(x) for x in (tmp_path / "r" / "completions.jsonl").read_text().splitlines()]
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r["step"] == 1:
            groups.setdefault(r["prompt"], []).append(r["advantage"])
    assert len(groups) == 2 and all(len(g) == 4 for g in groups.values())
    expected = 0.0
    for adv in groups.values():
        n_pos = sum(a > 0 for a in adv)
        if 0 < n_pos < len(adv):
            expected += math.log(1 + len(adv) - n_pos) + math.log(1 + n_pos)
    expected /= len(groups)
    assert expected > 0 and steps[0]["loss"] == pytest.approx(expected, rel=1e-5)
    proc = run_cli([*base, "--generation_batch_size", "16", "--output-dir", tmp_path / "bad"], env=_env(files),
                   check=False)
    assert proc.returncode == 2 and "--loss-type real: a generation round of 16 completions serves 2" in proc.stderr \
        and not (tmp_path / "bad").exists()


def test_a_reward_model_scores_the_completions(files, tmp_path):
    """--reward_model (ms-swift's default plugin): a one-output classifier, here built like an exported
    `swiftlite rlhf --rlhf_type rm` folder, is a reward after the functions; each logged completion's
    score equals the classifier's score of the prompt + completion conversation."""
    import re

    import torch

    from swiftlite.rlhf.reward_model import RewardModelScorer
    from tests.unit.test_grpo_reward_model import build_tiny_rm
    rm = build_tiny_rm(tmp_path / "tiny-rm")
    run_cli(["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--reward_funcs", "format", "--reward_model", rm,
             "--reward_weights", "1", "2", "--log-completions", "true", "--max-steps", "1",
             "--output-dir", tmp_path / "g"])
    step = _steps(tmp_path / "g")[0]
    rows = [json.loads(x) for x in (tmp_path / "g" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(set(r["rewards"]) == {"Format", "tiny-rm"} for r in rows)
    scorer = RewardModelScorer(str(rm), "cpu", torch.float32)
    convs = [[{"role": "user", "content": re.search(r"reverse: \w+", r["prompt"]).group(0)},
              {"role": "assistant", "content": r["completion"]}] for r in rows]
    want = scorer([r["completion"] for r in rows], messages=convs)
    assert [r["rewards"]["tiny-rm"] for r in rows] == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert step["rewards/tiny-rm/mean"] == pytest.approx(sum(want) / len(want), rel=1e-4, abs=1e-6)
    # the weights apply in order (functions, then models): reward = format + 2 x score
    assert step["reward"] == pytest.approx(sum(r["rewards"]["Format"] + 2 * r["rewards"]["tiny-rm"] for r in rows) / 8,
                                           rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("train_type", ["lora", "full"])
def test_padding_free_scores_the_same_as_padded(files, tmp_path, train_type):
    """--padding_free true (sequence_parallel_grpo.sh, fipo.sh): the policy's, old and reference
    log-probs from one padding-free sequence. Same seed, same completions: the losses, KL, entropy and
    gradient norms of the padded run (1e-4 relative: the attention sums in another order), over two
    passes of a round (old log-probs) with the reference on (the adapter off, or a frozen copy)."""
    args = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--reward-funcs", "length", "repetition",
            "--external-plugins", files / "plugin.py", "--num_iterations", "2", "--learning-rate", "1e-3",
            "--train-type", train_type, "--max-steps", "4"]
    run_cli([*args, "--output-dir", tmp_path / "pad"], env=_env(files))
    proc = run_cli([*args, "--padding_free", "true", "--output-dir", tmp_path / "free"], env=_env(files))
    assert "padding-free batches (--padding_free true)" in proc.stdout
    pad, free = _steps(tmp_path / "pad"), _steps(tmp_path / "free")
    assert len(pad) == len(free) == 4
    for a, b in zip(pad, free):
        assert a["completions/mean_length"] == b["completions/mean_length"] and a["reward"] == b["reward"]
        for k in ("loss", "grad_norm", "kl", "entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), (a["step"], k)
