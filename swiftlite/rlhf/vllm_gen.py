"""GRPO's completions from a colocated vLLM engine (--use_vllm true --vllm_mode colocate), as TRL's
VLLMGeneration and ms-swift's colocate rollout do it: one `vllm.LLM` per training process
(distributed_executor_backend="external_launcher", the processes' own torch.distributed world; with
--vllm_tensor_parallel_size > 1 a group of that many processes shares one engine), built once, on
the first generation round.

Each round: (--sleep_level > 0: wake the engine's weights) -> the policy's weights handed to the
engine's `load_weights` (gathered as for `generate`, swiftlite/parallel/gather.py) -> (wake the KV
cache) -> one `generate` call for all of this process's completions of the round -> (sleep again at
--sleep_level). --offload_model / --offload_optimizer move the policy's parameters / the optimizer
state to CPU memory while vLLM generates and back after (ms-swift's offload_context;
parallel/offload.py, the caller's context).

The weights: a full policy's parameters under the names the model class has (FSDP/checkpoint
wrappers' prefixes taken off; tied weights once). A LoRA/QLoRA policy's are the merged weights,
base + B @ A x scale (peft's own `get_delta_weight`, what `merge_adapter` adds), computed beside the
policy instead of merged into it: TRL merges into the policy and unmerges after, but in bf16
W + d - d is not W, and a 4-bit base re-quantizes on every merge, so the policy would drift a little
every round; here it is never touched. Names lose peft's `base_model.model.` and `.base_layer`, the
lora_ parameters are not sent, a 4-bit base is dequantized. The engine is built from the policy's
config alone with load_format="dummy" (the first sync writes every weight), so presets and QLoRA
bases (vLLM gets the dense model in the run's dtype) work alike; skip_tokenizer_init: prompts go
in as token ids and completions come back as token ids, decoded by the caller.

Sampling: SamplingParams per completion (n=1, as swiftlite's plan lays completions out), with
--temperature, --top_p, --top_k, max_tokens=--max_completion_length, stop_token_ids = the
tokenizer's EOS, and seed = swiftlite's `completion_seed(--seed, round, c)`: a completion's draw
depends on its own seed and the weights, not on the batch (as far as vLLM's kernels are
batch-invariant). The tensors returned per micro-batch are `generate.sample`'s layout exactly.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from swiftlite.errors import UserError
from swiftlite.rlhf.generate import left_padded


def engine_kwargs(o: Any, *, model_dir: str, dtype: str, rank: int, per_device: int, steps_per_generation: int
                  ) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` for options `o` (cfg.rlhf): ms-swift's colocate engine (rollout_mixin
    _prepare_vllm_engine); seed = rank // tp so the processes of one TP group share it (TRL)."""
    tp = o.vllm_tensor_parallel_size
    return dict(model=model_dir, dtype=dtype, tensor_parallel_size=tp,
                gpu_memory_utilization=o.vllm_gpu_memory_utilization, max_model_len=o.vllm_max_model_len,
                max_num_seqs=o.vllm_max_num_seqs or per_device * tp * steps_per_generation,
                enable_prefix_caching=o.vllm_enable_prefix_caching, enforce_eager=o.vllm_enforce_eager,
                enable_sleep_mode=o.sleep_level > 0,
                seed=rank // tp, distributed_executor_backend="external_launcher", load_format="dummy",
                skip_tokenizer_init=True,
                # --log_rollout_offpolicy_metrics: the sampled tokens' log-probs after temperature, top-k
                # and top-p (ms-swift's setting, vLLM >= 0.10.2), what the training side computes
                **({"logprobs_mode": "processed_logprobs"} if getattr(o, "log_rollout_offpolicy_metrics", False)
                   else {}))


def sampling_params(SamplingParams: Any, seeds: list[int], *, temperature: float, top_p: float, top_k: int,
                    max_tokens: int, eos_ids: list[int], logprobs: bool = False) -> list[Any]:
    """One SamplingParams per completion (n=1), its seed the completion's own; `logprobs`: the sampled
    token's log-probability with each token (vLLM's logprobs=0)."""
    extra = {"logprobs": 0} if logprobs else {}
    return [SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                           stop_token_ids=list(eos_ids), seed=s, detokenize=False, **extra) for s in seeds]


