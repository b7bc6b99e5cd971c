"""The two engines a `swiftlite rollout` server generates with. Both answer the same calls, made
one at a time from the server's engine thread (rollout/server.py):

- `info()`: what the run needs to know before it syncs: the number of engine workers (the weight-sync
  group's size less the run), the engine's dtype and device type, and its parameters' names and shapes
  where the engine keeps the model class's own names (transformers) so the run can check them first;
- `join(host, port, world_size, backend, timeout_s, first_rank)`: every worker joins the weight-sync group
  (rlhf/weight_group.py) as ranks first_rank .. first_rank + W-1 (first_rank: 0, or a data-parallel
  copy's place, rollout/replicas.py);
- `receive(name, dtype, shape)`: one tensor broadcast by the run, loaded under that name;
- `after_sync()`: the weights of a round are all in (vLLM: its prefix cache is stale now);
- `generate(groups, seeds, sampling)`: completions, token ids, one list per group of prompts; with
  `sampling.logprobs` each completion is a pair (token ids, the sampled tokens' log-probabilities);
- `prompt_logprobs(prompts, k)`: per prompt, (vLLM's prompt_logprobs: None for the first token, then for
  each later token {token id: (log-probability, rank)} of the k most likely next tokens after the prefix
  and the token itself; the greedy token after the whole prompt): a GKD teacher's scores
  (rollout/server.py `/v1/completions`);
- `close()` leaves the group; `shutdown()` ends what the engine started (the server's exit; a
  data-parallel engine's copies, rollout/replicas.py); `copies`: 1 here.

`vllm` (ms-swift's only rollout engine): `vllm.LLM` with swiftlite's worker extension
(rollout/vllm_worker.py) receiving the tensors inside vLLM's workers and handing them to the model's
`load_weights`, which maps the model class's names onto vLLM's fused layers; one SamplingParams per
completion with the completion's seed (rlhf/vllm_gen.py's, as colocate mode). Needs a CUDA GPU.

`transformers` (swiftlite's addition, for CPUs): the model loaded as `swiftlite infer` loads it, each
group sampled by `rlhf/generate.sample`, the function a run without --use_vllm samples with, on the
same per-completion seeds and micro-batches: a run in server mode then samples what it would have
sampled in-process, given the same weights and dtype (tests/e2e/test_rollout_server.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from swiftlite.errors import UserError


@dataclass
class Sampling:
    """One /infer/ request's sampling settings (the run's --temperature, --top_p, --top_k,
    --max_completion_length and its tokenizer's stop and pad ids)."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: list[int]
    pad_id: int
    logprobs: bool = False      # also the sampled tokens' log-probabilities (a scheduler's own rollout asked)


