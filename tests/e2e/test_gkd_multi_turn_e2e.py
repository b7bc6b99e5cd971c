"""GKD with `--multi_turn_scheduler math_tip_trick` (ms-swift's examples/train/rlhf/gkd/multi_turn.sh): a
sampled step's completions are continued after ms-swift's tip by GRPO's rollouts (rlhf/multi_turn.py), and
the rows trained on hold the whole trajectory with the tip out of the targets; --max_turns 1 is the run
without a scheduler; a row without the `solution` column and --lmbda 0 are refused.

The student is GRPO's multi-turn test model (a tiny Llama whose weights make EOS likely, so completions end
before the length limit and get the tip; its answers never verify); the teacher is tiny-llama. A plugin (own
process) records the rows each sampled step trains on."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, run_cli
from tests.e2e.test_grpo_multi_turn_e2e import _at, _tips, build_eos_prone

COMMON = ["--rlhf-type", "gkd", "--teacher-model", "tiny-llama", "--torch-dtype", "fp32", "--parallelism", "single",
          "--seed", "3", "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2", "--lmbda", "1",
          "--max-completion-length", "12", "--logging-steps", "1", "--save-hf-model", "false",
          "--log-completions", "true", "--max-steps", "2"]
#: records every row a sampled step trains on (input_ids, labels, the sampled completion's length)
PLUGIN = '''import json, os
import swiftlite.rlhf.gkd as gkd
_orig = gkd._sampled_rows
def recorded(*a, **k):
    rows, sampled = _orig(*a, **k)
    with open(os.environ["GKD_ROWS"], "a") as f:
        for r, (_, c, _) in zip([r for mb in rows for r in mb], sampled):
            f.write(json.dumps({"input_ids": r["input_ids"], "labels": r["labels"], "completion": len(c)}) + "\\n")
    return rows, sampled
gkd._sampled_rows = recorded
'''


def write_math_rows(path):
    """8 sft rows (a sum and its answer) with the `solution` column math_tip_trick verifies against."""
    path.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"what is {i} + 1?"},
                                 {"role": "assistant", "content": f"{i + 1}"}], "solution": f"${i + 1}$"}) + "\n"
        for i in range(8)))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gkd_mt")
    build_eos_prone(d / "model")
    write_math_rows(d / "data.jsonl")
    (d / "plugin.py").write_text(PLUGIN)
    return d


def _run(files, out, *extra, data=None, check=True):
    env = cli_env(GKD_ROWS=str(out.parent / f"{out.name}.rows.jsonl"))
    return run_cli(["rlhf", *COMMON, "--model", files / "model", "--dataset", data or files / "data.jsonl",
                    "--external-plugins", files / "plugin.py", *extra, "--output-dir", out], env=env, check=check,
                   own_process=True)


def _rows(out):
    return [json.loads(x) for x in (out.parent / f"{out.name}.rows.jsonl").read_text().splitlines()]


def _steps(out):
    return [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in x]


def test_math_tip_trick_continues_gkd_completions_with_the_tip_out_of_the_targets(files, tmp_path):
    proc = _run(files, tmp_path / "mt", "--multi-turn-scheduler", "math_tip_trick")
    assert "multi-turn: math_tip_trick (up to 2 turns" in proc.stdout
    tips, eos = _tips(), 258
    rows = _rows(tmp_path / "mt")
    assert len(rows) == 16
    tipped = 0
    for r in rows:
        ids, labels = r["input_ids"], r["labels"]
        start = len(ids) - r["completion"]
        assert all(v == -100 for v in labels[:start])                   # the prompt is not trained on (last_round)
        at = _at(ids[start:], tips)
        if not at:
            assert labels[start:] == ids[start:]                        # one turn: every completion token
            continue
        tipped += 1
        k = start + at[0]
        assert len(at) == 1 and (at[0] == 0 or ids[k - 1] != eos)       # given once; the first turn's EOS dropped
        assert labels[k:k + len(tips)] == [-100] * len(tips)            # the tip: attended to, not trained on
        assert labels[start:k] == ids[start:k] and labels[k + len(tips):] == ids[k + len(tips):]
        assert len(ids) > k + len(tips)                                 # the student continued after it
    assert tipped >= 4
    # the logged length counts the trained tokens: the completion less its tip
    steps = _steps(tmp_path / "mt")
    for s, step in enumerate(steps):
        part = rows[8 * s:8 * s + 8]
        n = [sum(1 for v in r["labels"] if v != -100) for r in part]
        assert step["completions/mean_length"] == pytest.approx(sum(n) / 8)
        assert step["jsd"] > 0
    logged = [json.loads(x) for x in (tmp_path / "mt" / "completions.jsonl").read_text().splitlines()]
    assert sum("But wait... It seems I made a mistake," in r["completion"] for r in logged) == tipped


def test_one_turn_is_the_run_without_a_scheduler(files, tmp_path):
    _run(files, tmp_path / "plain")
    _run(files, tmp_path / "one", "--multi-turn-scheduler", "math_tip_trick", "--max-turns", "1")
    assert _rows(tmp_path / "plain") == _rows(tmp_path / "one")
    a, b = _steps(tmp_path / "plain"), _steps(tmp_path / "one")
    assert [s["loss"] for s in a] == pytest.approx([s["loss"] for s in b], rel=1e-6)


def test_refusals(files, tmp_path):
    bad = tmp_path / "nosol.jsonl"
    rows = [json.loads(x) for x in (files / "data.jsonl").read_text().splitlines()]
    del rows[4]["solution"]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _run(files, tmp_path / "a", "--multi-turn-scheduler", "math_tip_trick", data=bad, check=False)
    assert proc.returncode == 2 and "'solution' column: 1 training row(s) have none" in proc.stderr, proc.stderr
    assert not (tmp_path / "a").exists()
    proc = _run(files, tmp_path / "b", "--multi-turn-scheduler", "math_tip_trick", "--lmbda", "0", check=False)
    assert proc.returncode == 2 and "with --lmbda 0: no step samples" in proc.stderr, proc.stderr
