"""GRPO's completions from `swiftlite rollout` servers (--use_vllm true --vllm_mode server), as ms-swift's
server mode: the run keeps no engine of its own; every round its weights go to the server(s), then
the round's prompts, and the completions come back (swiftlite/rollout/server.py has the API).

Each round, on every process:
1. the weights, gathered as for the colocated engine (rlhf/vllm_gen.py: FSDP units unsharded, ZeRO-3
   gathered, in --move_model_batches batches if given; a LoRA policy's merged weights), and the main
   process hands each to every server: a /update_named_param/ request names it, then the tensor goes
   over that server's weight-sync group (rlhf/weight_group.py; NCCL between GPUs, gloo otherwise),
   in the engine's dtype;
2. the round's prompts and seeds of every process gathered on the main process, which sends them as
   the processes' micro-batches, in order, split across the servers in contiguous shares; the
   completions are handed back to each process as `generate.sample`'s tensors (vllm_gen's layout).

The weight-sync group is joined on the first round (ms-swift joins when the run starts); the server's
parameter names and shapes are checked before each tensor is sent (a transformers engine lists them),
so a server started on another model is refused in one line naming the parameter.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from swiftlite.errors import UserError

#: ms-swift's first weight-sync port (VLLMClient: 51216 + server index).
GROUP_PORT = 51216


def server_urls(o: Any) -> list[str]:
    """The servers' base URLs from --vllm_server_base_url, else --vllm_server_host/--vllm_server_port."""
    if o.vllm_server_base_url:
        return [u.rstrip("/") if "://" in u else f"http://{u.rstrip('/')}" for u in o.vllm_server_base_url]
    return [f"http://{'[' + h + ']' if ':' in h else h}:{p}" for h, p in zip(o.vllm_server_host, o.vllm_server_port)]


def group_ports(o: Any, n: int) -> list[int]:
    g = o.vllm_server_group_port
    if not g:
        return [GROUP_PORT + i for i in range(n)]
    return list(g) if len(g) == n else [g[0] + i for i in range(n)]


