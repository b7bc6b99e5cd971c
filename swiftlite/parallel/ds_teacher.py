"""GRPO's teacher on a DeepSpeed run with its own ZeRO config (--teacher_deepspeed; rlhf/teacher.py,
rlhf/frozen.py): the teacher's JSON (`teacher_ds_config`: stage 3 partitions it, the other stages keep
a replica) and its partitioned load (`partitioned_init`). The copy itself is laid out by
parallel/deepspeed.py's `frozen_copy` (its `own_config` / `replica`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

from swiftlite.distributed import World
from swiftlite.parallel import deepspeed as ds_engine
from swiftlite.parallel.ds_config import ds_stage, resolve_ds_config
from swiftlite.parallel.ds_env import _prepare_deepspeed

if TYPE_CHECKING:
    from swiftlite.config import RunConfig


#: ms-swift's --teacher_deepspeed presets that keep a whole teacher on each rank (stages 0-2 shard no
#: parameters; a frozen model has no optimizer state to shard).
TEACHER_REPLICA_PRESETS = ("zero0", "zero1", "zero2", "zero2_offload")


def teacher_ds_config(source: str, cfg: "RunConfig", world: World, hidden_size: int | None) -> dict[str, Any] | None:
    """GRPO's --teacher_deepspeed (a preset of ms-swift's list or a JSON file): the teacher's ZeRO-3 JSON,
    filled like the run's own, or None when its stage is not 3 (the teacher is then a replica)."""
    if source in TEACHER_REPLICA_PRESETS:
        return None
    ds = resolve_ds_config(cfg, world.world_size, hidden_size, source)
    if ds_stage(ds) != 3:
        return None
    ds["zero_allow_untested_optimizer"] = True
    ds.setdefault("steps_per_print", 10 ** 9)
    return ds


@contextlib.contextmanager
def partitioned_init(ds: dict[str, Any], cfg: "RunConfig", world: World) -> Iterator[None]:
    """Load a model partitioned by `ds` (a ZeRO-3 JSON: a teacher's own), as `zero_init_context` loads
    the policy. transformers' ZeRO-3 marker is the run's again afterwards: a ZeRO-2 policy's generate
    must not take the teacher's stage for its own."""
    import torch._dynamo  # noqa: F401  (see zero_init_context)
    from transformers.integrations import deepspeed as hf_ds
    deepspeed = _prepare_deepspeed(world, cfg.parallel.ddp_timeout)
    saved, saved_obj = hf_ds._hf_deepspeed_config_weak_ref, ds_engine._HF_DS_CONFIG
    ds_engine._set_hf_ds_config(ds)
    try:
        with deepspeed.zero.Init(config_dict_or_path=ds):
            yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref, ds_engine._HF_DS_CONFIG = saved, saved_obj


__all__ = ["TEACHER_REPLICA_PRESETS", "partitioned_init", "teacher_ds_config"]
