"""A plugin's multi-turn scheduler (`--external_plugins F --multi_turn_scheduler NAME`, a subclass of ms-swift's
MultiTurnScheduler registered in `multi_turns`) driven by swiftlite's turn loop (rlhf/multi_turn.rollout), the
way ms-swift's MultiTurnScheduler.run drives it (swift/rollout/multi_turn.py):

- after each turn: the turn's text is added to the conversation (appended to the last assistant message
  when the last step left one to continue, else as a new assistant message); the async `on_turn_end` hook
  runs after every turn, the last included (its 'done', when given, decides); else `check_finished(request,
  choice, turn)` (ms-swift's default: finish_reason 'length' or --max_turns). --max_turns ends the
  trajectory whatever they answer; a turn cut at the length limit continues only when the scheduler says
  so (with --completion_length_limit_scope total, only while budget is left).
- otherwise `step(request, choice, turn)` gives the next request, and optionally `response_token_ids` (the
  turn's tokens as the scheduler wants them trained: ms-swift's ToolCallScheduler returns the turn's tokens
  followed by the tool's answer) with `response_loss_mask` (1 trained, 0 not). Without token ids the turn
  stays as sampled, and text the step appended to the assistant message is tokenized and trained on
  (ms-swift then encodes the assistant message, whose content the default loss scale trains).
- the next turn continues the tokens: when the step's last message is the assistant's, the policy continues
  it; when the step appended messages (a tool or user turn), the chat template's text between the
  conversation before and after the step is added out of the loss, with the generation prompt. That text is
  the part of the new rendering past the old one, which must agree up to the assistant's answer (a template
  that rewrites earlier turns, e.g. one that strips their reasoning, cannot be continued token by token:
  the run stops with that reason).

Before the first turn, a scheduler that overrides the async `on_trajectory_start(requests)` (ms-swift's gym
scheduler: each request's environment is reset) gets one request per completion, and the first turn is
sampled from the conversations it leaves there (the chat template's rendering with its generation prompt),
not from the dataset's prompt. The `rollout_infos` that `on_turn_end` and `step` return are merged over the
turns; their `total_reward` is the trajectory's --use_gym_env reward (`trajectory_reward`).

`choice.token_ids` are the turn's sampled tokens (an end-of-turn token included when sampled, as vLLM
returns them); `choice.message.content` their text without special tokens; `finish_reason` 'stop' or
'length'. The request's `messages` are the prompt's conversation, its `data_dict` the row's columns (with
--vllm_mode server only under --vllm_server_pass_dataset true, ms-swift's rule: its server gets them only
then; an empty dict otherwise).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from swiftlite.errors import UserError


class PluginTurns:
    """A plugin scheduler behind the loop's interface: `start(prompts, rows)`, `finished(t, turn)`,
    `step(t, turn)`, and with --use_gym_env `trajectory_reward(t)`."""

    def __init__(self, name: str, cls: Any, tokenizer: Any, max_turns: int | None, columns: bool = True,
                 gym_env: str | None = None, use_gym_env: bool = False, engine: Any = None):
        from swiftlite.msswift_api.rollout import RolloutScheduler
        from swiftlite.plugin_imports import msswift_aliases
        self.name, self.tok, self.columns, self.gym = name, tokenizer, columns, use_gym_env
        kw = {"gym_env": gym_env} if gym_env is not None else {}   # ms-swift passes it only when given
        with msswift_aliases():
            self.sched = cls(infer_engine=engine, max_turns=max_turns, tokenizer=tokenizer, **kw)
        self.rewrites = cls.on_trajectory_start is not RolloutScheduler.on_trajectory_start

    def _request(self, row: dict) -> Any:
        from swiftlite.msswift_api.protocol import RolloutInferRequest
        return RolloutInferRequest(copy.deepcopy(row["prompt"]), copy.deepcopy(row["columns"]) if self.columns else {})

    def start(self, micro_prompts: list[list[list[int]]], micro_rows: list[list[dict]]
              ) -> tuple[list[list[list[int]]], list[list[Any]] | None]:
        """The first turn's prompts and the trajectories' states: as given, unless the scheduler overrides
        `on_trajectory_start` (a gym scheduler: its environment's reset gives the conversation), whose
        conversations are rendered with the chat template and its generation prompt."""
        if not self.rewrites:
            return micro_prompts, None
        from swiftlite.data.tokenize import render
        from swiftlite.plugin_imports import msswift_aliases
        reqs = [[self._request(row) for row in rows] for rows in micro_rows]
        try:
            with msswift_aliases():
                asyncio.run(self.sched.on_trajectory_start([q for mb in reqs for q in mb]))
        except Exception as e:   # a plugin's environment: one line naming it, and why its data may be missing
            hint = ("; its requests' data_dict is empty: in --vllm_mode server the rows' columns reach the scheduler "
                    "only with --vllm_server_pass_dataset true (ms-swift's rule)") if not self.columns else ""
            raise UserError(f"--multi_turn_scheduler {self.name}: on_trajectory_start raised {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}{hint}") from None
        prompts = [[self.tok(render(self.tok, q.messages, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"] for q in mb] for mb in reqs]
        return prompts, [[{"request": q, "seen": -1} for q in mb] for mb in reqs]

    def trajectory_reward(self, t: Any) -> float:
        """--use_gym_env: the trajectory's 'total_reward' (the scheduler's rollout_infos), NaN without one."""
        v = ((t.state or {}).get("infos") or {}).get("total_reward")
        return float("nan") if v is None else float(v)

    def _turn(self, t: Any) -> tuple[Any, Any]:
        """(request, choice) of the trajectory's latest turn; the request's conversation holds its text."""
        from swiftlite.msswift_api.protocol import ChatCompletionResponseChoice, ChatMessage
        ids = t.ids[t.last:]
        text = self.tok.decode(ids, skip_special_tokens=True)
        st = t.state
        if st is None:
            st = t.state = {"request": self._request(t.row), "seen": -1}
        req = st["request"]
        if st["seen"] != t.last:     # this turn's text joins the conversation once
            st["seen"] = t.last
            msgs = req.messages
            if msgs and msgs[-1]["role"] == "assistant" and st.get("continue"):
                msgs[-1]["content"] += text
            else:
                msgs.append({"role": "assistant", "content": text})
        reason = "length" if t.length_cut else "stop"
        return req, ChatCompletionResponseChoice(0, ChatMessage("assistant", text), reason, token_ids=list(ids))

    def finished(self, t: Any, turn: int) -> bool:
        from swiftlite.plugin_imports import msswift_aliases
        req, choice = self._turn(t)
        with msswift_aliases():
            out = asyncio.run(self.sched.on_turn_end(req, choice, turn)) or {}
            if out.get("rollout_infos"):    # merged over the turns, as ms-swift's run() does
                t.state.setdefault("infos", {}).update(out["rollout_infos"])
            if "done" in out:
                return bool(out["done"])
            return bool(self.sched.check_finished(req, choice, turn))

    def step(self, t: Any, turn: int, eos_ids: set[int]) -> tuple[list[int], list[int]]:
        """The completion's tokens and loss mask after the scheduler's step (the turn rewritten as it says,
        then the template's text up to the next turn)."""
        from swiftlite.plugin_imports import msswift_aliases
        req, choice = self._turn(t)
        before = copy.deepcopy(req.messages)
        with msswift_aliases():
            ret = self.sched.step(req, choice, turn)
        if not isinstance(ret, dict) or "infer_request" not in ret:
            raise UserError(f"--multi_turn_scheduler {self.name}: step() returned {type(ret).__name__}, not a dict with "
                            "'infer_request' (ms-swift's MultiTurnScheduler.step contract)")
        new = ret["infer_request"]
        if ret.get("rollout_infos"):
            t.state.setdefault("infos", {}).update(ret["rollout_infos"])
        turn_ids, turn_loss = list(t.ids[t.last:]), list(t.loss[t.last:])
        if "response_token_ids" in ret:
            turn_ids = list(ret["response_token_ids"])
            turn_loss = list(ret.get("response_loss_mask") or [1] * len(turn_ids))
            if len(turn_loss) != len(turn_ids):
                raise UserError(f"--multi_turn_scheduler {self.name}: step() returned {len(turn_loss)} loss-mask values "
                                f"for {len(turn_ids)} response_token_ids (they must align)")
        msgs = new.messages
        cont = bool(msgs) and msgs[-1]["role"] == "assistant"
        bridge: list[int] = []
        if cont and "response_token_ids" not in ret:
            old = before[-1]["content"] if before and before[-1]["role"] == "assistant" else ""
            if not msgs[-1]["content"].startswith(old):
                raise UserError(f"--multi_turn_scheduler {self.name}: step() rewrote the assistant's message instead of "
                                "appending to it; return response_token_ids for the turn as it should be trained")
            added = self.tok.encode(msgs[-1]["content"][len(old):], add_special_tokens=False)
            turn_ids, turn_loss = turn_ids + added, turn_loss + [1] * len(added)
        elif not cont:
            bridge = self._bridge(before, msgs, turn_ids, eos_ids)
        t.state["request"] = new
        t.state["continue"] = cont
        return (t.ids[:t.last] + turn_ids + bridge, t.loss[:t.last] + turn_loss + [0] * len(bridge))

    def _bridge(self, before: list[dict], after: list[dict], turn_ids: list[int], eos_ids: set[int]) -> list[int]:
        """The template's tokens between the assistant's answer (as rendered before the step) and the next
        turn's generation prompt (as rendered after it)."""
        from swiftlite.data.tokenize import render
        old = render(self.tok, before)
        answer = before[-1]["content"]
        cut = old.rfind(answer) + len(answer) if answer else len(render(self.tok, before[:-1], add_generation_prompt=True))
        if turn_ids and turn_ids[-1] in eos_ids:    # the sampled end-of-turn token is already in the completion
            eot = self.tok.decode(turn_ids[-1:])
            if old.startswith(eot, cut):
                cut += len(eot)
        text = render(self.tok, after, add_generation_prompt=True)
        if text[:cut] != old[:cut]:
            raise UserError(f"--multi_turn_scheduler {self.name}: the chat template renders the conversation before the "
                            "step differently once the step's messages are added (it rewrites earlier turns), so the "
                            "next turn cannot continue the sampled tokens")
        return self.tok.encode(text[cut:], add_special_tokens=False)


def check_scheduler(name: str) -> None:
    """A plugin's scheduler name: registered by --external_plugins, and a class that runs here (one line)."""
    from swiftlite.msswift_api.rollout import multi_turns, unsupported
    if name not in multi_turns:
        builtin = ("gym_scheduler", "thinking_tips_scheduler")
        have = ", ".join(sorted(k for k in multi_turns if k not in builtin)) or "none"
        raise UserError(f"--multi_turn_scheduler {name}: no scheduler of that name; built in: math_tip_trick, "
                        "gym_scheduler, thinking_tips_scheduler; "
                        f"registered by --external_plugins (multi_turns['name'] = Cls): {have}")
    why = unsupported(multi_turns[name])
    if why:
        raise UserError(f"--multi_turn_scheduler {name}: {multi_turns[name].__name__} {why}")


def check_gym_env(name: str) -> None:
    """--gym_env: ms-swift's math_env or a name the plugin files registered in envs (one line)."""
    from swiftlite.msswift_api.gym_env import envs
    if name not in envs:
        raise UserError(f"--gym_env {name}: no environment of that name; built in: math_env; registered by "
                        f"--external_plugins (envs['name'] = Cls): {', '.join(sorted(set(envs) - {'math_env'})) or 'none'}")


def gym_reward(completions: list[str], gym_reward: list[float], **kwargs: Any) -> list[float]:
    """--use_gym_env's reward: each trajectory's total environment reward (rlhf/trajectory.layout)."""
    import math
    if any(math.isnan(v) for v in gym_reward):
        raise ValueError("the multi-turn scheduler gave no rollout_infos['total_reward'] (a gym scheduler's)")
    return gym_reward


def gym_rewards(r: Any) -> list:
    """--use_gym_env's reward entry (after the reward functions and models, as ms-swift orders them), or none."""
    from swiftlite.config.multi_turn_options import gym_on
    from swiftlite.plugin import Reward
    return [Reward("gym_reward", gym_reward, "gym_reward", ())] if gym_on(r) else []


__all__ = ["PluginTurns", "check_gym_env", "check_scheduler", "gym_reward", "gym_rewards"]
