"""The GRPO demo's data and reward (scripts/quickstart_grpo.sh): prompts of the reverse-string task
whose `solution` is the reversal, disjoint from the SFT demo's held-out rows, and the exact-match
reward the plugin file registers."""

from __future__ import annotations

import importlib.util
import json

from swiftlite.demo import make_rows
from swiftlite.rlhf.grpo_demo import exact_match, make_prompts, write_grpo_data


def test_prompts_carry_the_reversal_as_solution(tmp_path):
    rows = [json.loads(x) for x in write_grpo_data(tmp_path, n=50).read_text().splitlines()]
    assert 40 <= len(rows) <= 50
    for r in rows:
        (turn,) = r["messages"]
        assert turn["role"] == "user" and turn["content"] == f"reverse: {r['solution'][::-1]}"
    held_out = {r["messages"][0]["content"] for r in make_rows(200, 1)}        # demo_data/val.jsonl's seed
    assert not held_out & {r["messages"][0]["content"] for r in make_prompts(1000, 20)}   # none held out


def test_the_plugin_rewards_exact_matches_only():
    assert exact_match(["cba", " cba\n", "cb", "abc"], ["cba"] * 4) == [1.0, 1.0, 0.0, 0.0]
    spec = importlib.util.spec_from_file_location("grpo_exact_reward", "scripts/grpo_exact_reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from swiftlite.plugin import orms
    assert orms["exact"] is mod.ExactMatch
    assert mod.ExactMatch()(["ba", "ab"], solution=["ba", "ba"], prompts=[[], []]) == [1.0, 0.0]