def output_logprobs(out: Any, n: int) -> list[float]:
    """The sampled tokens' log-probabilities of a vLLM RequestOutput (sampled with logprobs=0), one per
    token of `output_token_ids` (n of them); nan where vLLM gave none (the stop token it leaves out)."""
    c = out.outputs[0]
    vals = [float("nan")] * n
    for k, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs or [])):
        if k < n and lp and tok in lp:
            vals[k] = float(lp[tok].logprob)
    return vals


def output_token_ids(out: Any) -> list[int]:
    """A vLLM RequestOutput's completion token ids, the stop token included: vLLM leaves a stop token of
    `stop_token_ids` out of token_ids (it is the stop_reason), where generate keeps the EOS."""
    c = out.outputs[0]
    ids = list(c.token_ids)
    stop = getattr(c, "stop_reason", None)
    if getattr(c, "finish_reason", None) == "stop" and isinstance(stop, int) and (not ids or ids[-1] != stop):
        ids.append(stop)
    return ids


def _dense(module: Any, name: str = "weight") -> torch.Tensor:
    """A module's weight as a dense tensor: a bitsandbytes 4-bit weight dequantized."""
    w = getattr(module, name)
    if type(w).__name__ == "Params4bit":
        import bitsandbytes.functional as bnbf
        return bnbf.dequantize_4bit(w.data, w.quant_state)
    return w.data.full_tensor() if hasattr(w.data, "full_tensor") else w.data


def _fix(name: str) -> str:
    """The model class's own name of a parameter (TRL's _fix_param_name_to_vllm)."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def policy_weights(model: Any, only: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight vLLM's model holds, from the policy `model` (module docstring):
    a LoRA layer's weight is base + the active adapters' delta (peft's get_delta_weight), the policy
    untouched. Call with the weights gathered (parallel/gather.py); `only`: the parameters (names in
    `weight_batches`'s terms) of one batch of --move_model_batches."""
    from swiftlite.rlhf.reference import peft_model
    peft = peft_model(model)
    if peft is None:
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=True):
            if id(p) in seen or (only is not None and name not in only):
                continue
            seen.add(id(p))
            yield _fix(name), (p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data)
        return
    merged: dict[str, torch.Tensor] = {}                   # "<layer>.base_layer.weight" -> merged
    for mname, mod in peft.named_modules():
        if hasattr(mod, "get_delta_weight") and hasattr(mod, "base_layer") and not getattr(
                mod, "disable_adapters", False) and (only is None or f"{mname}.base_layer.weight" in only):
            base = _dense(mod.base_layer)
            w = base.float()
            for a in mod.active_adapters:
                if a in getattr(mod, "lora_A", {}) or a in getattr(mod, "lora_embedding_A", {}):
                    w = w + mod.get_delta_weight(a).float()
            merged[f"{mname}.base_layer.weight"] = w.to(base.dtype)   # a 4-bit base: its compute dtype
    modules = dict(peft.named_modules())
    for name, p in peft.named_parameters():
        if peft.prefix in name or "original_module" in name or (only is not None and name not in only):
            continue                                       # lora_A/B (merged above), modules_to_save's original
        if name in merged:
            data = merged[name]
        elif type(p).__name__ == "Params4bit":
            data = _dense(modules[name.rsplit(".", 1)[0]])
        else:
            data = p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data
        out = name.removeprefix("base_model.model.").replace(".base_layer", "").replace("modules_to_save.default.", "")
        yield _fix(out), data


