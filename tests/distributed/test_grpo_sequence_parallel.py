"""GRPO under --sequence_parallel_size (rlhf/grpo_sp.py) through the real CLI: a group of ranks that shares
its completions and splits every sequence trains as one process on whole sequences.

tiny-llama-2l (4 heads, 2 key/value heads), 3 steps, 2 passes over each generation round (old log-probs)
with the reference on (beta 0.04): one process against 2 ranks in one group (fp32 full fine-tuning:
FSDP2 padded and padding-free, ZeRO-3), and 2 data-parallel ranks against 4 ranks in 2 groups (LoRA,
the reference being the adapter switched off). The rewards, completion lengths, losses, gradient norms,
KL and entropy agree to 1e-5 (relative): the same completions (their draws depend on the seed, round
and index only), the same sums in another order. On a model that draws EOS about one token in five
(`_eos` runs), completions end mid-way at different lengths, so the padding (or, padding-free, the packed
row's end) falls at a different place in every sequence the group splits.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import LazyRuns, run_cli

REL = 1e-5
PLUGIN = '''from swiftlite.plugin import orms
from swift.rollout.gym_env import Env, envs
orms["chars"] = lambda completions, **kwargs: [sum(map(ord, c)) % 17 / 17 for c in completions]


class Shout(Env):   # a gym environment: its own first prompt, an observation after every turn, a reward each
    async def reset(self, config):
        return config.messages[-1]["content"].upper(), {}, ""

    async def step(self, action):
        return "again", len(action[-1]["content"]) % 5 / 5, False, {}

    async def close(self):
        pass


envs["shout"] = Shout
'''
KEYS = ("loss", "grad_norm", "kl", "entropy", "reward", "reward_std", "completions/mean_length")
#: ms-swift's gym scheduler: the group shares the environment's prompts and rewards as one process has them
GYM = ["--multi_turn_scheduler", "gym_scheduler", "--gym_env", "shout", "--max_turns", "2"]

RUNS = {   # name -> (flags, the run it must equal)
    "one": (["--nproc_per_node", "1"], None),
    "sp2": (["--nproc_per_node", "2", "--sequence_parallel_size", "2"], "one"),
    "one_free": (["--nproc_per_node", "1", "--padding_free", "true"], None),
    "sp2_free": (["--nproc_per_node", "2", "--sequence_parallel_size", "2", "--padding_free", "true"], "one_free"),
    "sp2_zero3": (["--nproc_per_node", "2", "--sequence_parallel_size", "2", "--parallelism", "zero3"], "one"),
    "one_gym": (["--nproc_per_node", "1", *GYM], None),
    "sp2_gym": (["--nproc_per_node", "2", "--sequence_parallel_size", "2", *GYM], "one_gym"),
    "one_eos": (["--nproc_per_node", "1"], None),
    "sp2_eos": (["--nproc_per_node", "2", "--sequence_parallel_size", "2"], "one_eos"),
    "one_eos_free": (["--nproc_per_node", "1", "--padding_free", "true"], None),
    "sp2_eos_free": (["--nproc_per_node", "2", "--sequence_parallel_size", "2", "--padding_free", "true"],
                     "one_eos_free"),
    "dp2_lora": (["--nproc_per_node", "2", "--train_type", "lora", "--lora_dropout", "0",
                  "--gradient_accumulation_steps", "1", "--learning_rate", "1e-2"], None),
    "dp2_sp2_lora": (["--nproc_per_node", "4", "--sequence_parallel_size", "2", "--train_type", "lora",
                      "--lora_dropout", "0", "--gradient_accumulation_steps", "1", "--learning_rate", "1e-2"],
                     "dp2_lora"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_sp")
    words = ["abcd", "bcda", "cdab", "dabc", "abdc", "badc", "cadb", "dcba"]
    (root / "data.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"reverse the word {w} please, letter by letter"}]})
        + "\n" for w in words))
    (root / "plugin.py").write_text(PLUGIN)

    def train_one(name: str):
        d = root / name
        model = "tiny-llama-2l"
        if "_eos" in name:
            from tests.e2e.test_grpo_multi_turn_e2e import build_eos_prone
            model = root / "eos_model"
            if not model.is_dir():
                build_eos_prone(model)
        proc = run_cli(["rlhf", "--rlhf_type", "grpo", "--model", model, "--torch_dtype", "fp32",
                        "--train_type", "full", "--dataset", root / "data.jsonl", "--external_plugins",
                        root / "plugin.py", "--reward_funcs", "chars", "--seed", "3",
                        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                        "--num_generations", "4", "--max_completion_length", "6", "--num_iterations", "2",
                        "--learning_rate", "1e-3", "--max_steps", "3", "--logging_steps", "1",
                        "--save_strategy", "no", "--output_dir", d, *RUNS[name][0]], timeout=600)
        steps = [json.loads(x) for x in (d / "logging.jsonl").read_text().splitlines() if '"loss"' in x]
        return steps, proc.stdout

    return LazyRuns(train_one)


@pytest.mark.parametrize("name", [n for n, (_, ref) in RUNS.items() if ref])
def test_a_sequence_parallel_group_trains_as_one_process(runs, name):
    steps, out = runs[name]
    want, _ = runs[RUNS[name][1]]
    assert "sequence parallel in groups of 2" in out
    assert len(steps) == len(want) == 3
    for a, b in zip(want, steps):
        for k in KEYS:
            assert b[k] == pytest.approx(a[k], rel=REL, abs=1e-7), (name, a["step"], k, a[k], b[k])
    assert steps[1]["kl"] > 0 and steps[0]["grad_norm"] > 0   # the reference and the advantages both act
    if "_eos" in name:   # completions that end mid-way, at lengths that differ within a batch
        assert all(s["completions/min_length"] < s["completions/max_length"] for s in steps), steps
        assert min(s["completions/clipped_ratio"] for s in steps) < 1 and min(
            s["completions/min_length"] for s in steps) < 6
    if "gym" in name:   # the environment's reward is the run's second, the same in the group as in one process
        assert [s["rewards/gym_reward/mean"] for s in steps] == pytest.approx(
            [s["rewards/gym_reward/mean"] for s in want], rel=REL)
        assert "rewards gym_reward" not in out and "rewards chars, gym_reward" in out
