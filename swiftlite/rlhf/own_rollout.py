"""A plugin scheduler that overrides ms-swift's `run` (`--external_plugins F --multi_turn_scheduler NAME`):
ms-swift's "full customization", where the scheduler drives its own turns and calls the inference engine
itself (its examples/train/grpo/plugin/treepo TreeRolloutScheduler grows a tree of turns per prompt, its
branches chosen by the sampled tokens' entropy).

The engine. The scheduler is built with `infer_engine` = `PolicyEngine`, whose async `infer_async(request,
request_config)` samples one turn from the policy with the run's generator, the one a round's turns use
(transformers' generate, the colocated vLLM engine or the rollout server; rlhf/multi_turn.py): the request's
conversation rendered with the chat template and its generation prompt, answered with a ChatCompletionResponse
whose one choice holds the turn's text (without special tokens), its token ids (an end-of-turn token included
when sampled, as vLLM returns them), finish_reason ('length' at the token limit) and, when the request config
asks (`logprobs=True`), each sampled token's log-probability (`choice.logprobs['content'][i]['logprob']`).
Calls that the scheduler's coroutines make while others are under way are answered together: the engine lets
every coroutine run until each waits for its answer, then samples the waiting requests as one batch, in
micro-batches of the run's size. Every process takes part in every sampling call while any process has a
request left (the vLLM paths and the server gather across processes), with an empty share when it has none.

The round. The completions are the requests (one each, as ms-swift's trainer sends them: the prompt's
conversation, the row's columns as `data_dict` under ms-swift's --vllm_server_pass_dataset rule, a uuid of its
own; a prompt's side by side, ms-swift's order), given together to the scheduler's `async_infer` (ms-swift's
base: `run` for each, at once). Colocated, each process's own completions (ms-swift's colocate mode: each
process's engine). In --vllm_mode server, every process's, on the first process (ms-swift's server mode: the
main process gathers the requests and the server's scheduler sees them all, so a tree that merges a group's
requests finds the whole group), whose sampling calls the others join with nothing to ask, each then taking
its share of the trajectories. It must return one rollout per request, in the requests' order (ms-swift's
default path zips them). A scheduler may instead return several rollouts for a request (ms-swift's
dynamic_num_samples, e.g. its thinking_tips_scheduler: one per turn): each is a training row of its own,
matched to its request by the response's id (the request's uuid, as the engine answers it) and laid out next
to the request's other rows (rlhf/grpo_rows.py says how a round trains such rows); where the run cannot
(`split_refusal`), it stops naming the reason.

A rollout (ms-swift's RolloutOutput) becomes the completion trained on. Its `messages` begin with the prompt's;
each assistant message after them is a turn, whose tokens are the rollout's `response_token_ids` (one list per
turn, matched to the last turns when there are fewer lists) with its `response_loss_mask` (default: all
trained), else the message's text encoded (and the end-of-turn token where the template closes the turn with
it). Between two turns the chat template's text (the user's or a tool's message, the next generation prompt)
is in the sequence, out of the loss, as rlhf/plugin_turns.py bridges a step; with --loss_scale last_round only
the last assistant turn is in the loss (ms-swift's loss scale on the rollout's messages). A bare ChatCompletionResponse,
or a rollout without messages, is one turn. Its `rollout_infos` are the trajectory's (`total_reward`: the
--use_gym_env reward). The sampled tokens' log-probabilities follow a turn whose tokens were sampled here
(for --log_rollout_offpolicy_metrics); other tokens have none.

Sampling settings are the run's (--temperature, --top_p, --top_k; --stop_words end a turn as in the turn
loop): a request config that asks for other values, or for more than one choice, stops the run naming them.
Its `max_tokens` caps a turn below --max_completion_length, which bounds every turn (ms-swift's per-request
max_tokens; --completion_length_limit_scope does not apply). Seeds: request i of the k-th sampling call of a
round is seeded from the round's first completion seed, k and i, so that the turns depend on --seed, the round
and the order of the scheduler's calls, not on the micro-batch size (a scheduler's own randomness is its own:
treepo's roll-back draws from Python's `random`, as in ms-swift).

Not here: --parallelism fsdp1 (its processes generate in lockstep, each the same calls, which a scheduler's own
calls cannot promise; refused before launch, train/tasks.py) and a scheduler that rewrites the prompt's
messages or adds messages before its first turn (the prompt's tokens are sampled from as the dataset gives
them; the run stops naming the scheduler).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Callable

import torch

from swiftlite.errors import UserError
from swiftlite.rlhf.plugin_turns import PluginTurns

#: why --parallelism fsdp1 cannot run such a scheduler
OWN_LOCKSTEP = ("overrides run(), whose calls differ from process to process, and --parallelism fsdp1 samples in "
                "lockstep (every process the same calls); use fsdp (FSDP2), a ZeRO stage or ddp")

#: await points the engine gives the scheduler's coroutines to reach their next call before it samples
SETTLE_YIELDS = 16


class PolicyEngine:
    """The `infer_engine` a run()-overriding scheduler calls (module docstring); `_round` is set while a
    round's requests are sampled."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._round: _Round | None = None

    def serve(self, rnd: _Round | None) -> None:
        """The round whose requests `infer_async` queues (None: between rounds)."""
        self._round = rnd

    async def infer_async(self, infer_request: Any, request_config: Any = None, **kwargs: Any) -> Any:
        from swiftlite.msswift_api.protocol import RolloutInferRequest
        if self._round is None:
            raise RuntimeError("the policy is sampled only during a round")
        if isinstance(infer_request, dict):
            infer_request = RolloutInferRequest(**infer_request)
        fut = asyncio.get_running_loop().create_future()
        self._round.ask(infer_request, request_config, fut)
        return await fut

    async def _batch_infer_stream(self, tasks: list, stream: bool = False, use_tqdm: bool = False,
                                  metrics: Any = None) -> list:
        """ms-swift's engine helper that the base async_infer awaits: the tasks at once, results in order."""
        return list(await asyncio.gather(*tasks))


