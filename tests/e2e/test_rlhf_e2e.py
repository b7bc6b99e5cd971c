"""`swiftlite rlhf` through the CLI in a subprocess: a DPO LoRA run, its export reloaded by transformers,
ORPO's logged terms, and bad preference rows (one-line errors with nothing written, or counted)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_cli

COMMON = ["--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--parallelism", "single", "--seed", "3",
          "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "1", "--logging-steps", "1",
          "--save-hf-model", "true"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from swiftlite.rlhf.demo import write_preference_data
    return write_preference_data(tmp_path_factory.mktemp("pairs"), n_train=12, n_val=4)


def _records(run):
    return [json.loads(line) for line in (run / "logging.jsonl").read_text().splitlines()]


def test_dpo_lora_run_exports_and_reloads(pairs, tmp_path):
    train, val = pairs
    run = tmp_path / "dpo"
    proc = run_cli(["rlhf", *COMMON, "--lora", "--lora-dropout", "0", "--learning-rate", "5e-3", "--dataset", train,
                    "--val-dataset", val, "--max-steps", "3", "--output-dir", run])
    assert "dpo (sigmoid, beta 0.1, reference: the base model with the adapter disabled)" in proc.stdout
    recs = _records(run)
    steps = {r["step"]: r for r in recs if "loss" in r}
    assert abs(steps[1]["loss"] - math.log(2)) <= 1e-6 and steps[1]["rewards/margins"] == 0.0
    assert steps[3]["rewards/margins"] != 0.0
    ev = [r for r in recs if "eval_loss" in r]
    assert ev and "eval_rewards/accuracies" in ev[-1] and 0.0 <= ev[-1]["eval_rewards/accuracies"] <= 1.0
    out = tmp_path / "exported"
    run_cli(["export", "--ckpt", run / "checkpoint-3", "--merge-lora", "true", "--output", out], timeout=300)
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(out))
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_orpo_logs_its_terms_and_a_pair_over_max_length_is_deleted_and_counted(pairs, tmp_path):
    train, _ = pairs
    data = tmp_path / "d.jsonl"
    long = {"prompt": "reverse: " + "ab" * 40, "chosen": "ba" * 40, "rejected": "ab" * 40}
    data.write_text(train.read_text() + json.dumps(long) + "\n")
    run = tmp_path / "orpo"
    proc = run_cli(["rlhf", *COMMON, "--rlhf-type", "orpo", "--full", "--dataset", data, "--max-steps", "2",
                    "--max-length", "64", "--save-hf-model", "false", "--output-dir", run])
    assert "12 train pairs" in proc.stdout and "1 longer than 64 deleted" in proc.stdout
    first = [r for r in _records(run) if "loss" in r][0]
    # ORPO's loss = the chosen answers' token-mean NLL - mean(beta log sigmoid(log odds)), TRL's terms
    assert first["loss"] == pytest.approx(first["nll_loss"] - 0.1 * first["log_odds_ratio"], abs=1e-5)
    assert first["rewards/chosen"] == pytest.approx(0.1 * first["logps/chosen"], abs=1e-6)


def test_cpo_full_run_logs_its_terms_and_writes_a_checkpoint(pairs, tmp_path):
    train, _ = pairs
    run = tmp_path / "cpo"
    proc = run_cli(["rlhf", *COMMON, "--rlhf-type", "cpo", "--full", "--dataset", train, "--max-steps", "2",
                    "--save-hf-model", "false", "--output-dir", run])
    assert "cpo (beta 0.1), " in proc.stdout
    recs = [r for r in _records(run) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    for r in recs:   # summed log-probs, rewards beta x them, the loss = pair term (> 0) + cpo_alpha 1 x NLL
        assert r["rewards/chosen"] == pytest.approx(0.1 * r["logps/chosen"], abs=1e-5)
        assert r["loss"] > r["nll_loss"] > 0
    assert (run / "checkpoint-2").is_dir()


def test_dpo_packed_trains_the_loss_of_the_same_pairs_padded(pairs, tmp_path):
    """ms-swift's examples/train/packing/dpo.sh flags (--packing true, --rpo_alpha, a batch of 1 pack):
    the 12 pairs fit one pack of 1024 tokens, so each step trains on all of them, as a padded run with
    a batch of 12 pairs does; the losses and validation agree (the packed run's reference precomputed
    over the packs, the padded run's a frozen copy: the same starting weights)."""
    train, val = pairs
    base = COMMON[:COMMON.index("--per-device-train-batch-size")]
    common = [*base, "--gradient-accumulation-steps", "1", "--logging-steps", "1", "--full", "--dataset", train, "--val-dataset", val, "--max-steps", "3",
              "--eval-steps", "3", "--max-length", "1024", "--rpo_alpha", "0.1", "--learning-rate", "1e-3",
              "--save-hf-model", "false"]
    packed, padded = tmp_path / "packed", tmp_path / "padded"
    proc = run_cli(["rlhf", "--rlhf_type", "dpo", *common, "--packing", "true", "--per-device-train-batch-size", "1",
                    "--per-device-eval-batch-size", "1", "--precompute-ref-log-probs", "true", "--output-dir", packed])
    assert "1 packs of whole pairs" in proc.stdout and "packed to 1024 tokens" in proc.stdout
    assert json.loads((packed / "args.json").read_text())["data"]["packing"] is True
    proc = run_cli(["rlhf", "--rlhf_type", "dpo", *common, "--per-device-train-batch-size", "12",
                    "--per-device-eval-batch-size", "4", "--output-dir", padded])
    assert "padded batches" in proc.stdout
    a, b = _records(packed), _records(padded)
    la = {r["step"]: r for r in a if "loss" in r}
    lb = {r["step"]: r for r in b if "loss" in r}
    assert sorted(la) == sorted(lb) == [1, 2, 3]
    assert la[3]["loss"] < la[1]["loss"] - 1e-3      # it trains
    for k in (1, 2, 3):
        for name in ("loss", "nll_loss", "rewards/margins", "logps/chosen"):
            assert la[k][name] == pytest.approx(lb[k][name], abs=2e-5), (k, name)
    ea, eb = [r for r in a if "eval_loss" in r][-1], [r for r in b if "eval_loss" in r][-1]
    assert ea["eval_loss"] == pytest.approx(eb["eval_loss"], abs=2e-5)


def test_orpo_padding_free_trains(pairs, tmp_path):
    train, _ = pairs
    run = tmp_path / "orpo_pf"
    proc = run_cli(["rlhf", *COMMON, "--rlhf-type", "orpo", "--lora", "--padding_free", "true", "--dataset", train,
                    "--max-steps", "2", "--save-hf-model", "false", "--output-dir", run])
    assert "padding-free batches (--padding_free true)" in proc.stdout
    recs = [r for r in _records(run) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)


def _kto_rows(pairs_file, path):
    """The demo pairs unpaired: even rows their right answer (label true), odd rows the wrong one."""
    rows = []
    for i, line in enumerate(pairs_file.read_text().splitlines()):
        r = json.loads(line)
        ans = r["messages"][-1]["content"] if i % 2 == 0 else r["rejected_response"]
        rows.append({"messages": [*r["messages"][:-1], {"role": "assistant", "content": ans}], "label": i % 2 == 0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_kto_runs_checkpoints_and_accumulation_gives_the_one_batch_losses(pairs, tmp_path):
    """KTO, full: 2 steps of 4 rows as one micro-batch of 4 and as 2 x 2 accumulated: the same losses
    and KL estimate (the KL mismatches and mean are over the global batch)."""
    train, val = pairs
    data = _kto_rows(train, tmp_path / "kto.jsonl")
    vdata = _kto_rows(val, tmp_path / "kto_val.jsonl")
    logs = {}
    for name, bs, acc in (("one", "4", "1"), ("acc", "2", "2")):
        run = tmp_path / name
        base = COMMON[:COMMON.index("--per-device-train-batch-size")]
        proc = run_cli(["rlhf", *base, "--logging-steps", "1", "--rlhf-type", "kto", "--full", "--dataset", data, "--val-dataset", vdata,
                        "--per-device-train-batch-size", bs, "--gradient-accumulation-steps", acc,
                        "--learning-rate", "1e-3", "--max-steps", "2", "--save-hf-model", "false",
                        "--output-dir", run])
        assert "kto (beta 0.1, desirable_weight 1, undesirable_weight 1, reference: a frozen copy)" in proc.stdout
        assert "12 train rows" in proc.stdout and "global batch 4," in proc.stdout
        logs[name] = [r for r in _records(run) if "loss" in r]
        ev = [r for r in _records(run) if "eval_loss" in r]
        assert ev and math.isfinite(ev[-1]["eval_loss"]) and "eval_kl" in ev[-1]
        assert (run / "checkpoint-2").is_dir()
    one, acc = logs["one"], logs["acc"]
    assert [r["step"] for r in one] == [1, 2]
    assert one[0]["loss"] == pytest.approx(0.5, abs=1e-6)     # policy = reference, KL 0: 1 - sigmoid(0)
    for a, b in zip(one, acc):
        assert math.isfinite(a["loss"]) and a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-6)
    assert one[1]["loss"] != one[0]["loss"]


def test_reward_model_trains_exports_and_infer_prints_rewards(pairs, tmp_path):
    """rm, full, 2 steps on TRL rows with a margin column: the loss is -log sigmoid(r_c - r_r - margin)
    (step 1: the margin shifts it above ln 2), a checkpoint, an export AutoModelForSequenceClassification
    loads with one output, and `swiftlite infer` on it prints a reward per side and the accuracy."""
    train, _ = pairs
    data = tmp_path / "rm.jsonl"
    rows = []
    for line in train.read_text().splitlines():
        r = json.loads(line)
        rows.append({"prompt": r["messages"][:-1], "chosen": [r["messages"][-1]],
                     "rejected": [{"role": "assistant", "content": r["rejected_response"]}], "margin": 1.0})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "rm"
    proc = run_cli(["rlhf", *COMMON, "--rlhf-type", "rm", "--full", "--dataset", data, "--max-steps", "2",
                    "--output-dir", run])
    assert "rm (reward model: score head, pairwise loss), 12 train pairs" in proc.stdout
    recs = [r for r in _records(run) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    # a fresh score head gives r_c ~ r_r: the loss is ~ -log sigmoid(-1) = 1.3133, not ln 2
    assert recs[0]["loss"] == pytest.approx(-math.log(1 / (1 + math.e)), abs=0.05)
    assert 0.0 <= recs[0]["accuracy"] <= 1.0 and "margin" in recs[0] and "mean_reward" in recs[0]
    out = tmp_path / "rm_export"
    run_cli(["export", "--ckpt", run / "checkpoint-2", "--output", out], timeout=300)
    import torch
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(str(out))
    assert model.config.num_labels == 1 and type(model).__name__ == "LlamaForSequenceClassification"
    assert model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.shape == (1, 1)
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    inf = run_cli(["infer", "--model", out, "--dataset", few], timeout=300)
    lines = inf.stdout.strip().splitlines()
    assert len(lines) == 4 and all(len(ln.split()) == 2 for ln in lines[:3])
    assert [math.isfinite(float(x)) for ln in lines[:3] for x in ln.split()] == [True] * 6
    assert lines[3].startswith("preference accuracy: ")


@pytest.mark.parametrize("row,words", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "no rejected answer"),
])
def test_bad_rows_stop_before_anything_is_written(tmp_path, row, words):
    """(identical answers and the other bad rows: tests/unit/test_rlhf_data.py, the same error path)"""
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "reverse: ab", "chosen": "ba", "rejected": "ab"}) + "\n" + json.dumps(row) + "\n")
    out = tmp_path / "out"
    proc = run_cli(["rlhf", *COMMON, "--dataset", data, "--max-steps", "1", "--output-dir", out], check=False)
    _one_line_exit_2(proc, data, words, out)


