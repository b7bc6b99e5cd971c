"""The planner: memory per GPU for every backend, from a model's config, and the backend to use.

    shape = shape_from_model_arg("llama-8b")                      # shape.py: counts, not weights
    work = Workload(train_type="full", dtype="bf16", world_size=8, gpu_memory_bytes=80 * 10**9)
    est = estimate(shape, work, "fsdp")                           # memory.py: MemoryEstimate, by phase:
                                                                  #   load (load.py), training, optimizer
                                                                  #   step (transients.py); est.peak
    verdict = assess(shape, work, "zero2_offload")                # one named backend: fits or not
    links = comm_per_link(shape, work, "hsdp")                    # intra/inter-node bytes (topology.py)
    decision = recommend(shape, work)                             # recommend.py: Decision
    decision = run_estimate("llama-8b", gpus=8)                  # render.py: `swiftlite estimate`,
    render.render(decision)                                       #   its table

backends.py says which registered backend records are estimated and with which formulas (their
`memory_family`). Nothing here imports torch at import time (the CLI imports the planner); the
meta-device shape count and the FSDP2 availability check import it when called. docs/estimate.md
has the formulas, the rules and their limits.
"""

from __future__ import annotations

from swiftlite.planner.backends import FAMILIES, SHARDING, backend_record, ds_config_family, table_backends
from swiftlite.planner.load import LoadPhase, largest_shard_file, load_phase
from swiftlite.planner.transients import autocast_copy_bytes, host_step_transient_bytes, step_transient_bytes
from swiftlite.planner.memory import (
    GiB, MemoryEstimate, Workload, activation_bytes, base_bits, comm_bytes_per_step, estimate, estimate_all,
    model_state_bytes, quantized_bytes, temp_buffer_bytes, trainable_params, unavailable_reason,
)
from swiftlite.planner.recommend import (RULES, Decision, Rule, assess, choose_backend, fmt_gb, recommend,
                                         resolve_auto, workload_from_config)
from swiftlite.planner.render import run_estimate, to_json  # not `render`: that name is the module
from swiftlite.planner.shape import Linear, ModelShape, shape_from_config, shape_from_model_arg
from swiftlite.planner.memory import LinkBytes, comm_per_link

__all__ = [
    "FAMILIES", "RULES", "SHARDING", "Decision", "GiB", "Linear", "LinkBytes", "LoadPhase", "MemoryEstimate",
    "ModelShape", "Rule", "Workload", "activation_bytes", "assess", "autocast_copy_bytes", "backend_record",
    "base_bits", "choose_backend", "comm_bytes_per_step", "comm_per_link", "ds_config_family", "estimate", "host_step_transient_bytes",
    "largest_shard_file", "load_phase", "step_transient_bytes",
    "estimate_all", "fmt_gb", "model_state_bytes", "quantized_bytes", "recommend", "resolve_auto",
    "run_estimate", "shape_from_config", "shape_from_model_arg", "table_backends", "temp_buffer_bytes",
    "to_json", "trainable_params", "unavailable_reason", "workload_from_config",
]
