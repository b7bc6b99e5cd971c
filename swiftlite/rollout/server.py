"""`swiftlite rollout`: GRPO's generation server (ms-swift's `swift rollout`), which a run in
`--use_vllm true --vllm_mode server` samples its completions from (rlhf/rollout_client.py).

    swiftlite rollout --model Qwen/Qwen2.5-7B-Instruct --port 8000            # vLLM on this machine's GPU(s)
    swiftlite rollout --model DIR --infer_backend transformers                # anywhere, CPUs included

The HTTP API (JSON in and out; the paths are ms-swift's where they mean the same):

- GET  /health/            {"status": "ok"} once the engine is up.
- GET  /get_world_size/    the engine's workers, dtype, device and (transformers) parameter shapes.
- POST /init_communicator/ {"host", "port", "world_size", "backend"}: the workers join the weight-sync
  group (rlhf/weight_group.py); answered at once, the join completes when the run joins too.
- POST /update_named_param/ {"name", "dtype", "shape"}: the next tensor the run broadcasts is that
  weight; answered at once, received in order.
- POST /reset_prefix_cache/ the round's weights are all in.
- POST /infer/             {"groups": [[prompt ids, ...], ...], "seeds": [[...], ...], "max_tokens",
  "temperature", "top_p", "top_k", "stop_token_ids", "pad_id"} -> {"completions": [[ids, ...], ...]};
  with "logprobs": true also {"logprobs": [[[the sampled tokens' log-probabilities], ...], ...]}.
- POST /close_communicator/ the run leaves the group.
- GET  /v1/models          vLLM's OpenAI model list: the served model's name.
- POST /v1/completions     vLLM's OpenAI completions API for scoring prompts, as a GKD teacher is asked
  (`swiftlite deploy`, a run's --teacher_model_server: rlhf/teacher_server.py): {"prompt": token ids
  (one list, or one per prompt), "max_tokens": 1, "temperature": 0, "prompt_logprobs": k <= --max_logprobs}
  -> {"choices": [{"index", "prompt_logprobs": [null, {"<token id>": {"logprob", "rank",
  "decoded_token"}, ...}, ...], "token_ids": [the greedy next token], "text": "", ...}]}: per prompt
  token after the first, the k most likely tokens after its prefix and the token itself (vLLM's shape).
  Nothing else of the API is served (no text prompts, no sampling: /infer/ samples for GRPO).

Requests are JSON and token ids, not ms-swift's chat requests (the run renders its prompts itself), so
the server speaks to swiftlite's runs, not to ms-swift's trainer; the commands and flags are ms-swift's.

One engine thread runs the engine's calls in the order the requests came (a weight's receive is queued
before the run broadcasts it, and /infer/ waits behind the round's weights); the HTTP threads only queue
and wait. A call that fails answers 400 with the reason, and a failed receive is reported by the next
request that waits. SIGTERM or Ctrl-C stops the server.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from swiftlite.errors import UserError


@dataclass
class RolloutOptions:
    model: str
    host: str = "0.0.0.0"
    port: int = 8000
    infer_backend: str = "vllm"
    torch_dtype: str = "auto"
    seed: int = 42
    model_revision: str | None = None
    vllm_tensor_parallel_size: int = 1
    vllm_gpu_memory_utilization: float = 0.9
    vllm_max_model_len: int | None = None
    vllm_max_num_seqs: int | None = None
    vllm_enable_prefix_caching: bool = True
    vllm_enforce_eager: bool = False
    vllm_enable_lora: bool = False
    #: copies of the engine, each on its own GPUs (ms-swift's --vllm_data_parallel_size; rollout/replicas.py)
    vllm_data_parallel_size: int = 1
    #: /v1/completions: the most prompt_logprobs a request may ask (ms-swift's and vLLM's --max_logprobs)
    max_logprobs: int = 20
    served_model_name: str | None = None
    #: /v1/completions: the longest prompt served (ms-swift deploy's --max_length; None: the model's)
    max_length: int | None = None
    command: str = "rollout"
    #: the multi-turn scheduler the runs it serves drive their turns with (ms-swift's rollout options; the
    #: run reads them from /get_world_size/ before launch: launch/server_turns.py)
    multi_turn_scheduler: str | None = None
    max_turns: int | None = None
    external_plugins: tuple[str, ...] = ()
    #: the served runs train on their gym environments' rewards (ms-swift's server says so in /get_world_size/)
    use_gym_env: bool = False
    gym_env: str | None = None


def build_engine(o: RolloutOptions) -> Any:
    """The engine --infer_backend names, its model loaded (rollout/engines.py); with
    --vllm_data_parallel_size N, N copies of it (rollout/replicas.py)."""
    from swiftlite.rollout.engines import TransformersEngine, VllmEngine
    if o.vllm_data_parallel_size > 1:
        from swiftlite.rollout.replicas import ReplicatedEngine
        return ReplicatedEngine(o, build_engine)
    if o.infer_backend == "transformers":
        from swiftlite.infer import InferOptions, load
        return TransformersEngine(load(InferOptions(model=o.model, dtype=o.torch_dtype, seed=o.seed,
                                                    model_revision=o.model_revision)).model)
    import importlib.util

    import torch
    missing = ("vllm is not installed" if importlib.util.find_spec("vllm") is None
               else None if torch.cuda.is_available() else "no CUDA GPU is visible here")
    if missing:
        raise UserError(f"swiftlite {o.command} --infer_backend vllm needs a CUDA GPU and the vllm package: {missing}; "
                        "--infer_backend transformers serves on a CPU (slower)")
    from swiftlite.models.loading import resolve_model
    ms = resolve_model(o.model)
    if ms.kind == "preset":
        raise UserError(f"--model {o.model}: a built-in preset has no weight files for vLLM; give an HF folder or "
                        "hub id")
    import vllm
    dtype = "auto" if o.torch_dtype == "auto" else {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(
        o.torch_dtype, o.torch_dtype)
    llm = vllm.LLM(model=ms.ref, revision=o.model_revision, dtype=dtype, seed=o.seed,
                   tensor_parallel_size=o.vllm_tensor_parallel_size,
                   gpu_memory_utilization=o.vllm_gpu_memory_utilization, max_model_len=o.vllm_max_model_len,
                   max_num_seqs=o.vllm_max_num_seqs or 256, enable_prefix_caching=o.vllm_enable_prefix_caching,
                   enforce_eager=o.vllm_enforce_eager, skip_tokenizer_init=True, max_logprobs=o.max_logprobs,
                   worker_extension_cls="swiftlite.rollout.vllm_worker.WeightReceiver")
    core = llm.llm_engine      # vLLM's own engine object (the dtype "auto" resolved to), not a training engine
    return VllmEngine(llm, o.vllm_tensor_parallel_size, str(core.model_config.dtype).removeprefix("torch."))


class EngineThread:
    """Runs the inference backend's calls one at a time, in the order they were queued (module docstring)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.jobs: queue.Queue = queue.Queue()
        self.failed: str | None = None          # a queued call's error, reported by the next waiting request
        threading.Thread(target=self._loop, name="swiftlite-rollout-engine", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, fut = self.jobs.get()
            if fn is None:
                return
            try:
                fut.set_result(fn())
            except Exception as e:     # the request's answer (or, queued, the next request's)
                fut.set_exception(e)

    def queue(self, fn: Callable[[], Any], *, waited: bool = False) -> Future:
        """Queue `fn`; unless a request waits for it (`waited`), its error is kept for the next one."""
        fut: Future = Future()

        def remember(f: Future) -> None:
            if f.exception() is not None and self.failed is None:
                self.failed = _reason(f.exception())
        if not waited:
            fut.add_done_callback(remember)
        self.jobs.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:
        result = self.queue(fn, waited=True).result()
        if self.failed is not None:
            why, self.failed = self.failed, None
            raise UserError(why)
        return result

    def stop(self) -> None:
        self.jobs.put((None, None))


def _reason(e: BaseException) -> str:
    return str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"


def completions(body: dict, score: Callable[[list[list[int]], int], list], name: str, max_logprobs: int,
                max_length: int | None) -> dict:
    """POST /v1/completions (module docstring): the request checked against what is served, `score(prompts,
    k)` (an engine's prompt_logprobs), the answer in vLLM's shape."""
    import time
    prompts = body.get("prompt")
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [prompts]
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p and all(
            isinstance(t, int) for t in p) for p in prompts)):
        raise UserError("/v1/completions: prompt must be token ids (a list of ints, or one list per prompt); "
                        "this server scores prompts, it has no tokenizer")
    k = body.get("prompt_logprobs")
    if not isinstance(k, int) or not 0 <= k <= max_logprobs:
        raise UserError(f"/v1/completions: prompt_logprobs {k!r}: an int from 0 to --max_logprobs {max_logprobs}")
    if int(body.get("max_tokens", 1)) != 1 or float(body.get("temperature") or 0) != 0 or int(body.get("n", 1)) != 1:
        raise UserError("/v1/completions: this server scores prompts (max_tokens 1, temperature 0, n 1); GRPO's "
                        "sampling is /infer/")
    if max_length is not None and max(len(p) for p in prompts) > max_length:
        raise UserError(f"/v1/completions: a prompt of {max(len(p) for p in prompts)} tokens, over --max_length "
                        f"{max_length}")
    scored = score(prompts, k)
    choices = []
    for i, (rows, nxt) in enumerate(scored):
        choices.append({"index": i, "text": "", "finish_reason": "length", "logprobs": None, "token_ids": [nxt],
                        "prompt_logprobs": [None if d is None else {
                            str(t): {"logprob": v, "rank": r, "decoded_token": None} for t, (v, r) in d.items()}
                            for d in rows]})
    n = sum(len(p) for p in prompts)
    return {"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()), "model": name,
            "choices": choices, "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}}


def make_handler(work: EngineThread, timeout_s: float = 1800.0, o: RolloutOptions | None = None) -> type:
    from swiftlite.rollout.engines import Sampling
    o = o or RolloutOptions(model="")
    name = o.served_model_name or o.model

    def infer(body: dict) -> dict:
        s = Sampling(max_tokens=int(body["max_tokens"]), temperature=float(body["temperature"]),
                     top_p=float(body["top_p"]), top_k=int(body["top_k"]),
                     stop_token_ids=[int(t) for t in body["stop_token_ids"]], pad_id=int(body["pad_id"]),
                     logprobs=bool(body.get("logprobs", False)))
        groups, seeds = body["groups"], body["seeds"]
        if len(groups) != len(seeds) or any(len(g) != len(sd) for g, sd in zip(groups, seeds)):
            raise UserError("/infer/: one seed per prompt")
        out = work.call(lambda: work.backend.generate(groups, seeds, s))
        if not s.logprobs:
            return {"completions": out}
        return {"completions": [[c[0] for c in g] for g in out], "logprobs": [[c[1] for c in g] for g in out]}

    e = work.backend
    turns = ({"multi_turn_scheduler": o.multi_turn_scheduler, "max_turns": o.max_turns,
              "external_plugins": list(o.external_plugins), "use_gym_env": o.use_gym_env, "gym_env": o.gym_env}
             if o.multi_turn_scheduler else {})
    routes: dict[tuple[str, str], Callable[[dict], Any]] = {
        ("GET", "/health/"): lambda b: {"status": "ok"},
        ("GET", "/get_world_size/"): lambda b: {**work.call(e.info), **turns},
        ("POST", "/init_communicator/"): lambda b: (work.queue(lambda: e.join(
            str(b["host"]), int(b["port"]), int(b["world_size"]), str(b["backend"]),
            float(b.get("timeout", timeout_s)))), {"status": "joining"})[1],
        ("POST", "/update_named_param/"): lambda b: (work.queue(lambda: e.receive(
            str(b["name"]), str(b["dtype"]), [int(x) for x in b["shape"]])), {"status": "receiving"})[1],
        ("POST", "/reset_prefix_cache/"): lambda b: (work.call(e.after_sync), {"status": "ok"})[1],
        ("POST", "/infer/"): infer,
        ("POST", "/close_communicator/"): lambda b: (work.call(e.close), {"status": "ok"})[1],
        ("GET", "/v1/models/"): lambda b: {"object": "list", "data": [{"id": name, "object": "model",
                                                                        "owned_by": "swiftlite"}]},
        ("POST", "/v1/completions/"): lambda b: completions(
            b, lambda p, k: work.call(lambda: e.prompt_logprobs(p, k)), name, o.max_logprobs, o.max_length),
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self, method: str) -> None:
            path = self.path.split("?")[0]
            path = path if path.endswith("/") else path + "/"
            fn = routes.get((method, path))
            try:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}") if n else {}
                if fn is None:
                    raise LookupError(f"no such endpoint: {method} {path}")
                code, out = 200, fn(body)
            except LookupError as ex:
                code, out = 404, {"error": str(ex)}
            except Exception as ex:       # the caller's mistake or the engine's: said, the server goes on
                code, out = 400, {"error": _reason(ex)}
            data = json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:   # one line per request would drown the log
            pass

    return Handler


def serve(o: RolloutOptions, *, ready: Callable[[str], None] | None = None) -> int:
    """Load the engine, then serve until SIGTERM/SIGINT; returns the exit code."""
    import signal
    backend = build_engine(o)
    work = EngineThread(backend)
    httpd = ThreadingHTTPServer((o.host, o.port), make_handler(work, o=o))
    httpd.daemon_threads = True

    def stop(*_: Any) -> None:
        threading.Thread(target=httpd.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = httpd.server_address[:2]
    copies = backend.copies
    msg = (f"swiftlite {o.command}: {backend.name} engine{f' x {copies} (data parallel)' if copies > 1 else ''} on "
           f"{o.model}, serving http://{host}:{port}")
    print(msg, file=sys.stderr, flush=True)
    if ready is not None:
        ready(msg)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        httpd.server_close()
        work.stop()
        try:
            backend.close()
        finally:
            backend.shutdown()
    return 0


__all__ = ["EngineThread", "RolloutOptions", "build_engine", "completions", "make_handler", "serve"]
