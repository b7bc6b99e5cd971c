"""scripts/msswift_examples.py's rollout servers: the `swift rollout` commands it extracts (live, or from a
commented-out block when the training is in server mode), and the ports and hosts it gives the servers and
the training commands; and its GKD commands (a supported training type: the teacher and the datasets
replaced). Pure functions on small inline scripts: no server, no network."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def mx():
    spec = importlib.util.spec_from_file_location("msswift_examples", ROOT / "scripts" / "msswift_examples.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


PLATFORM = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}

TRAIN = """
CUDA_VISIBLE_DEVICES=0,1 \\
NPROC_PER_NODE=2 \\
swift rlhf \\
    --rlhf_type grpo \\
    --model Qwen/Qwen2.5-7B-Instruct \\
    --use_vllm true \\
    --vllm_mode {mode} \\
    --vllm_server_host 127.0.0.1 \\
    --vllm_server_port 8000 \\
    --dataset AI-MO/NuminaMath-TIR#1000
"""

# examples/train/grpo/external/grpo_7b.sh's shape: the server only in a comment block at the top
COMMENTED = """# 8 * 80 G (6 for training, 2 for rollout)
# Before running this script, please run the following `swift rollout` script first
# CUDA_VISIBLE_DEVICES=6,7 \\
# swift rollout \\
#     --model Qwen/Qwen2.5-7B-Instruct \\
#     --data_parallel_size 2
""" + TRAIN

# examples/train/grpo/internal/real.sh's shape: a live server command
LIVE = """CUDA_VISIBLE_DEVICES=2 \\
swift rollout \\
    --model Qwen/Qwen3-1.7B

# CUDA_VISIBLE_DEVICES=3 \\
# swift rollout \\
#     --model Qwen/Other-Model
""" + TRAIN


def _extract(mx, text, mode="server"):
    return mx.extract("examples/x.sh", text.replace("{mode}", mode), PLATFORM)


def test_commented_rollout_used_in_server_mode(mx):
    cmds, launchers = _extract(mx, COMMENTED)
    assert [c.sub for c in cmds] == ["rollout", "rlhf"] and launchers == []
    ro = cmds[0]
    assert ro.commented and ro.env == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert ro.argv == ["--model", "Qwen/Qwen2.5-7B-Instruct", "--data_parallel_size", "2"]
    assert cmds[1].server_mode() and not cmds[1].commented
    assert mx.skip_reason("examples/x.sh", cmds, launchers) is None


def test_commented_rollout_ignored_without_server_mode(mx):
    cmds, _ = _extract(mx, COMMENTED, mode="colocate")
    assert [c.sub for c in cmds] == ["rlhf"] and not cmds[0].server_mode()


def test_live_rollout_wins_over_commented(mx):
    cmds, launchers = _extract(mx, LIVE)
    assert [(c.sub, c.commented) for c in cmds] == [("rollout", False), ("rlhf", False)]
    assert cmds[0].argv == ["--model", "Qwen/Qwen3-1.7B"] and cmds[0].env == {"CUDA_VISIBLE_DEVICES": "2"}
    assert launchers == []


def test_indented_commented_block_between_prose(mx):
    # run_grpo_sudoku_server.sh's shape: numbered prose, another command, then the server, indented
    text = """# ====
