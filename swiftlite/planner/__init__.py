"""The planner: memory per GPU for every backend, from a model's config, and the backend to use.

    shape = shape_from_model_arg("llama-8b")                      # shape.py: counts, not weights
    work = Workload(train_type="full", dtype="bf16", world_size=8, gpu_memory_bytes=80 * 10**9)
    est = estimate(shape, work, "fsdp")                           # memory.py: MemoryEstimate
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

from swiftlite.planner.backends import FAMILIES, SHARDING, backend_record, table_backends
from swiftlite.planner.memory import (
    GiB, MemoryEstimate, Workload, activation_bytes, base_bits, comm_bytes_per_step, estimate, estimate_all,
    model_state_bytes, quantized_bytes, temp_buffer_bytes, trainable_params, unavailable_reason,
)
from swiftlite.planner.recommend import RULES, Decision, Rule, fmt_gb, recommend, resolve_auto, workload_from_config
from swiftlite.planner.render import run_estimate, to_json  # not `render`: that name is the module
from swiftlite.planner.shape import Linear, ModelShape, shape_from_config, shape_from_model_arg
from swiftlite.planner.memory import LinkBytes, comm_per_link

__all__ = [
    "FAMILIES", "RULES", "SHARDING", "Decision", "GiB", "Linear", "LinkBytes", "MemoryEstimate", "ModelShape",
    "Rule", "Workload", "activation_bytes", "backend_record", "base_bits", "comm_bytes_per_step", "comm_per_link",
    "estimate",
    "estimate_all", "fmt_gb", "model_state_bytes", "quantized_bytes", "recommend", "resolve_auto",
    "run_estimate", "shape_from_config", "shape_from_model_arg", "table_backends", "temp_buffer_bytes",
    "to_json", "trainable_params", "unavailable_reason", "workload_from_config",
]
