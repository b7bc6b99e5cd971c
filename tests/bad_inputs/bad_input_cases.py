"""The bad-input catalogue: one row per mistake a user can make, with the one line swiftlite must
answer. Every case must exit with code 2, print exactly one non-empty line on stderr containing
`expect`, print no traceback, and leave the case folder (its working directory) byte-for-byte as it
was: no output folder created, an existing one unchanged.

A case runs in a fresh folder holding `data/train.jsonl` (200 demo rows) and `data/val.jsonl`;
`setup(folder)` adds what the case needs. Paths in `argv` are relative to that folder. sft/pt cases
get `--output-dir out` appended unless they name one. Add a row to cover a new mistake.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

GOOD = ["--model", "tiny-llama-2l", "--max-steps", "2", "--torch-dtype", "fp32"]
DATA = ["--dataset", "data/train.jsonl"]


@dataclass
class Case:
    id: str
    argv: list[str]
    expect: str
    setup: Callable[[Path], None] | None = None
    real: bool = False            # run as a real `python -m swiftlite` subprocess (not forked)
    env: dict[str, str] = field(default_factory=dict)
    holds: Callable[[Path], object] | None = None  # context manager held during the run (a bound port)
    xfail: str | None = None      # a known gap in a command owned elsewhere (reason); remove once fixed
    script: str | None = None     # run `bash <repo>/<script> argv...` instead (a recipe); env applies


def write(rel: str, text: str) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return setup


def write_bytes(rel: str, data: bytes) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        (d / rel).write_bytes(data)
    return setup


def both(*fns: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        for fn in fns:
            fn(d)
    return setup


CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]})


def three_rows(d: Path) -> None:
    (d / "small.jsonl").write_text("\n".join([CHAT] * 3) + "\n")


def old_run(d: Path) -> None:
    """An output folder that already holds a (fake) checkpoint of an earlier run."""
    c = d / "out" / "checkpoint-2"
    c.mkdir(parents=True)
    (c / "trainer_state.json").write_text("{}\n")
    (d / "out" / "args.json").write_text("{}\n")


def finished_run(d: Path) -> None:
    """An output folder with a complete-looking checkpoint (manifest verifies; no weights)."""
    from swiftlite import checkpoint as ckpt
    c = d / "out" / "checkpoint-2"
    c.mkdir(parents=True)
    (c / "trainer_state.json").write_text(json.dumps({"global_step": 2, "backend": "single", "world_size": 1,
                                                      "train_type": "full", "model": "tiny-llama-2l"}) + "\n")
    (c / "dcp").mkdir()
    (c / "dcp" / ".metadata").write_bytes(b"not read before the output check")
    from swiftlite.config import build_config, save_args
    save_args(build_config({"model": "tiny-llama-2l", "dataset": ["data/train.jsonl"]}), d / "out" / "args.json")
    ckpt.write_manifest(c)
    ckpt.write_latest(d / "out", c.name)


def not_a_checkpoint(d: Path) -> None:
    (d / "notckpt").mkdir()
    (d / "notckpt" / "readme.txt").write_text("just a folder\n")


def model_no_config(d: Path) -> None:
    (d / "mymodel").mkdir()
    (d / "mymodel" / "weights.txt").write_text("x\n")


def model_no_weights(d: Path) -> None:
    (d / "mymodel").mkdir()
    (d / "mymodel" / "config.json").write_text(json.dumps({"model_type": "llama"}))


def model_remote_code(d: Path) -> None:
    """A model folder whose architecture exists only as its own Python code; the code would leave a
    marker file if it ever ran."""
    m = d / "evilmodel"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({
        "model_type": "evilnet", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                     "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}))
    marker = (d / "REMOTE_CODE_RAN").resolve()
    code = f"open({str(marker)!r}, 'w').write('ran')\n"
    (m / "configuration_evil.py").write_text(code)
    (m / "modeling_evil.py").write_text(code)
    (m / "model.safetensors").write_bytes(b"")


class BoundPort:
    """Holds a listening TCP port on 127.0.0.1 for the duration of a case."""

    def __init__(self, d: Path):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        (d / ".port").write_text(str(self.port))

    def __enter__(self) -> "BoundPort":
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


CASES: list[Case] = [
    # -- flags: unknown, misspelt, wrong type, out of range ----------------------------------------
    Case("sft-unknown-flag", ["sft", *GOOD, *DATA, "--frobnicate", "3"], "unknown option --frobnicate", real=True),
    Case("sft-misspelt-flag", ["sft", *GOOD, *DATA, "--learning-rat", "1e-4"],
         "did you mean --learning-rate?"),
    Case("sft-stray-argument", ["sft", *DATA, *GOOD, "extra"], "unexpected argument 'extra'"),
    Case("sft-wrong-type-int", ["sft", *DATA, "--max-steps", "ten"], "max_steps: expected an integer, got 'ten'"),
    Case("sft-wrong-type-float", ["sft", *DATA, "--learning-rate", "fast"],
         "learning_rate: expected a number, got 'fast'"),
    Case("sft-wrong-type-bool", ["sft", *DATA, "--packing=maybe"], "packing: expected true/false, got 'maybe'"),
    Case("sft-bad-choice", ["sft", *DATA, "--torch-dtype", "fp8"], "torch_dtype='fp8' is not one of bf16, fp16, fp32"),
    Case("sft-negative-lr", ["sft", *GOOD, *DATA, "--learning-rate", "-1e-4"],
         "--learning-rate must be > 0, got -0.0001"),
    Case("sft-max-length-0", ["sft", *GOOD, *DATA, "--max-length", "0"], "--max-length must be > 0, got 0"),
    Case("sft-max-steps-0", ["sft", *GOOD[:2], *DATA, "--max-steps", "0"], "--max-steps must be > 0"),
    Case("sft-flag-without-value", ["sft", *DATA, "--learning-rate"], "--learning-rate needs a value"),
    Case("sft-no-dataset", ["sft", *GOOD], "--dataset is required"),
    Case("sft-split-ratio", ["sft", *GOOD, *DATA, "--split-dataset-ratio", "1.5"],
         "--split-dataset-ratio must be in [0, 1), got 1.5"),
    Case("sft-resume-both", ["sft", *GOOD, *DATA, "--resume", "--resume-from", "x"],
         "--resume and --resume-from both given"),
    # -- models ----------------------------------------------------------------------------------
    Case("sft-missing-model-folder", ["sft", *DATA, "--model", "./models/nope"],
         "--model ./models/nope: model folder not found"),
    Case("sft-unknown-preset", ["sft", *DATA, "--model", "tiny-lama"], "--model tiny-lama: unknown preset"),
    Case("sft-model-folder-no-config", ["sft", *DATA, "--model", "mymodel"], "folder has no config.json",
         setup=model_no_config),
    Case("sft-model-folder-no-weights", ["sft", *DATA, "--model", "mymodel"], "folder has config.json but no weights",
         setup=model_no_weights),
    Case("sft-remote-code-refused", ["sft", *DATA, "--model", "evilmodel"], "unless you pass --trust-remote-code",
         setup=model_remote_code),
    Case("sft-template-missing", ["sft", *GOOD, *DATA, "--template", "chat.jinja"], "--template: file not found"),
    # -- datasets --------------------------------------------------------------------------------
    Case("sft-dataset-not-found", ["sft", *GOOD, "--dataset", "data/nope.jsonl"],
         "--dataset data/nope.jsonl: file not found"),
    Case("sft-val-dataset-not-found", ["sft", *GOOD, *DATA, "--val-dataset", "data/nope.jsonl"],
         "--val-dataset data/nope.jsonl: file not found"),
    Case("sft-dataset-bad-type", ["sft", *GOOD, "--dataset", "rows.xml"], "unsupported file type '.xml'",
         setup=write("rows.xml", "<rows/>\n")),
    Case("sft-dataset-bad-count", ["sft", *GOOD, "--dataset", "data/train.jsonl#lots"], "'#lots' is not a row count"),
    Case("sft-dataset-modelscope", ["sft", *GOOD, "--dataset", "ms::AI-ModelScope/alpaca-gpt4-data-en#500"],
         "ModelScope datasets are not supported"),
    Case("sft-dataset-hf-prefix-no-id", ["sft", *GOOD, "--dataset", "hf::#5"], "no dataset id after 'hf::'"),
    Case("sft-dataset-hub-unreachable", ["sft", *GOOD, "--dataset", "hf::tatsu-lab/alpaca#5"],
         "--dataset hf::tatsu-lab/alpaca#5: the Hugging Face hub is unreachable"),   # HF_HUB_OFFLINE=1
    Case("sft-jsonl-not-json", ["sft", *GOOD, "--dataset", "bad.jsonl"],
         "bad.jsonl:2: not valid JSON", setup=write("bad.jsonl", CHAT + "\n{\"messages\": [\n" + CHAT + "\n")),
    Case("sft-jsonl-not-object", ["sft", *GOOD, "--dataset", "bad.jsonl"],
         "bad.jsonl:1: expected a JSON object, got list", setup=write("bad.jsonl", "[1, 2]\n")),
    Case("sft-jsonl-not-utf8", ["sft", *GOOD, "--dataset", "bad.jsonl"], "bad.jsonl:2: not UTF-8 text",
         setup=write_bytes("bad.jsonl", CHAT.encode() + b"\n\xff\xfe{}\n")),
    Case("sft-row-no-format", ["sft", *GOOD, "--dataset", "odd.jsonl"],
         "odd.jsonl:2: row matches no known format (found keys: answer, question",
         setup=write("odd.jsonl", CHAT + "\n" + json.dumps({"question": "q", "answer": "a"}) + "\n")),
    Case("sft-row-unknown-role", ["sft", *GOOD, "--dataset", "odd.jsonl"], "messages[0] has unknown role 'human'",
         setup=write("odd.jsonl", json.dumps({"messages": [{"role": "human", "content": "x"}]}) + "\n")),
    Case("sft-row-no-assistant", ["sft", *GOOD, "--dataset", "odd.jsonl"], "has no assistant turn",
         setup=write("odd.jsonl", json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")),
    Case("sft-json-array-broken", ["sft", *GOOD, "--dataset", "rows.json"], "rows.json:3:1: invalid JSON",
         setup=write("rows.json", "[\n" + CHAT + ",\n]\n")),
    Case("sft-empty-dataset", ["sft", *GOOD, "--dataset", "empty.jsonl"],
         "--dataset empty.jsonl: no usable rows (read 0", setup=write("empty.jsonl", "")),
    Case("sft-all-rows-skipped", ["sft", *GOOD, "--dataset", "bad.jsonl", "--skip-bad-rows"],
         "no usable rows (read 0, skipped 2", setup=write("bad.jsonl", "{oops\n[1]\n")),
    Case("pt-chat-rows", ["pt", *GOOD, *DATA], "data/train.jsonl:1: pre-training row needs a 'text' field"),
    Case("sft-smaller-than-global-batch", ["sft", *GOOD, "--dataset", "small.jsonl", "--per-device-train-batch-size",
                                           "2", "--gradient-accumulation-steps", "2"],
         "3 usable rows, fewer than one global batch of 4 (per-device 2 x 1 processes x accumulation 2)",
         setup=three_rows),
    Case("sft-world-size-vs-batch", ["sft", *GOOD, "--dataset", "small.jsonl", "--nproc-per-node", "2",
                                     "--per-device-train-batch-size", "2"],
         "fewer than one global batch of 4 (per-device 2 x 2 processes x accumulation 1)", setup=three_rows),
    # -- launch ----------------------------------------------------------------------------------
    Case("sft-port-in-use", ["sft", *GOOD, *DATA, "--nproc-per-node", "2", "--master-port", "{port}"],
         "--master-port {port}: already in use", holds=BoundPort, real=True),
    Case("sft-single-with-nproc", ["sft", *GOOD, *DATA, "--parallelism", "single", "--nproc-per-node", "2"],
         "--parallelism single runs one process"),
    Case("sft-node-rank-range", ["sft", *GOOD, *DATA, "--nnodes", "2", "--node-rank", "2"],
         "--node-rank 2 is out of range for --nnodes 2"),
    Case("sft-ddp-timeout-0", ["sft", *GOOD, *DATA, "--ddp-timeout", "0"], "--ddp-timeout must be > 0 seconds, got 0"),
    Case("sft-hostfile-missing", ["sft", *GOOD, *DATA, "--nproc-per-node", "2", "--launcher", "deepspeed",
                                  "--hostfile", "hosts.txt"], "--hostfile hosts.txt: file not found"),
    # -- output / resume -------------------------------------------------------------------------
    Case("sft-output-has-checkpoints", ["sft", *GOOD, *DATA], "already holds checkpoints; pass --resume",
         setup=old_run),
    Case("sft-output-is-file", ["sft", *GOOD, *DATA, "--output-dir", "afile"], "--output-dir afile: exists and is not a folder",
         setup=write("afile", "x\n")),
    Case("sft-output-under-file", ["sft", *GOOD, *DATA, "--output-dir", "afile/run"], "cannot be created",
         setup=write("afile", "x\n")),
    Case("sft-resume-not-checkpoint", ["sft", *GOOD, *DATA, "--resume-from", "notckpt"],
         "--resume-from notckpt: not a checkpoint", setup=not_a_checkpoint),
    Case("sft-resume-missing", ["sft", *GOOD, *DATA, "--resume-from", "gone/checkpoint-5"],
         "--resume-from gone/checkpoint-5: no such folder"),
    Case("sft-resume-half-written", ["sft", *GOOD, *DATA, "--resume-from", "out/checkpoint-2"],
         "not a usable checkpoint (no manifest.json", setup=old_run),
    # -- config files ----------------------------------------------------------------------------
    Case("config-unknown-key", ["sft", "--config", "run.yaml"], "run.yaml: unknown option 'lerning_rate'",
         setup=write("run.yaml", "model: tiny-llama-2l\nlerning_rate: 1e-4\n")),
    Case("config-unknown-key-nested", ["sft", "--config", "run.yaml"], "run.yaml: unknown option 'warp_speed'",
         setup=write("run.yaml", "train:\n  max_steps: 2\n  warp_speed: 9\n")),
    Case("config-bad-yaml", ["sft", "--config", "run.yaml"], "run.yaml:4:10: invalid YAML",
         setup=write("run.yaml", "model: tiny-llama-2l\ndataset:\n  - [data/train.jsonl\nmax_steps: 2\n")),
    Case("config-bad-json", ["sft", "--config", "run.json"], "run.json:3:1: invalid JSON",
         setup=write("run.json", '{"model": "tiny-llama-2l",\n "max_steps": 2,\n}\n')),
    Case("config-not-mapping", ["sft", "--config", "run.yaml"], "expected a mapping of option names to values",
         setup=write("run.yaml", "- a\n- b\n")),
    Case("config-wrong-type", ["sft", "--config", "run.yaml", *DATA], "run.yaml: max_steps: expected an integer",
         setup=write("run.yaml", "max_steps: many\n")),
    Case("config-missing", ["sft", "--config", "nope.yaml"], "--config: file not found: nope.yaml"),
    Case("config-bad-value", ["sft", "--config", "run.yaml"], "--learning-rate must be > 0",
         setup=write("run.yaml", "dataset: data/train.jsonl\nlearning_rate: 0\n")),
    # -- DeepSpeed configs -----------------------------------------------------------------------
    Case("ds-config-missing", ["sft", *GOOD, *DATA, "--deepspeed", "ds.json"], "--deepspeed: file not found: ds.json"),
    Case("ds-config-unknown-preset", ["sft", *GOOD, *DATA, "--deepspeed", "zero9"], "unknown DeepSpeed preset 'zero9'"),
    Case("ds-config-bad-json", ["sft", *GOOD, *DATA, "--deepspeed", "ds.json"], "ds.json:2:",
         setup=write("ds.json", '{"zero_optimization": {"stage": 2}\n "bf16": {}}\n')),
    Case("ds-config-contradiction", ["sft", *GOOD, *DATA, "--deepspeed", "ds.json"],
         "contradicts --per-device-train-batch-size",
         setup=write("ds.json", json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}))),
    Case("ds-config-bad-stage", ["sft", *GOOD, *DATA, "--deepspeed", "ds.json"], "zero_optimization.stage must be 0-3",
         setup=write("ds.json", json.dumps({"zero_optimization": {"stage": 7}}))),
    Case("ds-unknown-parallelism", ["sft", *GOOD, *DATA, "--parallelism", "zero5"], "--parallelism: unknown value 'zero5'"),
    # -- combinations the recipes use --------------------------------------------------------------
    Case("recipe-qlora-zero3-offload", ["sft", *GOOD[:2], *DATA, "--qlora", "--parallelism", "zero3_offload"],
         "DeepSpeed offload cannot move bitsandbytes-quantized weights"),
    Case("recipe-full-quant", ["sft", *GOOD, *DATA, "--quant-bits", "4"], "--quant-bits needs --train-type lora/qlora"),
    Case("recipe-fp16-fsdp", ["sft", *GOOD[:4], *DATA, "--parallelism", "fsdp", "--torch-dtype", "fp16"],
         "--torch-dtype fp16 needs loss scaling"),
    Case("recipe-cpu-offload-zero3", ["sft", *GOOD, *DATA, "--parallelism", "zero3", "--cpu-offload"],
         "--cpu-offload applies to fsdp/fsdp1"),
    Case("recipe-lora-rank-0", ["sft", *GOOD, *DATA, "--lora", "--lora-rank", "0"], "--lora-rank must be > 0"),
    Case("recipe-script-missing-data", [], "--dataset nope.jsonl: file not found", script="recipes/qlora_fsdp_2gpu.sh",
         env={"DATA": "nope.jsonl", "MODEL": "tiny-llama-2l"}),
    Case("recipe-script-bad-extra-flag", ["--cpu-offload"], "--cpu-offload applies to fsdp/fsdp1",
         script="recipes/lora_zero3.sh", env={"DATA": "data/train.jsonl", "MODEL": "tiny-llama-2l"}),
    Case("recipe-script-qlora-offload", ["--parallelism", "zero3_offload"],
         "DeepSpeed offload cannot move bitsandbytes-quantized weights", script="recipes/qlora_fsdp_2gpu.sh",
         env={"DATA": "data/train.jsonl", "MODEL": "tiny-llama-2l"}),
    Case("recipe-mixed-precision-ddp", ["sft", *GOOD, *DATA, "--parallelism", "ddp", "--mixed-precision", "bf16"],
         "--mixed-precision applies to fsdp/fsdp1"),
    # -- other commands --------------------------------------------------------------------------
    Case("estimate-unknown-model", ["estimate", "--model", "gpt-17"], "--model gpt-17: not a preset"),
    Case("estimate-bad-memory", ["estimate", "--gpu-memory", "lots"], "--gpu-memory: cannot read 'lots' as a size"),
    Case("estimate-zero-gpus", ["estimate", "--gpus", "0"], "--gpus must be a positive integer, got 0"),
    Case("estimate-wrong-type", ["estimate", "--max-length", "long"], "Invalid value for '--max-length'"),
    Case("estimate-bad-train-type", ["estimate", "--train-type", "half"], "--train-type 'half': choose from"),
    Case("estimate-bad-quant-bits", ["estimate", "--train-type", "qlora", "--quant-bits", "3"],
         "--quant-bits must be 4 or 8, got 3"),
    Case("export-missing-ckpt", ["export", "--ckpt", "runs/nope", "-o", "exp"], "--ckpt runs/nope: no such folder"),
    Case("export-not-a-checkpoint", ["export", "--ckpt", "data", "-o", "exp"], "--ckpt data: not a checkpoint"),
    Case("export-ckpt-flag-missing", ["export", "-o", "exp"], "pass the checkpoint to export with --ckpt or --adapters"),
    Case("export-ckpt-and-adapters", ["export", "--ckpt", "out", "--adapters", "data"], "both name the checkpoint"),
    Case("export-merge-lora-bad-value", ["export", "--adapters", "out", "--merge_lora", "maybe"],
         "--merge-lora: expected true or false, got 'maybe'"),
    Case("export-merge-lora-full-run", ["export", "--adapters", "out/checkpoint-2", "--merge_lora", "true"],
         "--adapters out/checkpoint-2 is a full fine-tune", setup=finished_run),
    Case("export-bad-dtype", ["export", "--ckpt", "data", "-o", "exp", "--dtype", "fp8"], "--dtype fp8: choose bf16 or fp16"),
    Case("export-bad-shard-size", ["export", "--ckpt", "data", "-o", "exp", "--max-shard-size", "huge"],
         "--max-shard-size: cannot read 'huge' as a size"),
    Case("export-output-exists", ["export", "--ckpt", "out", "-o", "data"], "--output data: already exists",
         setup=finished_run),
    Case("infer-unknown-preset", ["infer", "--model", "tiny-lama", "--prompt", "hi"], "--model tiny-lama: unknown preset"),
    Case("infer-missing-model-folder", ["infer", "--model", "./models/nope", "--prompt", "hi"],
         "--model ./models/nope: model folder not found"),
    Case("infer-dataset-not-found", ["infer", "--model", "tiny-llama-2l", "--dataset", "data/nope.jsonl"],
         "--dataset data/nope.jsonl: file not found"),
    Case("infer-jsonl-not-json", ["infer", "--model", "tiny-llama-2l", "--dataset", "bad.jsonl"],
         "bad.jsonl:2: not valid JSON", setup=write("bad.jsonl", CHAT + "\n{oops\n")),
    Case("infer-negative-tokens", ["infer", "--model", "tiny-llama-2l", "--prompt", "hi", "--max-new-tokens", "-3"],
         "--max-new-tokens must be > 0, got -3"),
    Case("infer-bad-dtype", ["infer", "--model", "tiny-llama-2l", "--prompt", "hi", "--dtype", "fp7"],
         "--dtype fp7: choose auto, bf16, fp16 or fp32"),
    Case("infer-wrong-type", ["infer", "--model", "tiny-llama-2l", "--prompt", "hi", "--max-new-tokens", "many"],
         "Invalid value for '--max-new-tokens'"),
    Case("infer-missing-adapter", ["infer", "--model", "tiny-llama-2l", "--adapters", "nope", "--prompt", "hi"],
         "--adapters nope: not a peft adapter folder"),
    Case("bench-unknown-backend", ["bench", "--parallelism", "ddp,warp"], "--parallelism warp: unknown backend 'warp'"),
    Case("bench-too-few-steps", ["bench", "--steps", "0"], "--steps 0: needs at least"),
    Case("bench-bad-dtype", ["bench", "--torch-dtype", "fp9"], "--torch-dtype 'fp9': choose from"),
    Case("bench-unknown-model", ["bench", "--model", "tiny-lama", "--parallelism", "ddp", "--steps", "8"],
         "--model tiny-lama: unknown preset"),
    Case("models-unknown-flag", ["models", "--all"], "No such option: --all"),
    Case("unknown-command", ["fine-tune"], "No such command 'fine-tune'", real=True),
]
