"""GRPO on tool-calling prompts (ms-swift's examples/train/grpo/external/agent.sh): a row's tools are written
into its prompt by --agent_template (react_grpo: ms-swift's system text), the ReAct rewards score the
completions, --stop_words ends them at `Observation:`; a tools row without --agent_template is refused."""

from __future__ import annotations

import json

from tests.conftest import run_cli

TOOL = {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
COMMON = ["rlhf", "--rlhf-type", "grpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--parallelism", "single",
          "--seed", "3", "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2",
          "--num-generations", "4", "--max-completion-length", "8", "--logging-steps", "1", "--save-hf-model", "false",
          "--max-steps", "1", "--reward-funcs", "toolbench", "react_format"]


def _data(d):
    p = d / "tools.jsonl"
    p.write_text("".join(json.dumps({"tools": [TOOL], "messages": [{"role": "user", "content": f"Weather in c{i}?"}],
                                     "solution": f'Action: get_weather\nAction Input: {{"city": "c{i}"}}'}) + "\n"
                         for i in range(8)))
    return p


def test_tools_go_into_the_prompt_and_the_react_rewards_score(tmp_path):
    data = _data(tmp_path)
    run_cli([*COMMON, "--dataset", data, "--agent_template", "react_grpo", "--stop_words", "Observation:",
             "--log-completions", "true", "--output-dir", tmp_path / "out"])
    rows = [json.loads(x) for x in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for r in rows:
        assert r["prompt"].startswith("<|im_start|>system\nA conversation for tool calling between User and Assistant.")
        assert "get_weather: Call this tool to interact with the get_weather API." in r["prompt"]
        assert r["prompt"].rstrip().endswith("<|im_start|>assistant")
        assert set(r["rewards"]) == {"ReactORM", "ReActFormat"}
    step = json.loads([x for x in (tmp_path / "out" / "logging.jsonl").read_text().splitlines() if '"loss"' in x][0])
    assert "rewards/ReactORM/mean" in step and "rewards/ReActFormat/mean" in step


def test_a_tools_row_without_an_agent_template_is_refused(tmp_path):
    proc = run_cli([*COMMON, "--dataset", _data(tmp_path), "--output-dir", tmp_path / "out"], check=False)
    assert proc.returncode == 2 and "a tool-calling row (tools, tool_call or tool_response): pass --agent_template" \
        in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
