"""Whether a completion's math answer verifies against a solution (math_verify), as ms-swift's `accuracy`
reward does: what --reward_funcs accuracy (plugin.MathAccuracy) and ms-swift's gym environment `math_env`
(msswift_api/gym_env.py) score. Kept apart from plugin.py, which imports ms-swift's API, so that the API's
environments can score without importing it back."""

from __future__ import annotations

import importlib.util
import re

from swiftlite.errors import UserError

PACKAGE = "math_verify"


def check_installed(what: str) -> None:
    """One line naming `what` needs math_verify, before any answer is scored."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise UserError(f"{what} needs the math_verify package (pip install math-verify, or swiftlite's grpo extra), "
                        "as in ms-swift")


def accuracy(content: str, sol: str) -> float:
    """1.0 when the answer (inside <answer>...</answer> if tagged) verifies against `sol`, else 0.0."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify
    m = re.search(r"<answer>(.*?)</answer>", content, re.DOTALL)
    to_parse = m.group(1).strip() if m else content
    sm = re.search(r"<answer>(.*?)</answer>", sol, re.DOTALL)
    gold = parse(sm.group(1).strip() if sm else sol, extraction_mode="first_match")
    if not gold:
        return 0.0      # an unparseable solution scores 0 (ms-swift: skips the example)
    if m:
        answer = parse(to_parse, extraction_mode="first_match")
    else:
        answer = parse(to_parse, extraction_config=[LatexExtractionConfig(
            normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                     boxed=True, units=True),
            boxed_match_priority=0, try_extract_without_anchor=False)], extraction_mode="first_match")
    try:
        return float(verify(gold, answer))
    except Exception:
        return 0.0


__all__ = ["PACKAGE", "accuracy", "check_installed"]
