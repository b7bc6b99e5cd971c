"""GRPO with `--multi_turn_scheduler math_tip_trick` through the CLI (rlhf/multi_turn.py): wrong answers
are continued after ms-swift's tip, the tip is in the sequence but out of the loss and the token counts,
--completion_length_limit_scope and --max_turns bound the turns, and the refusals.

The model is a tiny Llama whose weights make the end-of-sequence token likely (a residual dimension held
at a constant, read by the EOS row of the head), so that completions end before the length limit and
the scheduler has something to continue; its answers never verify, so every such completion gets the tip.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, run_cli

COMMON = ["--rlhf-type", "grpo", "--torch-dtype", "fp32", "--parallelism", "single", "--seed", "3",
          "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2", "--num-generations", "4",
          "--max-completion-length", "12", "--logging-steps", "1", "--save-hf-model", "false",
          "--log-completions", "true", "--learning-rate", "1e-3"]
#: a reward with spread (the completion's token count) that writes down the ids it was given
PLUGIN = '''import json, os
from swiftlite.plugin import orms

def ids(completions, completion_ids, **kwargs):
    with open(os.environ["MT_IDS"], "a") as f:
        f.write(json.dumps(completion_ids) + "\\n")
    return [float(len(c)) for c in completion_ids]

orms["ids"] = ids
'''


def build_eos_prone(d):
    """tiny-llama-2l's shape; residual dimension 0 held at 5 (embeddings; attention and MLP outputs
    never write it), which the head's EOS row reads: EOS is drawn about one token in five."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    conf = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=2048,
                       eos_token_id=258, pad_token_id=259, bos_token_id=None)
    torch.manual_seed(0)
    m = LlamaForCausalLM(conf)
    with torch.no_grad():
        m.model.embed_tokens.weight[:, 0] = 5.0
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        m.lm_head.weight[258, 0] = 0.5
    m.save_pretrained(d)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(d)
    return d


def math_files(d, plugin):
    """The EOS-prone model, eight "what is i + 1?" prompts with their `solution`, and the plugin file."""
    build_eos_prone(d / "model")
    (d / "data.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"what is {i} + 1?"}], "solution": f"${i + 1}$"}) + "\n"
        for i in range(8)))
    (d / "plugin.py").write_text(plugin)
    return d


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return math_files(tmp_path_factory.mktemp("mt"), PLUGIN)


def _run(files, out, *extra, check=True):
    env = cli_env()
    env["MT_IDS"] = str(out.parent / f"{out.name}.ids.jsonl")
    return run_cli(["rlhf", *COMMON, "--model", files / "model", "--dataset", files / "data.jsonl",
                    "--external-plugins", files / "plugin.py", "--reward-funcs", "ids", *extra,
                    "--output-dir", out], env=env, check=check)


def _logged(out):
    steps = [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in x]
    ids = [c for x in (out.parent / f"{out.name}.ids.jsonl").read_text().splitlines() for c in json.loads(x)]
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    return steps, ids, rows


def _tips():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    from swiftlite.rlhf.multi_turn import TIPS
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER).encode(TIPS, add_special_tokens=False)


def _at(ids, part):
    return [i for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part]


def test_math_tip_trick_continues_after_the_tip_which_stays_out_of_the_loss(files, tmp_path):
    """bnpo's first-step loss is -sum(adv x n) / sum(n) per micro-batch, n each completion's tokens in the
    loss: it equals the value with n excluding the tip's tokens (and differs from the one with them)."""
    out = tmp_path / "a"
    proc = _run(files, out, "--multi-turn-scheduler", "math_tip_trick", "--loss-type", "bnpo", "--max-steps", "2")
    assert "multi-turn: math_tip_trick" in proc.stdout
    steps, ids, rows = _logged(out)
    tips, eos = _tips(), 258
    assert len(ids) == 16 and len(rows) == 16
    tipped = [c for c in ids if _at(c, tips)]
    assert len(tipped) >= 4                             # most of the seed's completions ended before the limit
    for c in tipped:
        at = _at(c, tips)
        assert len(at) == 1                              # the tip is given once
        assert at[0] == 0 or c[at[0] - 1] != eos         # the continued turn's EOS was dropped
        assert len(c) > at[0] + len(tips)                # and the policy continued after the tip
    assert any(len(c) > 12 for c in tipped)              # per_round: each turn may take 12 new tokens
    assert all(("But wait... It seems I made a mistake," in r["completion"]) == bool(_at(c, tips))
               for r, c in zip(rows, ids))
    n = [len(c) - len(tips) * len(_at(c, tips)) for c in ids]
    for s, step in enumerate(steps):
        part = slice(8 * s, 8 * s + 8)
        assert step["completions/mean_length"] == pytest.approx(sum(n[part]) / 8)
        # ms-swift's num_turns: the round's mean, 2 for a tipped completion
        assert step["num_turns"] == pytest.approx(sum(1 + bool(_at(c, tips)) for c in ids[part]) / 8)
    adv = [r["advantage"] for r in rows[:8]]

    def bnpo(counts):
        return sum(-sum(a * k for a, k in zip(adv[m:m + 4], counts[m:m + 4])) / sum(counts[m:m + 4])
                   for m in (0, 4)) / 2
    assert steps[0]["loss"] == pytest.approx(bnpo(n[:8]), abs=1e-5)
    assert abs(bnpo([len(c) for c in ids[:8]]) - bnpo(n[:8])) > 1e-3   # the check can tell the two apart


