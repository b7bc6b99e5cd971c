"""--loss_scale: which tokens of a chat row are targets, and with what weight, with ms-swift's names.

ms-swift (swift/loss_scale/) names a loss scale as `[strategy][+name...]`:

- the strategy: `default` (every assistant turn), `last_round` (the assistant turns after the last user
  or tool turn) or `all` (every token, prompts and template text too);
- then named rules applied inside the assistant turns, in order:
  * binary ones, with ms-swift's own patterns (swift/loss_scale/config/*.json): `ignore_empty_think`
    takes an empty thinking block at the start of an answer out of the loss (so that training on
    answers without thinking does not teach the model to skip it), `ignore_think_prefix` the opening
    `<think>` tag alone. A binary scale is a choice of labels, nothing more.
  * weighted ones, ms-swift's agent scales (`hermes`, `react`, `qwen`, `agentflan`, `alpha_umi`): the
    answer's text is split at the scale's markers and each part weighted (`hermes`: 2 on each
    `<tool_call>...</tool_call>`; `react`: 2 on `Action:` and what follows it, 0 on what follows
    `Observation:`...). The weights are ms-swift's (its config JSON files, copied below as data).

The loss is ms-swift's: sum over target tokens of weight x cross-entropy, divided by the number of
target tokens (a weight-0 token is no target, as in ms-swift, where its label becomes -100), so a
binary scale gives the mean cross-entropy over the targets.

Where a weight applies. ms-swift tokenizes each weighted piece of an answer on its own; swiftlite
tokenizes the whole rendered conversation once (data/tokenize.py), and a token takes the weight of the
piece its first character lies in. The scale splits the message's own text (its `content`, found in
the rendered turn); the rest of the turn (the end-of-turn token, a template's prefix) has weight 1, as
ms-swift's separate suffix context has. agentflan's query rule (the whole answer weighted 3 when the
user turn before it holds one of its phrases) reads the turn just before the answer.

`spans` turns the assistant turns' character ranges in the rendered conversation (data/tokenize.py)
into the ranges whose tokens are targets; `weighted_spans` into (start, end, weight) pieces.
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
#: ms-swift's weighted scales (swift/loss_scale/config/<name>.json, its values): marker -> weights. Two
#: weights: the marker's own text, then the text up to the next marker (the markers matched literally);
#: one weight: the text the marker (a regular expression) matches. agentflan's "query" part: the whole
#: answer takes that weight when the turn before it contains the phrase.
WEIGHTED: dict[str, dict[str, tuple[float, ...]]] = {
    "hermes": {"<tool_call>.+?</tool_call>": (2.0,)},
    "react": {"Action:": (2.0, 2.0), "Action Input:": (2.0, 2.0), "Thought:": (1.0, 1.0),
              "Final Answer:": (1.0, 1.0), "Observation:": (2.0, 0.0)},
    "qwen": {"\u273fFUNCTION\u273f:": (2.0, 2.0), "\u273fARGS\u273f:": (2.0, 2.0), "\u273fRETURN\u273f:": (1.0, 1.0),
             "\u273fRESULT\u273f:": (2.0, 0.0)},
    "agentflan": {"Name:": (1.0, 3.0), "Action:": (1.0, 3.0), "ACTION:": (1.0, 3.0), "Tool:": (1.0, 3.0),
                  "Command": (1.0, 3.0), "Arguments:": (1.0, 3.0), "action input": (1.0, 3.0),
                  "ACTION_INPUT:": (1.0, 3.0), "Action Input:": (1.0, 3.0), "Thought:": (1.0, 1.0),
                  "Final Answer:": (1.0, 1.0), "Observation:": (2.0, 0.0)},
    "alpha_umi": {"Action:": (2.0, 2.0), "Action Input:": (2.0, 2.0), "Thought:": (1.0, 1.0),
                  "Final Answer:": (1.0, 1.0), "Observation:": (2.0, 0.0), "Next:": (2.0, 2.0)},
}
#: agentflan's query phrases (ms-swift: the first one found in the query decides the answer's weight).
AGENTFLAN_QUERY: dict[str, float] = {
    "What is the tool you want to use": 3.0, "What are the required parameter names": 3.0,
    "What is the value of": 3.0, "What are the required parameter names for this tool": 3.0,
}


@dataclass(frozen=True)
class LossScale:
    strategy: str = "default"
    rules: tuple[str, ...] = ()
    #: --is_binary_loss_scale: None = binary unless a weighted rule is named (ms-swift's rule); false keeps
    #: the weights of a row's messages (their own "loss_scale") with any scale; true keeps labels only
    binary: bool | None = None

    @property
    def patterns(self) -> list[re.Pattern]:
        return [re.compile(p, re.DOTALL) for r in self.rules if r in RULES for p in RULES[r]]

    @property
    def weighted(self) -> tuple[str, ...]:
        """The weighted rules, in the order given (ms-swift applies them one after the other)."""
        return tuple(r for r in self.rules if r in WEIGHTED)

    @property
    def is_binary(self) -> bool:
        """The weights become labels only (weight > 0: a target) and do not travel with the rows."""
        return self.binary if self.binary is not None else not self.weighted

    def splits(self, messages: list[dict]) -> bool:
        """Whether a row's targets need `weighted_spans`: a weighted rule, a message's own "loss_scale", or
        weights kept (--is_binary_loss_scale false)."""
        return bool(self.weighted) or not self.is_binary or any(m.get("loss_scale") is not None for m in messages)

    def _turns(self, messages: list[dict], turns: list[tuple[int, int]]) -> list[tuple[int, tuple[int, int]]]:
        """(message index, character range) of the assistant turns that are trained: a message's own
        "loss" (true/false) first, then the strategy (last_round: after the last user or tool turn); a
        message whose own "loss_scale" is 0 is not (ms-swift's data fields, docs/usage.md "Data")."""
        roles = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), default=-1)
        out = []
        for i, t in zip(roles, turns):
            loss, own = messages[i].get("loss"), messages[i].get("loss_scale")
            trained = (self.strategy != "last_round" or i > last_user) if loss is None else bool(loss)
            if trained and (own is None or own > 0):
                out.append((i, t))
        return out

    def spans(self, messages: list[dict], turns: list[tuple[int, int]], full: str) -> list[tuple[int, int]]:
        """The target ranges of `full` (the rendered conversation) given `turns`, the character range
        of each assistant message in order."""
        pairs = self._turns(messages, turns)
        cuts = []   # the ranges a rule takes out of an assistant turn
        pats = self.patterns
        for i, (a, b) in pairs:
            if messages[i].get("loss_scale") is not None:   # a message's own weight: no rule applies (ms-swift)
                continue
            text = full[a:b]   # a slice, not match(full, a): `^` anchors at the turn's start only so
            for p in pats:
                m = p.match(text)
                if m and m.end():
                    cuts.append((a, a + m.end()))
                    break
        if self.strategy == "all":   # every token but the answers whose own fields say no
            trained = {t for _, t in pairs}
            kept = _subtract([(0, len(full))], [t for t in turns if t not in trained])
        else:
            kept = [t for _, t in pairs]
        return _subtract(kept, cuts)

    def weighted_spans(self, messages: list[dict], turns: list[tuple[int, int]], full: str
                       ) -> list[tuple[int, int, float]]:
        """The target ranges of `full` with their weights: `spans`' ranges, each trained answer's text
        split by the weighted rules (module docstring) or weighted by its message's own "loss_scale",
        pieces of weight 0 left out. Sorted, not overlapping."""
        targets = self.spans(messages, turns, full)
        if not self.splits(messages):
            return [(a, b, 1.0) for a, b in targets]
        pairs = self._turns(messages, turns)
        pieces: list[tuple[int, int, float]] = []
        for i, (a, b) in pairs:
            content = messages[i].get("content")
            pos = full.find(content, a, b) if isinstance(content, str) and content else -1
            if pos < 0:   # the template changed the text: the whole turn is split
                pos, content = a, full[a:b]
            own = messages[i].get("loss_scale")
            if own is not None:
                parts = [(pos, pos + len(content), float(own))]
            else:
                query = messages[i - 1].get("content") if i else None
                parts = [(pos, pos + len(content), 1.0)]
                for name in self.weighted:
                    parts = [q for x, y, w in parts for q in _split(name, full[x:y], x, w,
                                                                     query if isinstance(query, str) else "")]
            pieces += [(a, pos, 1.0), *parts, (pos + len(content), b, 1.0)]
        # targets outside the trained answers (the prompts under `all`) have weight 1
        out = [(x, y, 1.0) for x, y in _subtract(targets, [t for _, t in pairs])]
        for x, y, w in pieces:
            if w <= 0:
                continue
            for c, d in targets:   # the binary rules' cuts and the strategy stay as they are
                lo, hi = max(x, c), min(y, d)
                if hi > lo:
                    out.append((lo, hi, w))
        return sorted(out)


