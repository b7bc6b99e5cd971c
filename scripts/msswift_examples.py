"""ms-swift's own example scripts, run with swiftlite with only the model and the datasets replaced.

Reads ms-swift's public repository (a bare git mirror; default /work/.mirror/modelscope+ms-swift/repo,
--mirror) at its HEAD: every `.sh` under examples/train and examples/export. Each `swift sft|pt|rlhf|export`
command of a text-LLM script is extracted (shell variables, `$(expr ...)` and line continuations
resolved), and run as `python -m swiftlite ...` with:

- its environment assignments kept, except NPROC_PER_NODE capped at 2 (this machine has 2 cores; --max-nproc N
  for another cap, where a script's batch sizes need its own process count, such as GRPO's groups; never
  below the script's --sequence_parallel_size, whose group needs that many ranks) and
  CUDA_VISIBLE_DEVICES dropped; MASTER_PORT becomes a free port (the written one may be taken here), and a
  placeholder MASTER_ADDR (`xxx.xxx.xxx.xxx`, the other node's script) this machine's 127.0.0.1;
- `--model` (and `--ref_model`, `--reward_model`, `--teacher_model`) replaced by a local tiny folder
  built from a config with the repository's tokenizer: a Llama one for a Llama model, a Qwen3-MoE one for
  a mixture of experts (an `-A3B`-style or MoE id), a Qwen2 one
  otherwise; a pre-quantized AWQ/GPTQ model gets a tiny folder carrying that quantization_config; a
  `--teacher_model` other than the script's `--model` gets the Qwen2 folder's shape with other weights; a
  `--reward_model` a tiny one-output Qwen2 classifier when its id names a reward model, else a tiny Qwen2 chat
  model of 3072 positions as a generative judge (a random judge never ends an answer early);
- `--dataset` / `--val_dataset` replaced by local files of the same format (`#N` and `:subset` kept as
  `#N`; a `--to_cached_dataset true` export of a whole hub dataset gets `#CACHED_ROWS`, enough rows to pack): alpaca rows, chat messages, tool-calling rows (ms-swift's agent format), query/response,
  self-cognition rows (query/response/tag with {{NAME}}/{{AUTHOR}}), preference pairs, KTO rows, GRPO prompts with a solution column, plain text;
  GRPO's `--chord_sft_dataset` (CHORD's expert rows) by the chat-messages file, and so is a GRPO prompt set
  under `--rlhf_type gkd` (GKD trains on sft rows: ms-swift's loader gives NuminaMath-TIR's `messages` with its
  `solution` column, gsm8k's question/answer, as a question and its answer); a file an earlier `swift infer` of the script
  writes (GKD's `new_dataset.jsonl`; that command is not run) is replaced the same way, with as many rows as
  it would hold (`#N`, the sum of that command's `--val_dataset` counts);
- a placeholder checkpoint path (`--adapters`/`--ckpt_dir output/vx-xxx/checkpoint-xxx`) replaced by a
  LoRA checkpoint trained here first (the scripts name the output of an earlier training run);
- `--max_steps 2` appended to a training command; nothing else changes.

Rollout servers (`swift rollout`, the generation server of GRPO's `--vllm_mode server`):

- extracted: a script's live `swift rollout` commands; a script whose training command has `--vllm_mode
  server` and that has no live one gets the rollout commands of its commented-out blocks
  (`# CUDA_VISIBLE_DEVICES=6,7 \\` / `# swift rollout \\` / `#     --model ...`, each line's `#` stripped:
  the README says to start that server first);
- run as `python -m swiftlite rollout ...` in the background before the script's training commands, the
  flags kept, `--model` replaced as above; the training starts once every server's `GET /health/` answers
  200 (--rollout-wait seconds at most). A server that exits first (no GPU, a refused flag) classifies the
  script from its exit as a failed command would (error text `rollout: ...`), and the training does not run.
  The servers are stopped after the training (SIGTERM, then SIGKILL); one that exited on its own meanwhile
  makes the script a crash;
- addresses: a script's servers all run on this machine, and the written port may be taken here (as
  MASTER_PORT's), so each server port a rollout command names (`--port`, ms-swift's 8000 when none,
  `<node1_port>` placeholders too) becomes a free port, given to the server as `--port` and, by value, to the
  training command's `--vllm_server_port` (or the port of its `--vllm_server_base_url`); a value naming none
  of the script's servers becomes the only server's port; a training command relying on the 8000 default
  gets `--vllm_server_port`. Every `--vllm_server_host` (`xxx`, `<node1_ip>`, 127.0.0.1) becomes 127.0.0.1;
- --rollout-backend transformers appends `--infer_backend transformers` to every rollout command (default:
  as written, vLLM, which needs a GPU) and drops its `--vllm_tensor_parallel_size` (how vLLM shards its engine
  over GPUs; the transformers engine is one process), so that a CPU machine runs these scripts end to end
  (their training commands as written); such results say
  `rollout: transformers` (the json's `rollout` field, the table's error column).

--cpu-stand-ins checks what the `gpu` class claims, that only the GPU stands between a script and a run: each
training command's GPU-only flags are swapped for what runs on a CPU, and the result says which
(`stand-ins: ...`, the json's `stand_ins` field): `--attn_impl flash_*` becomes sdpa, `--use_liger_kernel
true` is dropped (the exact chunked loss), and a colocated vLLM engine (`--use_vllm true`, not server mode)
becomes transformers' generate (`--use_vllm`, `--vllm_mode` and the colocated engine's options dropped:
every `--vllm_*`, `--sleep_level`, `--offload_model`, `--offload_optimizer`, `--move_model_batches`).
With --rollout-backend transformers too, a script whose class is `gpu` without them should run.

Each command runs first with --dry-run, then for real (in a fresh folder whose `examples/` is the mirror's, so
relative paths in a script resolve as they do in ms-swift's repository root; the nodes of a multi-node pair
run at once, whether two scripts or consecutive commands of one script, each its NODE_RANK). Scripts run one
group at a time (a script, or the scripts of a multi-node pair), so servers of different groups never overlap.
The table: script, class, first line of the error:

- runs: every command of the script exited 0, dry run and real run (`export` has no dry run: it runs once);
- refused: exit 2 with one `error:` line per refused flag and no traceback (the first is shown, with how many
  more);
- gpu: refused the same way, every line because this machine has no GPU (flash attention, Liger's Triton
  kernels): a GPU would pass them;
- crash: anything else (a traceback, another exit code, a timeout).

Skipped, each with its reason: multimodal models or data, Megatron, files without a `swift sft|pt|rlhf|export`
command (infer, deploy, sample, app, a rollout server alone), ms-swift's Python entry under another launcher
(accelerate, torchrun, deepspeed: no `swift` command), and training types swiftlite does not have
(classification, embedding, reranker, PPO, ...).

    python scripts/msswift_examples.py [--only SUBSTR ...] [--json out.json] [--timeout 600]
        [--rollout-backend {vllm,transformers}] [--cpu-stand-ins] [--rollout-wait 120] [--list] [--dry-only]

--dry-only runs the dry runs alone (no training, no export): a quick sort of the scripts into refused and
gpu; its `runs` means only that the dry run passed, and scripts that need a rollout server or an export's
folder are listed as `not-dry` (run them without it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIRROR = Path("/work/.mirror/modelscope+ms-swift/repo")
COMMANDS = ("sft", "pt", "rlhf", "export")
ROLLOUT = "rollout"      # `swift rollout`: a training command's generation server
DEPLOY = "deploy"        # `swift deploy`: GKD's teacher server (--teacher_model_server)
SERVERS = (ROLLOUT, DEPLOY)
SERVER_PORT = "8000"     # ms-swift's default `swift rollout --port` and `--vllm_server_port`

# ---------------------------------------------------------------- reading the scripts

MULTIMODAL_MODEL = re.compile(r"(VL|Omni|vision|Vision|llava|InternVL|Audio|-V-|MiniCPM-V|glm-4v|Ovis|Kimi-VL|"
                              r"Phi-3-vision|Florence|deepseek-vl|qwen2-vl|Janus|Emu|Keye|mPLUG|molmo|paligemma|"
                              r"GLM-4\.\dV|Qwen3-VL|Step-Audio)", re.I)
MULTIMODAL_DATA = re.compile(r"(coco|LaTeX_OCR|RLAIF-V|TextCaps|VideoChatGPT|clevr|chartqa|multimodal|aishell|"
                             r"garbage265|voc2007|visual_toolbox|geoqa|MathV|OCR)", re.I)
#: ms-swift training types swiftlite does not have (its --task_type / --rlhf_type values).
OTHER_TASKS = {"seq_cls", "embedding", "reranker", "generative_reranker"}
OTHER_RLHF = {"ppo", "opsd", "gym"}


def opt_values(argv: list[str], name: str) -> list[str] | None:
    """The values of --name in argv (None when absent; [] for a bare flag)."""
    for i, a in enumerate(argv):
        if a == f"--{name}":
            vals = []
            for b in argv[i + 1:]:
                if b.startswith("--"):
                    break
                vals.append(b)
            return vals
    return None


def set_opt(argv: list[str], name: str, values: list[str]) -> list[str]:
    """argv with the values of --name replaced (--name appended when absent)."""
    for i, a in enumerate(argv):
        if a == f"--{name}":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            return [*argv[:i + 1], *values, *argv[j:]]
    return [*argv, f"--{name}", *values]


def drop_opt(argv: list[str], name: str) -> list[str]:
    """argv without --name and its values."""
    for i, a in enumerate(argv):
        if a == f"--{name}":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            return [*argv[:i], *argv[j:]]
    return argv


@dataclass
class Command:
    script: str
    sub: str                  # sft | pt | rlhf | export | rollout | deploy
    env: dict[str, str]
    argv: list[str]           # after `swift SUB`
    commented: bool = False   # a server command from a commented-out block

    def opt(self, name: str) -> list[str] | None:
        """The values of --name (None when absent; [] for a bare flag)."""
        return opt_values(self.argv, name)

    def server_mode(self) -> bool:
        """A training command that asks a running server: GRPO's (GKD's) rollout server for its generations,
        or GKD's teacher server."""
        return self.sub == "rlhf" and ((self.opt("vllm_mode") or [""])[0] == "server"   # ms-swift: no default mode
                                       or bool(self.opt("teacher_model_server")))


