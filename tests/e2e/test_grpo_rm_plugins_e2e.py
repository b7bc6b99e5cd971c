"""GRPO with ms-swift's reward-model plugins through the CLI (run_external_reward_model.sh's shape): a plugin
file written against ms-swift's API registers a generative judge (a GenRMPlugin subclass) and ms-swift's
CustomizedRMPlugin, both given with --reward_model / --reward_model_plugin. Every logged completion's reward
from the judge is what that judge answers when asked alone (greedy, up to its length: recomputed here with
transformers' generate), and the classifier plugin's equals the default plugin's score."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.conftest import run_cli
from tests.e2e.test_grpo_e2e import COMMON, _steps, write_reverse_rows
from tests.unit.test_msswift_rm_plugins import RM_PLUGIN

#: ms-swift's CustomizedRMPlugin (test_msswift_rm_plugins.RM_PLUGIN) and a judge of genrm's prompt and engine
PLUGIN = RM_PLUGIN + '''
from swift.rewards.rm_plugin import GenRMPlugin


class LengthJudge(GenRMPlugin):
    """genrm's prompt and engine; the reward read from the answer's length (a random judge writes no number)."""

    @staticmethod
    def extract_reward(model_output):
        return (len(model_output) % 10) / 10


rm_plugins['length_judge'] = LengthJudge
'''


def test_a_judge_and_a_plugin_class_score_the_completions(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlite.msswift_api.rm_plugin import GENRM_SYSTEM, GenRMPlugin
    from swiftlite.rlhf.reward_model import RewardModelScorer
    from tests.unit.test_grpo_reward_model import build_tiny_rm
    from tests.unit.test_msswift_rm_plugins import build_tiny_judge
    rm = build_tiny_rm(tmp_path / "tiny-rm")
    judge = build_tiny_judge(tmp_path / "tiny-judge", positions=480)
    (tmp_path / "rm_plugin.py").write_text(PLUGIN)
    data = write_reverse_rows(tmp_path / "data.jsonl")
    run_cli(["rlhf", *COMMON, "--dataset", data, "--external_plugins", tmp_path / "rm_plugin.py",
             "--reward_funcs", "format", "--reward_model", judge, rm, "--reward_model_plugin", "length_judge",
             "my_rmplugin", "--reward_weights", "0.1", "1", "1", "--log-completions", "true", "--max-steps", "1",
             "--output-dir", tmp_path / "g"])
    step = _steps(tmp_path / "g")[0]
    rows = [json.loads(x) for x in (tmp_path / "g" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(set(r["rewards"]) == {"Format", "tiny-judge", "tiny-rm"} for r in rows)
    convs = [[{"role": "user", "content": re.search(r"reverse: \w+", r["prompt"]).group(0)},
              {"role": "assistant", "content": r["completion"]}] for r in rows]
    # the classifier plugin of ms-swift's shape scores as the default plugin
    want_rm = RewardModelScorer(str(rm), "cpu", torch.float32)([r["completion"] for r in rows], messages=convs)
    assert [r["rewards"]["tiny-rm"] for r in rows] == pytest.approx(want_rm, rel=1e-4, abs=1e-6)
    # the judge: asked with genrm's system prompt and query, greedy; the 8 completions are one batch, whose
    # answers may run to the judge's 480 positions less the longest prompt (ms-swift's max_tokens rule)
    tok = AutoTokenizer.from_pretrained(judge)
    model = AutoModelForCausalLM.from_pretrained(judge).eval()
    prompts = [tok(tok.apply_chat_template([{"role": "system", "content": GENRM_SYSTEM},
                                            {"role": "user", "content": GenRMPlugin.messages_to_query(conv)}],
                                           tokenize=False, add_generation_prompt=True), add_special_tokens=False,
                   return_tensors="pt")["input_ids"] for conv in convs]
    room = 480 - max(ids.shape[1] for ids in prompts)
    want_judge = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=259,
                                 max_new_tokens=room)[0, ids.shape[1]:].tolist()
        out = out[:out.index(258)] if 258 in out else out
        want_judge.append((len(tok.decode(out, skip_special_tokens=True)) % 10) / 10)
    assert [r["rewards"]["tiny-judge"] for r in rows] == pytest.approx(want_judge, abs=1e-6)
    assert len(set(want_judge)) > 1                     # the answers differ by completion
    assert step["rewards/tiny-judge/mean"] == pytest.approx(sum(want_judge) / 8, abs=1e-6)
    assert step["reward"] == pytest.approx(sum(0.1 * r["rewards"]["Format"] + r["rewards"]["tiny-judge"] +
                                               r["rewards"]["tiny-rm"] for r in rows) / 8, rel=1e-4, abs=1e-6)
