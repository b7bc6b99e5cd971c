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


def test_grpo_round_file_is_a_checkpoint_name_of_layout(tmp_path):
    from swiftlite.rlhf import grpo
    assert grpo.ROUND_FILE is layout.ROUND_FILE and grpo.COMPLETIONS_FILE is layout.COMPLETIONS_FILE
    from swiftlite.rlhf import reference
    assert reference.REF_LOGPS_FILE is layout.REF_LOGPS_FILE
    assert [layout.round_file(r) for r in (0, 11)] == ["grpo_round_rank0.pt", "grpo_round_rank11.pt"]
    # not one of the run folder's per-rank kinds: a rank-file glob never picks it up
    (tmp_path / layout.round_file(2)).write_text("x")
    assert not [k for k in layout.RANK_FILES if list(tmp_path.glob(layout.rank_glob(k)))]


def test_profiling_writes_under_layout_profile_dir(tmp_path, monkeypatch):
    from swiftlite import env, profiling
    monkeypatch.delenv(env.PROFILE_DIR, raising=False)
    assert profiling._State(tmp_path, 0).out == tmp_path / layout.PROFILE_DIR


def test_link_bytes_reads_the_trace_of_the_same_rank(tmp_path, monkeypatch):
    """bench/groups.py pairs each rank's collectives file with that rank's trace, both named by layout."""
    from swiftlite.bench import groups, trace
    seen = []
    monkeypatch.setattr(trace, "collective_kinds", lambda p: seen.append(Path(p).name) or None)
    for rank in (0, 12):
        (tmp_path / layout.rank_file("collectives", rank)).write_text("{}")
        (tmp_path / layout.rank_file("trace", rank)).write_text("{}")
    groups.link_bytes(tmp_path, per_node=2, steps=1)
    assert sorted(seen) == sorted(layout.rank_file("trace", r) for r in (0, 12))


def test_no_module_spells_a_per_rank_or_profile_name_of_its_own():
    """String literals (docstrings aside) outside checkpoint/layout.py do not spell the per-rank file
    names or the profile folder: they ask layout."""
    import ast
    root = Path(__file__).resolve().parents[2]
    stems = {spec.partition("{rank}")[0] for spec in [*layout.RANK_FILES.values(), layout.ROUND_FILE]}
    stems = {s for s in stems if len(s) > 4}          # "rank" alone (rank{rank}.err) is too common a word
    found = []
    for path in sorted((root / "swiftlite").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "swiftlite/checkpoint/layout.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                hits = {s for s in stems if s in node.value} | ({layout.PROFILE_DIR} & {node.value})
                if hits:
                    found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, found
