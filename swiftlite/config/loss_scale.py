"""--loss_scale: which tokens of a chat row are targets, with ms-swift's names.

ms-swift (swift/loss_scale/) names a loss scale as `[strategy][+name...]`:

- the strategy: `default` (every assistant turn), `last_round` (the assistant turns after the last user
  or tool turn) or `all` (every token, prompts and template text too);
- then named rules applied inside the assistant turns. The binary ones are here, with ms-swift's own
  patterns (swift/loss_scale/config/*.json): `ignore_empty_think` takes an empty thinking block at the
  start of an answer out of the loss (so that training on answers without thinking does not teach the
  model to skip it), `ignore_think_prefix` the opening `<think>` tag alone.

A binary loss scale is a choice of labels, nothing more: the loss stays the mean cross-entropy over the
targets, as ms-swift computes it for a binary scale (its `is_binary` scales become labels). The weighted
scales (ms-swift's agent ones: hermes, react, qwen, agentflan, alpha_umi, weight 2 on tool calls) need a
per-token weight in every loss path and are refused with the reason (config/rules.py).

`spans` turns the assistant turns' character ranges in the rendered conversation (data/tokenize.py)
into the ranges whose tokens are targets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STRATEGIES = ("default", "last_round", "all")
#: ms-swift's binary rules: regexes matched at the start of an assistant turn's text, whose match is
#: not a target (swift/loss_scale/config/ignore_empty_think.json and ignore_think_prefix.json).
RULES: dict[str, tuple[str, ...]] = {
    "ignore_empty_think": (
        r"^<think>\s*</think>\s*",
        r"^<seed:think><seed:cot_budget_reflect>The current thinking budget is 0, so I will directly start "
        r"answering the question.</seed:cot_budget_reflect>\n</seed:think>\s*",
        r"^</think>\s*",
        r"^<\|channel>thought\n<channel\|>",
        r"^</mm:think>\s*",
    ),
    "ignore_think_prefix": (r"^<think>\n?",),
}
#: ms-swift's weighted scales (weights other than 0 and 1): not available here.
WEIGHTED = ("hermes", "react", "qwen", "agentflan", "alpha_umi")


@dataclass(frozen=True)
class LossScale:
    strategy: str = "default"
    rules: tuple[str, ...] = ()

    @property
    def patterns(self) -> list[re.Pattern]:
        return [re.compile(p, re.DOTALL) for r in self.rules for p in RULES[r]]

    def spans(self, messages: list[dict], turns: list[tuple[int, int]], full: str) -> list[tuple[int, int]]:
        """The target ranges of `full` (the rendered conversation) given `turns`, the character range
        of each assistant message in order."""
        roles = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.strategy == "last_round":
            last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), default=-1)
            turns = [t for i, t in zip(roles, turns) if i > last_user]
        cuts = []   # the ranges a rule takes out of an assistant turn
        pats = self.patterns
        for a, b in turns:
            text = full[a:b]   # a slice, not match(full, a): `^` anchors at the turn's start only so
            for p in pats:
                m = p.match(text)
                if m and m.end():
                    cuts.append((a, a + m.end()))
                    break
        kept = [(0, len(full))] if self.strategy == "all" else list(turns)
        return _subtract(kept, cuts)


def _subtract(spans: list[tuple[int, int]], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in spans:
        pieces = [(a, b)]
        for c, d in cuts:
            pieces = [q for x, y in pieces for q in ((x, min(y, c)), (max(x, d), y)) if q[1] > q[0]]
        out += pieces
    return sorted(out)


def parse(value: str | None, default: str = "default") -> LossScale:
    """ms-swift's spelling -> a LossScale; raises ValueError with the reason for a name it cannot be."""
    parts = (value or default).split("+")
    strategy = parts.pop(0) if parts[0] in STRATEGIES else "default"
    unknown = [p for p in parts if p not in RULES]
    if unknown:
        p = unknown[0]
        if p in WEIGHTED:
            raise ValueError(f"'{p}' is one of ms-swift's weighted agent loss scales (weights other than 0 and 1 "
                             "on tool calls); swiftlite's loss is the mean cross-entropy over the target tokens, "
                             f"so only the binary ones are available: {', '.join(names())}")
        raise ValueError(f"unknown loss scale '{p}': choose from {', '.join(names())}, joined with + "
                         "(e.g. last_round+ignore_empty_think)")
    return LossScale(strategy, tuple(dict.fromkeys(parts)))


def names() -> list[str]:
    return [*STRATEGIES, *RULES]
