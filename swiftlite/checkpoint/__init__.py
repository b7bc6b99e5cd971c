"""Atomic save and resume of the whole training state, and reading checkpoints offline.

    layout.py    every name in a run folder and a checkpoint
    store.py     atomic write, manifest, publish, prune, `latest`, find_resume
    safety.py    allow-list unpicklers (DCP metadata, torch files, DeepSpeed globals)
    state.py     save/load the training state (engine, RNG, trainer_state.json, HF copy)
    run_dir.py   the --output-dir check (preflight) and preparation (trainer)
    universal.py a checkpoint converted once to DeepSpeed's universal format (another world size, ZeRO
                 stage or backend) and loaded into a DeepSpeed or torch engine; universal_files.py
                 writes what DeepSpeed's converter lacks
    readers/     offline tensor readers of DCP, ZeRO, safetensors folders and live models (export)

The names below are the package's public interface (`from swiftlite import checkpoint as ckpt`).
`readers` is imported on its own: it needs torch at import time, this package does not.
"""

from swiftlite.checkpoint.layout import LATEST, MANIFEST, PREFIX, checkpoint_name, step_of
from swiftlite.checkpoint.run_dir import check_output_dir, prepare_run_dir
from swiftlite.checkpoint.safety import (DEEPSPEED_SAFE_GLOBALS, PICKLE_SUFFIXES, check_checkpoint_safe,
                                         check_dcp_metadata, check_torch_file, load_dcp_metadata,
                                         safe_torch_load)
from swiftlite.checkpoint.state import (export_weights, load_rng, load_training_state,
                                        save_rng, save_training_state)
from swiftlite.checkpoint.store import (clean_partial, find_resume, fsync_dir, list_checkpoints, prune, publish,
                                        read_latest, replace_dir, resolve_resume_arg, verify_checkpoint,
                                        write_latest, write_manifest)

__all__ = [
    "LATEST", "MANIFEST", "PREFIX", "checkpoint_name", "step_of",
    "check_output_dir", "prepare_run_dir",
    "DEEPSPEED_SAFE_GLOBALS", "PICKLE_SUFFIXES", "check_checkpoint_safe", "check_dcp_metadata",
    "check_torch_file", "load_dcp_metadata", "safe_torch_load",
    "export_weights", "load_rng", "load_training_state", "save_rng",
    "save_training_state",
    "clean_partial", "find_resume", "fsync_dir", "list_checkpoints", "prune", "publish", "read_latest",
    "replace_dir", "resolve_resume_arg", "verify_checkpoint", "write_latest", "write_manifest",
]