class _Round:
    """The sampling calls of one round on this process: `ask` queues a request, `flush` samples the queue."""

    def __init__(self, gen: Callable[..., list], tok: Any, options: Any, base_seed: int, batch: int, eos_ids: set[int],
                 stop: Callable[[list[int]], int | None]):
        self.gen, self.tok, self.o, self.base, self.batch = gen, tok, options, base_seed, max(1, batch)
        self.eos_ids, self.stop = eos_ids, stop
        self.pending: list[tuple[list[int], int, bool, Any, Any]] = []
        self.calls, self.first = 0, True
        self.logps: dict[tuple[int, ...], list[float]] = {}   # a sampled turn's tokens -> their log-probabilities
        self.device: Any = None

    def ask(self, req: Any, cfg: Any, fut: Any) -> None:
        from swiftlite.data.tokenize import render
        o = self.o
        if cfg is not None:
            asked = {k: getattr(cfg, k, None) for k in ("temperature", "top_p", "top_k")}
            run = {"temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k}
            other = [f"{k} {v} (the run's --{k} {run[k]})" for k, v in asked.items()
                     if v is not None and not math.isclose(float(v), float(run[k]))]
            if getattr(cfg, "n", 1) != 1 or getattr(cfg, "num_beams", 1) != 1:
                other.append("n/num_beams above 1 (one choice per call here)")
            if other:
                raise UserError(f"a scheduler's request asked for {', '.join(other)}: the policy is sampled with the "
                                "run's settings; give them on the command line")
        limit = o.max_completion_length
        if cfg is not None and getattr(cfg, "max_tokens", None):
            limit = min(limit, int(cfg.max_tokens))
        prompt = self.tok(render(self.tok, req.messages, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]
        self.pending.append((prompt, limit, bool(cfg is not None and getattr(cfg, "logprobs", False)), req, fut))

    def flush(self) -> None:
        """Sample every queued request (an empty share when there is none: the call is made on every process)."""
        from swiftlite.msswift_api.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage
        from swiftlite.rlhf.trajectory import ended, turn_seed
        todo, self.pending = self.pending, []
        chunks = [todo[i:i + self.batch] for i in range(0, len(todo), self.batch)]
        prompts = [[q[0] for q in ch] for ch in chunks]
        seeds = [[turn_seed(self.base, 2 + self.calls * 100_003 + c * self.batch + i) for i in range(len(ch))]
                 for c, ch in enumerate(chunks)]
        want = any(q[2] for q in todo)
        n = max((q[1] for q in todo), default=1)
        outs = self.gen(prompts, seeds, n, self.first, **({"logprobs": True} if want else {}))
        self.first, self.calls = False, self.calls + 1
        for ch, (_, _, c_ids, c_mask, *lp) in zip(chunks, outs):
            self.device = c_ids.device
            for j, (_, limit, asks_lp, req, fut) in enumerate(ch):
                k = int(c_mask[j].sum())
                ids, cut = ended(c_ids[j, :min(k, limit)].tolist(), self.eos_ids, self.stop)
                lps = lp[0][j, :len(ids)].tolist() if lp else None
                if lps is not None:
                    self.logps[tuple(ids)] = lps
                if asks_lp and lps is None:
                    raise UserError("a scheduler's request asked for logprobs, which this run's generator does not "
                                    "return")
                logprobs = ({"content": [{"token": self.tok.decode([t]), "logprob": v} for t, v in zip(ids, lps)]}
                            if asks_lp else None)
                choice = ChatCompletionResponseChoice(0, ChatMessage("assistant", self.tok.decode(
                    ids, skip_special_tokens=True)), "length" if cut else "stop", token_ids=ids, logprobs=logprobs)
                fut.set_result(ChatCompletionResponse(model="policy", choices=[choice], id=req.uuid))


class OwnRollout(PluginTurns):
    """A scheduler that overrides `run` behind the turn loop's interface: `sample(...)` gives the round's
    micro-batches as rlhf/multi_turn.rollout does (module docstring)."""
    owns_rollout = True

    def __init__(self, name: str, cls: Any, tokenizer: Any, max_turns: int | None, **kw: Any):
        self.policy = PolicyEngine(tokenizer)
        self._device: Any = None
        self.last_round = False                # --loss_scale last_round: each row trains its last turn
        self.split_refusal: str | None = None  # why this run cannot train several rows per request, if it cannot
        super().__init__(name, cls, tokenizer, max_turns, engine=self.policy, **kw)

    def sample(self, gen: Callable[..., list], options: Any, micro_prompts: list[list[list[int]]],
               micro_seeds: list[list[int]], micro_rows: list[list[dict]], *, eos_ids: set[int], pad_id: int,
               lockstep: bool, any_pending: Callable[[bool], bool], device: Any = None,
               stop: Callable[[list[int]], int | None] | None = None) -> list[dict]:
        """The round's micro-batches (rlhf/trajectory.layout); `stop(ids)`: how many of a turn's tokens its first
        --stop_words word keeps (rlhf/multi_turn.sample_turns builds it)."""
        from swiftlite.rlhf.generate import left_padded
        from swiftlite.rlhf.trajectory import Trajectory, layout
        o = options
        if lockstep:    # refused before launch (train/tasks.py); a direct caller gets the same line
            raise UserError(f"--multi_turn_scheduler {self.name}: {OWN_LOCKSTEP}")
        rows = [row for mb in micro_rows for row in mb]
        base = micro_seeds[0][0] if micro_seeds and micro_seeds[0] else 0
        batch = len(micro_prompts[0]) if micro_prompts else 1
        world, rank = _world()
        if bool(getattr(o, "use_vllm", False)) and getattr(o, "vllm_mode", None) == "server" and world > 1:
            # ms-swift's server mode: the main process gathers every process's requests and the server's
            # scheduler sees them all (a tree merges a group's requests, which processes may share); the others
            # take part in each sampling call with nothing to ask, then get their share of the trajectories
            from swiftlite.distributed import gather_objects
            shares = gather_objects((rows, base, batch), world)
            start = sum(len(r) for r, _, _ in shares[:rank])
            done = None
            if rank == 0:
                done = self._rollout(gen, o, [x for r, _, _ in shares for x in r], shares[0][1], shares[0][2],
                                     eos_ids, any_pending, stop)
            else:
                first = True
                while any_pending(False):
                    gen([], [], 1, first)
                    first = False
            done = gather_objects(done, world)[0][start:start + len(rows)]
        else:
            done = self._rollout(gen, o, rows, base, batch, eos_ids, any_pending, stop)
        device = self._device or device or torch.device("cpu")
        want = bool(getattr(o, "log_rollout_offpolicy_metrics", False))
        reward_of = self.trajectory_reward if self.gym else None
        out, k = [], 0
        for prompts, mb_rows, seeds in zip(micro_prompts, micro_rows, micro_seeds):
            # one row per rollout: a request's rows side by side, `row_of` naming each row's request (its slot)
            mb, ps, slots, info = [], [], [], []
            for j, (p, row, s) in enumerate(zip(prompts, mb_rows, seeds)):
                rid, frags = done[k]
                for ids, loss, logps, infos, msgs in frags:
                    mb.append(Trajectory(p, row, s, ids, loss, logps, done=True, state={"infos": infos},
                                         turns=float(infos.get("num_turns", math.nan))))
                    ps.append(p)
                    slots.append(j)
                    info.append({"request_id": rid, "messages": msgs})
                k += 1
            t = layout(tuple(x.to(device) for x in left_padded(ps, pad_id)), mb, pad_id, want, reward_of)
            if len(slots) != len(prompts):
                t["row_of"] = torch.tensor(slots, dtype=torch.long, device=device)
            t["rows_info"] = info      # the rows' request ids and conversations, for the reward functions
            out.append(t)
        return out

    def _rollout(self, gen: Callable[..., list], o: Any, rows: list[dict], base: int, batch: int, eos_ids: set[int],
                 any_pending: Callable[[bool], bool], stop: Callable[[list[int]], int | None] | None
                 ) -> list[tuple[str, list[tuple]]]:
        """The scheduler's rollout of `rows` (one request each): per row its request's uuid and its rollouts, one
        or more, each (ids, loss mask, log-probabilities, infos, messages)."""
        from swiftlite.msswift_api.protocol import RequestConfig
        from swiftlite.plugin_imports import msswift_aliases
        words = list(o.stop_words or [])
        rnd = _Round(gen, self.tok, o, base, batch, eos_ids, stop or (lambda ids: None))
        # ms-swift's order: a prompt's completions side by side (its trainer's sampler lays a generation batch out
        # group by group, and treepo's async_infer gives a merged group's trajectories to their ids in that order);
        # a process's micro-batches may interleave groups, so the requests go grouped, first seen first
        first: dict[str, int] = {}
        keys = [first.setdefault(json.dumps(row["prompt"], sort_keys=True), len(first)) for row in rows]
        order = sorted(range(len(rows)), key=lambda i: (keys[i], i))
        rows = [rows[i] for i in order]
        reqs = [self._request(row) for row in rows]
        cfg = RequestConfig(max_tokens=o.max_completion_length, temperature=o.temperature, top_p=o.top_p,
                            top_k=o.top_k, stop=words)
        self.policy.serve(rnd)
        try:
            with msswift_aliases():
                outputs = asyncio.run(self._drive(self.sched.async_infer(reqs, cfg), rnd, any_pending))
        finally:
            self.policy.serve(None)
        self._device = rnd.device
        per_request = self._matched(reqs, outputs)
        done: list[Any] = [None] * len(rows)
        for i, row, req, outs in zip(order, rows, reqs, per_request):
            done[i] = (req.uuid, [self._completion(row["prompt"], out, rnd.logps, eos_ids) for out in outs])
        return done

    def _matched(self, reqs: list, outputs: list) -> list[list]:
        """Each request's rollouts: one each, in order (ms-swift's default path zips them), or where the scheduler
        returned another number, those whose response id is the request's uuid (ms-swift's dynamic_num_samples)."""
        if len(outputs) == len(reqs):
            return [[out] for out in outputs]
        what = (f"--multi_turn_scheduler {self.name}: its rollout returned {len(outputs)} rollouts for {len(reqs)} "
                "requests")
        if self.split_refusal:
            raise UserError(f"{what} (several training rows per request, ms-swift's dynamic_num_samples): "
                            f"{self.split_refusal}")
        by_id: dict[str, list] = {q.uuid: [] for q in reqs}
        for out in outputs:
            rid = getattr(getattr(out, "response", out), "id", None)
            if rid not in by_id:
                raise UserError(f"{what}, one with the response id {rid!r}, which is no request's uuid: a scheduler "
                                "that returns several rollouts per request answers each with its request's id")
            by_id[rid].append(out)
        lost = [q.uuid for q in reqs if not by_id[q.uuid]]
        if lost:
            raise UserError(f"{what}, none for request {lost[0]}: each request needs at least one")
        return [by_id[q.uuid] for q in reqs]

    async def _drive(self, coro: Any, rnd: _Round, any_pending: Callable[[bool], bool]) -> list:
        """Run the scheduler's coroutine, sampling whenever every one of its coroutines waits for an answer;
        the loop goes on while any process has requests (each sampling call is made on every process)."""
        task = asyncio.ensure_future(coro)
        while True:
            last, stable = -1, 0
            while stable < SETTLE_YIELDS and not task.done():
                await asyncio.sleep(0)
                stable, last = (stable + 1 if len(rnd.pending) == last else 0), len(rnd.pending)
            if task.done() and task.exception() is not None:
                self._raise(task.exception())
            if not any_pending(bool(rnd.pending) or not task.done()):
                break
            rnd.flush()
        return list(task.result())

    def _raise(self, e: BaseException) -> None:
        if isinstance(e, UserError):
            raise e
        first = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"--multi_turn_scheduler {self.name}: its rollout raised {type(e).__name__}: {first}") from None

    def _completion(self, prompt: list[dict], out: Any, logps: dict, eos_ids: set[int]
                    ) -> tuple[list[int], list[int], list[float], dict, list[dict] | None]:
        """A rollout's completion: tokens, loss mask, sampling log-probabilities (NaN where none), infos, and
        its conversation (None for a bare response)."""
        resp = getattr(out, "response", out)
        choice = resp.choices[0]
        msgs = getattr(out, "messages", None)
        turn_ids = [list(x) for x in _per_turn(getattr(out, "response_token_ids", None))]
        masks = [list(x) for x in _per_turn(getattr(out, "response_loss_mask", None))]
        infos = dict(getattr(out, "rollout_infos", None) or {})
        if msgs is None:      # one turn: ms-swift appends the response to the prompt's conversation
            ids = turn_ids[-1] if turn_ids else list(choice.token_ids or [])
            loss = masks[-1] if masks else [1] * len(ids)
            return ids, self._check(ids, loss), logps.get(tuple(ids), [math.nan] * len(ids)), infos, None
        p = len(prompt)
        if [dict(m) for m in msgs[:p]] != [dict(m) for m in prompt]:
            raise UserError(f"--multi_turn_scheduler {self.name}: a rollout's messages do not begin with its prompt's "
                            "conversation; the prompt is trained as the dataset gives it")
        turns = [i for i in range(p, len(msgs)) if msgs[i]["role"] == "assistant"]
        if not turns or turns[0] != p:
            raise UserError(f"--multi_turn_scheduler {self.name}: a rollout's messages must continue the prompt with "
                            "the assistant's first turn (found "
                            f"{'none' if not turns else msgs[p]['role'] + ' first'})")
        if len(turn_ids) > len(turns):
            raise UserError(f"--multi_turn_scheduler {self.name}: a rollout has {len(turn_ids)} response_token_ids lists "
                            f"for {len(turns)} assistant turns")
        skip = len(turns) - len(turn_ids)
        ids: list[int] = []
        loss: list[int] = []
        lps: list[float] = []
        prev: tuple[list[dict], list[int]] | None = None
        for k, a in enumerate(turns):
            gap = [] if prev is None else self._bridge(prev[0], msgs[:a], prev[1], eos_ids)
            j = k - skip
            tids = turn_ids[j] if j >= 0 else self._encoded(msgs[:a + 1])
            tmask = masks[j] if 0 <= j < len(masks) and masks[j] else [1] * len(tids)
            self._check(tids, tmask)
            if self.last_round and k < len(turns) - 1:    # only the last assistant turn is trained
                tmask = [0] * len(tids)
            ids += gap + tids
            loss += [0] * len(gap) + tmask
            lps += [math.nan] * len(gap) + logps.get(tuple(tids), [math.nan] * len(tids))
            prev = (msgs[:a + 1], tids)
        return ids, loss, lps, infos, [dict(m) for m in msgs]

    def _encoded(self, msgs: list[dict]) -> list[int]:
        """An assistant message given as text: its tokens, and the end-of-turn token where the template ends
        the turn with the tokenizer's EOS (the token the model samples there)."""
        from swiftlite.data.tokenize import render
        content = msgs[-1]["content"]
        ids = self.tok.encode(content, add_special_tokens=False)
        text = render(self.tok, msgs)
        cut = text.rfind(content) + len(content)
        eos = self.tok.eos_token
        if eos and text.startswith(eos, cut) and self.tok.eos_token_id is not None:
            ids.append(self.tok.eos_token_id)
        return ids

    def _check(self, ids: list[int], loss: list[int]) -> list[int]:
        if len(ids) != len(loss):
            raise UserError(f"--multi_turn_scheduler {self.name}: a rollout's response_loss_mask has {len(loss)} values "
                            f"for {len(ids)} response_token_ids (they must align)")
        return loss


def _world() -> tuple[int, int]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _per_turn(x: Any) -> list:
    """ms-swift's per-turn lists; a flat list of ints is one turn."""
    if not x:
        return []
    return [x] if isinstance(x[0], int) else list(x)


__all__ = ["OWN_LOCKSTEP", "OwnRollout", "PolicyEngine"]