#    1. Start the env server:
#       TEXTARENA_ENV_ID=Sudoku-v0 \\
#         python examples/start_sudoku_server.py
#
#    2. Start vLLM rollout server (separate terminal):
#       CUDA_VISIBLE_DEVICES=0 \\
#       swift rollout \\
#           --model Qwen/Qwen3.5-4B \\
#           --max_turns 3\\
#           --use_gym_env true
#
#    3. This script starts training in server mode
""" + TRAIN
    cmds, _ = _extract(mx, text)
    assert [c.sub for c in cmds] == ["rollout", "rlhf"]
    assert cmds[0].argv == ["--model", "Qwen/Qwen3.5-4B", "--max_turns", "3", "--use_gym_env", "true"]


def test_rollout_alone_is_skipped(mx):
    cmds, launchers = _extract(mx, "CUDA_VISIBLE_DEVICES=0 swift rollout --model Qwen/Qwen3-1.7B\n")
    assert [c.sub for c in cmds] == ["rollout"]
    assert mx.skip_reason("examples/x.sh", cmds, launchers) == "no swift sft/pt/rlhf/export command (swift rollout)"


def test_multimodal_rollout_model_is_skipped(mx):
    cmds, launchers = _extract(mx, "swift rollout --model Qwen/Qwen2.5-VL-7B-Instruct\n" + TRAIN)
    assert mx.skip_reason("examples/x.sh", cmds, launchers).startswith("multimodal model")


def _cmd(mx, argv, sub="rollout", env=None):
    return mx.Command("examples/x.sh", sub, env or {}, argv)


def test_ports_two_placeholder_servers(mx):
    # server_multi_node.sh: two servers on `<nodeN_port>`, the training names both hosts and ports
    rollouts = [_cmd(mx, ["--model", "M", "--port", f"<node{n}_port>"]) for n in (1, 2)]
    ports = mx.server_ports(rollouts, [41001, 41002])
    assert ports == {"<node1_port>": 41001, "<node2_port>": 41002}
    assert mx.rollout_argv(rollouts[1].argv, ports, None) == ["--model", "M", "--port", "41002"]
    train = ["--use_vllm", "true", "--vllm_server_host", "<node1_ip>", "<node2_ip>",
             "--vllm_server_port", "<node1_port>", "<node2_port>", "--max_steps", "2"]
    assert mx.training_argv(train, ports) == ["--use_vllm", "true", "--vllm_server_host", "127.0.0.1", "127.0.0.1",
                                              "--vllm_server_port", "41001", "41002", "--max_steps", "2"]


def test_ports_default_8000(mx):
    ports = mx.server_ports([_cmd(mx, ["--model", "M"])], [42000])
    assert ports == {"8000": 42000}
    # the server gets --port; a training command without a port (the 8000 default) gets --vllm_server_port
    assert mx.rollout_argv(["--model", "M"], ports, "transformers") == [
        "--model", "M", "--port", "42000", "--infer_backend", "transformers"]
    assert mx.training_argv(["--vllm_mode", "server", "--vllm_server_host", "xxx"], ports) == [
        "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port", "42000"]
    # a port naming no server (sudoku: server on 8000, training on 8001) is the only server's
    assert mx.training_argv(["--vllm_server_port", "8001"], ports) == ["--vllm_server_port", "42000"]
    assert mx.training_argv(["--vllm_server_base_url", "http://10.0.0.1:8000/v1", "http://<ip>"], ports) == [
        "--vllm_server_base_url", "http://127.0.0.1:42000/v1", "http://127.0.0.1:42000"]


def test_backend_replaces_written_one(mx):
    ports = {"8000": 43000}
    assert mx.rollout_argv(["--infer_backend", "vllm", "--model", "M"], ports, "transformers") == [
        "--infer_backend", "transformers", "--model", "M", "--port", "43000"]
    assert mx.rollout_argv(["--infer_backend", "vllm"], ports, None) == ["--infer_backend", "vllm", "--port", "43000"]


def test_node_steps(mx):
    a = _cmd(mx, [], "rlhf", {"NNODES": "2", "NODE_RANK": "0"})
    b = _cmd(mx, [], "rlhf", {"NNODES": "2", "NODE_RANK": "1"})
    c = _cmd(mx, [], "export")
    assert mx.node_steps([a, b, c]) == [[a, b], [c]]
    assert mx.node_steps([a, a]) == [[a], [a]]       # the same rank twice: one after the other
    assert mx.node_steps([c, c]) == [[c], [c]]


def test_plan_wires_servers_to_training(mx):
    text = """swift rollout --model Qwen/Qwen2.5-7B-Instruct --port <node1_port>
swift rollout --model Qwen/Qwen2.5-7B-Instruct --port <node2_port>
NNODES=2 NODE_RANK=0 MASTER_PORT=29500 swift rlhf --rlhf_type grpo --model Qwen/Qwen2.5-7B-Instruct \\
    --use_vllm true --vllm_mode server --vllm_server_host <node1_ip> <node2_ip> \\
    --vllm_server_port <node1_port> <node2_port> --dataset AI-MO/NuminaMath-TIR#1000
NNODES=2 NODE_RANK=1 MASTER_ADDR=<node3_ip> MASTER_PORT=29500 swift rlhf --rlhf_type grpo \\
    --model Qwen/Qwen2.5-7B-Instruct --use_vllm true --vllm_mode server --vllm_server_host <node1_ip> <node2_ip> \\
    --vllm_server_port <node1_port> <node2_port> --dataset AI-MO/NuminaMath-TIR#1000
