"""ms-swift's data-loading flags: --dataloader_num_workers (batches built in DataLoader workers, the same
tensors in the same order, exact resume), --dataloader_prefetch_factor, --dataloader_pin_memory."""

from __future__ import annotations

import pytest
import torch

from swiftlite.config import load_config
from swiftlite.data.loader import BatchPlan
from swiftlite.data.prefetch import Prefetcher, StepBatches
from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError

ROWS = [{"input_ids": list(range(5, 5 + n)), "labels": [IGNORE] + list(range(6, 5 + n))} for n in
        (3, 7, 4, 9, 5, 6, 8, 2, 5, 7, 3, 4)]


def _targets(i: int) -> int:
    return sum(1 for x in ROWS[i]["labels"][1:] if x != IGNORE)


def _same(a, b) -> None:
    assert a.global_targets == b.global_targets and a.local_tokens == b.local_tokens
    assert len(a.micro) == len(b.micro)
    for x, y in zip(a.micro, b.micro):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("padding_free", [False, True])
def test_workers_build_the_same_steps_in_the_same_order(padding_free):
    plan = BatchPlan(len(ROWS), 2, 2, 2, seed=3)      # 2 ranks x accumulation 2: 8 rows a step
    steps = StepBatches(plan, 1, ROWS.__getitem__, _targets, 0, padding_free)
    pre = Prefetcher(steps, 1, 6, num_workers=2, prefetch_factor=2)   # resume at data step 1, epochs wrap
    try:
        assert pre._it is not None
        for k in range(1, 6):
            _same(pre.get(k), steps[k])
    finally:
        pre.close()
    assert pre._it is None


def _cfg(tmp_path, data, name, **extra):
    values = {"model": "tiny-llama-2l", "train_type": "full", "dataset": [f"{data}#48"], "max_steps": 4,
              "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "logging_steps": 1,
              "output_dir": str(tmp_path / name), "save_steps": 2, "seed": 5}
    values.update(extra)
    return load_config(None, {k: v for k, v in values.items() if v is not None}, task="sft")


def test_training_losses_are_identical_with_0_and_2_workers_and_resume_is_exact(tmp_path, demo_data, monkeypatch):
    from swiftlite.data import prefetch
    from swiftlite.train.loop import train
    data = demo_data[0]
    started = []   # (workers, first data step, end) of each DataLoader the runs start
    real_init = prefetch.Prefetcher.__init__

    def spy(self, steps, first, end, **kw):
        real_init(self, steps, first, end, **kw)
        started.append((kw["num_workers"], first, end, self._it is not None))
    monkeypatch.setattr(prefetch.Prefetcher, "__init__", spy)
    inline = train(_cfg(tmp_path, data, "w0", dataloader_num_workers=0)).losses
    workers = train(_cfg(tmp_path, data, "w2", dataloader_num_workers=2, dataloader_prefetch_factor=3)).losses
    assert len(inline) == 4 and workers == inline           # bit for bit: same batches, same order
    assert started == [(2, 0, 4, True)]                     # 0 workers: no DataLoader at all
    # stop after step 2 (a checkpoint), resume with workers: steps 3-4 as in the uninterrupted run
    first = train(_cfg(tmp_path, data, "r", dataloader_num_workers=2, max_steps=4, save_steps=2,
                       )).losses
    assert first == inline
    import shutil
    from swiftlite.checkpoint import layout
    run = tmp_path / "r"
    shutil.rmtree(run / layout.checkpoint_name(4))
    (run / "latest").write_text(layout.checkpoint_name(2))
    resumed = train(_cfg(tmp_path, data, "r", dataloader_num_workers=2, resume="true")).losses
    assert resumed == inline[2:]
    assert started[-1] == (2, 2, 4, True)                   # the resumed loader starts at data step 2


def test_msswift_default_and_bad_values():
    cfg = load_config(None, {"dataset": ["d.jsonl"]}, task="sft", validate_paths=False)
    assert cfg.train.dataloader_num_workers == 1 and cfg.train.dataloader_pin_memory is True
    assert cfg.train.dataloader_prefetch_factor is None
    with pytest.raises(UserError, match=r"--dataloader-prefetch-factor needs --dataloader-num-workers > 0"):
        load_config(None, {"dataset": ["d.jsonl"], "dataloader_num_workers": 0, "dataloader_prefetch_factor": 2},
                    task="sft", validate_paths=False)
    with pytest.raises(UserError, match=r"--dataloader-num-workers must be >= 0, got -1"):
        load_config(None, {"dataset": ["d.jsonl"], "dataloader_num_workers": -1}, task="sft", validate_paths=False)