def git_show(mirror: Path, path: str) -> str:
    return subprocess.run(["git", "-C", str(mirror), "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout


def list_scripts(mirror: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(mirror), "ls-tree", "-r", "--name-only", "HEAD", "examples/train",
                          "examples/export"], check=True, capture_output=True, text=True).stdout
    return sorted(p for p in out.split() if p.endswith(".sh"))


def logical_lines(text: str) -> list[str]:
    """Comment lines dropped, backslash continuations joined."""
    lines, cur = [], ""
    for raw in text.splitlines():
        s = raw.rstrip()
        if not cur and s.lstrip().startswith("#"):
            continue
        if s.lstrip().startswith("#"):   # a comment line inside a continued command
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        if cur.strip():
            lines.append(cur.strip())
        cur = ""
    if cur.strip():
        lines.append(cur.strip())
    return lines


def _expand(s: str, shell: dict[str, str]) -> str:
    def arith(m: re.Match) -> str:
        expr = m.group(1).replace("\\*", "*")
        expr = re.sub(r"\b/\b|\s/\s", " // ", expr)
        expr = re.sub(r"\b[A-Za-z_]\w*\b", lambda v: shell.get(v.group(0), v.group(0)), expr)
        try:   # integers from the script's own variables
            return str(eval(expr, {"__builtins__": {}}, {}))
        except Exception:
            return m.group(0)
    for _ in range(3):
        s = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: shell.get(m.group(1) or m.group(2), ""), s)
        s = re.sub(r"\$\(\(\s*([^)]*)\)\)", arith, s)
        s = re.sub(r"\$\(expr ([^)]*)\)", arith, s)
    return s


ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)=(\S*)$")


def _split(line: str, shell: dict[str, str]) -> tuple[dict[str, str], list[str]] | None:
    """(leading VAR=value assignments, the rest) of one command line; None when the shell can't split it."""
    try:
        toks = shlex.split(_expand(line, shell))
    except ValueError:
        return None
    env: dict[str, str] = {}
    i = 0
    while i < len(toks) and re.match(r"^[A-Za-z_]\w*=", toks[i]):
        k, _, v = toks[i].partition("=")
        env[k] = v
        i += 1
    return env, toks[i:]


