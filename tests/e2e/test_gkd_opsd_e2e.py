"""GKD with OPSD rows through the CLI, as ms-swift's examples/train/rlhf/opsd/opsd.sh runs it: a plugin file
registers the dataset (swift.dataset's register_dataset) with a preprocessor that keeps the verified rows
as prompts and writes each row's `teacher_prompt` (the problem with its reference solution); --lmbda 1.

The student is LoRA on the teacher's own model (the teacher is the base with the adapter disabled), so at
the first step both have the same weights: the divergence is 0 exactly when the teacher reads the student's
prompt, and not 0 when it reads its own."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

PLUGIN = '''
from swift.dataset import DatasetMeta, RowPreprocessor, register_dataset


class Opsd(RowPreprocessor):
    def preprocess(self, row):
        if not row.get("correct", True):
            return None
        out = {"messages": [{"role": "system", "content": "Reason step by step."},
                            {"role": "user", "content": row["problem"]}]}
        if WITH_TEACHER:
            out["teacher_prompt"] = row["problem"] + " Here is a reference solution: " + row["solution"]
        return out


register_dataset(DatasetMeta(ms_dataset_id="org/opsd-math", hf_dataset_id="org/opsd-math",
                             dataset_path=r"{raw}", preprocess_func=Opsd()))
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("opsd")
    raw = d / "raw.jsonl"
    raw.write_text("".join(json.dumps({"problem": f"what is {i} + {i}?", "solution": f"{i} + {i} = {2 * i}",
                                       "correct": i % 4 != 3}) + "\n" for i in range(12)))
    for name, flag in (("opsd.py", "True"), ("plain.py", "False")):
        (d / name).write_text(f"WITH_TEACHER = {flag}\n" + PLUGIN.replace("{raw}", str(raw)))
    return d


def _run(files, plugin, out, *extra, check=True):
    return run_cli(["rlhf", "--rlhf-type", "gkd", "--model", "tiny-llama-2l", "--teacher-model", "tiny-llama-2l",
                    "--tuner-type", "lora", "--external-plugins", files / plugin, "--dataset", "org/opsd-math",
                    "--lmbda", "1", "--beta", "0.5", "--temperature", "1.2", "--max-steps", "2",
                    "--per-device-train-batch-size", "3", "--gradient-accumulation-steps", "1",
                    "--max-completion-length", "8", "--logging-steps", "1", "--torch-dtype", "fp32", "--seed", "5",
                    "--save-strategy", "no", "--log-completions", "true", *extra, "--output-dir", out], check=check,
                   own_process=True)   # each run registers the dataset anew (ms-swift refuses a second registration)


def _jsd(out):
    return [json.loads(x)["jsd"] for x in (out / "logging.jsonl").read_text().splitlines() if '"jsd"' in x]


def test_the_teacher_reads_its_privileged_prompt(files, tmp_path):
    proc = _run(files, "opsd.py", tmp_path / "opsd")
    assert "9 train rows" in proc.stdout                       # the 3 unverified rows dropped by the preprocessor
    _run(files, "plain.py", tmp_path / "plain")
    opsd, plain = _jsd(tmp_path / "opsd"), _jsd(tmp_path / "plain")
    assert plain[0] == pytest.approx(0.0, abs=1e-9)            # the same model on the same tokens
    assert opsd[0] > 1e-6                                      # the teacher's own prompt changes its logits
    _run(files, "opsd.py", tmp_path / "free", "--padding-free", "true")   # the teacher's rows concatenated too
    # the first step's completions are drawn from the same weights: D to fp32 noise (padded and concatenated
    # attention differ by ~1e-7 in the logits, and D is ~5e-5 here)
    assert _jsd(tmp_path / "free")[0] == pytest.approx(opsd[0], rel=1e-3)
    logged = [json.loads(x) for x in (tmp_path / "opsd" / "completions.jsonl").read_text().splitlines()]
    assert logged and all("reference solution" not in r["prompt"] for r in logged)   # the student's prompt


def test_a_prompt_alone_needs_every_step_to_sample(files, tmp_path):
    proc = _run(files, "opsd.py", tmp_path / "x", "--lmbda", "0.5", check=False)
    assert proc.returncode == 2 and "the conversation has no assistant turn to learn from" in proc.stderr
    assert not (tmp_path / "x").exists()
