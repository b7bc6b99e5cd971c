"""GRPO's variants through the CLI (tiny Llama, LoRA, one process): --dynamic_sample replaces the groups
without a reward signal by resampled ones (every logged group has one, the resamples are logged, a run
resumed at a round's start resamples the same); --loss_type fipo with --delta logs FIPO's metrics and is
dapo on a round's first step but not on its second; the variant options' misuses are refused together."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.conftest import run_cli
from tests.e2e.test_grpo_e2e import write_reverse_rows

COMMON = ["--rlhf-type", "grpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--parallelism", "single",
          "--seed", "3", "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2",
          "--num-generations", "4", "--max-completion-length", "6", "--logging-steps", "1", "--save-hf-model", "false"]
# picky: a signal (the completion's length) only for the prompts whose answer starts with a or b; 0 otherwise
PLUGIN = '''from swiftlite.plugin import orms
orms["picky"] = lambda completions, solution, **kw: [float(len(c)) if s[0] in "ab" else 0.0
                                                     for c, s in zip(completions, solution)]
orms["length"] = lambda completions, **kw: [len(c) / 10 for c in completions]
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_variants")
    write_reverse_rows(d / "data.jsonl")
    (d / "plugin.py").write_text(PLUGIN)
    return d


def _steps(run):
    return [json.loads(x) for x in (run / "logging.jsonl").read_text().splitlines() if '"loss"' in x]


def test_dynamic_sample_trains_only_on_groups_with_a_signal_and_resumes_the_same(files, tmp_path):
    args = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "picky", "--dynamic_sample", "true", "--log-completions", "true",
            "--learning-rate", "1e-3", "--lr-scheduler", "constant", "--max-steps", "4", "--save-steps", "2"]
    proc = run_cli([*args, "--output-dir", tmp_path / "a"])
    assert "dynamic sampling (up to 3 resamples)" in proc.stdout
    steps = _steps(tmp_path / "a")
    assert all(s["frac_reward_zero_std"] == 0.0 and s["dynamic_sample/kept_original"] == 0.0 for s in steps)
    # 2 of every 8 prompts would give a signal by chance per round: most rounds must have resampled
    assert sum(s["dynamic_sample/resamples"] for s in steps) >= 2
    rows = [json.loads(x) for x in (tmp_path / "a" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 8
    for k in range(0, len(rows), 4):           # each group: one prompt, rewards not all equal
        group = rows[k:k + 4]
        assert len({r["prompt"] for r in group}) == 1
        assert statistics.pstdev([r["rewards"]["picky"] for r in group]) > 0
        word = group[0]["prompt"].split("reverse: ")[1][:4]
        assert word[::-1][0] in "ab"            # only the prompts that can give a signal were kept
    # resumed at round 3's start: the same resampling, so the same steps 3 and 4
    run_cli([*args, "--resume-from", tmp_path / "a" / "checkpoint-2", "--output-dir", tmp_path / "b"])
    again = {s["step"]: s for s in _steps(tmp_path / "b")}
    for s in steps[2:]:
        assert again[s["step"]]["loss"] == pytest.approx(s["loss"], rel=1e-6, abs=1e-9)
        assert again[s["step"]]["dynamic_sample/resamples"] == s["dynamic_sample/resamples"]
        assert again[s["step"]]["reward"] == s["reward"]


def test_fipo_with_delta_is_dapo_on_a_rounds_first_step_only(files, tmp_path):
    base = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "length", "--num-iterations", "2", "--learning-rate", "5e-2", "--beta", "0",
            "--lr-scheduler", "constant", "--max-steps", "2", "--epsilon-high", "0.28"]
    proc = run_cli([*base, "--loss-type", "fipo", "--delta", "10", "--fipo_clip_high_only", "false",
                    "--fipo_decay_rate", "4", "--output-dir", tmp_path / "fipo"])
    assert "fipo loss, FIPO weights (half-life 4 tokens, clamped to [0.8, 1.2], safety threshold 4), " \
           "unclipped ratio capped at 10" in proc.stdout
    run_cli([*base, "--loss-type", "dapo", "--output-dir", tmp_path / "dapo"])
    fipo, dapo = _steps(tmp_path / "fipo"), _steps(tmp_path / "dapo")
    assert fipo[0]["fipo/influence_weight_mean"] == 1.0 and fipo[0]["fipo/future_kl_mean"] == 0.0
    assert fipo[0]["loss"] == pytest.approx(dapo[0]["loss"], rel=1e-6, abs=1e-9)
    assert fipo[0]["grad_norm"] == pytest.approx(dapo[0]["grad_norm"], rel=1e-6)
    # step 2 trains the same round again after an update: the ratios move, and so do the weights
    assert fipo[1]["fipo/future_kl_mean"] != 0.0 and fipo[1]["fipo/influence_weight_mean"] != 1.0
    assert 0.8 <= fipo[1]["fipo/influence_weight_mean"] <= 1.2 and fipo[1]["fipo/safety_keep_ratio"] == 1.0
    assert fipo[1]["grad_norm"] != pytest.approx(dapo[1]["grad_norm"], rel=1e-6)


def test_variant_misuses_are_refused_together(files, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
                    "--reward-funcs", "picky", "--max_resample_times", "2", "--fipo_decay_rate", "8",
                    "--max-steps", "1", "--output-dir", out], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert any("--max-resample-times applies to --dynamic-sample true" in x for x in err), err
    assert any("--fipo-decay-rate applies to --loss-type fipo" in x for x in err), err
    assert not out.exists()
    for extra, words in ((["--loss-type", "fipo", "--delta", "1.1"], "--delta 1.1: the cap of the unclipped ratio "
                                                                      "must be above"),
                         (["--dynamic_sample", "true", "--max_resample_times", "0"], "--max-resample-times 0")):
        proc = run_cli(["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins",
                        files / "plugin.py", "--reward-funcs", "picky", *extra, "--dry-run"], check=False)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr


def test_stop_words_cut_the_completions_the_run_without_them_samples(files, tmp_path):
    """Step 1 (the same weights): each completion of a run with --stop_words is the run's without them, cut
    after its first stop word (the draws do not depend on where generation stops: rlhf/generate.py); a
    completion cut there is not counted as clipped. GKD's sampled steps are cut the same way."""
    base = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            "--reward-funcs", "length", "--log-completions", "true", "--max-steps", "1",
            "--max-completion-length", "12"]
    words = list("abcdefghijklmnopqrstuvwxyz")   # random bytes: about one token in ten completes one
    run_cli([*base, "--output-dir", tmp_path / "plain"])
    run_cli([*base, "--stop_words", *words, "--output-dir", tmp_path / "stop"])
    plain = [json.loads(x)["completion"] for x in (tmp_path / "plain" / "completions.jsonl").read_text().splitlines()]
    stop = [json.loads(x)["completion"] for x in (tmp_path / "stop" / "completions.jsonl").read_text().splitlines()]
    cut = 0
    for p, s in zip(plain, stop):
        first = min([p.index(w) + len(w) for w in words if w in p] or [len(p)])
        assert s == p[:first]
        cut += first < len(p)
    assert cut >= 2 and len(stop) == 8
    a, b = _steps(tmp_path / "plain")[0], _steps(tmp_path / "stop")[0]
    assert b["completions/mean_length"] < a["completions/mean_length"]
    assert b["completions/clipped_ratio"] < a["completions/clipped_ratio"]
    gkd = ["rlhf", "--rlhf-type", "gkd", "--model", "tiny-llama-2l", "--teacher-model", "tiny-llama", "--lmbda", "1",
           "--torch-dtype", "fp32", "--parallelism", "single", "--seed", "3", "--per-device-train-batch-size", "4",
           "--gradient-accumulation-steps", "1",
           "--max-completion-length", "12", "--max-steps", "1", "--log-completions", "true", "--save-hf-model",
           "false", "--dataset", tmp_path / "gkd.jsonl"]
    (tmp_path / "gkd.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                                        {"role": "assistant", "content": "a"}]}) + "\n"
                                                for i in range(4)))
    run_cli([*gkd, "--output-dir", tmp_path / "gkd_plain"])
    run_cli([*gkd, "--stop_words", *words, "--output-dir", tmp_path / "gkd_stop"])
    rows = [[json.loads(x)["completion"] for x in (tmp_path / n / "completions.jsonl").read_text().splitlines()]
            for n in ("gkd_plain", "gkd_stop")]
    assert sum(s != p for p, s in zip(*rows)) >= 1
    assert all(p.startswith(s) and (s == p or s.endswith(tuple(words))) for p, s in zip(*rows))