class TransformersEngine:
    name, copies = "transformers", 1

    def __init__(self, model: Any):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.params = dict(model.named_parameters())      # tied weights once, under their first name
        self.group: Any = None

    def info(self) -> dict[str, Any]:
        dtype = next(iter(self.params.values())).dtype
        return {"world_size": 1, "engine": self.name, "device": self.device.type,
                "dtype": str(dtype).removeprefix("torch."),
                "params": {n: list(p.shape) for n, p in self.params.items()}}

    def join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float,
             first_rank: int = 0) -> None:
        from swiftlite.rlhf.weight_group import join
        self.close()
        self.group = join(host, port, first_rank, world_size, backend=backend, timeout_s=timeout_s)

    def receive(self, name: str, dtype: str, shape: list[int]) -> None:
        from swiftlite.rlhf.weight_group import dtype_of
        if self.group is None:
            raise UserError("a weight arrived before the run joined the weight-sync group (/init_communicator/)")
        dev = self.device if self.group.backend == "nccl" else torch.device("cpu")
        buf = torch.empty(shape, dtype=dtype_of(dtype), device=dev)
        self.group.broadcast(buf)           # received first, always: the run's broadcast waits for it
        p = self.params.get(name)
        if p is None or list(p.shape) != list(shape):
            raise UserError(f"the rollout server's model has no parameter {name} of shape {list(shape)}: start "
                            "`swiftlite rollout` with the run's --model")
        with torch.no_grad():
            p.copy_(buf)

    def after_sync(self) -> None:
        pass

    def generate(self, groups: list[list[list[int]]], seeds: list[list[int]], s: Sampling) -> list[list[list[int]]]:
        from swiftlite.rlhf.generate import sample
        out = []
        for prompts, sd in zip(groups, seeds):
            _, _, cids, cmask, *lp = sample(self.model, prompts, sd, pad_id=s.pad_id, eos_id=list(s.stop_token_ids),
                                            max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                            top_k=s.top_k, device=self.device, logprobs=s.logprobs)
            ids = [cids[j, :int(cmask[j].sum())].tolist() for j in range(len(prompts))]
            out.append([(c, lp[0][j, :len(c)].tolist()) for j, c in enumerate(ids)] if s.logprobs else ids)
        return out

    def prompt_logprobs(self, prompts: list[list[int]], k: int) -> list[tuple[list, int]]:
        """One forward per prompt, the log-softmax of its logits in fp32 (what vLLM reports)."""
        out = []
        with torch.no_grad():
            for ids in prompts:
                x = torch.tensor([ids], device=self.device)
                logits = self.model(input_ids=x).logits[0].float()
                lp = torch.log_softmax(logits[:-1], dim=-1)
                top_v, top_i = torch.topk(lp, k=min(k, lp.shape[-1]), dim=-1) if k else (None, None)
                rows: list[dict[int, tuple[float, int]] | None] = [None]
                for j in range(1, len(ids)):
                    row = {int(i): (float(v), r + 1) for r, (v, i) in enumerate(zip(top_v[j - 1], top_i[j - 1]))} \
                        if k else {}
                    tok = ids[j]
                    if tok not in row:   # the prompt's own token, with its rank among all
                        v = lp[j - 1, tok]
                        row[tok] = (float(v), int((lp[j - 1] > v).sum()) + 1)
                    rows.append(row)
                out.append((rows, int(logits[-1].argmax())))
        return out

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def shutdown(self) -> None:
        pass


class VllmEngine:
    name, copies = "vllm", 1

    def __init__(self, llm: Any, workers: int, dtype: str):
        self.llm, self.workers, self.dtype = llm, workers, dtype

    def info(self) -> dict[str, Any]:
        # vLLM's parameters are its own fused layers (qkv_proj, gate_up_proj): the run's names are the
        # model class's, which load_weights maps; so no table to check names against here.
        return {"world_size": self.workers, "engine": self.name, "device": "cuda", "dtype": self.dtype,
                "params": None}

    def join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float,
             first_rank: int = 0) -> None:
        self.llm.collective_rpc("swiftlite_join", args=(host, port, world_size, backend, timeout_s, first_rank))

    def receive(self, name: str, dtype: str, shape: list[int]) -> None:
        self.llm.collective_rpc("swiftlite_receive", args=(name, dtype, list(shape)))

    def after_sync(self) -> None:
        self.llm.reset_prefix_cache()

    def generate(self, groups: list[list[list[int]]], seeds: list[list[int]], s: Sampling) -> list[list[list[int]]]:
        from vllm import SamplingParams

        from swiftlite.rlhf.vllm_gen import output_logprobs, output_token_ids, sampling_params
        prompts = [p for g in groups for p in g]
        params = sampling_params(SamplingParams, [x for sd in seeds for x in sd], temperature=s.temperature,
                                 top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens, eos_ids=s.stop_token_ids,
                                 logprobs=s.logprobs)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False)
        comps: list[Any] = [output_token_ids(o) for o in outs]
        if s.logprobs:
            comps = [(c, output_logprobs(o, len(c))) for c, o in zip(comps, outs)]
        result, k = [], 0
        for g in groups:
            result.append(comps[k:k + len(g)])
            k += len(g)
        return result

    def prompt_logprobs(self, prompts: list[list[int]], k: int) -> list[tuple[list, int]]:
        from vllm import SamplingParams
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], use_tqdm=False,
                                 sampling_params=SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k))
        return [([None if d is None else {int(t): (float(lp.logprob), int(lp.rank)) for t, lp in d.items()}
                  for d in o.prompt_logprobs], int(o.outputs[0].token_ids[0])) for o in outs]

    def close(self) -> None:
        try:
            self.llm.collective_rpc("swiftlite_leave")
        except Exception:   # the engine is shutting down with the server: nothing left to release
            pass

    def shutdown(self) -> None:
        pass


__all__ = ["Sampling", "TransformersEngine", "VllmEngine"]
