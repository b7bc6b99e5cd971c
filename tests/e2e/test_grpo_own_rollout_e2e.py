"""GRPO through the CLI with a plugin scheduler that overrides ms-swift's `run` (rlhf/own_rollout.py),
colocated and with the scheduler given to the rollout server, as ms-swift's
examples/train/grpo/plugin/treepo/tree_rollout.sh gives its tree scheduler. The scheduler is treepo's shape
reduced: `async_infer` merges the identical requests of a group, `run` grows each merged request back into
`num_generations` trajectories of one or two turns (by prompt; a user message between them), asking for the
sampled tokens' log-probabilities, and writes down every trajectory's turns; the reward is the completion's token
count."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import cli_env, run_cli
from tests.e2e.test_grpo_multi_turn_e2e import COMMON, build_eos_prone
from tests.unit.test_own_rollout import MERGE

PLUGIN = '''import asyncio, json, os
from swift.rewards import MultiTurnScheduler, multi_turns, orms
from swift.infer_engine.protocol import RolloutInferRequest, RolloutOutput


class Tree(MultiTurnScheduler):
    width = 4

''' + MERGE + '''
    async def run(self, infer_request, request_config, **kwargs):
        reqs = [RolloutInferRequest(messages=[dict(m) for m in infer_request.messages], uuid=f'{infer_request.uuid}-{k}')
                for k in range(self.width)]
        turns = [[] for _ in reqs]
        n = 1 + int(infer_request.messages[-1]['content'][1:]) % 2     # q0: 1 turn, q1: 2, ...
        for t in range(n):
            outs = await asyncio.gather(*[self.infer_engine.infer_async(r, request_config) for r in reqs])
            for r, o, tt in zip(reqs, outs, turns):
                c = o.choices[0]
                r.messages.append({'role': 'assistant', 'content': c.message.content})
                tt.append((list(c.token_ids), [x['logprob'] for x in c.logprobs['content']]))
                if t < n - 1:
                    r.messages.append({'role': 'user', 'content': 'again'})
        with open(os.environ['OWN_LOG'], 'a') as f:
            for tt in turns:
                f.write(json.dumps(tt) + '\\n')
        return [RolloutOutput(response=o, messages=r.messages, response_token_ids=[x[0] for x in tt],
                              rollout_infos={'num_turns': n}) for r, o, tt in zip(reqs, outs, turns)]


multi_turns['tree'] = Tree
orms['length'] = lambda completions, completion_ids, **kw: [float(len(c)) for c in completion_ids]
'''
TREE = ["--multi_turn_scheduler", "tree", "--max_turns", "2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("own")
    build_eos_prone(d / "model")
    (d / "data.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(4)))
    (d / "tree.py").write_text(PLUGIN)
    return d


def _run(files, out, *extra, check=True, own_process=False):
    env = cli_env()
    env["OWN_LOG"] = str(out.parent / f"{out.name}.own.jsonl")
    return run_cli(["rlhf", *COMMON, "--model", files / "model", "--dataset", files / "data.jsonl", "--max-steps", "2",
                    "--reward_funcs", "length", *extra, "--output-dir", out], env=env, check=check,
                   own_process=own_process)


def _turns(out):
    return [json.loads(x) for x in (out.parent / f"{out.name}.own.jsonl").read_text().splitlines()]


def _steps(out):
    return [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in x]


def test_a_schedulers_own_run_samples_the_policy_and_its_trajectories_are_trained(files, tmp_path):
    out = tmp_path / "a"
    _run(files, out, "--external-plugins", files / "tree.py", *TREE)
    trajs = _turns(out)
    assert len(trajs) == 16                          # 2 rounds x 8 completions, each one trajectory of the scheduler
    assert sorted({len(t) for t in trajs}) == [1, 2]
    for t in trajs:   # every sampled token has its log-probability, a real one
        assert all(len(ids) == len(lps) and all(math.isfinite(v) and v <= 0 for v in lps) for ids, lps in t)
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    two = [r for r in rows if r["prompt"].strip().endswith(("q1", "q3")) or "q1" in r["prompt"] or "q3" in r["prompt"]]
    assert len(rows) == 16 and len(two) == 8 and all("again" in r["completion"] for r in two)   # the user turn
    # the reward saw the whole completion: the turns, and the template's text between two of them
    lengths = sorted(sum(len(ids) for ids, _ in t) + (len(t) > 1) for t in trajs)
    assert all(a >= b for a, b in zip(sorted(r["rewards"]["length"] for r in rows), lengths))
    assert len(_steps(out)) == 2


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    from tests.e2e.test_rollout_server import _server
    proc, srv = _server(tmp_path_factory, model=files / "model",
                        extra=("--external_plugins", str(files / "tree.py"), *TREE))
    yield srv
    proc.terminate()
    assert proc.wait(timeout=30) == 0, srv["log"].read_text()


def test_with_the_scheduler_on_the_rollout_server_the_run_samples_and_trains_the_same(files, server, tmp_path):
    """tree_rollout.sh's split: the server names the scheduler, the training command only loads the plugin.
    Two FSDP2 processes, each holding half of every group: as in ms-swift's server mode the first process
    gathers every request and the scheduler merges whole groups, the other joins each sampling call; the
    server's engine answers the log-probabilities too (/infer/ "logprobs"). The run samples the same
    trajectories with the same log-probabilities (within what training on two processes instead of one moves
    the second round's weights) and rewards as one process sampling in-process. Colocated, each process
    holds its own requests (ms-swift's colocate mode), and the tree's own check of the split groups stops the
    run in one line."""
    from tests.e2e.test_rollout_server import _port
    two = ["--parallelism", "fsdp", "--nproc-per-node", "2", "--per-device-train-batch-size", "2"]
    srv = ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port",
           str(server["port"]), "--vllm_server_group_port", str(_port())]
    _run(files, tmp_path / "srv", "--external-plugins", files / "tree.py", *two, *srv, own_process=True)
    _run(files, tmp_path / "local", "--external-plugins", files / "tree.py", *TREE)
    split = _run(files, tmp_path / "split", "--external-plugins", files / "tree.py", *two, *TREE, check=False)
    assert split.returncode == 2 and split.stderr.strip().endswith(
        "--multi_turn_scheduler tree: its rollout raised AssertionError: width must equal num_generations")
    a, b = _turns(tmp_path / "srv"), _turns(tmp_path / "local")
    assert [[ids for ids, _ in t] for t in a] == [[ids for ids, _ in t] for t in b]
    for ta, tb in zip(a, b):
        for (_, la), (_, lb) in zip(ta, tb):
            assert la == pytest.approx(lb, rel=1e-3, abs=1e-4)   # the second round: weights trained on 2 vs 1 process
    for x, y in zip(_steps(tmp_path / "srv"), _steps(tmp_path / "local")):    # the same completions, scored alike
        assert (x["reward"], x["completions/mean_length"]) == (y["reward"], y["completions/mean_length"])