def _split(name: str, text: str, base: int, weight: float, query: str) -> list[tuple[int, int, float]]:
    """`text` (at `base` in the conversation, of weight `weight`) cut into ms-swift's weighted pieces by
    the scale `name` (swift/loss_scale/utils.calculate_loss_scale and template/utils.split_str_parts_by):
    (start, end, weight x the piece's weight)."""
    if not text:
        return []
    if name == "agentflan":
        for phrase, w in AGENTFLAN_QUERY.items():
            if phrase in query:
                return [(base, base + len(text), weight * w)]
    table = WEIGHTED[name]
    literal = [k for k, v in table.items() if len(v) == 2]
    keys = literal or [k for k, v in table.items() if len(v) == 1]
    pats = [re.escape(k) for k in keys] if literal else keys
    combined = re.compile("|".join(f"({p})" for p in pats), re.DOTALL)
    out: list[tuple[int, int, float]] = []
    at = 0
    follow = 1.0   # the weight of the text up to the next marker (before the first one: 1)
    for m in combined.finditer(text):
        if not m.group(0):
            continue
        out.append((at, m.start(), follow))
        key = next(k for k, p in zip(keys, pats) if re.match(p, m.group(0), re.DOTALL))
        w = table[key]
        out.append((m.start(), m.end(), w[0]))
        follow = w[1] if literal else 1.0
        at = m.end()
    out.append((at, len(text), follow))
    return [(base + x, base + y, weight * w) for x, y, w in out if y > x]


