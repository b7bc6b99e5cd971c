"""GRPO reward functions: ms-swift's plugin shape and its built-ins (`--reward_funcs`, docs/rlhf.md).

A plugin file passed with `--external_plugins` registers its rewards in `orms` (an `ORM`, an `AsyncORM` whose
`__call__` is a coroutine, or a function), and reward-model plugins in `rm_plugins` (msswift_api/rm_plugin.py),
as an ms-swift plugin does. ms-swift's own plugin files run unedited: while their code runs, `from
swift.rewards import ORM, orms` imports this module (swiftlite.plugin_imports). A plugin written for
swiftlite imports it by name:

    from swiftlite.plugin import ORM, orms

    class ExactMatch(ORM):
        def __call__(self, completions, solution, **kwargs) -> list[float]:
            return [float(c.strip() == s.strip()) for c, s in zip(completions, solution)]

    orms["exact"] = ExactMatch          # --reward_funcs exact
    orms["short"] = lambda completions, **kw: [-len(c) / 100 for c in completions]   # a function works too

Each call gets the completions of the rows this process generated (strings) and, as keyword lists
aligned with them, every column of each completion's dataset row (`solution`, ...; ms-swift's
`messages` is the prompt with the completion as the last assistant turn), plus `prompts` (the prompt
messages), `completion_ids` / `response_token_ids` (token ids) and `trainer_state` (`.global_step`).
A parameter of `__call__` without a default besides `completions` names a column every row must have
(checked before training starts). A reward of None is "not applicable" (nan, left out of the means).

The built-ins follow ms-swift's swift/rewards/orm.py: accuracy (math_verify, an extra install),
format (`<think>...</think><answer>...</answer>`), cosine (length-shaped accuracy), repetition (n-gram
penalty) and soft_overlong (DAPO's length penalty). Classes are built with `args=` the run's
RlhfConfig (the cosine_*, repetition_*, soft_* options), as ms-swift builds them with its arguments.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import re
from typing import Any, Callable

from swiftlite.errors import UserError


class ORM:
    """Base class of an outcome reward: `__call__(completions, **kwargs) -> list[float]`."""

    def __init__(self, args: Any = None, **kwargs: Any):
        self.args = args

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
        raise NotImplementedError


class AsyncORM:
    """Base class of an asynchronous outcome reward (ms-swift's): `async def __call__(completions, **kwargs)`,
    for rewards that wait on I/O (an API judge). swiftlite awaits each call where it calls a reward
    (ms-swift gathers several async rewards concurrently; the scores are the same)."""

    def __init__(self, args: Any = None, **kwargs: Any):
        self.args = args

    async def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
        raise NotImplementedError


class MathAccuracy(ORM):
    """1.0 when the answer (inside <answer>...</answer> if tagged) verifies against `solution` with
    math_verify, else 0.0 (ms-swift's `accuracy`)."""

    #: the package it needs and the refusal without it (check_reward_funcs, before launch)
    requires = ("math_verify", "--reward_funcs accuracy needs the math_verify package (pip install math-verify, or "
                "swiftlite's grpo extra), as in ms-swift")

    def __init__(self, args: Any = None, **kwargs: Any):
        super().__init__(args, **kwargs)
        if importlib.util.find_spec(self.requires[0]) is None:
            raise UserError(self.requires[1])

    def __call__(self, completions: list[str], solution: list[str], **kwargs: Any) -> list[float]:
        from swiftlite.math_answers import accuracy
        return [accuracy(content, sol) for content, sol in zip(completions, solution)]


class Format(ORM):
    """1.0 for `<think>...</think> <answer>...</answer>` and nothing after, else 0.0."""

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
        pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>(?![\s\S])"
        return [1.0 if re.match(pattern, c, re.DOTALL | re.MULTILINE) else 0.0 for c in completions]


class CosineReward(ORM):
    """Accuracy shaped by length (arXiv 2502.03373): a cosine from the length-0 value to the
    --cosine-max-len value, correct and wrong answers on their own curves."""

    def __init__(self, args: Any = None, accuracy_orm: Any = None, **kwargs: Any):
        super().__init__(args)
        self.min_len_value_wrong = args.cosine_min_len_value_wrong
        self.max_len_value_wrong = args.cosine_max_len_value_wrong
        self.min_len_value_correct = args.cosine_min_len_value_correct
        self.max_len_value_correct = args.cosine_max_len_value_correct
        self.max_len = args.cosine_max_len or args.max_completion_length
        self.accuracy_orm = accuracy_orm or MathAccuracy()

    @staticmethod
    def cosfn(t: float, T: float, min_value: float, max_value: float) -> float:
        return max_value - (max_value - min_value) * (1 - math.cos(t * math.pi / T)) / 2

    def __call__(self, completions: list[str], solution: list[str], **kwargs: Any) -> list[float]:
        acc = self.accuracy_orm(completions, solution, **kwargs)
        out = []
        for ids, a in zip(kwargs["response_token_ids"], acc):
            if a >= 1.0:
                lo, hi = self.max_len_value_correct, self.min_len_value_correct
            else:
                lo, hi = self.max_len_value_wrong, self.min_len_value_wrong
            out.append(self.cosfn(len(ids), self.max_len, lo, hi))
        return out


class RepetitionPenalty(ORM):
    """(1 - distinct word n-grams / n-grams) x --repetition-max-penalty; 0 for completions shorter
    than one n-gram."""

    def __init__(self, args: Any = None, **kwargs: Any):
        super().__init__(args)
        self.ngram_size = args.repetition_n_grams
        self.max_penalty = args.repetition_max_penalty

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
        out = []
        for c in completions:
            words = c.lower().split()
            if not c or len(words) < self.ngram_size:
                out.append(0.0)
                continue
            grams = list(zip(*[words[i:] for i in range(self.ngram_size)]))
            out.append((1 - len(set(grams)) / len(grams)) * self.max_penalty)
        return out


class SoftOverlong(ORM):
    """DAPO's soft overlong penalty: min(-(length - (L_max - L_cache)) / L_cache, 0)."""

    def __init__(self, args: Any = None, **kwargs: Any):
        super().__init__(args)
        self.soft_max_length = args.soft_max_length or args.max_completion_length
        self.soft_cache_length = args.soft_cache_length

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
        expected = self.soft_max_length - self.soft_cache_length
        return [min(-(len(ids) - expected) / self.soft_cache_length, 0) for ids in kwargs["response_token_ids"]]


class ReActFormat(ORM):
    """1.0 for `<think>...</think>` then `Action: ... Action Input: ...`, else 0.0 (ms-swift's `react_format`,
    the answer form --agent_template react_grpo asks for)."""

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
        pattern = r"^<think>.*?</think>\s*Action:.*?Action Input:.*?$"
        return [1.0 if re.match(pattern, c, re.DOTALL | re.MULTILINE) else 0.0 for c in completions]


class ReactORM(ORM):
    """ms-swift's `toolbench` reward (swift/rewards/orm.py ReactORM): 1.0 when the completion's last `Action:`
    names the `solution`'s and its last `Action Input:` matches the solution's, else 0.0. A trailing
    `Observation:` and the end tokens are dropped first. Inputs that are both JSON objects match when their
    keys' F1 (a key with an equal value counts 1, with another value 0.5) is 1, i.e. they are equal; two empty
    objects match. Inputs that are not both JSON never match: ms-swift compares their ROUGE-L F (0 to 1)
    with 10 and 20, which it never reaches, so no ROUGE is computed here."""

    @staticmethod
    def parse(text: str) -> tuple[str, str]:
        """(action, action input) as ms-swift's parse_action reads them: after the last markers."""
        action_input = text[text.rindex("Action Input:") + len("Action Input:"):].strip() \
            if "Action Input:" in text else "{}"
        if "Action:" not in text:
            return "none", action_input
        action = text[text.rindex("Action:") + len("Action:"):].strip()
        if "Action Input:" in action:
            action = action[:action.index("Action Input:")].strip()
        return action, action_input

    @staticmethod
    def _json(text: str) -> tuple[bool, Any]:
        try:
            return True, json.loads(text)
        except Exception:
            return False, text

    @classmethod
    def match(cls, prediction: str, reference: str) -> bool:
        if prediction.endswith("Observation:"):   # ms-swift cuts at the first one
            prediction = prediction[:prediction.index("Observation:")].strip()
        prediction = prediction.replace("<|endoftext|>", "").replace("<|im_end|>", "").strip()
        (ref_action, ref_input), (action, given) = cls.parse(reference), cls.parse(prediction)
        (ref_is_json, ref), (is_json, cand) = cls._json(ref_input), cls._json(given)
        if ref_action != action or ref_is_json != is_json or not ref_is_json:
            return False
        if not isinstance(ref, dict) or not isinstance(cand, dict):
            return False
        if ref == {}:
            return cand == {}
        full = sum(1 for k, v in ref.items() if k in cand and cand[k] == v)
        half = sum(1 for k, v in ref.items() if k in cand and cand[k] != v)
        recall = (0.5 * half + full) / (len(ref) + 1e-30)
        precision = (0.5 * half + full) / (len(cand) + 1e-30)
        return recall + precision > 0 and (2 * recall * precision) / (recall + precision) == 1.0

    def __call__(self, completions: list[str], solution: list[str], **kwargs: Any) -> list[float]:
        return [float(self.match(c, s)) for c, s in zip(completions, solution)]


#: name -> reward class or function. Plugin files add theirs (`orms["name"] = Class`).
orms: dict[str, Any] = {
    "accuracy": MathAccuracy,
    "format": Format,
    "react_format": ReActFormat,
    "toolbench": ReactORM,
    "cosine": CosineReward,
    "repetition": RepetitionPenalty,
    "soft_overlong": SoftOverlong,
}

from swiftlite.msswift_api.rm_plugin import rm_plugins  # noqa: E402  (ms-swift's swift.rewards has it: plugins register theirs)


def __getattr__(name: str) -> Any:
    """`from swift.rewards import MultiTurnScheduler, multi_turns`: the scheduler registry under the name it had
    before ms-swift moved it to swift.rollout (its v4 reorganisation, c4538f7); ms-swift's own
    examples/train/grpo/plugin/treepo plugin still imports it from here, which ms-swift itself no longer serves."""
    if name in ("MultiTurnScheduler", "multi_turns"):
        from swiftlite.msswift_api import rollout
        return getattr(rollout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: Keyword arguments every call gets besides the dataset's columns (never "missing" from a row).
PASSED = frozenset({"completions", "prompts", "messages", "completion_ids", "response_token_ids", "request_id",
                    "trajectory_inputs", "trainer_state"})


class Reward:
    """One --reward_funcs entry, built: its name for messages and metrics, the callable, and the
    dataset columns it requires."""

    def __init__(self, key: str, fn: Callable, name: str, needs: tuple[str, ...]):
        self.key, self.fn, self.name, self.needs = key, fn, name, needs

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
        from swiftlite.plugin_imports import msswift_aliases
        with msswift_aliases():   # a plugin's function-level `from swift... import` resolves as at its top
            out = self.fn(completions, **kwargs)
            if inspect.isawaitable(out):   # an AsyncORM
                import asyncio
                out = asyncio.run(out)
        return out


def call_reward(r: Any, completions: list[str], kwargs: dict, wheres: list[str]) -> list[float]:
    """One reward function on this rank's completions; an exception or a wrong answer becomes a
    UserError naming the function and the first row it fails on."""
    def one(i: int) -> Any:
        return r(completions[i:i + 1], **{k: v[i:i + 1] if isinstance(v, list) else v for k, v in kwargs.items()})
    try:
        out = r(completions, **kwargs)
    except Exception as e:
        for i in range(len(completions)):
            try:
                one(i)
            except Exception as e1:
                raise UserError(f"reward function {r.key} ({r.name}) raised {type(e1).__name__}: "
                                f"{str(e1).splitlines()[0] if str(e1) else ''} on {wheres[i]}") from None
        first = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"reward function {r.key} ({r.name}) raised {type(e).__name__}: {first} on a batch of "
                        f"{len(completions)} completions (rows {wheres[0]} ...)") from None
    out = list(out) if out is not None else []
    if len(out) != len(completions):
        raise UserError(f"reward function {r.key} ({r.name}) returned {len(out)} values for {len(completions)} "
                        f"completions (rows {wheres[0]} ...)")
    try:
        return [float("nan") if v is None else float(v) for v in out]
    except (TypeError, ValueError):
        bad = next(i for i, v in enumerate(out) if v is not None and not isinstance(v, (int, float)))
        raise UserError(f"reward function {r.key} ({r.name}) returned {out[bad]!r}, not a number, on {wheres[bad]}") \
            from None


def _required(fn: Callable) -> tuple[str, ...]:
    """The parameters of `fn` (its `__call__` for an object) without a default, other than what every
    call passes: the dataset columns it needs."""
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
                 and p.name not in PASSED and p.name != "self")


def check_reward_funcs(names: list[str]) -> None:
    """What `build_rewards` would refuse, without building anything (preflight and --dry-run, after
    --external_plugins registered theirs): an unknown name, or a built-in whose package is missing."""
    for key in names:
        if key not in orms:
            raise UserError(_unknown(key))
        missing = getattr(orms[key], "requires", None)
        if missing and importlib.util.find_spec(missing[0]) is None:
            raise UserError(missing[1])


def _unknown(key: str) -> str:
    return (f"--reward_funcs {key}: unknown reward function (registered: {', '.join(sorted(orms))}; "
            "add your own with --external_plugins FILE, which sets orms['name'])")


def build_rewards(names: list[str], args: Any) -> list[Reward]:
    """--reward_funcs -> built rewards (classes instantiated with `args=` the RlhfConfig). An unknown
    name is a UserError listing what is registered (built-ins and --external_plugins)."""
    out = []
    for key in names:
        if key not in orms:
            raise UserError(_unknown(key))
        obj = orms[key]
        if inspect.isclass(obj):
            from swiftlite.plugin_imports import msswift_aliases
            with msswift_aliases():
                fn = obj(args=args)
            name = obj.__name__
        elif callable(obj):
            fn, name = obj, getattr(obj, "__name__", key)
            if name == "<lambda>":
                name = key
        else:
            raise UserError(f"--reward_funcs {key}: orms['{key}'] is neither a class nor a function")
        out.append(Reward(key, fn, name, _required(fn)))
    return out


__all__ = ["AsyncORM", "CosineReward", "Format", "MathAccuracy", "ORM", "PASSED", "ReActFormat", "ReactORM", "RepetitionPenalty",
           "Reward", "SoftOverlong",
           "build_rewards", "call_reward", "check_reward_funcs", "orms", "rm_plugins"]
