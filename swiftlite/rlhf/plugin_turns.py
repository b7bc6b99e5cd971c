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
    """A plugin scheduler behind the loop's interface: `finished(t, turn)`, `step(t, turn)`."""

    def __init__(self, name: str, cls: Any, tokenizer: Any, max_turns: int | None, columns: bool = True):
        from swiftlite.plugin_imports import msswift_aliases
        self.name, self.tok, self.columns = name, tokenizer, columns
        with msswift_aliases():
            self.sched = cls(infer_engine=None, max_turns=max_turns, tokenizer=tokenizer)

    def _turn(self, t: Any) -> tuple[Any, Any]:
        """(request, choice) of the trajectory's latest turn; the request's conversation holds its text."""
        from swiftlite.msswift_api.protocol import ChatCompletionResponseChoice, ChatMessage, RolloutInferRequest
        ids = t.ids[t.last:]
        text = self.tok.decode(ids, skip_special_tokens=True)
        st = t.state
        if st is None:
            data = copy.deepcopy(t.row["columns"]) if self.columns else {}
            st = t.state = {"request": RolloutInferRequest(copy.deepcopy(t.row["prompt"]), data), "seen": -1}
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
        have = ", ".join(sorted(multi_turns)) or "none"
        raise UserError(f"--multi_turn_scheduler {name}: no scheduler of that name; built in: math_tip_trick; "
                        f"registered by --external_plugins (multi_turns['name'] = Cls): {have}")
    why = unsupported(multi_turns[name])
    if why:
        raise UserError(f"--multi_turn_scheduler {name}: {multi_turns[name].__name__} {why}")


__all__ = ["PluginTurns", "check_scheduler"]
