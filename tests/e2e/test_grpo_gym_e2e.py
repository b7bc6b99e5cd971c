"""GRPO with ms-swift's gym scheduler through the CLI (`--multi_turn_scheduler gym_scheduler --gym_env NAME`,
no --reward_funcs: the environments' total rewards are the run's only reward, `gym_reward`), colocated and
with the scheduler given to the rollout server as ms-swift's examples/train/grpo/external/vllm_gym.sh gives
it (launch/server_turns.py). The environment is a plugin's: each row says how many steps its episode lasts,
each step scores the answer's length, and it writes down every step's reward by episode.
The model is test_grpo_multi_turn_e2e's EOS-prone tiny Llama, so turns end before the length limit."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from tests.conftest import cli_env, run_cli
from tests.e2e.test_grpo_multi_turn_e2e import COMMON, build_eos_prone

ENV = '''import itertools, json, os
from swift.rollout.gym_env import Env, envs

EPISODES = itertools.count()


class Countdown(Env):
    async def reset(self, config):
        self.k, self.left = next(EPISODES), int(config.data_dict["n"])
        return f"count {self.left}", {}, ""

    async def step(self, action):
        self.left -= 1
        reward = float(len(action[-1]["content"]))
        with open(os.environ["GYM_LOG"], "a") as f:
            f.write(json.dumps({"episode": self.k, "reward": reward}) + "\\n")
        return "next", reward, self.left == 0, {}

    async def close(self):
        pass


envs["countdown"] = Countdown
'''
GYM = ["--multi_turn_scheduler", "gym_scheduler", "--gym_env", "countdown", "--max_turns", "4"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gym")
    build_eos_prone(d / "model")
    (d / "data.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "n": 1 + i % 3}) + "\n" for i in range(8)))
    (d / "env.py").write_text(ENV)
    return d


def _run(files, out, *extra, check=True, own_process=False):
    env = cli_env()
    env["GYM_LOG"] = str(out.parent / f"{out.name}.gym.jsonl")
    return run_cli(["rlhf", *COMMON, "--model", files / "model", "--dataset", files / "data.jsonl", "--max-steps", "2",
                    *extra, "--output-dir", out], env=env, check=check, own_process=own_process)


def _episodes(out):
    total = defaultdict(float)
    for line in (out.parent / f"{out.name}.gym.jsonl").read_text().splitlines():
        d = json.loads(line)
        total[d["episode"]] += d["reward"]
    return [total[k] for k in sorted(total)]


def _steps(out):
    return [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in x]


def test_the_environments_total_rewards_are_the_runs_reward_and_write_its_prompts(files, tmp_path):
    out = tmp_path / "a"
    proc = _run(files, out, "--external-plugins", files / "env.py", *GYM)
    assert "rewards gym_reward, multi-turn: gym_scheduler (up to 4 turns" in proc.stdout
    totals, steps = _episodes(out), _steps(out)
    assert len(totals) == 16 and len(steps) == 2            # one episode per completion, 8 per round
    for s, step in enumerate(steps):
        assert step["rewards/gym_reward/mean"] == pytest.approx(sum(totals[8 * s:8 * s + 8]) / 8, rel=1e-6)
    assert step["reward"] == step["rewards/gym_reward/mean"]
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert all("count " in r["prompt"] and "q" not in r["prompt"].split("count")[1] for r in rows)
    assert sorted(r["rewards"]["gym_reward"] for r in rows) == pytest.approx(sorted(totals))


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    from tests.e2e.test_rollout_server import _server
    proc, srv = _server(tmp_path_factory, model=files / "model",
                        extra=("--external_plugins", str(files / "env.py"), *GYM, "--use_gym_env", "true"))
    yield srv
    proc.terminate()
    assert proc.wait(timeout=30) == 0, srv["log"].read_text()


def test_a_servers_gym_scheduler_is_the_runs_as_in_msswifts_vllm_gym_script(files, server, tmp_path):
    """The training command names no reward and no scheduler (vllm_gym.sh): it takes the server's, and trains
    on the same completions and rewards as the colocated run; without --vllm_server_pass_dataset the
    environment cannot read its row, which the run says in one line."""
    from tests.e2e.test_rollout_server import _port
    srv = ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port",
           str(server["port"])]
    # in a process of its own: nothing registered but what the server's plugin file registers there
    _run(files, tmp_path / "srv", *srv, "--vllm_server_pass_dataset", "true", "--vllm_server_group_port", str(_port()),
         own_process=True)
    _run(files, tmp_path / "local", "--external-plugins", files / "env.py", *GYM)
    assert _episodes(tmp_path / "srv") == _episodes(tmp_path / "local")
    assert [s["loss"] for s in _steps(tmp_path / "srv")] == pytest.approx(
        [s["loss"] for s in _steps(tmp_path / "local")], rel=1e-6, abs=1e-9)
    bad = _run(files, tmp_path / "x", *srv, "--vllm_server_group_port", str(_port()), check=False, own_process=True)
    assert bad.returncode == 2 and "on_trajectory_start raised KeyError: 'n'; its requests' data_dict is empty" \
        in bad.stderr
