"""Names spelled once in checkpoint/layout.py: the checkpoint-format vocabulary and per-rank files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiftlite.checkpoint import layout
from swiftlite.checkpoint.layout import CheckpointFormat


def test_every_backend_record_names_its_checkpoint_format_from_the_one_vocabulary():
    from swiftlite.parallel.base import get_backend, parallelism_names
    names = parallelism_names()
    assert "fsdp" in names and "zero3" in names
    for name in names:
        if name == "auto":
            continue   # a choice among the records, not one
        rec = get_backend(name)
        assert isinstance(rec.checkpoint_format, CheckpointFormat), name
        want = CheckpointFormat.DS if rec.engine == "deepspeed" else CheckpointFormat.DCP
        assert rec.checkpoint_format is want, name


def test_trainer_state_format_reads_back_and_old_checkpoints_are_recognised():
    written = json.loads(json.dumps({"format": CheckpointFormat.DS}))      # as _save writes it
    assert written == {"format": "ds"} and CheckpointFormat.of_state(written) is CheckpointFormat.DS
    assert CheckpointFormat.of_state({"backend": "deepspeed"}) is CheckpointFormat.DS   # before "format"
    assert CheckpointFormat.of_state({"backend": "fsdp"}) is CheckpointFormat.DCP
    assert f"{CheckpointFormat.DCP}" == "dcp" and CheckpointFormat.DCP.folder == layout.DCP_DIR
    assert CheckpointFormat.DS.folder == layout.DS_TAG
    with pytest.raises(ValueError):
        CheckpointFormat.of_state({"format": "zip"})


@pytest.mark.parametrize("kind", sorted(layout.RANK_FILES))
def test_rank_file_names_round_trip(kind, tmp_path):
    for rank in (0, 7, 12):
        p = tmp_path / layout.rank_file(kind, rank)
        p.write_text("x")
        assert layout.rank_of(kind, p) == rank
    assert sorted(layout.rank_of(kind, f) for f in tmp_path.glob(layout.rank_glob(kind))) == [0, 7, 12]


def test_rank_globs_do_not_match_each_other(tmp_path):
    """memory_rank* must not pick up cuda_memory_rank* files, and so on: a reader sees only its kind."""
    for kind in layout.RANK_FILES:
        (tmp_path / layout.rank_file(kind, 3)).write_text(kind)
    for kind in layout.RANK_FILES:
        found = [Path(f).read_text() for f in tmp_path.glob(layout.rank_glob(kind))]
        assert found == [kind], (kind, found)