def extract(path: str, text: str, platform: dict[str, str]) -> tuple[list[Command], list[str]]:
    """The swift commands of one script (rollout servers included), and the other launchers found in it."""
    shell = dict(platform)
    cmds, launchers = [], []
    written: dict[str, int] = {}   # `swift infer --result_path F`: F -> its rows (one per --val_dataset row)
    for line in logical_lines(text):
        m = ASSIGN.match(line)
        if m:
            shell[m.group(1)] = _expand(m.group(2).strip("'\""), shell)
            continue
        split = _split(line, shell)
        if split is None:
            continue
        env, rest = split
        if not rest:   # assignments alone, ASSIGN's one word apart (`a=$((b + c))`, a quoted value): shell variables
            shell.update(env)
            continue
        if len(rest) >= 2 and rest[0] == "swift" and rest[1] in COMMANDS:
            if re.search(r"\$\{?(RANK|WORLD_SIZE|MASTER_ADDR)\b", text):
                # a platform script (PAI-DLC): the platform sets these in the process environment too
                env = {**{k: v for k, v in platform.items() if k not in env}, **env}
            cmds.append(Command(path, rest[1], env, rest[2:]))
        elif rest[:2] == ["swift", ROLLOUT]:
            cmds.append(Command(path, ROLLOUT, env, rest[2:]))
        elif rest and rest[0] in ("accelerate", "torchrun", "deepspeed", "python") and "swift/cli" in line:
            launchers.append(rest[0])
        elif rest and rest[0] == "megatron":
            launchers.append("megatron")
        elif len(rest) >= 2 and rest[0] == "swift":
            launchers.append(f"swift {rest[1]}")
            result = opt_values(rest, "result_path")
            counts = [v.partition("#")[2] for v in opt_values(rest, "val_dataset") or []]
            if rest[1] == "infer" and result and counts and all(n.isdigit() for n in counts):
                written[result[0]] = sum(map(int, counts))
    for c in cmds:   # a later command's `--dataset F` (GKD's new_dataset.jsonl): as many rows as F would have
        if written and c.opt("dataset"):
            c.argv = set_opt(c.argv, "dataset", [f"{v}#{written[v]}" if v in written else v for v in c.opt("dataset")])
    if not any(c.sub in SERVERS for c in cmds) and any(c.server_mode() for c in cmds):
        cmds[:0] = commented_rollouts(path, text, shell)
    return cmds, launchers


def commented_rollouts(path: str, text: str, shell: dict[str, str]) -> list[Command]:
    """The `swift rollout` (and `swift deploy`: a GKD teacher server) commands of a script's commented-out blocks
    (`# swift rollout \\` / `#     --model ...`): each run of comment lines with its `#` stripped, read as shell
    lines."""
    blocks, cur = [], []
    for raw in [*text.splitlines(), ""]:
        m = re.match(r"\s*#(.*)$", raw)
        if m:
            cur.append(m.group(1))
        elif cur:
            blocks.append("\n".join(cur))
            cur = []
    out = []
    for block in blocks:
        for line in logical_lines(block):
            split = _split(line, shell)
            if split and split[1][:1] == ["swift"] and split[1][1:2] and split[1][1] in SERVERS:
                out.append(Command(path, split[1][1], split[0], split[1][2:], commented=True))
    return out


def node_steps(cmds: list[Command]) -> list[list[Command]]:
    """A script's commands in run order, one list per step: consecutive commands that are the nodes of one
    multi-node job (NNODES > 1, each its NODE_RANK) share a step, as they must run at once."""
    steps: list[list[Command]] = []
    for c in cmds:
        nn, last = c.env.get("NNODES", "1") or "1", steps[-1] if steps else []
        if (int(nn) > 1 and "NODE_RANK" in c.env and last and len(last) < int(nn)
                and all(p.env.get("NNODES") == nn and p.env.get("NODE_RANK") not in (None, c.env["NODE_RANK"])
                        for p in last)):
            last.append(c)
        else:
            steps.append([c])
    return steps


def skip_reason(path: str, cmds: list[Command], launchers: list[str]) -> str | None:
    text_all = " ".join(" ".join(c.argv) for c in cmds)
    if "megatron" in path or "megatron" in launchers:
        return "Megatron (its training half runs under `megatron sft`)"
    if all(c.sub in SERVERS for c in cmds):
        other = sorted({*launchers, *(f"swift {c.sub}" for c in cmds)})   # a rollout server alone
        if any(lch in ("accelerate", "torchrun", "deepspeed", "python") for lch in other):
            return f"ms-swift's Python entry under {'/'.join(x for x in other if not x.startswith('swift'))}, no swift command"
        return f"no swift sft/pt/rlhf/export command ({', '.join(other) or 'none'})"
    for c in cmds:
        for name in ("model", "ref_model", "reward_model", "teacher_model"):
            for v in c.opt(name) or []:
                if MULTIMODAL_MODEL.search(v):
                    return f"multimodal model {v}"
        for v in (c.opt("dataset") or []) + (c.opt("val_dataset") or []):
            if MULTIMODAL_DATA.search(v):
                return f"multimodal dataset {v}"
    if any(a.endswith((".yaml", ".yml")) and not a.startswith("--") for c in cmds for a in c.argv[:1]):
        return "a YAML config for ms-swift's Ray launcher (use_ray: true, device_groups)"
    if any(re.search(r"\bbert\b|bert-|_bert\b", v, re.I) for c in cmds
           for v in (c.opt("model") or []) + (c.opt("adapters") or [])):
        return "BERT (an encoder, not a causal LM)"
    if re.search(r"multimodal|omni|mllm", path):
        return "multimodal (folder)"
    for c in cmds:
        task = (c.opt("task_type") or [""])[0]
        if task in OTHER_TASKS:
            return f"--task_type {task} (no such training type here)"
        rl = (c.opt("rlhf_type") or [""])[0]
        if c.sub == "rlhf" and rl in OTHER_RLHF:
            return f"--rlhf_type {rl} (no such training type here)"
    if "embedding" in text_all or "reranker" in path:
        return "embedding/reranker (no such training type here)"
    return None


# ---------------------------------------------------------------- local stand-ins

def _row_text(i: int) -> tuple[str, str]:
    word = "".join(chr(97 + (i * 7 + k) % 26) for k in range(3 + i % 5))
    return f"Reverse the word {word}.", word[::-1]