def _one_line_exit_2(proc, data, words, out):
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {data}:2:") and words in err and "Traceback" not in err
    assert not out.exists()


def test_a_reward_model_row_without_chosen_and_rejected_stops_before_anything_is_written(tmp_path):
    data = tmp_path / "bad_rm.jsonl"
    data.write_text(json.dumps({"prompt": "reverse: ab", "chosen": "ba", "rejected": "ab"}) + "\n"
                    + json.dumps({"prompt": "reverse: ab", "completion": "ba"}) + "\n")
    out = tmp_path / "out"
    proc = run_cli(["rlhf", *COMMON, "--rlhf-type", "rm", "--dataset", data, "--max-steps", "1", "--output-dir", out],
                   check=False)
    _one_line_exit_2(proc, data, "no rejected answer", out)


def test_a_kto_row_without_label_stops_before_anything_is_written(tmp_path):
    data = tmp_path / "bad_kto.jsonl"
    msgs = [{"role": "user", "content": "reverse: ab"}, {"role": "assistant", "content": "ba"}]
    data.write_text(json.dumps({"messages": msgs, "label": True}) + "\n" + json.dumps({"messages": msgs}) + "\n")
    out = tmp_path / "out"
    proc = run_cli(["rlhf", *COMMON, "--rlhf-type", "kto", "--dataset", data, "--max-steps", "1", "--output-dir", out],
                   check=False)
    _one_line_exit_2(proc, data, "no 'label'", out)
