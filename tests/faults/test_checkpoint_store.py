"""Checkpoint integrity: manifests catch truncated/corrupt files, resume falls back to the previous
good checkpoint, pruning and re-saving never leave a half-deleted checkpoint-N."""

import json
import os
from pathlib import Path

from swiftlite import checkpoint as ckpt


def make(run: Path, step: int, *, size: int = 1000, latest: bool = True) -> Path:
    c = run / f"checkpoint-{step}"
    (c / "dcp").mkdir(parents=True)
    (c / "dcp" / "__0_0.distcp").write_bytes(bytes([step % 256]) * size)
    (c / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    ckpt.write_manifest(c)
    if latest:
        ckpt.write_latest(run, c.name)
    return c


def test_manifest_lists_sizes_and_checksums(tmp_path):
    c = make(tmp_path, 1)
    m = json.loads((c / "manifest.json").read_text())
    assert m["files"]["dcp/__0_0.distcp"]["size"] == 1000
    assert len(m["files"]["dcp/__0_0.distcp"]["sha256"]) == 64
    assert ckpt.verify_checkpoint(c) is None


def test_truncated_file_detected_and_previous_used(tmp_path):
    make(tmp_path, 1)
    c2 = make(tmp_path, 2)
    f = c2 / "dcp" / "__0_0.distcp"
    os.truncate(f, 500)
    assert "has 500 bytes, manifest says 1000" in ckpt.verify_checkpoint(c2)
    logged = []
    assert ckpt.find_resume(tmp_path, log=logged.append) == tmp_path / "checkpoint-1"
    assert any("skipping" in m and "checkpoint-2" in m and "500 bytes" in m for m in logged), logged


def test_same_size_corruption_detected_by_checksum(tmp_path):
    make(tmp_path, 1)
    c2 = make(tmp_path, 2)
    f = c2 / "dcp" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    assert ckpt.verify_checkpoint(c2, deep=False) is None  # sizes alone cannot see it
    assert "checksum mismatch" in ckpt.verify_checkpoint(c2)
    logged = []
    assert ckpt.find_resume(tmp_path, log=logged.append) == tmp_path / "checkpoint-1"
    assert any("checksum mismatch" in m for m in logged)


def test_missing_manifest_or_file_or_bad_manifest(tmp_path):
    c = make(tmp_path, 1)
    (c / "dcp" / "__0_0.distcp").unlink()
    assert "missing file dcp/__0_0.distcp" in ckpt.verify_checkpoint(c)
    c2 = make(tmp_path, 2)
    (c2 / "manifest.json").write_text("{not json")
    assert "unreadable" in ckpt.verify_checkpoint(c2)
    c3 = make(tmp_path, 3)
    (c3 / "manifest.json").unlink()
    assert "no manifest.json" in ckpt.verify_checkpoint(c3)
    assert ckpt.find_resume(tmp_path, log=lambda *_: None) is None


def test_manifest_naming_files_outside_is_rejected(tmp_path):
    c = make(tmp_path, 1)
    (tmp_path / "outside.bin").write_bytes(b"x")
    m = json.loads((c / "manifest.json").read_text())
    m["files"]["../outside.bin"] = {"size": 1, "sha256": "0" * 64}
    (c / "manifest.json").write_text(json.dumps(m))
    assert "outside the checkpoint" in ckpt.verify_checkpoint(c)


def test_latest_is_preferred_then_newest_good(tmp_path):
    make(tmp_path, 1)
    make(tmp_path, 2)
    make(tmp_path, 3, latest=False)  # written, but the run was resumed from 2 and went another way
    assert ckpt.find_resume(tmp_path) == tmp_path / "checkpoint-2"
    (tmp_path / "latest").write_text("../../etc\n")  # garbage latest: newest good one
    assert ckpt.find_resume(tmp_path) == tmp_path / "checkpoint-3"


def test_prune_keeps_limit_and_never_the_last_good(tmp_path):
    for s in (1, 2, 3, 4):
        make(tmp_path, s)
    ckpt.prune(tmp_path, 2, keep=tmp_path / "checkpoint-4")
    assert [c.name for c in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4"]
    ckpt.prune(tmp_path, 1, keep=tmp_path / "checkpoint-4")
    assert [c.name for c in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-4"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".del-")]


def test_prune_spares_the_newest_good_when_newer_ones_are_stale(tmp_path):
    """keep (just written) and the newest checkpoint that verifies both survive a limit of 1."""
    make(tmp_path, 1)
    make(tmp_path, 5, latest=False)
    c2 = make(tmp_path, 2)
    ckpt.prune(tmp_path, 1, keep=c2)
    names = [c.name for c in ckpt.list_checkpoints(tmp_path)]
    assert "checkpoint-2" in names and "checkpoint-5" in names and "checkpoint-1" not in names


def test_interrupted_delete_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """A crash inside rmtree (simulated) leaves a .del- folder, never a broken checkpoint-N."""
    import shutil
    for s in (1, 2, 3):
        make(tmp_path, s)
    real = shutil.rmtree

    def crash(path, *a, **kw):
        p = Path(path)
        (next(p.rglob("*.distcp"))).unlink()  # half-way through deleting
        raise KeyboardInterrupt
    monkeypatch.setattr(shutil, "rmtree", crash)
    try:
        ckpt.prune(tmp_path, 1, keep=tmp_path / "checkpoint-3")
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(shutil, "rmtree", real)
    for c in ckpt.list_checkpoints(tmp_path):
        assert ckpt.verify_checkpoint(c) is None, c
    assert any(p.name.startswith(".del-") for p in tmp_path.iterdir())
    ckpt.clean_partial(tmp_path)
    assert not any(p.name.startswith((".del-", ".tmp-")) for p in tmp_path.iterdir())


def test_publish_replaces_an_existing_step_whole(tmp_path):
    old = make(tmp_path, 3)
    tmp = tmp_path / ".tmp-checkpoint-3"
    (tmp / "dcp").mkdir(parents=True)
    (tmp / "dcp" / "__0_0.distcp").write_bytes(b"new" * 10)
    ckpt.write_manifest(tmp)
    ckpt.publish(tmp, old, tmp_path)
    assert (old / "dcp" / "__0_0.distcp").read_bytes() == b"new" * 10
    assert ckpt.verify_checkpoint(old) is None and not tmp.exists()
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-3"
    assert not any(p.name.startswith(".del-") for p in tmp_path.iterdir())


def test_clean_partial_removes_tmp_and_del(tmp_path):
    make(tmp_path, 1)
    (tmp_path / ".tmp-checkpoint-2" / "dcp").mkdir(parents=True)
    (tmp_path / ".del-checkpoint-0").mkdir()
    ckpt.clean_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "latest"]