"""
    cmds, _ = _extract(mx, text)
    models = {k: Path(f"/m/{k}") for k in ("qwen2", "llama", "moe", "awq", "gptq", "teacher")}
    files = {"grpo": Path("/d/grpo.jsonl")}
    plan = mx.make_plan("examples/x.sh", cmds, models, files, None, 29999, "transformers")
    assert plan.rollout == "transformers" and len(plan.steps) == 1 and len(plan.steps[0]) == 2
    served = [int(mx.opt_values(argv, "port")[0]) for _, argv in plan.servers]
    assert len(set(served)) == 2 and all(mx.opt_values(argv, "model") == ["/m/qwen2"] for _, argv in plan.servers)
    for env, argv, sub in plan.steps[0]:
        assert sub == "rlhf" and env["MASTER_PORT"] == "29999" and env.get("MASTER_ADDR", "127.0.0.1") == "127.0.0.1"
        assert [int(p) for p in mx.opt_values(argv, "vllm_server_port")] == served
        assert mx.opt_values(argv, "vllm_server_host") == ["127.0.0.1", "127.0.0.1"]
        assert mx.opt_values(argv, "dataset") == ["/d/grpo.jsonl#1000"]
    assert mx.make_plan("examples/x.sh", [c for c in cmds if c.sub != "rollout"], models, files, None, 1,
                        "transformers").rollout == ""


def test_a_commented_deploy_block_is_a_gkd_teacher_server(mx):
    """teacher_server.sh: `# swift deploy ...` (the teacher) runs as `swiftlite deploy`, and the training's
    --teacher_model_server points at it; nothing of GRPO's server mode is added."""
    text = """# CUDA_VISIBLE_DEVICES=0 \\
# swift deploy \\
#     --model Qwen/Qwen3.5-4B \\
#     --infer_backend vllm \\
#     --port 8000 \\
#     --max_logprobs 64

NPROC_PER_NODE=4 swift rlhf --rlhf_type gkd --model Qwen/Qwen3.5-4B \\
    --teacher_model_server http://localhost:8000 --gkd_logits_topk 64 --use_vllm true --vllm_mode colocate \\
    --dataset modelscope/gsm8k
"""
    cmds, _ = _extract(mx, text)
    assert [c.sub for c in cmds] == ["deploy", "rlhf"] and cmds[0].commented
    models = {k: Path(f"/m/{k}") for k in ("qwen2", "llama", "moe", "awq", "gptq", "teacher")}
    files = type("Files", (dict,), {"__missing__": lambda self, k: Path(f"/d/{k}.jsonl")})()
    plan = mx.make_plan("examples/x.sh", cmds, models, files, None, 29999, "transformers")
    (_, argv), = plan.servers
    port = mx.opt_values(argv, "port")[0]
    assert argv[0] == "deploy" and mx.opt_values(argv, "infer_backend") == ["transformers"] and port != "8000"
    assert mx.opt_values(argv, "max_logprobs") == ["64"] and plan.rollout == "transformers"
    (_, train, sub), = plan.steps[0]
    assert mx.opt_values(train, "teacher_model_server") == [f"http://127.0.0.1:{port}"]
    assert mx.opt_values(train, "vllm_server_port") is None and mx.opt_values(train, "vllm_mode") == ["colocate"]


def test_cpu_stand_ins_swap_only_the_gpu_only_flags(mx):
    argv = ["--model", "m", "--attn_impl", "flash_attn", "--use_liger_kernel", "true", "--use_vllm", "true",
            "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.4", "--sleep_level", "1",
            "--offload_model", "true", "--offload_optimizer", "true", "--beta", "0.0", "--max_steps", "2"]
    out, subs = mx.cpu_stand_ins(argv)
    assert out == ["--model", "m", "--attn_impl", "sdpa", "--beta", "0.0", "--max_steps", "2"]
    assert subs == ["attn_impl flash_attn -> sdpa", "no liger", "generate, not colocated vLLM"]
    server = ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1", "--attn_impl", "sdpa"]
    assert mx.cpu_stand_ins(server) == (server, [])                  # a rollout server runs on CPU already
    assert mx.cpu_stand_ins(["--use_liger_kernel", "false"]) == (["--use_liger_kernel", "false"], [])


# examples/train/rlhf/gkd/teacher_server.sh's shape: spaced arithmetic in an assignment
GKD = """top_k=64
max_prompt_length=2048
max_total_length=$((max_prompt_length + 2048))
NPROC_PER_NODE=4 \\
swift rlhf \\
    --rlhf_type gkd \\
    --model Qwen/Qwen2.5-7B \\
    --teacher_model Qwen/Qwen2.5-14B-Instruct \\
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#2000' 'AI-ModelScope/NuminaMath-TIR#5000' new_dataset.jsonl \\
    --gkd_logits_topk $top_k \\
    --vllm_max_model_len $max_total_length
"""


