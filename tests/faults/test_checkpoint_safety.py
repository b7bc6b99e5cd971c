"""A checkpoint carrying a pickle payload is refused with one line, and the payload never runs."""

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from swiftlite import checkpoint as ckpt
from swiftlite.errors import UserError


class Evil:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _refused(fn, marker: Path, match: str) -> str:
    with pytest.raises(UserError, match=match) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg and msg
    assert not marker.exists(), "the pickle payload ran"
    return msg


def _dcp(tmp_path: Path) -> Path:
    """A real DCP checkpoint with a tensor and a non-tensor ("bytes") item, like an optimizer's lr."""
    import torch.distributed.checkpoint as dcp
    d = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0), "lr": 0.5, "betas": (0.9, 0.95)}, checkpoint_id=str(d))
    return d


def test_real_dcp_checkpoint_passes(tmp_path):
    ckpt.check_dcp_metadata(_dcp(tmp_path))  # incl. pathlib.PosixPath in its storage_meta


def test_metadata_with_os_system_is_refused(tmp_path):
    d = _dcp(tmp_path)
    marker = tmp_path / "PWNED"
    (d / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    _refused(lambda: ckpt.check_dcp_metadata(d), marker, r"\.metadata: refused, unsafe pickle content")


def _call_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol-4 pickle bytes for `module.name(arg)` (STACK_GLOBAL + REDUCE)."""
    def s(x: str) -> bytes:
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b
    return b"\x80\x04" + s(module) + s(name) + b"\x93" + s(arg) + b"\x85" + b"R" + b"."


def test_metadata_dotted_name_through_an_allowed_module_is_refused(tmp_path):
    """`torch.distributed.checkpoint.filesystem` imports os: protocol 4 would resolve the name
    "os.system" through it (getattr chain) if the check trusted whole modules."""
    d = _dcp(tmp_path)
    marker = tmp_path / "PWNED"
    payload = _call_pickle("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}")
    (d / ".metadata").write_bytes(payload)
    _refused(lambda: ckpt.check_dcp_metadata(d), marker,
             r"refusing to load torch\.distributed\.checkpoint\.filesystem\.os\.system")


def test_metadata_function_from_a_dcp_module_is_refused(tmp_path):
    """Only DCP's data classes and enums may be built, not any callable its modules define."""
    import inspect

    import torch.distributed.checkpoint.filesystem as fs
    d = _dcp(tmp_path)
    name = next(n for n, f in vars(fs).items() if inspect.isfunction(f) and f.__module__ == fs.__name__)
    (d / ".metadata").write_bytes(_call_pickle(fs.__name__, name, "x"))
    _refused(lambda: ckpt.check_dcp_metadata(d), tmp_path / "none", f"refusing to load {fs.__name__}.{name}")


def test_garbage_metadata_is_one_line(tmp_path):
    d = _dcp(tmp_path)
    (d / ".metadata").write_bytes(b"\x00garbage")
    _refused(lambda: ckpt.check_dcp_metadata(d), tmp_path / "none", "unreadable checkpoint metadata")


def test_distcp_bytes_item_with_payload_is_refused(tmp_path):
    """DCP's planner loads non-tensor items with torch.load(weights_only=False): a crafted item in
    a .distcp file (pointed to by a consistent .metadata) is caught before dcp.load runs."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    d = _dcp(tmp_path)
    marker = tmp_path / "PWNED"
    md = pickle.loads((d / ".metadata").read_bytes())  # our own file: trusted here
    idx = next(k for k in md.storage_data if k.fqn == "lr")
    info = md.storage_data[idx]
    buf = io.BytesIO()
    torch.save(Evil(marker), buf)
    data_file = d / info.relative_path
    offset = data_file.stat().st_size
    with data_file.open("ab") as fh:
        fh.write(buf.getvalue())
    md.storage_data[idx] = _StorageInfo(info.relative_path, offset, len(buf.getvalue()), info.transform_descriptors)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    _refused(lambda: ckpt.check_dcp_metadata(d), marker, r"refused, item lr is not plain data")


def test_distcp_path_outside_checkpoint_is_refused(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    d = _dcp(tmp_path)
    md = pickle.loads((d / ".metadata").read_bytes())
    idx = next(iter(md.storage_data))
    info = md.storage_data[idx]
    md.storage_data[idx] = _StorageInfo("../../etc/passwd", info.offset, info.length, info.transform_descriptors)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    _refused(lambda: ckpt.check_dcp_metadata(d), tmp_path / "none", "outside the checkpoint")


def test_rng_file_with_payload_is_refused(tmp_path):
    marker = tmp_path / "PWNED"
    f = tmp_path / "rank0.pt"
    torch.save({"torch": Evil(marker)}, f)
    _refused(lambda: ckpt.check_torch_file(f), marker, r"rank0\.pt: refused, unsafe pickle content \(would call posix\.system\)")
    _refused(lambda: ckpt.load_rng(tmp_path, 0), marker, r"refused, not a plain RNG state")


def test_legacy_format_payload_is_refused(tmp_path):
    marker = tmp_path / "PWNED"
    f = tmp_path / "optim.pt"
    torch.save({"x": Evil(marker)}, f, _use_new_zipfile_serialization=False)
    _refused(lambda: ckpt.check_torch_file(f), marker, "refused, not a plain-data torch file")


def test_plain_torch_files_pass_and_extra_globals_are_explicit(tmp_path):
    import argparse
    f = tmp_path / "state.pt"
    torch.save({"t": torch.ones(2), "step": 3, "betas": (0.9, 0.95), "name": "x"}, f)
    ckpt.check_torch_file(f)
    g = tmp_path / "counter.pt"
    torch.save({"c": argparse.Namespace(a=1)}, g)
    with pytest.raises(UserError, match="would call argparse.Namespace"):
        ckpt.check_torch_file(g)
    ckpt.check_torch_file(g, extra_safe=frozenset({"argparse.Namespace"}))


def test_check_checkpoint_safe_walks_every_pickle(tmp_path):
    c = tmp_path / "checkpoint-1"
    (c / "ds").mkdir(parents=True)
    marker = tmp_path / "PWNED"
    torch.save({"module": {"w": torch.ones(1)}}, c / "ds" / "mp_rank_00_model_states.pt")
    ckpt.check_checkpoint_safe(c)
    torch.save({"optimizer_state_dict": Evil(marker)}, c / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _refused(lambda: ckpt.check_checkpoint_safe(c), marker, "zero_pp_rank_0_mp_rank_00_optim_states.pt: refused")


def test_resume_refuses_a_tampered_checkpoint_even_with_a_fresh_manifest(tmp_path):
    """An attacker can rewrite manifest.json: integrity is not safety. find_resume refuses (it does
    not silently fall back), resolve_resume_arg too."""
    run = tmp_path / "run"
    for step in (1, 2):
        c = run / f"checkpoint-{step}"
        (c / "rng").mkdir(parents=True)
        torch.save({"torch": torch.get_rng_state()}, c / "rng" / "rank0.pt")
        (c / "trainer_state.json").write_text("{}")
        ckpt.write_manifest(c)
    ckpt.write_latest(run, "checkpoint-2")
    assert ckpt.find_resume(run) == run / "checkpoint-2"
    marker = tmp_path / "PWNED"
    torch.save({"torch": Evil(marker)}, run / "checkpoint-2" / "rng" / "rank0.pt")
    ckpt.write_manifest(run / "checkpoint-2")
    _refused(lambda: ckpt.find_resume(run), marker, "refused")
    _refused(lambda: ckpt.resolve_resume_arg(str(run / "checkpoint-2")), marker, "refused")