def write_data(d: Path, n: int = 64) -> dict[str, Path]:
    """One small local file per hub dataset format the scripts use."""
    d.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {k: [] for k in ("alpaca", "messages", "messages_solution", "query_response",
                                                   "self_cognition", "preference", "kto", "grpo", "text", "agent")}
    tool = {"name": "reverse", "description": "Reverse a word",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}
    for i in range(n):
        q, a = _row_text(i)
        rows["alpaca"].append({"instruction": q, "input": "", "output": a})
        rows["messages"].append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        rows["query_response"].append({"query": q, "response": a})
        rows["self_cognition"].append({"query": "Who are you?" if i % 2 else "你是谁？",
                                       "response": f"I am {{{{NAME}}}}, made by {{{{AUTHOR}}}} ({i}).",
                                       "tag": "en" if i % 2 else "zh"})
        rows["preference"].append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                   "rejected_response": a[::-1] + "x"})
        rows["kto"].append({"prompt": [{"role": "user", "content": q}],
                            "completion": [{"role": "assistant", "content": a if i % 2 else a + "!"}],
                            "label": bool(i % 2)})
        # `problem` too, as NuminaMath-TIR's rows keep it (ms-swift's math_env reads it: grpo/external/vllm_gym.sh)
        rows["grpo"].append({"messages": [{"role": "user", "content": q}], "problem": q, "solution": a})
        rows["messages_solution"].append({"messages": [{"role": "user", "content": q},
                                                       {"role": "assistant", "content": a}], "solution": a})
        rows["text"].append({"text": f"{q} {a}. " * 3})
    # ms-swift's agent format (AI-ModelScope/function-calling-chatml after its preprocessing): tools, a tool
    # call, its response, the answer. Twice as many rows: its scripts pack them into 8192-token sequences
    # with 8 per step (agent/qwen2_5.sh, deepseek_r1.sh), which 64 rows of this tokenizer's bytes do not fill
    for i in range(2 * n):
        q, a = _row_text(i)
        rows["agent"].append({"tools": [json.dumps(tool)], "messages": [
            {"role": "user", "content": q},
            {"role": "tool_call", "content": json.dumps({"name": "reverse", "arguments": {"word": a[::-1]}})},
            {"role": "tool_response", "content": a}, {"role": "assistant", "content": a}]})
    out = {}
    for k, rs in rows.items():
        p = d / f"{k}.jsonl"
        p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rs))
        out[k] = p
    return out


#: hub id (before `#N` / `:subset`) -> the local format of its rows, as ms-swift's loader gives them.
HUB_FORMAT = {
    "AI-ModelScope/alpaca-gpt4-data-zh": "alpaca", "AI-ModelScope/alpaca-gpt4-data-en": "alpaca",
    "AI-ModelScope/LongAlpaca-12k": "alpaca", "swift/self-cognition": "self_cognition",
    "hjh0119/shareAI-Llama3-DPO-zh-en-emoji": "preference", "AI-ModelScope/orpo-dpo-mix-40k": "preference",
    "AI-ModelScope/ultrafeedback-binarized-preferences-cleaned-kto": "kto",
    "AI-MO/NuminaMath-TIR": "grpo", "AI-ModelScope/NuminaMath-TIR": "grpo", "modelscope/gsm8k": "grpo",
    # NuminaMath-CoT's `messages` column holds the problem and its worked solution (a chat row; its
    # only script, full/dft.sh, is sft)
    "AI-MO/NuminaMath-CoT": "messages", "open-r1/OpenThoughts-114k-math": "grpo",
    "AI-ModelScope/function-calling-chatml": "agent",
    "swift/chinese-c4": "text", "lvjianjin/AdvertiseGen": "query_response", "AI-ModelScope/ruozhiba": "text",
}


def local_dataset(spec: str, files: dict[str, Path], cmd: Command) -> str:
    base, _, n = spec.partition("#")
    hub = base.split(":")[0]
    kind = HUB_FORMAT.get(hub)
    rl = (cmd.opt("rlhf_type") or [""])[0]
    if kind == "grpo" and rl == "gkd":   # GKD's rows are sft ones: the problem and its solution as the answer
        # (NuminaMath-TIR's rows also keep their `solution` column, which a multi-turn scheduler verifies against)
        kind = "messages_solution" if "NuminaMath-TIR" in hub else "messages"
    if kind is None:
        kind = {"grpo": "grpo", "kto": "kto", "dpo": "preference", "orpo": "preference", "simpo": "preference",
                "cpo": "preference", "rm": "preference"}.get(rl, "text" if cmd.sub == "pt" else "messages")
    if not n and cmd.sub == "export" and (cmd.opt("to_cached_dataset") or ["false"])[0].lower() == "true":
        n = str(CACHED_ROWS)   # the hub dataset's size stands in: the cached rows are packed into long sequences
    return str(files[kind]) + (f"#{n}" if n else "")


#: Rows a `--to_cached_dataset true` export of a whole hub dataset (no `#N`) gets from the local file (ms-swift's
#: `#N` sampling, repeating it): its scripts pack the cached rows into 8192-token sequences, 8 per step, which
#: the 64 local rows of this tokenizer's bytes do not fill (the hub's hold 110k rows).
CACHED_ROWS = 3000