def weight_batches(model: Any, n: int) -> list[set[str]]:
    """--move_model_batches n: the policy's parameter names (the PeftModel's for LoRA) in batches: the
    decoder layers in n contiguous groups, everything else (embeddings, norm, head) one more batch; a
    layer's base weight and its adapter always share a batch (ms-swift's split_batches)."""
    import re
    from swiftlite.rlhf.reference import peft_model
    names = [nm for nm, _ in (peft_model(model) or model).named_parameters()]
    layer_of = {nm: (int(m.group(1)) if (m := re.search(r"\.layers\.(\d+)\.", nm)) else None) for nm in names}
    layers = sorted({v for v in layer_of.values() if v is not None})
    k = max(1, min(n, len(layers)))
    groups: list[set[str]] = [set() for _ in range(k)]
    for nm, v in layer_of.items():
        if v is not None:
            groups[layers.index(v) * k // len(layers)].add(nm)
    rest = {nm for nm, v in layer_of.items() if v is None}
    return [g for g in [*groups, rest] if g]


def _zero3(model: Any) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _zero3_gather(params: list[Any]) -> Any:
    import deepspeed
    return deepspeed.zero.GatheredParameters(params)


def completion_layout(prompts: list[list[int]], completions: list[list[int]], *, pad_id: int, eos_ids: list[int],
                      device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`generate.sample`'s tensors from token lists: prompt ids [B, P] left-padded with their mask,
    completion ids [B, C] (C the longest completion; pad after the first EOS) with the mask (1 up
    to and including the first EOS)."""
    ids, mask = left_padded(prompts, pad_id)
    n = max(1, max(len(c) for c in completions))
    cids = torch.full((len(completions), n), pad_id, dtype=torch.long)
    cmask = torch.zeros((len(completions), n), dtype=torch.long)
    eos = set(eos_ids)
    for i, c in enumerate(completions):
        cut = next((k + 1 for k, t in enumerate(c) if t in eos), len(c))
        cids[i, :cut] = torch.tensor(c[:cut], dtype=torch.long)
        cmask[i, :cut] = 1
    return ids.to(device), mask.to(device), cids.to(device), cmask.to(device)


def vllm_model_dir(model: Any) -> str:
    """A folder with the policy's config.json (its base's, dense: no quantization_config) for vLLM."""
    from swiftlite.rlhf.reference import peft_model
    peft = peft_model(model)
    base = peft.get_base_model() if peft is not None else model
    conf = base.config.to_dict()
    conf.pop("quantization_config", None)
    conf["architectures"] = conf.get("architectures") or [type(base).__name__]
    d = Path(tempfile.mkdtemp(prefix="swiftlite-vllm-"))
    import atexit
    import shutil
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    (d / "config.json").write_text(json.dumps(conf, indent=1, default=str))
    return str(d)


def _sync_gather(root: Any, gather: Any) -> Any:
    """The weights whole for the sync: `gather` (parallel/gather.py), except FSDP1, whose round gather
    holds only its root unit: its every unit is summoned (TRL gathers FSDP1 unit by unit)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    if isinstance(root, FSDP1):
        return FSDP1.summon_full_params(root, writeback=False, recurse=True)
    return gather(root)


class VllmGenerator:
    """This process's colocated engine and its generation rounds (module docstring)."""

    def __init__(self, options: Any, *, dtype: str, world: Any, per_device: int, steps_per_generation: int):
        self.o, self.dtype, self.world = options, dtype, world
        self.per_device, self.spg = per_device, steps_per_generation
        self.llm: Any = None
        self.tp_group: Any = None
        self.syncs = 0

    def _build(self, model: Any) -> None:
        import vllm
        tp, w = self.o.vllm_tensor_parallel_size, self.world
        if w.world_size % tp:
            raise UserError(f"--vllm_tensor_parallel_size {tp} must divide the number of processes ({w.world_size})")
        if tp > 1:
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(i * tp, (i + 1) * tp)) for i in range(w.world_size // tp)])
        from swiftlite import env           # vLLM's external_launcher reads torchrun's variables
        for k, v in (("RANK", w.rank), ("LOCAL_RANK", w.local_rank), ("WORLD_SIZE", w.world_size),
                     ("MASTER_ADDR", "127.0.0.1")):
            env.set_default(k, str(v))
        if not env.has("MASTER_PORT"):      # one process without torchrun: a free port
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                env.set_default("MASTER_PORT", str(s.getsockname()[1]))
        kw = engine_kwargs(self.o, model_dir=vllm_model_dir(model), dtype=self.dtype, rank=w.rank,
                           per_device=self.per_device, steps_per_generation=self.spg)
        self.llm = vllm.LLM(**kw)
        if self.o.vllm_enable_lora and w.is_main:   # accepted for ms-swift's scripts: say what happens instead
            print("--vllm_enable_lora true: vLLM gets the merged weights (base + B@A x scale) every round, not a "
                  "LoRA adapter; the completions are the same", flush=True)
        if self.o.sleep_level > 0:
            self.llm.sleep(level=self.o.sleep_level)

    def _vllm_model(self) -> Any:
        """The model inside vLLM's in-process worker (TRL's path to its load_weights)."""
        llm_eng = self.llm.llm_engine        # vLLM's engine (not a swiftlite Engine)
        return llm_eng.model_executor.driver_worker.model_runner.model

    def sync(self, model: Any, batches: list[set[str]] | None = None) -> int:
        """Hand the policy's weights to the engine (ZeRO-3 with --move_model_batches: `batches` of
        parameters gathered one after the other); returns how many tensors."""
        from swiftlite.rlhf.reference import peft_model
        target = self._vllm_model()
        n = 0
        params = dict((peft_model(model) or model).named_parameters())
        for only in batches or [None]:
            ctx = _zero3_gather([params[x] for x in sorted(only)]) if only is not None else contextlib.nullcontext()
            with ctx:
                for name, t in policy_weights(model, only):
                    target.load_weights([(name, t)])
                    n += 1
        self.llm.reset_prefix_cache()
        self.syncs += 1
        return n

    def generate_round(self, model: Any, root: Any, gather: Any, micro_prompts: list[list[list[int]]],
                       micro_seeds: list[list[int]], *, pad_id: int, eos_id: int | list[int], max_new_tokens: int,
                       temperature: float, top_p: float, top_k: int, device: Any, offload: Any = None,
                       sync: bool = True, logprobs: bool = False) -> list[tuple[torch.Tensor, ...]]:
        """This process's micro-batches of a round: one (prompt_ids, prompt_mask, completion_ids,
        completion_mask) per micro-batch, as `generate.sample` returns them, and the sampled tokens'
        log-probabilities with --log_rollout_offpolicy_metrics or `logprobs` (a scheduler's own rollout asked).
        `offload`: a context (parallel/offload.py) held while vLLM generates. `sync` false: a multi-turn round's
        later turn, on the weights already synced (again where --sleep_level 2 discarded them)."""
        from vllm import SamplingParams
        if self.llm is None:
            self._build(model)
        sleeping = self.o.sleep_level > 0
        if sleeping:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()        # TRL: waking after training's allocations can OOM without it
            self.llm.wake_up(tags=["weights"])
        if not sync and self.o.sleep_level < 2:   # a multi-turn round's later turn: the weights are in place
            pass
        elif self.o.move_model_batches and _zero3(model):     # the model whole batch by batch, not at once
            self.sync(model, weight_batches(model, self.o.move_model_batches))
        else:
            with _sync_gather(root, gather):
                self.sync(model)
        eos_ids = list(eos_id) if isinstance(eos_id, list) else [eos_id]
        prompts = [p for mb in micro_prompts for p in mb]
        seeds = [s for mb in micro_seeds for s in mb]
        want_lp = bool(getattr(self.o, "log_rollout_offpolicy_metrics", False)) or logprobs
        params = sampling_params(SamplingParams, seeds, temperature=temperature, top_p=top_p, top_k=top_k,
                                 max_tokens=max_new_tokens, eos_ids=eos_ids, logprobs=want_lp)
        tp = self.o.vllm_tensor_parallel_size
        if tp > 1:                     # the group generates for all its processes; each keeps its share
            parts: list[Any] = [None] * tp
            torch.distributed.all_gather_object(parts, (prompts, seeds), group=self.tp_group)
            mine = torch.distributed.get_rank(group=self.tp_group)
            all_prompts = [p for pr, _ in parts for p in pr]
            params = [q for _, sd in parts for q in sampling_params(
                SamplingParams, sd, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
                eos_ids=eos_ids, logprobs=want_lp)]
        else:
            all_prompts, mine = prompts, 0
        o = self.o
        with offload if offload is not None else contextlib.nullcontext():
            if sleeping:
                self.llm.wake_up(tags=["kv_cache"])
            outs = self.llm.generate([{"prompt_token_ids": p} for p in all_prompts], sampling_params=params,
                                     use_tqdm=False) if all_prompts else []
            if sleeping:
                self.llm.sleep(level=o.sleep_level)
        outs = outs[mine * len(prompts):(mine + 1) * len(prompts)]
        comps = [output_token_ids(out) for out in outs]
        result, k = [], 0
        for mb in micro_prompts:
            layout = completion_layout(mb, comps[k:k + len(mb)], pad_id=pad_id, eos_ids=eos_ids, device=device)
            if want_lp:   # [B, C] as the completion ids, nan past each completion's tokens
                C = layout[2].shape[1]
                lps = [output_logprobs(out, len(c))[:C] for out, c in zip(outs[k:k + len(mb)], comps[k:k + len(mb)])]
                layout = (*layout, torch.tensor([v + [float("nan")] * (C - len(v)) for v in lps],
                                                dtype=torch.float32, device=device))
            result.append(layout)
            k += len(mb)
        return result


__all__ = ["VllmGenerator", "completion_layout", "engine_kwargs", "output_logprobs", "output_token_ids", "policy_weights", "sampling_params",
           "vllm_model_dir", "weight_batches"]