def test_one_turn_is_the_run_without_a_scheduler(files, tmp_path):
    """--max_turns 1 finishes every completion at its first turn: the completions, rewards and losses
    of the run without --multi_turn_scheduler."""
    _run(files, tmp_path / "plain", "--max-steps", "2")
    _run(files, tmp_path / "one", "--multi-turn-scheduler", "math_tip_trick", "--max-turns", "1", "--max-steps", "2")
    a, b = _logged(tmp_path / "plain"), _logged(tmp_path / "one")
    assert a[1] == b[1] and [r["completion"] for r in a[2]] == [r["completion"] for r in b[2]]
    assert [s["loss"] for s in a[0]] == pytest.approx([s["loss"] for s in b[0]], abs=1e-7)
    assert all("num_turns" not in s for s in a[0]) and all(s["num_turns"] == 1 for s in b[0])


def test_padding_free_turns_score_as_padded(files, tmp_path):
    """--padding_free true with the turns: each row's completion (tip inside, attended to) up to its mask's
    end in one sequence; the padded run's losses, KL, entropy and gradient norms over two passes a round.
    LoRA dropout off: the turns make the rows' lengths differ, so the padded batch has pad positions the
    packed one lacks and the two would draw different dropout masks (2.7% apart in grad norm with 0.05)."""
    common = ["--multi-turn-scheduler", "math_tip_trick", "--num_iterations", "2", "--max-steps", "4", "--lora-dropout", "0"]
    _run(files, tmp_path / "pad", *common)
    _run(files, tmp_path / "free", *common, "--padding_free", "true")
    pad, free = _logged(tmp_path / "pad")[0], _logged(tmp_path / "free")[0]
    assert len(pad) == len(free) == 4
    for a, b in zip(pad, free):
        assert a["completions/mean_length"] == b["completions/mean_length"] and a["reward"] == b["reward"]
        for k in ("loss", "grad_norm", "kl", "entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), (a["step"], k)


def test_total_scope_caps_the_whole_completion(files, tmp_path):
    out = tmp_path / "t"
    _run(files, out, "--multi-turn-scheduler", "math_tip_trick", "--completion-length-limit-scope", "total",
         "--max-steps", "2")
    _, ids, _ = _logged(out)
    tips = _tips()
    assert max(len(c) for c in ids) <= 12
    assert all(len(c) >= len(tips) + 1 for c in ids if _at(c, tips))   # continued only with room left


@pytest.mark.parametrize("extra,words", [
    (["--multi-turn-scheduler", "openenv_scheduler"], "--multi-turn-scheduler openenv_scheduler: not "
                                                      "available here: it drives an OpenEnv environment server"),
    (["--multi-turn-scheduler", "my_plugin_scheduler"], "--multi_turn_scheduler my_plugin_scheduler: no scheduler "
                                                        "of that name; built in: math_tip_trick, gym_scheduler, "
                                                        "thinking_tips_scheduler; registered by"),
    (["--multi-turn-scheduler", "math_tip_trick", "--loss-scale", "last_round"],
     "--loss-scale last_round with --multi-turn-scheduler math_tip_trick: GRPO trains every turn"),
    (["--max-turns", "3"], "--max-turns applies to multi-turn rollouts"),
    (["--completion-length-limit-scope", "total"], "--completion-length-limit-scope applies to multi-turn"),
    (["--multi-turn-scheduler", "math_tip_trick", "--max-turns", "0"], "--max-turns 0: out of range"),
    (["--multi-turn-scheduler", "math_tip_trick", "--dataset", "NOSOL"],
     "no 'solution' column, which --multi_turn_scheduler math_tip_trick verifies"),
])
def test_refusals_stop_before_anything_is_written(files, tmp_path, extra, words):
    if "NOSOL" in extra:
        bad = tmp_path / "nosol.jsonl"
        bad.write_text(json.dumps({"prompt": "1+1", "solution": "2"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
        extra = [bad if e == "NOSOL" else e for e in extra]
    out = tmp_path / "out"
    proc = _run(files, out, *extra, "--max-steps", "1", check=False)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and words in err and "Traceback" not in err, err
    assert not out.exists()
    if any(str(e).endswith("nosol.jsonl") for e in extra):
        assert err.endswith("nosol.jsonl:2: no 'solution' column, which --multi_turn_scheduler math_tip_trick "
                            "verifies each completion against")


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    from tests.e2e.test_rollout_server import _server
    proc, srv = _server(tmp_path_factory, model=files / "model")
    yield srv
    proc.terminate()
    assert proc.wait(timeout=30) == 0, srv["log"].read_text()


def test_the_turns_against_a_rollout_server_are_the_in_process_ones(files, server, tmp_path):
    """Two FSDP2 processes ask `swiftlite rollout` for every turn (the weights synced once per round): the
    completions, tips and continuations included, and the losses of the same run sampling in-process."""
    from tests.e2e.test_rollout_server import _port
    common = ["--multi-turn-scheduler", "math_tip_trick", "--max-steps", "2", "--parallelism", "fsdp",
              "--nproc-per-node", "2", "--per-device-train-batch-size", "2"]
    _run(files, tmp_path / "srv", *common, "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host",
         "127.0.0.1", "--vllm_server_port", str(server["port"]), "--vllm_server_group_port", str(_port()))
    _run(files, tmp_path / "local", *common)
    (s1, ids1, rows1), (s2, ids2, rows2) = _logged(tmp_path / "srv"), _logged(tmp_path / "local")
    assert any(_at(c, _tips()) for c in ids2) and rows1 == rows2
    assert [s["loss"] for s in s1] == pytest.approx([s["loss"] for s in s2], rel=1e-6, abs=1e-9)
