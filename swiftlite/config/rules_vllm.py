"""The rules of GRPO's (and GKD's) vLLM options (config/vllm_options.py): --use_vllm's modes, the colocated engine's
ranges and the machine it needs (rlhf/vllm_gen.py), and server mode's addresses (swiftlite/rollout/).
Called by config/rules.py's GRPO rule, kept here so that module stays short. Import-light (no torch)."""

from __future__ import annotations

from swiftlite.config.schema import RunConfig
from swiftlite.config.vllm_options import COLOCATE_ONLY, SERVER_ONLY, VLLM_KEYS


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def vllm_problem(c: RunConfig) -> str | None:
    """--use_vllm and its options (config/vllm_options.py; rlhf/vllm_gen.py): ms-swift's mode rules, the
    ranges, and a machine that can run it (a CUDA GPU and the vllm package), checked before launch."""
    r = c.rlhf
    if not r.use_vllm:
        if r.vllm_mode is not None:
            return "--vllm-mode needs --use-vllm true (ms-swift's rule)"
        given = [k for k in VLLM_KEYS if k in c.explicit
                 and not (k == "vllm_server_timeout" and r.teacher_model_server)]   # GKD's teacher server waits too
        return f"{_flag(given[0])} applies to --use-vllm true (vLLM generation); drop it or add --use-vllm true" \
            if given else None
    if r.vllm_mode is None:
        return ("--use-vllm true needs --vllm-mode colocate or server (ms-swift requires the mode with --use_vllm)")
    if r.vllm_mode == "server":
        if r.log_rollout_offpolicy_metrics:
            return ("--log-rollout-offpolicy-metrics with --vllm-mode server: the rollout server does not return "
                    "its sampling log-probs; use --vllm-mode colocate or transformers' generate, or drop the flag")
        return _vllm_server(c)
    given = [k for k in SERVER_ONLY if k in c.explicit]
    if given:
        return f"{_flag(given[0])} applies to --vllm-mode server (a `swiftlite rollout` server); drop it"
    checks = [("vllm_gpu_memory_utilization", 0 < r.vllm_gpu_memory_utilization <= 1),
              ("vllm_tensor_parallel_size", r.vllm_tensor_parallel_size >= 1),
              ("vllm_max_model_len", r.vllm_max_model_len is None or r.vllm_max_model_len >= 1),
              ("vllm_max_num_seqs", r.vllm_max_num_seqs is None or r.vllm_max_num_seqs >= 1),
              ("sleep_level", r.sleep_level in (0, 1, 2)),
              ("move_model_batches", r.move_model_batches is None or r.move_model_batches >= 1)]
    for k, ok in checks:
        if not ok:
            return f"{_flag(k)} {getattr(r, k)}: out of range"
    fsdp = c.parallel.parallelism in ("fsdp", "hsdp", "fsdp1") or c.parallel.fsdp
    if r.move_model_batches and fsdp:
        return ("--move-model-batches with FSDP: swiftlite's sync unshards every FSDP unit at once; use --deepspeed "
                "zero3 for a batched sync, or drop the flag")
    if r.offload_model and fsdp:
        return (f"--offload-model with --parallelism {c.parallel.parallelism if not c.parallel.fsdp else 'fsdp'}: "
                "FSDP's sharded parameters are not moved to CPU by swiftlite; use single, ddp or --deepspeed")
    if c.lora.use_dora and c.is_lora:
        return ("--use-vllm with --use-dora: the weight sync hands vLLM base + B@A x scale, which leaves out DoRA's "
                "magnitude; drop one of them")
    import importlib.util
    missing = "vllm is not installed" if importlib.util.find_spec("vllm") is None else None
    if missing is None:
        import torch
        missing = None if torch.cuda.is_available() else "no CUDA GPU is visible here"
    if missing:
        return (f"--use-vllm needs a CUDA GPU and the vllm package (pip install vllm): {missing}; without the flag "
                "generation runs on transformers' generate")
    return None


def _vllm_server(c: RunConfig) -> str | None:
    """--vllm-mode server (swiftlite/rollout/): where the server is, and no option of the colocated engine
    (the server has its own). The run itself needs no GPU and no vllm package: the server generates."""
    r = c.rlhf
    if not r.vllm_server_host and not r.vllm_server_base_url:
        return ("--vllm-mode server needs --vllm-server-host HOST [HOST ...] (or --vllm-server-base-url URL ...): "
                "where `swiftlite rollout` serves (ms-swift's rule)")
    if r.vllm_server_host and not r.vllm_server_base_url and len(r.vllm_server_host) != len(r.vllm_server_port):
        return (f"--vllm-server-host gives {len(r.vllm_server_host)} host(s) and --vllm-server-port "
                f"{len(r.vllm_server_port)} port(s): give one port per host")
    n = len(r.vllm_server_base_url or r.vllm_server_host)
    if r.vllm_server_group_port is not None and len(r.vllm_server_group_port) not in (1, n):
        return f"--vllm-server-group-port: give one port, or one per server ({n})"
    if not r.vllm_server_timeout > 0:
        return f"--vllm-server-timeout {r.vllm_server_timeout}: must be > 0"
    given = [k for k in COLOCATE_ONLY if k in c.explicit]
    if given:
        return (f"{_flag(given[0])} configures the colocated vLLM engine; with --vllm-mode server the rollout server "
                f"has its own (swiftlite rollout {_flag(given[0])} ...): drop it here")
    if r.move_model_batches is not None and r.move_model_batches < 1:
        return f"--move-model-batches {r.move_model_batches}: out of range"
    if c.lora.use_dora and c.is_lora:
        return ("--use-vllm with --use-dora: the weight sync hands vLLM base + B@A x scale, which leaves out DoRA's "
                "magnitude; drop one of them")
    return None


__all__ = ["vllm_problem"]
