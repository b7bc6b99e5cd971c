"""Every name in a run folder and in a checkpoint, spelled once.

    output_dir/
        args.json               the run's config (secrets redacted)
        logging.jsonl           one JSON record per logged step
        logs/                   per-rank files (errors, state bytes)
        latest                  "checkpoint-20", replaced atomically after each save
        checkpoint-20/
            dcp/                the torch backends' sharded model + optimizer (torch.distributed.checkpoint)
            ds/                 DeepSpeed's checkpoint (its tag); `latest` beside it is DeepSpeed's tag file
            ds_universal/       ds/ converted to DeepSpeed's universal format, at the first resume that
                                needs it (another world size, ZeRO stage or backend: checkpoint/universal.py)
            scheduler.json      LR schedule state (torch backends)
            trainer_state.json  global step, backend, world size, train type, model, dtype
            rng/rank<r>.pt      RNG states per rank
            model/ | adapter/   an HF model folder (full) or a peft adapter, for use without swiftlite
            manifest.json       every file with its size and sha256, written last
        .tmp-checkpoint-20/     a save in progress (renamed to checkpoint-20 when complete)
        .del-checkpoint-20/     a checkpoint being deleted (renamed out of the namespace first)

Two files are called `latest`: the run's (`LATEST`, naming the newest checkpoint) and DeepSpeed's own
tag file inside a checkpoint (`DS_LATEST`, naming the tag folder). They are different things.
"""

from __future__ import annotations

from pathlib import Path

# -- the run folder --------------------------------------------------------------------------------
PREFIX = "checkpoint-"
LATEST = "latest"
ARGS = "args.json"
LOGGING = "logging.jsonl"
LOGS_DIR = "logs"
LOCK = ".lock"                  # held by the run that owns the folder (checkpoint/run_dir.RunLock)
PREEMPTED = "preempted"         # written when a run stopped on a signal after saving
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"

# -- inside a checkpoint ---------------------------------------------------------------------------
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
SCHEDULER = "scheduler.json"
DCP_DIR = "dcp"
DCP_METADATA = ".metadata"     # torch.distributed.checkpoint's own index file
DS_TAG = "ds"                  # the tag swiftlite passes to DeepSpeed's save/load_checkpoint
DS_LATEST = "latest"           # DeepSpeed's own tag file (not the run's LATEST)
DS_UNIVERSAL = "ds_universal"  # ds/ in DeepSpeed's universal format (its tag folder inside is DS_TAG too)
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
RNG_DIR = "rng"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step}"


def step_of(path: Path) -> int:
    """The step of a `checkpoint-N` folder; -1 when the name is not one."""
    try:
        return int(path.name[len(PREFIX):])
    except ValueError:
        return -1


def rng_file(rank: int) -> str:
    return f"rank{rank}.pt"