def test_gkd_is_run_with_a_local_teacher_and_sft_rows(mx):
    cmds, launchers = _extract(mx, GKD)
    assert [c.sub for c in cmds] == ["rlhf"] and mx.skip_reason("examples/x.sh", cmds, launchers) is None
    assert cmds[0].opt("gkd_logits_topk") == ["64"] and cmds[0].opt("vllm_max_model_len") == ["4096"]
    models = {k: Path(f"/m/{k}") for k in ("qwen2", "llama", "moe", "awq", "gptq", "teacher")}
    files = {k: Path(f"/d/{k}.jsonl") for k in ("alpaca", "messages", "messages_solution", "grpo")}
    _, argv = mx.translate(cmds[0], models, files, None, 29500)
    assert mx.opt_values(argv, "model") == ["/m/qwen2"]
    assert mx.opt_values(argv, "teacher_model") == ["/m/teacher"]   # another model: other weights
    same = mx.Command("examples/x.sh", "rlhf", {}, ["--rlhf_type", "gkd", "--model", "Qwen/Qwen3-4B",
                                                    "--teacher_model", "Qwen/Qwen3-4B"])   # opsd.sh: itself
    assert mx.opt_values(mx.translate(same, models, files, None, 1)[1], "teacher_model") == ["/m/qwen2"]
    # GKD trains on sft rows: a GRPO prompt set (NuminaMath-TIR) is read as chat messages with their answers, and
    # its solution column (a multi-turn scheduler's)
    assert mx.opt_values(argv, "dataset") == ["/d/alpaca.jsonl#2000", "/d/messages_solution.jsonl#5000",
                                              "/d/messages.jsonl"]
    grpo = mx.Command("examples/x.sh", "rlhf", {}, ["--rlhf_type", "grpo", "--dataset", "AI-MO/NuminaMath-TIR"])
    assert mx.opt_values(mx.translate(grpo, models, files, None, 1)[1], "dataset") == ["/d/grpo.jsonl"]
    ppo = mx.Command("examples/x.sh", "rlhf", {}, ["--rlhf_type", "ppo", "--model", "m"])
    assert mx.skip_reason("examples/x.sh", [ppo], []) == "--rlhf_type ppo (no such training type here)"


def test_swift_infer_result_is_a_dataset_of_its_rows(mx):
    # examples/train/rlhf/gkd/fast.sh: `swift infer` writes new_dataset.jsonl (not run here), GKD trains on it
    text = """export teacher_model='Qwen/Qwen2.5-14B-Instruct'
swift infer --model $teacher_model --val_dataset 'AI-ModelScope/alpaca-gpt4-data-en#5000' \\
    'AI-ModelScope/alpaca-gpt4-data-zh#5000' --result_path new_dataset.jsonl
swift rlhf --rlhf_type gkd --model Qwen/Qwen2.5-7B --teacher_model $teacher_model --dataset 'new_dataset.jsonl'
"""
    cmds, launchers = _extract(mx, text)
    assert [c.sub for c in cmds] == ["rlhf"] and launchers == ["swift infer"]
    assert cmds[0].opt("dataset") == ["new_dataset.jsonl#10000"]
    assert cmds[0].opt("teacher_model") == ["Qwen/Qwen2.5-14B-Instruct"]
    files = {"messages": Path("/d/messages.jsonl")}
    assert mx.local_dataset("new_dataset.jsonl#10000", files, cmds[0]) == "/d/messages.jsonl#10000"


def test_a_cached_dataset_export_gets_enough_rows_to_pack(mx):
    """examples/train/cached_dataset/sft.sh exports a whole hub dataset (no #N) and packs it into 8192-token
    sequences, 8 per step: its local stand-in is sampled to CACHED_ROWS rows; an export with #N keeps its N."""
    files = {k: Path(f"/d/{k}.jsonl") for k in ("messages", "text")}
    cached = mx.Command("examples/x.sh", "export", {}, ["--dataset", "swift/x-SFT", "--to_cached_dataset", "true"])
    assert mx.local_dataset("swift/x-SFT", files, cached) == f"/d/messages.jsonl#{mx.CACHED_ROWS}"
    assert mx.local_dataset("swift/x-SFT#100", files, cached) == "/d/messages.jsonl#100"
    plain = mx.Command("examples/x.sh", "sft", {}, ["--dataset", "swift/x-SFT"])
    assert mx.local_dataset("swift/x-SFT", files, plain) == "/d/messages.jsonl"