def build_models(d: Path) -> dict[str, Path]:
    """Tiny Qwen2, Llama and Qwen3-MoE folders from a config (random weights, bf16) with the repository's tokenizer,
    and pre-quantized-looking folders (AWQ, GPTQ: the config's quantization_config, as the hub's carry)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    # widths of 128 and 256, as real models' are multiples of FP8's 128 x 128 blocks (k/v at 32 are not: both
    # cases); 4 layers: divisible by LLaMA-Pro's default --llamapro_num_new_blocks 4, as real models' 28 or 32 are;
    # 8 heads, as --sequence_parallel_size 8 of ms-swift's scripts splits Qwen2.5-3B's 16
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, eos_token_id=258, pad_token_id=259,
                  bos_token_id=None, dtype="bfloat16")
    cfgs = {"qwen2": Qwen2Config(max_position_embeddings=32768, tie_word_embeddings=False, **common),
            "llama": LlamaConfig(max_position_embeddings=8192, tie_word_embeddings=False, **common),
            # a mixture of experts (Qwen3-30B-A3B and the like): 4 experts, 2 per token
            "moe": Qwen3MoeConfig(max_position_embeddings=32768, tie_word_embeddings=False, moe_intermediate_size=32,
                                  num_experts=4, num_experts_per_tok=2, head_dim=16, **common)}
    out = {}
    for name, cfg in cfgs.items():
        p = d / f"tiny-{name}"
        if not (p / "config.json").is_file():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(p)
            for f in Path(TINY_TOKENIZER).iterdir():
                shutil.copy(f, p / f.name)
        out[name] = p
    # a teacher (--teacher_model naming another model than --model): the Qwen2 folder's shape with other weights,
    # so that distillation (GKD, GRPO's on-policy distillation) has a distance to close
    p = d / "tiny-qwen2-teacher"
    if not (p / "config.json").is_file():
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(cfgs["qwen2"], dtype=torch.bfloat16).save_pretrained(p)
        for f in Path(TINY_TOKENIZER).iterdir():
            shutil.copy(f, p / f.name)
    out["teacher"] = p
    # reward models: a one-output classifier (a hub reward model: the default plugin's score) and a chat model as
    # a generative judge (genrm), the Qwen2 shape with 3072 positions: a random judge never ends its answer and
    # ms-swift's engine generates up to the model's length
    from transformers import AutoModelForSequenceClassification
    for name, cls, extra in (("rm", AutoModelForSequenceClassification, dict(num_labels=1)),
                             ("judge", AutoModelForCausalLM, {})):
        p = d / f"tiny-qwen2-{name}"
        if not (p / "config.json").is_file():
            torch.manual_seed(2)
            conf = Qwen2Config(max_position_embeddings=3072 if name == "judge" else 32768, tie_word_embeddings=False,
                               **common, **extra)
            cls.from_config(conf, dtype=torch.bfloat16).save_pretrained(p)
            for f in Path(TINY_TOKENIZER).iterdir():
                shutil.copy(f, p / f.name)
        out[name] = p
    for method in ("awq", "gptq"):
        p = d / f"tiny-qwen2-{method}"
        if not p.exists():
            shutil.copytree(out["qwen2"], p)
            cfg = json.loads((p / "config.json").read_text())
            cfg["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
            (p / "config.json").write_text(json.dumps(cfg, indent=1))
        out[method] = p
    return out


def local_model(hub: str, models: dict[str, Path]) -> str:
    h = hub.lower()
    if "awq" in h:
        return str(models["awq"])
    if "gptq" in h or "int4" in h or "int8" in h:
        return str(models["gptq"])
    if re.search(r"-a\d+b|moe|mixtral", h):
        return str(models["moe"])
    return str(models["llama" if "llama" in h else "qwen2"])


def free_ports(n: int) -> list[int]:
    """n distinct free ports (their sockets held open together while asking)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


PLACEHOLDER = re.compile(r"x{2,}|vx-|/path/to|<", re.I)


#: NPROC_PER_NODE's cap (--max-nproc): 2 by default, the cores here.
NPROC_CAP = {"n": 2}


def translate(cmd: Command, models: dict[str, Path], files: dict[str, Path], ckpt: Path | None,
              port: int) -> tuple[dict[str, str], list[str]]:
    """(env, swiftlite argv) for one command: only the model, datasets and placeholder checkpoints replaced."""
    env = {k: v for k, v in cmd.env.items() if k != "CUDA_VISIBLE_DEVICES"}
    if "NPROC_PER_NODE" in env:   # never below a --sequence_parallel_size group: it needs that many ranks
        a = cmd.argv
        group = int(a[a.index("--sequence_parallel_size") + 1]) if "--sequence_parallel_size" in a[:-1] else 1
        env["NPROC_PER_NODE"] = str(min(max(NPROC_CAP["n"], group), int(env["NPROC_PER_NODE"] or 1)))
    if "MASTER_PORT" in env:
        env["MASTER_PORT"] = str(port)
    if PLACEHOLDER.search(env.get("MASTER_ADDR", "")):   # `xxx.xxx.xxx.xxx`: node 0's address, this machine here
        env["MASTER_ADDR"] = "127.0.0.1"
    out, i, a = [], 0, cmd.argv
    while i < len(a):
        tok = a[i]
        name = tok[2:] if tok.startswith("--") else None
        j = i + 1
        vals = []
        while j < len(a) and not a[j].startswith("--"):
            vals.append(a[j])
            j += 1
        if name == "teacher_model" and vals and vals != (cmd.opt("model") or []) and \
                local_model(vals[0], models) == str(models["qwen2"]):   # another model: other weights
            out += [tok, str(models["teacher"])]
        elif name == "reward_model" and vals:   # a hub reward model is a classifier; another model judges (genrm)
            out += [tok, *[str(models["rm" if re.search(r"reward|-rm\b", v, re.I) else "judge"]) for v in vals]]
        elif name in ("model", "ref_model", "teacher_model") and vals:
            out += [tok, *[local_model(v, models) for v in vals]]
        elif name in ("dataset", "val_dataset") and vals:
            out += [tok, *[local_dataset(v, files, cmd) for v in vals]]
        elif name == "chord_sft_dataset" and vals:   # CHORD's expert rows: sft data (ms-swift preprocesses them so)
            out += [tok, *[str(files["messages"]) + (f"#{v.partition('#')[2]}" if "#" in v else "") for v in vals]]
        elif name in ("adapters", "ckpt_dir", "resume_from_checkpoint") and vals and PLACEHOLDER.search(vals[0]):
            out += [tok, *([str(ckpt)] if ckpt else vals)]
        else:
            out += [tok, *vals]
        i = j
    if cmd.sub not in ("export", *SERVERS):
        out += ["--max_steps", "2"]
    return env, out


# ---------------------------------------------------------------- rollout servers: this machine's ports

def server_ports(rollouts: list[Command], ports: list[int]) -> dict[str, int]:
    """Each server port a script's rollout commands name (`--port`, 8000 when none, placeholders too) -> one of
    the free ports given, in order."""
    out: dict[str, int] = {}
    for c in rollouts:
        written = (c.opt("port") or [SERVER_PORT])[0]
        if written not in out:
            out[written] = ports[len(out)]
    return out


