"""One small real run (3 steps, a checkpoint per step, two bad rows skipped, a hub token in the
environment), then: skipped rows reported, no secret written anywhere, a corrupted newest
checkpoint detected at --resume with the previous one used, a tampered checkpoint refused."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

from fault_helpers import TINY, env_for, swiftlite
from swiftlite import checkpoint as ckpt

pytestmark = pytest.mark.slow
TOKEN = "hf_SwiftliteTestTokenDoNotLeak0123456789"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from swiftlite.demo import make_rows
    d = tmp_path_factory.mktemp("reliability")
    rows = [json.dumps(r) for r in make_rows(40, 0)]
    rows.insert(10, "{this is not json")
    rows.insert(20, json.dumps({"question": "p", "answer": "c"}))
    (d / "train.jsonl").write_text("\n".join(rows) + "\n")
    env = env_for(d / "cache", HF_TOKEN=TOKEN, HUGGING_FACE_HUB_TOKEN=TOKEN)
    args = ["sft", *TINY, "--dataset", "train.jsonl", "--skip-bad-rows", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "3", "--save-steps", "1",
            "--save-total-limit", "2", "--output-dir", "run"]
    r, _ = swiftlite(args, env, d)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return d, env, r


def test_skipped_rows_are_counted_and_named(run):
    d, _, r = run
    assert "40 train rows" in r.stdout and "2 skipped" in r.stdout, r.stdout
    assert "skipped: train.jsonl:11: not valid JSON" in r.stdout, r.stdout
    assert "skipped: train.jsonl:21: row matches no known format (found keys: answer, question" in r.stdout


def test_save_total_limit_kept_the_newest_two(run):
    d, _, _ = run
    assert [c.name for c in ckpt.list_checkpoints(d / "run")] == ["checkpoint-2", "checkpoint-3"]
    assert ckpt.read_latest(d / "run") == "checkpoint-3"
    assert not [p for p in (d / "run").iterdir() if p.name.startswith((".tmp-", ".del-"))]


def test_no_secret_in_any_file_or_output(run):
    d, _, r = run
    assert TOKEN not in r.stdout and TOKEN not in r.stderr
    for p in (d / "run").rglob("*"):
        if p.is_file():
            assert TOKEN.encode() not in p.read_bytes(), p


def test_hub_token_flag_value_is_never_echoed(run):
    d, env, _ = run
    r, _ = swiftlite(["sft", *TINY, "--dataset", "train.jsonl", "--hub-token", TOKEN, "--output-dir", "x"], env, d)
    assert r.returncode == 2 and TOKEN not in r.stderr + r.stdout and not (d / "x").exists()


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_used(run):
    d, env, _ = run
    shutil.copytree(d / "run", d / "corrupt")
    f = d / "corrupt" / "checkpoint-3" / "model" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum sees it
    f.write_bytes(bytes(data))
    r, _ = swiftlite(["sft", *TINY, "--dataset", "train.jsonl", "--skip-bad-rows", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "4",
                      "--save-steps", "1", "--save-total-limit", "2", "--output-dir", "corrupt", "--resume"], env, d)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "warning: skipping" in r.stdout and "checkpoint-3: model/model.safetensors checksum mismatch" in r.stdout
    assert "resuming from checkpoint-2" in r.stdout
    for c in ckpt.list_checkpoints(d / "corrupt"):
        assert ckpt.verify_checkpoint(c) is None, c
    assert ckpt.read_latest(d / "corrupt") == "checkpoint-4"


class Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("how", ["resume-from", "resume"])
def test_checkpoint_with_pickle_payload_is_refused(run, how):
    """rng/rank0.pt replaced by a payload and the manifest rewritten to match (an attacker can):
    the run is refused with one line, exit 2, and the payload does not run."""
    d, env, _ = run
    name = f"evil-{how}"
    shutil.copytree(d / "run", d / name)
    marker = d / f"PWNED-{how}"
    c = d / name / "checkpoint-3"
    torch.save({"torch": Evil(marker)}, c / "rng" / "rank0.pt")
    ckpt.write_manifest(c)
    before = sorted(p.name for p in (d / name).iterdir())
    flag = ["--resume-from", f"{name}/checkpoint-3"] if how == "resume-from" else ["--resume"]
    r, _ = swiftlite(["sft", *TINY, "--dataset", "train.jsonl", "--skip-bad-rows", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "4",
                      "--output-dir", name, *flag], env, d)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "rank0.pt: refused, unsafe pickle content (would call posix.system)" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not marker.exists()
    assert sorted(p.name for p in (d / name).iterdir()) == before


def test_dcp_metadata_with_pickle_payload_is_refused(run):
    d, env, _ = run
    shutil.copytree(d / "run", d / "evil-meta")
    marker = d / "PWNED-meta"
    c = d / "evil-meta" / "checkpoint-3"
    (c / "dcp" / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    ckpt.write_manifest(c)
    r, _ = swiftlite(["sft", *TINY, "--dataset", "train.jsonl", "--skip-bad-rows", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "4",
                      "--output-dir", "evil-meta", "--resume-from", "evil-meta/checkpoint-3"], env, d)
    assert r.returncode == 2 and not marker.exists()
    assert r.stderr.count("\n") == 1 and ".metadata: refused, unsafe pickle content" in r.stderr, r.stderr
