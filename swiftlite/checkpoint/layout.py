"""Every name in a run folder and in a checkpoint, spelled once.

    output_dir/
        args.json               the run's config (secrets redacted)
        logging.jsonl           one JSON record per logged step
        logs/                   per-rank files (errors, state bytes)
        profile/                per-rank profiler traces, collectives and bench stats (swiftlite/profiling.py)
        latest                  "checkpoint-20", replaced atomically after each save
        checkpoint-20/
            dcp/                the torch backends' sharded model + optimizer (torch.distributed.checkpoint)
            ds/                 DeepSpeed's checkpoint (its tag); `latest` beside it is DeepSpeed's tag file
            ds_universal/       ds/ converted to DeepSpeed's universal format, at the first resume that
                                needs it (another world size, ZeRO stage or backend: checkpoint/universal.py)
            scheduler.json      LR schedule state (torch backends)
            trainer_state.json  global step, backend, world size, train type, model, dtype
            rng/rank<r>.pt      RNG states per rank
            grpo_round_rank<r>.pt   GRPO: this rank's generation round, when saved inside one (rlhf/grpo.py)
            model/ | adapter/   an HF model folder (full) or a peft adapter, for use without swiftlite
            manifest.json       every file with its size and sha256, written last
        .tmp-checkpoint-20/     a save in progress (renamed to checkpoint-20 when complete)
        .del-checkpoint-20/     a checkpoint being deleted (renamed out of the namespace first)

Two files are called `latest`: the run's (`LATEST`, naming the newest checkpoint) and DeepSpeed's own
tag file inside a checkpoint (`DS_LATEST`, naming the tag folder). They are different things.
"""

from __future__ import annotations

import enum
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


class CheckpointFormat(str, enum.Enum):
    """The formats a checkpoint's sharded state is written in: the one vocabulary of the backend records
    (`Backend.checkpoint_format`), trainer_state.json ("format") and export (`Source.weights`). The
    values are what trainer_state.json has always held."""
    DCP = "dcp"   # torch.distributed.checkpoint, in DCP_DIR (the torch backends)
    DS = "ds"     # DeepSpeed's own checkpoint, its tag DS_TAG (every ZeRO record)

    def __str__(self) -> str:   # "ds", in messages and JSON alike, on every Python version
        return self.value

    @property
    def folder(self) -> str:
        """The checkpoint's subfolder that holds this format."""
        return DCP_DIR if self is CheckpointFormat.DCP else DS_TAG

    @classmethod
    def of_state(cls, state: dict) -> "CheckpointFormat":
        """A checkpoint's format from its trainer_state.json: "format"; checkpoints written before that
        field name only their engine key, and every ZeRO record's engine key is "deepspeed"."""
        if state.get("format"):
            return cls(state["format"])
        return cls.DS if state.get("backend") == "deepspeed" else cls.DCP
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


#: GRPO's generation round of one rank, in a checkpoint saved inside a round (rlhf/grpo.py): a resume
#: there continues with it.
ROUND_FILE = "grpo_round_rank{rank}.pt"


def round_file(rank: int) -> str:
    return ROUND_FILE.format(rank=rank)


#: --precompute_ref_log_probs: the reference log-probs table, in every checkpoint (rlhf/reference.py).
REF_LOGPS_FILE = "ref_logps.safetensors"
#: GRPO's --log_completions table, in the run folder (rlhf/grpo.py).
COMPLETIONS_FILE = "completions.jsonl"


# -- per-rank files of a run folder: logs/ (what each rank measured or said) and profile/ ----------
PROFILE_DIR = "profile"
#: kind -> file name with {rank}: each writer and each reader asks `rank_file` / `rank_glob`
RANK_FILES = {
    "memory": "memory_rank{rank}.json",            # RSS window: baseline, load and training peaks (CPU)
    "cuda_memory": "cuda_memory_rank{rank}.json",  # the CUDA allocator's peak at load and after step 1
    "state": "state_rank{rank}.json",              # model-state bytes the rank holds (first step)
    "warnings": "warnings_rank{rank}.log",         # library warnings kept off the console
    "error": "rank{rank}.err",                     # the one line a failed rank left
    "stack": "rank{rank}.stack",                   # every thread's stack of a hung rank
    "trace": "trace_rank{rank}.json",              # profile/: torch.profiler trace
    "collectives": "collectives_rank{rank}.json",  # profile/: collectives of the profiled steps
    "stats": "stats_rank{rank}.json",              # profile/: step statistics for bench
}


def rank_file(kind: str, rank: int) -> str:
    """The name of rank `rank`'s file of `kind` (RANK_FILES)."""
    return RANK_FILES[kind].format(rank=rank)


def rank_glob(kind: str) -> str:
    """A glob pattern matching every rank's file of `kind`."""
    return RANK_FILES[kind].replace("{rank}", "*")


def rank_of(kind: str, path: Path) -> int:
    """The rank a file of `kind` belongs to (its name as `rank_file` spells it)."""
    head, _, tail = RANK_FILES[kind].partition("{rank}")
    return int(path.name[len(head):len(path.name) - len(tail)])