def rollout_argv(argv: list[str], ports: dict[str, int], backend: str | None) -> list[str]:
    """A rollout command's argv listening on its port here, with --infer_backend BACKEND when one is given."""
    argv = set_opt(argv, "port", [str(ports[(opt_values(argv, "port") or [SERVER_PORT])[0]])])
    if backend == "transformers":   # vLLM's GPU sharding of its engine: the transformers engine is one process
        argv = drop_opt(argv, "vllm_tensor_parallel_size")
    return set_opt(argv, "infer_backend", [backend]) if backend else argv


URL = re.compile(r"^(?P<scheme>[A-Za-z][\w+.-]*://)?(?P<host>\[[^\]]*\]|[^/:]*)(?::(?P<port>[^/]*))?(?P<rest>/.*)?$")


def training_argv(argv: list[str], ports: dict[str, int]) -> list[str]:
    """A server-mode training command's argv pointed at the script's servers on this machine: every host
    127.0.0.1, every port through `ports` (by value; one naming no server is the only server's port when the
    script has one), `--vllm_server_port` added where the command relies on the 8000 default."""
    only = [str(p) for p in ports.values()][:1] if len(ports) == 1 else []

    def port(written: str) -> str:
        return str(ports[written]) if written in ports else (only or [written])[0]

    def local(u: str) -> str:
        m = URL.match(u)
        return f"{m['scheme'] or ''}127.0.0.1:{port(m['port'] or SERVER_PORT)}{m['rest'] or ''}" if m else u
    teacher = opt_values(argv, "teacher_model_server")
    if teacher:   # GKD's teacher server (`swift deploy`); GRPO's server mode only where asked
        argv = set_opt(argv, "teacher_model_server", [local(u) for u in teacher])
        if (opt_values(argv, "vllm_mode") or [""])[0] != "server":
            return argv
    urls = opt_values(argv, "vllm_server_base_url")
    if urls:
        return set_opt(argv, "vllm_server_base_url", [local(u) for u in urls])
    hosts = opt_values(argv, "vllm_server_host")
    if hosts:
        argv = set_opt(argv, "vllm_server_host", ["127.0.0.1"] * len(hosts))
    written = opt_values(argv, "vllm_server_port") or [SERVER_PORT] * max(1, len(hosts or []))
    return set_opt(argv, "vllm_server_port", [port(w) for w in written])


#: --cpu-stand-ins (module docstring)
STAND_INS = {"on": False}
DRY_ONLY = {"on": False}
#: the colocated vLLM engine's options, dropped with --use_vllm by a stand-in
COLOCATED = ("sleep_level", "offload_model", "offload_optimizer", "move_model_batches")


def cpu_stand_ins(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv with its GPU-only flags swapped for CPU ones, what was swapped), as --cpu-stand-ins says."""
    subs = []
    attn = opt_values(argv, "attn_impl")
    if attn and attn[0].startswith("flash"):
        argv = set_opt(argv, "attn_impl", ["sdpa"])
        subs.append(f"attn_impl {attn[0]} -> sdpa")
    liger = opt_values(argv, "use_liger_kernel")
    if liger is not None and (not liger or liger[0].lower() == "true"):
        argv = drop_opt(argv, "use_liger_kernel")
        subs.append("no liger")
    vllm = opt_values(argv, "use_vllm")
    if vllm and vllm[0].lower() == "true" and (opt_values(argv, "vllm_mode") or ["colocate"])[0] != "server":
        names = {a[2:] for a in argv if a.startswith("--vllm_")} | {"use_vllm", *COLOCATED}
        for n in sorted(names):
            argv = drop_opt(argv, n)
        subs.append("generate, not colocated vLLM")
    return argv, subs


Step = tuple[dict, list[str], str]   # (env, swiftlite argv, subcommand)


@dataclass
class Plan:
    """One script, translated: its rollout servers and its training commands, step by step."""
    script: str
    servers: list[tuple[dict, list[str]]]   # (env, argv of `swiftlite`: rollout or deploy, then its flags)
    steps: list[list[Step]]                 # the commands of a step run at once (the nodes of a pair)
    rollout: str = ""                       # the servers' backend; "" when the script has none
    stand_ins: list[str] = field(default_factory=list)   # --cpu-stand-ins: what was swapped


def make_plan(path: str, cmds: list[Command], models: dict[str, Path], files: dict[str, Path], ckpt: Path | None,
              port: int, backend: str | None) -> Plan:
    rollouts = [c for c in cmds if c.sub in SERVERS]
    ports = server_ports(rollouts, free_ports(len(rollouts)))
    servers = []
    for c in rollouts:
        env, argv = translate(c, models, files, None, port)
        servers.append((env, [c.sub, *rollout_argv(argv, ports, backend)]))
    steps, stand_ins = [], []
    for step in node_steps([c for c in cmds if c.sub not in SERVERS]):
        steps.append([])
        for c in step:
            env, argv = translate(c, models, files, ckpt, port)
            if STAND_INS["on"] and c.sub != "export":
                argv, subs = cpu_stand_ins(argv)
                stand_ins += [x for x in subs if x not in stand_ins]
            steps[-1].append((env, training_argv(argv, ports) if rollouts and c.server_mode() else argv, c.sub))
    written = next((v for c in rollouts for v in c.opt("infer_backend") or []),
                   "vllm" if any(c.sub == ROLLOUT for c in rollouts) else "transformers")   # each command's default
    return Plan(path, servers, steps, (backend or written) if rollouts else "", stand_ins)


# ---------------------------------------------------------------- running

#: a refusal because this machine has no GPU (not one swiftlite would give on a GPU too, such as vLLM's flags)
GPU_WORDS = re.compile(r"CUDA GPU|no GPU|needs a GPU|GPU kernel|GPU-only|without a GPU", re.I)


@dataclass
class Result:
    script: str
    cls: str
    error: str = ""
    commands: list[list[str]] = field(default_factory=list)
    seconds: float = 0.0
    rollout: str = ""      # the rollout servers' backend (vllm | transformers); "" without a server
    stand_ins: list[str] = field(default_factory=list)   # --cpu-stand-ins: the GPU-only flags swapped


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "NPROC_PER_NODE", "NNODES", "NODE_RANK", "CUDA_VISIBLE_DEVICES")}
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    # no network here: W&B and SwanLab write their runs locally, as for a user logged in offline
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("SWANLAB_MODE", "offline")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def classify(rc: int, stderr: str) -> tuple[str, str]:
    """(class, first error line) of one finished command."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    if rc == 0:
        return "runs", ""
    if rc == 2 and errors and "Traceback" not in stderr:
        first = errors[0][len("error:"):].strip()
        more = f" (+{len(errors) - 1} more refused)" if len(errors) > 1 else ""
        # gpu: every refusal is for the missing GPU (a run on a GPU would pass them)
        return ("gpu" if all(GPU_WORDS.search(e) for e in errors) else "refused"), first + more
    first = next((ln for ln in reversed(lines) if not ln.startswith(" ")), f"exit {rc}")
    return "crash", f"exit {rc}: {first[:300]}"


