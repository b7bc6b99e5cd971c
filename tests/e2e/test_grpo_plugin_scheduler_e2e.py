"""GRPO with a plugin's ms-swift MultiTurnScheduler (rlhf/plugin_turns.py) through the CLI: given to the run,
and given to the rollout server as ms-swift's scripts give it (`swift rollout --external_plugins F
--multi_turn_scheduler NAME --max_turns N`, the training command naming none: launch/server_turns.py).

The scheduler answers every turn inside the assistant's message (ToolCallScheduler's shape: the turn's
tokens, then the observation's out of the loss), until --max_turns. The model is
test_grpo_multi_turn_e2e's EOS-prone tiny Llama, so turns end before the length limit.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, run_cli
from tests.e2e.test_grpo_multi_turn_e2e import COMMON, PLUGIN, _at, _logged, build_eos_prone

SCHEDULER = '''
from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns

OBS = " Observation: 7."


class Observe(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]['content'] += OBS
        eos = self.tokenizer.eos_token_id
        ids = [t for t in response_choice.token_ids if t != eos]
        obs = self.tokenizer.encode(OBS, add_special_tokens=False)
        return {'infer_request': infer_request, 'response_token_ids': ids + obs,
                'response_loss_mask': [1] * len(ids) + [0] * len(obs)}


multi_turns['observe'] = Observe
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("pt")
    build_eos_prone(d / "model")
    (d / "data.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"what is {i} + 1?"}]}) + "\n" for i in range(8)))
    (d / "plugin.py").write_text(PLUGIN)
    (d / "sched.py").write_text(SCHEDULER)
    return d


def _run(files, out, *extra, sched=False, check=True):
    env = cli_env()
    env["MT_IDS"] = str(out.parent / f"{out.name}.ids.jsonl")
    plugins = [files / "plugin.py", *([files / "sched.py"] if sched else [])]
    return run_cli(["rlhf", *COMMON, "--model", files / "model", "--dataset", files / "data.jsonl",
                    "--external-plugins", *plugins, "--reward-funcs", "ids", *extra,
                    "--output-dir", out], env=env, check=check)


def _obs():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER).encode(" Observation: 7.", add_special_tokens=False)


def test_the_plugins_observations_are_in_the_sequence_and_out_of_the_loss(files, tmp_path):
    out = tmp_path / "a"
    proc = _run(files, out, "--multi-turn-scheduler", "observe", "--max-turns", "3", "--max-steps", "2", sched=True)
    assert "multi-turn: observe (up to 3 turns" in proc.stdout
    steps, ids, rows = _logged(out)
    obs = _obs()
    assert len(ids) == 16
    seen = [len(_at(c, obs)) for c in ids]
    assert max(seen) == 2 and sum(seen) >= 8          # at most max_turns - 1 observations; most completions got one
    for c, r in zip(ids, rows):
        assert r["completion"].count("Observation: 7.") == len(_at(c, obs))
        assert 258 not in c[:-1]                        # the step dropped each continued turn's EOS
    n = [len(c) - len(obs) * k for c, k in zip(ids, seen)]
    for s, step in enumerate(steps):                    # the token counts leave the observations out
        assert step["completions/mean_length"] == pytest.approx(sum(n[8 * s:8 * s + 8]) / 8)


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    from tests.e2e.test_rollout_server import _server
    proc, srv = _server(tmp_path_factory, model=files / "model",
                        extra=("--external_plugins", str(files / "sched.py"), "--multi_turn_scheduler", "observe",
                               "--max_turns", "3", "--vllm_use_async_engine", "true"))
    yield srv
    proc.terminate()
    assert proc.wait(timeout=30) == 0, srv["log"].read_text()


def test_a_servers_scheduler_is_the_runs_as_in_msswifts_scripts(files, server, tmp_path):
    """Two FSDP2 processes, the training command without the scheduler: the run takes the server's (its
    plugin file loaded in each rank) and its completions and losses are the in-process run's."""
    from tests.e2e.test_rollout_server import _port
    assert "vLLM's async engine is not used" in server["log"].read_text()
    common = ["--max-steps", "2", "--parallelism", "fsdp", "--nproc-per-node", "2", "--per-device-train-batch-size",
              "2"]
    srv = ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port",
           str(server["port"])]
    dry = _run(files, tmp_path / "dry", *common, *srv, "--dry-run")
    assert "rollout server: --multi_turn_scheduler observe --max_turns 3 (from " in dry.stdout
    assert "multi-turn: observe (up to 3 turns" in dry.stdout
    _run(files, tmp_path / "srv", *common, *srv, "--vllm_server_group_port", str(_port()))
    _run(files, tmp_path / "local", *common, "--multi-turn-scheduler", "observe", "--max-turns", "3", sched=True)
    (s1, ids1, rows1), (s2, ids2, rows2) = _logged(tmp_path / "srv"), _logged(tmp_path / "local")
    assert any(_at(c, _obs()) for c in ids1) and rows1 == rows2
    assert [s["loss"] for s in s1] == pytest.approx([s["loss"] for s in s2], rel=1e-6, abs=1e-9)
    conflict = _run(files, tmp_path / "x", *common, *srv, "--multi-turn-scheduler", "math_tip_trick", check=False)
    assert conflict.returncode == 2 and "the rollout server at http://127.0.0.1:" in conflict.stderr
    assert "names --multi_turn_scheduler observe --max_turns 3; give the scheduler on one command only" in \
        conflict.stderr and not (tmp_path / "x").exists()


def test_last_round_with_a_turn_loop_scheduler_is_refused_before_launch(files, tmp_path):
    # its turns are the loop's (every sampled turn trained); last_round needs a scheduler's own rollout messages
    out = tmp_path / "lr"
    proc = _run(files, out, "--multi_turn_scheduler", "observe", "--loss_scale", "last_round", "--max-steps", "1",
                sched=True, check=False)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.endswith("--loss_scale last_round with --multi_turn_scheduler observe: its turns are driven by "
                        "swiftlite's turn loop, which trains every turn the policy sampled (ms-swift's default with a "
                        "scheduler: default); last_round applies to a scheduler whose own run() gives its rollouts' "
                        "messages; drop the flag"), err
    assert not out.exists()
