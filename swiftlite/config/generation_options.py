"""Sampling options of the runs that generate while they train (GRPO's rounds, GKD's sampled steps), beyond
--temperature/--top_p/--top_k: ms-swift's --stop_words (RolloutTrainerArgumentsMixin). A base of
schema.RlhfConfig, kept here so that schema.py stays short; rlhf/stop_words.py applies them. Import-light."""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt


@dataclass(kw_only=True)
class GenerationOptions(Section):
    stop_words: list[str] = opt(help="GRPO, GKD: a sampled completion ends at the first token that completes one of "
                                "these strings (kept in the completion, as ms-swift trains on it), as at an "
                                "end-of-sequence token. Default: none.", factory=list)


#: The keys above (config/rules.py lists them among GRPO's own and GKD's shared ones).
GENERATION_KEYS = ("stop_words",)

__all__ = ["GENERATION_KEYS", "GenerationOptions"]