def run_one(sub: str, env: dict[str, str], argv: list[str], cwd: Path, timeout: float, dry: bool):
    full = [sys.executable, "-m", "swiftlite", sub, *argv, *(["--dry-run"] if dry else [])]
    try:
        p = subprocess.run(full, cwd=cwd, env={**base_env(), **env}, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stderr + ("" if p.returncode == 0 else p.stdout[-2000:])
    except subprocess.TimeoutExpired:
        return 124, f"timeout after {timeout:.0f} s"


class Server:
    """A `swiftlite rollout` (or `deploy`) process in the background, its output in files of the script's folder;
    `argv` starts with the subcommand."""

    def __init__(self, env: dict[str, str], argv: list[str], cwd: Path, k: int):
        self.port = int((opt_values(argv, "port") or [SERVER_PORT])[0])
        self.out, self.err = cwd / f"{argv[0]}-{k}.stdout", cwd / f"{argv[0]}-{k}.stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "swiftlite", *argv], cwd=cwd,
                                         env={**base_env(), **env}, stdout=out, stderr=err, start_new_session=True)

    def output(self) -> str:
        """Its stderr (and the tail of its stdout after a failure), as run_one gives a command's."""
        err = self.err.read_text(errors="replace")
        return err + ("" if self.proc.returncode == 0 else self.out.read_text(errors="replace")[-2000:])

    def wait_ready(self, seconds: float) -> int | None:
        """None once GET /health/ answers 200; its exit code if it exits first; 124 after `seconds`."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # no proxy for 127.0.0.1
        end = time.time() + seconds
        while True:
            if self.proc.poll() is not None:
                return self.proc.returncode
            try:
                with opener.open(f"http://127.0.0.1:{self.port}/health/", timeout=2) as r:
                    if r.status == 200:
                        return None
            except (OSError, http.client.HTTPException):   # not listening yet, or not answering
                pass
            if time.time() >= end:
                return 124
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM (it ends cleanly), then SIGKILL to its process group after a few seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # what is left: the server itself or its workers
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def start_servers(plans: list[Plan], cwds: dict[str, Path], results: dict[str, Result], ready_s: float,
                  servers: list[tuple[str, Server]]) -> None:
    """Start every plan's rollout servers (appended to `servers`) and wait for their /health/; a script whose
    server exits first (or never answers) gets its class from that exit."""
    for p in plans:
        for k, (env, argv) in enumerate(p.servers):
            results[p.script].commands.append([*(f"{a}={b}" for a, b in env.items()), "swiftlite", *argv])
            servers.append((p.script, Server(env, argv, cwds[p.script], k)))
    end = time.time() + ready_s
    for s, srv in servers:
        if results[s].cls != "runs":
            continue
        rc = srv.wait_ready(max(0.0, end - time.time()))
        if rc is None:
            continue
        if rc == 124 and srv.proc.poll() is None:
            last = "".join(f" ({ln[:300]})" for ln in srv.err.read_text(errors="replace").splitlines()[-1:])
            cls, first = "crash", f"its /health/ did not answer within {ready_s:.0f} s{last}"
        else:
            cls, first = classify(rc, srv.output())
            if cls == "runs":
                cls, first = "crash", "exit 0 before its /health/ answered"
        results[s].cls, results[s].error = cls, f"rollout: {first}"


def run_group(plans: list[Plan], work: Path, timeout: float, ready_s: float = 120) -> list[Result]:
    """Run the scripts of a group (one script, or the nodes of a multi-node pair at once): their rollout servers
    first, then command by command (a step's commands at once), then the servers stopped."""
    results = {p.script: Result(p.script, "runs", rollout=p.rollout, stand_ins=p.stand_ins) for p in plans}
    cwds = {}
    for p in plans:
        cwd = work / "runs" / p.script.replace("/", "__")
        shutil.rmtree(cwd, ignore_errors=True)
        cwd.mkdir(parents=True)
        (cwd / "examples").symlink_to(work / "mirror" / "examples")
        cwds[p.script] = cwd
    t0 = time.time()
    servers: list[tuple[str, Server]] = []
    try:
        if not DRY_ONLY["on"]:   # a dry run does not reach a server
            start_servers(plans, cwds, results, ready_s, servers)
        healthy = {s for s, _ in servers if results[s].cls == "runs"}
        for k in range(max((len(p.steps) for p in plans), default=0)):
            for dry in (True,) if DRY_ONLY["on"] else (True, False):
                # `swift export` has no dry run (ms-swift's neither): it runs once (not at all with --dry-only)
                todo = [(p.script, c) for p in plans if k < len(p.steps) and results[p.script].cls == "runs"
                        for c in p.steps[k] if not (dry and c[2] == "export")]
                if not todo:
                    continue
                with ThreadPoolExecutor(len(todo)) as ex:
                    futs = [ex.submit(run_one, c[2], c[0], c[1], cwds[s], timeout, dry) for s, c in todo]
                for (s, c), fut in zip(todo, futs):
                    rc, err = fut.result()
                    if dry or c[2] == "export":
                        results[s].commands.append([*(f"{a}={b}" for a, b in c[0].items()), "swiftlite", c[2], *c[1]])
                    cls, first = classify(rc, err)
                    if cls != "runs" and results[s].cls == "runs":
                        results[s].cls, results[s].error = cls, ("dry-run: " if dry else "run: ") + first
        for s, srv in servers:   # a server that exited on its own during the training: a crash
            if s in healthy and srv.proc.poll() is not None:
                first = classify(srv.proc.returncode, srv.output())[1] or f"exit {srv.proc.returncode}"
                note = f"rollout exited during the training: {first}"
                if note not in results[s].error:
                    results[s].error = f"{results[s].error} / {note}" if results[s].error else note
                results[s].cls = "crash"
    finally:
        for _, srv in servers:
            srv.stop()
    for r in results.values():
        r.seconds = time.time() - t0
    return list(results.values())


def note(r: Result) -> str:
    """The table's mark of a result whose rollout servers did not run as the script wrote them (vLLM), or
    whose GPU-only flags were swapped (--cpu-stand-ins)."""
    mark = f"[rollout: {r.rollout}] " if r.rollout not in ("", "vllm") else ""
    return mark + (f"[stand-ins: {', '.join(r.stand_ins)}] " if r.stand_ins else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, default=MIRROR)
    ap.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--only", nargs="*", default=None, help="run only scripts whose path contains one of these")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per command")
    ap.add_argument("--list", action="store_true", help="print the extracted commands and skips, run nothing")
    ap.add_argument("--rollout-backend", choices=("vllm", "transformers"), default=None,
                    help="--infer_backend for every `swift rollout` server (default: as the script writes it)")
    ap.add_argument("--max-nproc", type=int, default=2, help="cap of NPROC_PER_NODE (default 2)")
    ap.add_argument("--cpu-stand-ins", action="store_true",
                    help="swap the training commands' GPU-only flags for CPU ones (module docstring)")
    ap.add_argument("--dry-only", action="store_true",
                    help="run each command's --dry-run only (a quick sort into refused, gpu and the rest; "
                         "`runs` then means the dry run passed)")
    ap.add_argument("--rollout-wait", type=float, default=120,
                    help="seconds for a rollout server's /health/ to answer")
    args = ap.parse_args(argv)
    NPROC_CAP["n"] = args.max_nproc
    STAND_INS["on"] = args.cpu_stand_ins
    DRY_ONLY["on"] = args.dry_only
    work = args.work or Path(tempfile.mkdtemp(prefix="msswift-examples-"))
    work.mkdir(parents=True, exist_ok=True)
    # The platform variables a DLC script reads ($WORLD_SIZE, $RANK as the node count and rank): one node here.
    platform = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    skipped, todo = [], []
    for path in list_scripts(args.mirror):
        if args.only and not any(o in path for o in args.only):
            continue
        cmds, launchers = extract(path, git_show(args.mirror, path), platform)
        why = skip_reason(path, cmds, launchers)
        (skipped.append((path, why)) if why else todo.append((path, cmds)))
    if args.list:
        for p, why in skipped:
            print(f"skip  {p}: {why}")
        for p, cmds in todo:
            for c in cmds:
                where = "  (commented out in the script)" if c.commented else ""
                print(f"run   {p}: {' '.join(f'{k}={v}' for k, v in c.env.items())} swift {c.sub} {shlex.join(c.argv)}"
                      + where)
        print(f"{len(todo)} to run, {len(skipped)} skipped")
        return 0
    if not (work / "mirror" / "examples").is_dir():
        (work / "mirror").mkdir(exist_ok=True)
        arch = subprocess.run(["git", "-C", str(args.mirror), "archive", "HEAD", "examples"], check=True,
                              capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(work / "mirror")], input=arch, check=True)
    models = build_models(work / "models")
    files = write_data(work / "data")
    ckpt = None
    if any(c.sub == "export" or any(PLACEHOLDER.search(" ".join(c.opt(n) or [])) for n in ("adapters", "ckpt_dir"))
           for _, cmds in todo for c in cmds):
        ckpt = work / "lora_ckpt"
        if not (ckpt / "checkpoint-2").is_dir():
            rc, err = run_one("sft", {}, ["--model", str(models["qwen2"]), "--dataset", str(files["messages"]),
                                          "--max_steps", "2", "--output_dir", str(ckpt), "--save_steps", "2"],
                              work, args.timeout, False)
            if rc != 0:
                print(f"the LoRA checkpoint for export scripts failed: {err[-2000:]}", file=sys.stderr)
        ckpt = ckpt / "checkpoint-2"
    # group the nodes of a multi-node pair (NNODES > 1 with a NODE_RANK) in one folder: they run together
    groups: dict[str, list] = {}
    for path, cmds in todo:
        nodes = any(int(c.env.get("NNODES", "1") or 1) > 1 and "NODE_RANK" in c.env for c in cmds)
        key = str(Path(path).parent) + "#nodes" if nodes else path
        groups.setdefault(key, []).append((path, cmds))
    results: list[Result] = []
    for key, members in groups.items():
        port = free_port()
        group = []
        for path, cmds in members:
            own = None
            if ckpt is not None and ckpt.is_dir():   # each script its own copy (an export writes <ckpt>-merged)
                run_copy = work / "ckpts" / path.replace("/", "__")
                shutil.rmtree(run_copy, ignore_errors=True)
                shutil.copytree(ckpt.parent, run_copy, ignore=shutil.ignore_patterns("*-merged"))
                own = run_copy / ckpt.name
            group.append(make_plan(path, cmds, models, files, own, port, args.rollout_backend))
        waits = [p for p in group if p.servers or any(c[2] == "export" for st in p.steps for c in st)]
        if DRY_ONLY["on"] and waits:   # their dry runs need a server or an export's folder: not a quick sort
            for p in group:
                results.append(Result(p.script, "not-dry", error="needs its rollout server or an export's folder: "
                                                                 "run it without --dry-only"))
                print(f"not-dry  {p.script}", flush=True)
            continue
        for r in run_group(group, work, args.timeout, args.rollout_wait):
            results.append(r)
            print(f"{r.cls:8s} {r.seconds:6.1f}s  {r.script}  {note(r)}{r.error}", flush=True)
    counts: dict[str, int] = {}
    for r in results:
        counts[r.cls] = counts.get(r.cls, 0) + 1
    print("\n| script | class | first error line |\n|---|---|---|")
    for r in results:
        print(f"| {r.script} | {r.cls} | {(note(r) + r.error).replace('|', '/')} |")
    print("\nskipped:")
    for p, why in skipped:
        print(f"  {p}: {why}")
    print(f"\n{len(results)} scripts run: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
          + f"; {len(skipped)} skipped")
    if args.json:
        args.json.write_text(json.dumps({"results": [r.__dict__ for r in results], "skipped": skipped}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
