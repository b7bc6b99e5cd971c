"""GRPO's vLLM options (--use_vllm true --vllm_mode colocate: swiftlite/rlhf/vllm_gen.py; --vllm_mode
server: swiftlite/rollout/, a `swiftlite rollout` server): ms-swift's names and defaults (swift/rlhf_trainers/args_mixin.py VllmArguments and RolloutTrainerArgumentsMixin,
the latter's overrides where it has them). A base of schema.RlhfConfig, kept here so that schema.py
stays short; the vLLM options swiftlite does not have are refused by config/grpo_unsupported.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt


@dataclass(kw_only=True)
class VllmOptions(Section):
    """The `vllm_*` and memory options of GRPO's colocated vLLM engine."""
    vllm_gpu_memory_utilization: float = opt(0.9, "GRPO vLLM: fraction of the GPU's memory the colocated engine "
                                             "may take (weights and KV cache).")
    vllm_tensor_parallel_size: int = opt(1, "GRPO vLLM: processes sharing one engine (tensor parallel); must "
                                         "divide the number of processes.")
    vllm_max_model_len: int | None = opt(None, "GRPO vLLM: the engine's context length (default: the model's).")
    vllm_max_num_seqs: int | None = opt(None, "GRPO vLLM: most sequences the engine runs at once (default: "
                                        "per-device batch x tensor parallel size x --steps-per-generation).")
    vllm_enable_prefix_caching: bool = opt(True, "GRPO vLLM: reuse the KV cache of shared prompt prefixes (the "
                                           "G completions of a prompt share it).")
    vllm_enforce_eager: bool = opt(False, "GRPO vLLM: no CUDA graphs (less memory, slower decoding).")
    vllm_enable_lora: bool = opt(False, "GRPO vLLM with LoRA/QLoRA: accepted for ms-swift's scripts; swiftlite "
                                 "always hands vLLM the merged weights (base + B@A x scale), and says so in one line; "
                                 "the completions are the same as with a LoRA inside vLLM.")
    sleep_level: int = opt(0, "GRPO vLLM: release the engine's GPU memory between generation rounds: 0 keep it, "
                           "1 free the KV cache and move its weights to CPU, 2 free both (the weights are synced "
                           "every round anyway).")
    move_model_batches: int | None = opt(None, "GRPO vLLM under ZeRO-3: sync the weights to vLLM in this many "
                                         "batches of decoder layers, each gathered on its own, instead of the "
                                         "whole model at once (other backends hold whole weights: no effect).")
    offload_model: bool = opt(False, "GRPO vLLM: move the policy's weights to CPU memory while vLLM generates.")
    offload_optimizer: bool = opt(False, "GRPO vLLM: move the optimizer state to CPU memory while vLLM generates.")
    vllm_server_host: list[str] | None = opt(None, "GRPO --vllm-mode server: the `swiftlite rollout` server(s)' "
                                             "host(s), one per server (ms-swift's; needed in server mode unless "
                                             "--vllm-server-base-url is given).")
    vllm_server_port: list[int] = opt(help="GRPO --vllm-mode server: the server(s)' HTTP port(s), one per host "
                                      "(ms-swift's default: 8000).", factory=lambda: [8000])
    vllm_server_base_url: list[str] | None = opt(None, "GRPO --vllm-mode server: the server(s)' URL(s) "
                                                 "(http://host:port); replaces --vllm-server-host/--vllm-server-port.")
    vllm_server_timeout: float = opt(240.0, "GRPO --vllm-mode server, GKD --teacher-model-server: seconds to wait "
                                     "for the server(s) to answer at start (ms-swift's).")
    vllm_server_group_port: list[int] | None = opt(None, "GRPO --vllm-mode server: the TCP port of each server's "
                                                   "weight-sync group, opened by the server (default: 51216, "
                                                   "51217, ... as ms-swift).")


#: The keys above (config/rules.py lists them among GRPO's own).
VLLM_KEYS = ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_len", "vllm_max_num_seqs",
             "vllm_enable_prefix_caching", "vllm_enforce_eager", "vllm_enable_lora", "sleep_level",
             "move_model_batches", "offload_model",
             "offload_optimizer", "vllm_server_host", "vllm_server_port", "vllm_server_base_url", "vllm_server_timeout",
             "vllm_server_group_port", "vllm_server_pass_dataset")   # the last: config/multi_turn_options.py
#: The keys above that configure the colocated engine only: in server mode the rollout server has them
#: (`swiftlite rollout --vllm_...`), so a training run in server mode refuses them (config/rules.py).
COLOCATE_ONLY = ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_len", "vllm_max_num_seqs",
                 "vllm_enable_prefix_caching", "vllm_enforce_eager", "sleep_level", "offload_model",
                 "offload_optimizer")
#: The keys above that apply to server mode only.
SERVER_ONLY = ("vllm_server_host", "vllm_server_base_url", "vllm_server_group_port", "vllm_server_pass_dataset")

__all__ = ["COLOCATE_ONLY", "SERVER_ONLY", "VLLM_KEYS", "VllmOptions"]