def _subtract(spans: list[tuple[int, int]], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in spans:
        pieces = [(a, b)]
        for c, d in cuts:
            pieces = [q for x, y in pieces for q in ((x, min(y, c)), (max(x, d), y)) if q[1] > q[0]]
        out += pieces
    return sorted(out)


def parse(value: str | None, default: str = "default", binary: bool | None = None) -> LossScale:
    """ms-swift's spelling -> a LossScale (`binary`: --is_binary_loss_scale); raises ValueError with the
    reason for a name it cannot be."""
    parts = (value or default).split("+")
    strategy = parts.pop(0) if parts[0] in STRATEGIES else "default"
    unknown = [p for p in parts if p not in RULES and p not in WEIGHTED]
    if unknown:
        raise ValueError(f"unknown loss scale '{unknown[0]}': choose from {', '.join(names())}, joined with + "
                         "(e.g. last_round+ignore_empty_think, hermes)")
    scale = LossScale(strategy, tuple(dict.fromkeys(parts)), binary)
    if strategy == "all" and scale.weighted:
        raise ValueError(f"'{scale.weighted[0]}' weights parts of the answers, and `all` trains every token: "
                         "ms-swift then splits every template piece (system, user turns) by the scale's markers "
                         "too, which swiftlite does not reproduce; use default or last_round with it")
    return scale


def names() -> list[str]:
    return [*STRATEGIES, *RULES, *WEIGHTED]
