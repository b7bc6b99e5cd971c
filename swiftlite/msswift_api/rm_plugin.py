"""ms-swift's reward-model plugins (swift/rewards/rm_plugin.py): `--reward_model M --reward_model_plugin P`
builds `P(model=the loaded M, template=M's Template)` and calls it with the round's completions as rows
(`inputs`: each a dict with the conversation, prompt then completion, under `messages`, and the dataset
row's columns), which returns one score per row (rlhf/reward_model.py calls it).

- `default`: M is a sequence classifier with one output; the score is its first logit on the
  conversation rendered with M's template.
- `genrm`: M is a causal LM asked as a judge. Each conversation becomes one user message ("User: ...",
  "Assistant: ...", a line each, empty turns left out) under ms-swift's system prompt, M answers
  (TransformersEngine, the request's defaults: the model's generation_config, up to its max length),
  and the score is the number after "Reward:" in the answer (a value in [0, 1]), 0.0 when there is none.
- A plugin file registers its own class: `rm_plugins["name"] = Cls` (ms-swift's shape: `__init__(model,
  template)`, `__call__(inputs, **kwargs)`).
"""

from __future__ import annotations

import re
import textwrap
from copy import deepcopy
from typing import Any

from swiftlite.msswift_api.engine import RequestConfig, TransformersEngine
from swiftlite.msswift_api.utils import get_logger, to_device

logger = get_logger()


class DefaultRMPlugin:
    """A one-output classifier's first logit on each conversation."""

    def __init__(self, model: Any, template: Any):
        self.model = model
        self.template = template

    def __call__(self, inputs: list[dict], **kwargs: Any) -> Any:
        import torch
        encoded = [self.template.encode(deepcopy(row)) for row in inputs]
        batch = to_device(self.template.data_collator(encoded), self.model.device)
        with torch.inference_mode():
            return self.model(**batch).logits[:, 0]


#: ms-swift's genrm system prompt, word for word (the judge is asked in its words)
GENRM_SYSTEM = textwrap.dedent("""
    Based on the dialogue history, analyze in detail whether the model's response is accurate, complete, and relevant.
    Assign a reward score between 0 and 1, where 0 indicates completely incorrect and 1 indicates fully correct.
    Before finishing your response, please assign a reward using the following format:

    Reward: {reward}

    For example:
    Reward: 0.85
""")

#: how a role is written in the judge's query (others: capitalized)
ROLE_NAMES = {"user": "User", "assistant": "Assistant", "system": "System"}


class GenRMPlugin(DefaultRMPlugin):
    """A generative judge: asks M to rate each conversation and reads "Reward: x" from its answer."""

    def __init__(self, model: Any, template: Any):
        super().__init__(model, template)
        self.engine = TransformersEngine(self.model, template=self.template, max_batch_size=0)
        self.request_config = RequestConfig()
        self.system = GENRM_SYSTEM

    def __call__(self, inputs: list[dict], **kwargs: Any) -> Any:
        import torch
        answers = self.engine.infer(self.prepare_rm_inputs(inputs), self.request_config, use_tqdm=False)
        return torch.tensor(self.compute_rewards(answers), dtype=torch.float32)

    def prepare_rm_inputs(self, inputs: list[dict]) -> list[dict]:
        out = []
        for row in inputs:
            req = deepcopy(row)
            req["messages"] = [{"role": "system", "content": self.system},
                               {"role": "user", "content": self.messages_to_query(row["messages"])}]
            out.append(req)
        return out

    @staticmethod
    def messages_to_query(messages: list[dict]) -> str:
        """One line per turn with content: "User: ...", "Assistant: ..." (ms-swift's query)."""
        lines = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TypeError(f"message {i} is a {type(m).__name__}, not a dict")
            if not m.get("content"):
                continue
            role = m.get("role") or ""
            lines.append(f"{ROLE_NAMES.get(role.lower(), role.capitalize())}: {m['content']}")
        return "\n".join(lines)

    @staticmethod
    def extract_reward(model_output: str) -> float | None:
        """The first "Reward: x" with x in [0, 1] written as ms-swift reads it (a 0 or 1, then decimals), or None
        (compute_rewards scores that 0)."""
        m = re.search(r"Reward:\s*([0-1](?:\.\d+)?)", model_output)
        return float(m.group(1)) if m else None

    def compute_rewards(self, results: list[Any]) -> list[float]:
        """Each request's mean over its answers' rewards; 0.0 when none has one."""
        out, none = [], 0
        for res in results:
            got = [r for r in (self.extract_reward(c.message.content) for c in res.choices) if r is not None]
            out.append(sum(got) / len(got) if got else 0.0)
            none += not got
        if none:   # once per call, not per answer (ms-swift warns per answer)
            logger.warning("%d of %d judge answers have no 'Reward: x' and score 0", none, len(results))
        return out


#: name -> reward-model plugin class; plugin files add theirs
rm_plugins: dict[str, Any] = {"default": DefaultRMPlugin, "genrm": GenRMPlugin}

__all__ = ["DefaultRMPlugin", "GENRM_SYSTEM", "GenRMPlugin", "rm_plugins"]