def _get(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for_servers(urls: list[str], timeout_s: float) -> None:
    """Until every server answers /health/ (ms-swift's check_server), at most --vllm_server_timeout;
    checked before launch (train/tasks.py) and again by the run's main process."""
    end = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                _get(url + "/health/", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                if time.monotonic() > end:
                    raise UserError(f"--vllm-mode server: no `swiftlite rollout` answered at {url} within "
                                    f"{timeout_s:g} s (--vllm-server-timeout); start it first: swiftlite rollout "
                                    f"--model <the run's model> --port {urllib.parse.urlparse(url).port or 80}"
                                    ) from None
                time.sleep(0.5)


class RolloutClient:
    """The main process's connection to the servers (module docstring)."""

    def __init__(self, urls: list[str], ports: list[int], *, timeout_s: float, device: Any):
        self.urls, self.ports, self.device = urls, ports, torch.device(device)
        self.infos: list[dict] = []
        self.groups: list[Any] = []
        wait_for_servers(urls, timeout_s)

    def _req(self, i: int, path: str, body: dict | None = None, *, timeout: float | None = None) -> dict:
        url = self.urls[i] + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                why = json.loads(e.read()).get("error", "")
            except ValueError:
                why = e.reason
            raise UserError(f"rollout server {self.urls[i]}: {why}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise UserError(f"rollout server {self.urls[i]} did not answer {path} ({getattr(e, 'reason', e)})") from None

    def connect(self, join_timeout_s: float = 600.0) -> None:
        """Join each server's weight-sync group as its last rank."""
        from swiftlite.rlhf.weight_group import join
        for i, port in enumerate(self.ports):
            info = self._req(i, "/get_world_size/")
            backend = "nccl" if info["device"] == "cuda" and self.device.type == "cuda" else "gloo"
            w = int(info["world_size"]) + 1
            host = urllib.parse.urlparse(self.urls[i]).hostname
            self._req(i, "/close_communicator/", {})
            self._req(i, "/init_communicator/", {"host": "0.0.0.0", "port": port, "world_size": w,
                                                 "backend": backend, "timeout": join_timeout_s})
            self.groups.append(join(host, port, w - 1, w, backend=backend, timeout_s=join_timeout_s))
            self.infos.append(info)

    def send(self, name: str, t: torch.Tensor) -> None:
        """One weight to every server: named, then broadcast in the server's dtype."""
        from swiftlite.rlhf.weight_group import dtype_of
        for i, (info, g) in enumerate(zip(self.infos, self.groups)):
            table = info.get("params")
            if table is not None and list(table.get(name, [])) != list(t.shape):
                have = table.get(name)
                raise UserError(f"rollout server {self.urls[i]}: its model has "
                                f"{'no parameter ' + name if have is None else f'{name} of shape {have}'}, the run's "
                                f"is {list(t.shape)}: start `swiftlite rollout` with the run's --model")
            dt = dtype_of(info["dtype"]) if t.is_floating_point() else t.dtype
            x = t.detach().to(device=self.device if g.backend == "nccl" else "cpu", dtype=dt).contiguous()
            self._req(i, "/update_named_param/", {"name": name, "dtype": str(dt).removeprefix("torch."),
                                                  "shape": list(x.shape)})
            g.broadcast(x)

    def synced(self) -> None:
        for i in range(len(self.urls)):
            self._req(i, "/reset_prefix_cache/", {})

    def infer(self, groups: list[list[list[int]]], seeds: list[list[int]], sampling: dict) -> list[list[Any]]:
        """Completions per group, the groups shared out to the servers in contiguous parts; with
        sampling["logprobs"] each completion is a pair (token ids, log-probabilities)."""
        n = len(self.urls)
        k = -(-len(groups) // n)
        parts = [(i, groups[i * k:(i + 1) * k], seeds[i * k:(i + 1) * k]) for i in range(n) if groups[i * k:(i + 1) * k]]

        def one(part: tuple) -> list:
            i, g, s = part
            out = self._req(i, "/infer/", {"groups": g, "seeds": s, **sampling})
            if "logprobs" not in out:
                return out["completions"]
            return [list(zip(cg, lg)) for cg, lg in zip(out["completions"], out["logprobs"])]
        with ThreadPoolExecutor(max(1, len(parts))) as ex:
            outs = list(ex.map(one, parts))
        return [c for out in outs for c in out]

    def close(self) -> None:
        for i, g in enumerate(self.groups):
            try:
                self._req(i, "/close_communicator/", {}, timeout=10)
            except UserError:     # the server went first: its group is gone with it
                pass
            g.close()
        self.groups = []


class ServerGenerator:
    """This run's rounds from the servers; `generate_round` as rlhf/vllm_gen.VllmGenerator's."""

    def __init__(self, options: Any, *, world: Any):
        self.o, self.world = options, world
        self.client: RolloutClient | None = None
        self.syncs = 0
        if world.is_main:   # fail at start, not at the first round, when no server answers
            urls = server_urls(options)
            self.client = RolloutClient(urls, group_ports(options, len(urls)), timeout_s=options.vllm_server_timeout,
                                        device=world.device)
            if options.vllm_enable_lora:
                print("--vllm_enable_lora true: the rollout server gets the merged weights (base + B@A x scale) "
                      "every round, not a LoRA adapter; the completions are the same", flush=True)

    def sync(self, model: Any, root: Any, gather: Any) -> int:
        """Every process gathers (collectives); the main process sends. Returns the tensors sent."""
        import contextlib

        from swiftlite.rlhf.reference import peft_model
        from swiftlite.rlhf.vllm_gen import _sync_gather, _zero3, _zero3_gather, policy_weights, weight_batches
        if self.client is not None and not self.client.groups:
            self.client.connect()
        n = 0
        if self.o.move_model_batches and _zero3(model):
            params = dict((peft_model(model) or model).named_parameters())
            plan = [(_zero3_gather([params[x] for x in sorted(b)]), b)
                    for b in weight_batches(model, self.o.move_model_batches)]
        else:
            plan = [(_sync_gather(root, gather), None)]
        for ctx, only in plan:
            with ctx if ctx is not None else contextlib.nullcontext():
                for name, t in policy_weights(model, only):
                    if self.client is not None:
                        self.client.send(name, t)
                    n += 1
        if self.client is not None:
            self.client.synced()
        self.syncs += 1
        return n

    def generate_round(self, model: Any, root: Any, gather: Any, micro_prompts: list[list[list[int]]],
                       micro_seeds: list[list[int]], *, pad_id: int, eos_id: int | list[int], max_new_tokens: int,
                       temperature: float, top_p: float, top_k: int, device: Any, offload: Any = None,
                       sync: bool = True, logprobs: bool = False) -> list[tuple[torch.Tensor, ...]]:
        """As VllmGenerator.generate_round's; `sync` false: a later turn on the weights the servers hold;
        `logprobs`: the sampled tokens' log-probabilities too (a scheduler's own rollout asked; the servers'
        turns carry no others)."""
        from swiftlite.rlhf.vllm_gen import completion_layout
        if sync:
            self.sync(model, root, gather)
        eos_ids = list(eos_id) if isinstance(eos_id, list) else [eos_id]
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        parts: list[Any] = [(micro_prompts, micro_seeds)]
        if dist:
            parts = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, (micro_prompts, micro_seeds))
        answer: list[Any] = [None]
        if self.client is not None:
            groups = [mb for p, _ in parts for mb in p]
            seeds = [sd for _, s in parts for sd in s]
            comps = self.client.infer(groups, seeds, {
                "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "stop_token_ids": eos_ids, "pad_id": pad_id, **({"logprobs": True} if logprobs else {})})
            shares, k = [], 0
            for p, _ in parts:
                shares.append(comps[k:k + len(p)])
                k += len(p)
            answer = [shares]
        if dist:
            torch.distributed.broadcast_object_list(answer, src=0)
        mine = answer[0][self.world.rank if dist else 0]
        if not logprobs:
            return [completion_layout(mb, c, pad_id=pad_id, eos_ids=eos_ids, device=device)
                    for mb, c in zip(micro_prompts, mine)]
        out = []
        for mb, c in zip(micro_prompts, mine):
            layout = completion_layout(mb, [x[0] for x in c], pad_id=pad_id, eos_ids=eos_ids, device=device)
            C = layout[2].shape[1]       # [B, C] as the completion ids, nan past each completion's tokens
            out.append((*layout, torch.tensor([list(x[1])[:C] + [float("nan")] * (C - len(list(x[1])[:C])) for x in c],
                                              dtype=torch.float32, device=device)))
        return out

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


__all__ = ["GROUP_PORT", "RolloutClient", "ServerGenerator", "group_ports", "server_urls", "wait_for_servers"]
