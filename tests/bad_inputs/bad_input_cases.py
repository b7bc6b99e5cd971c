"""The bad-input catalogue: one row per mistake a user can make, with the one line swiftlite must
answer. Every case must exit with code 2, print exactly one non-empty line on stderr (one per mistake for
a case with `more`: all of them in one run) containing
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
    more: tuple[str, ...] = ()    # several mistakes at once: what each line after the first must contain


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
    Case("sft-report-to-typo", ["sft", *GOOD, *DATA, "--report_to", "tensorbord"],
         "--report-to tensorbord: unknown logger (did you mean tensorboard?)"),
    Case("sft-scheduler-on-a-metric", ["sft", *GOOD, *DATA, "--lr_scheduler_type", "reduce_lr_on_plateau"],
         "--lr-scheduler reduce_lr_on_plateau is not supported"),
    Case("sft-scheduler-needs-kwargs", ["sft", *GOOD, *DATA, "--lr_scheduler_type", "cosine_with_min_lr"],
         "--lr-scheduler cosine_with_min_lr: One of min_lr or min_lr_rate should be set"),
    Case("sft-scheduler-bad-kwargs", ["sft", *GOOD, *DATA, "--lr_scheduler_kwargs", '{"power": 2}'],
         "--lr-scheduler-kwargs: cosine takes no argument 'power'"),
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
    # -- ms-swift flags, values and defaults (docs/usage.md, "ms-swift flags") ----------------------
    Case("msswift-dataloader-workers", ["sft", *GOOD, *DATA, "--dataloader_num_workers", "-1"],
         "--dataloader-num-workers must be >= 0, got -1"),
    Case("msswift-save-only-model-deepspeed", ["sft", *GOOD, *DATA, "--save_only_model", "true", "--deepspeed",
                                               "zero2", "--save-hf-model", "false"],
         "--save_only_model with --save-hf-model false: under DeepSpeed a weights-only checkpoint is its model/"),
    Case("msswift-use-hf-false", ["sft", *GOOD, *DATA, "--use_hf", "false"],
         "--use_hf false: swiftlite downloads from the Hugging Face hub only"),
    Case("msswift-template-name", ["sft", *GOOD, *DATA, "--template", "qwen2_5"],
         "--template qwen2_5: ms-swift template names are not used here (but default)"),
    Case("msswift-model-type", ["sft", *GOOD, *DATA, "--model_type", "llama"], "--model_type llama: swiftlite reads"),
    Case("msswift-streaming-split", ["sft", *GOOD, *DATA, "--streaming",
                                     "--split_dataset_ratio", "0.1"],
         "--streaming with --split-dataset-ratio: a stream cannot hold rows out"),
    Case("msswift-agent-template-glm4", ["sft", *GOOD, *DATA, "--agent_template", "glm4"],
         "--agent_template glm4: not available; hermes, react_en, react_zh, react_grpo are"),
    Case("msswift-agent-row-without-template", ["sft", *GOOD, "--dataset", "agent.jsonl"],
         "agent.jsonl:1: a tool-calling row (tools, tool_call or tool_response): pass --agent_template hermes",
         setup=write("agent.jsonl", '{"tools": [], "messages": [{"role": "user", "content": "q"}, {"role": '
                     '"tool_call", "content": "{\\"name\\": \\"f\\", \\"arguments\\": {}}"}, {"role": '
                     '"tool_response", "content": "r"}, {"role": "assistant", "content": "a"}]}\n')),
    Case("msswift-cached-dataset-missing", ["sft", *GOOD, "--cached_dataset", "nothere/train"],
         "--cached_dataset nothere/train: no such folder"),
    Case("msswift-cached-dataset-streaming", ["sft", *GOOD, *DATA, "--cached_dataset", "c/train", "--streaming",
                                              "--max_steps", "2"],
         "--cached_dataset with --streaming: cached rows are already tokenized",
         more=("--cached_dataset c/train: no such folder",)),
    Case("msswift-cached-dataset-rlhf", ["rlhf", *GOOD, *DATA, "--cached_dataset", "c/train"],
         "--cached_dataset: cached datasets hold sft or pt rows", more=("--cached_dataset c/train: no such folder",)),
    Case("msswift-lazy-tokenize-packing", ["sft", *GOOD, *DATA, "--lazy_tokenize", "true", "--packing"],
         "--lazy-tokenize with --packing"),
    Case("msswift-model-author", ["sft", *GOOD, *DATA, "--model_author", "swift", "ms swift"],
         "--model_author: no --dataset/--val-dataset source (data/train.jsonl) is in ms-swift's self-cognition "
         "format"),
    Case("msswift-neftune", ["sft", *GOOD, *DATA, "--neftune_noise_alpha", "-1"], "--neftune_noise_alpha must be >= 0"),
    Case("msswift-optim", ["sft", *GOOD, *DATA, "--optim", "adamw_8bit"], "--optim adamw_8bit: not available"),
    Case("msswift-optim-args-without-muonclip", ["sft", *GOOD, *DATA, "--optim_args", "momentum=0.9"],
         "--optim_args 'momentum=0.9': only --optimizer muonclip reads it"),
    Case("msswift-muonclip-unknown-arg", ["sft", *GOOD, *DATA, "--optimizer", "muonclip", "--optim_args",
                                          "qk_clip_tau=50,betas=0.9"],
         "--optim_args 'betas=0.9': MuonClip reads momentum, nesterov, newton_schulz_steps, qk_clip_tau"),
    Case("msswift-muonclip-fsdp", ["sft", *GOOD, *DATA, "--optimizer", "muonclip", "--parallelism", "fsdp",
                                   "--nproc_per_node", "2"], "--optimizer muonclip: it orthogonalises each matrix"),
    Case("optim-whole-matrix-sharded", ["sft", *GOOD, *DATA, "--optim", "adafactor", "--parallelism", "fsdp",
                                        "--nproc_per_node", "2"], "--optim adafactor: it factors each matrix"),
    Case("msswift-bf16", ["sft", *GOOD, *DATA, "--bf16", "true"], "--bf16 true: use --torch_dtype bfloat16"),
    Case("msswift-fp16", ["sft", *GOOD, *DATA, "--fp16"], "--fp16: use --torch_dtype float16"),
    Case("msswift-add-version-nodes", ["sft", *GOOD, *DATA, "--add_version", "--nnodes", "2", "--master_addr",
                                       "10.0.0.1"], "--add_version with --nnodes > 1",
         env={"SLURM_JOB_ID": "", "SLURM_NODELIST": "", "SLURM_JOB_NODELIST": ""}),
    Case("msswift-logging-dir", ["sft", *GOOD, *DATA, "--logging_dir", "tb"], "--logging_dir tb: TensorBoard events"),
    Case("msswift-liger", ["sft", *GOOD, *DATA, "--use_liger_kernel", "true"], "--use-liger-kernel runs GPU (Triton/CUDA) kernels and this run has no GPU"),
    Case("msswift-device-map", ["sft", *GOOD, *DATA, "--device_map", "auto"], "--device_map auto: one process per GPU"),
    Case("msswift-tuner-vera", ["sft", *GOOD, *DATA, "--train_type", "vera"],
         "--train_type vera: swiftlite trains full, lora, qlora (LoRA on a bitsandbytes 4-bit base), longlora"),
    Case("tuner-boft-dora", ["sft", *GOOD, *DATA, "--train_type", "boft", "--use_dora", "true"],
         "--use_dora: DoRA is a variant of peft's LoRA; --train_type boft is not LoRA"),
    Case("tuner-boft-lora-rank", ["sft", *GOOD, *DATA, "--train_type", "boft", "--lora_rank", "16"],
         "--lora_rank does not apply to --train_type boft"),
    Case("tuner-boft-both-blocks", ["sft", *GOOD, *DATA, "--train_type", "boft", "--boft_block_num", "8"],
         "--boft_block_size 4 --boft_block_num 8: give exactly one of them"),
    Case("tuner-boft-block-width", ["sft", *GOOD, *DATA, "--train_type", "boft", "--boft_block_size", "6"],
         "--boft_block_size 6: model.layers.0.self_attn.q_proj takes 64 inputs, not a multiple of it"),
    Case("tuner-boft-butterfly", ["sft", *GOOD, *DATA, "--train_type", "boft", "--boft_n_butterfly_factor", "2"],
         "--boft_n_butterfly_factor 2: peft builds butterfly factors above 1 only"),
    Case("tuner-boft-4bit", ["sft", *GOOD, *DATA, "--train_type", "boft", "--quant_bits", "4"],
         "--quant_bits 4 with --train_type boft"),
    Case("tuner-bone-lora-init", ["sft", *GOOD, *DATA, "--train_type", "bone", "--init_weights", "pissa",
                                  "--lora_alpha", "16"],
         "--lora_alpha does not apply to --train_type bone: Bone (peft's MiSS) has no alpha scale",
         more=("--init_weights pissa: a LoRA initialisation; --train_type bone (peft's MiSS) takes true, false, bat",)),
    Case("tuner-bone-rank-on-lora", ["sft", *GOOD, *DATA, "--reft_rank", "8"],
         "--reft_rank is the rank of --train_type bone here (ms-swift's ReFT, --train_type reft, is not available)"),
    Case("tuner-bone-lora-rank", ["sft", *GOOD, *DATA, "--train_type", "bone", "--lora_rank", "16"],
         "--lora_rank does not apply to --train_type bone: Bone's rank is --reft_rank"),
    Case("tuner-bone-rank-width", ["sft", *GOOD, *DATA, "--train_type", "bone", "--reft_rank", "100"],
         "--reft_rank 100: model.layers.0.self_attn.q_proj takes 64 inputs, fewer than the rank"),
    Case("tuner-bone-bat-blocks", ["sft", *GOOD, *DATA, "--train_type", "bone", "--init_weights", "bat",
                                   "--reft_rank", "6"],
         "--reft_rank 6 --init_weights bat: model.layers.0.self_attn.q_proj is 64 x 64, not a whole number of 6 x 6"),
    Case("tuner-adalora-option-on-lora", ["sft", *GOOD, *DATA, "--adalora_init_r", "16"],
         "--adalora_init_r is an option of --train_type adalora; this run trains lora"),
    Case("tuner-adalora-target-above-init", ["sft", *GOOD, *DATA, "--train_type", "adalora", "--adalora_target_r", "16"],
         "--adalora_target_r 16: must be > 0 and at most --adalora_init_r 12"),
    Case("tuner-adalora-schedule", ["sft", *GOOD, *DATA, "--train_type", "adalora", "--adalora_tinit", "2"],
         "--adalora_tinit 2 --adalora_tfinal 0 with 2 optimizer steps"),
    Case("tuner-adalora-rlhf", ["rlhf", "--rlhf_type", "dpo", *GOOD, *DATA, "--train_type",
                                "adalora"], "--train_type adalora with swiftlite rlhf"),
    Case("tuner-adalora-zero3", ["sft", *GOOD, *DATA, "--train_type", "adalora", "--parallelism", "zero3",
                                 "--nproc_per_node", "2"], "--train_type adalora with --parallelism zero3"),
    Case("galore-option-without-galore", ["sft", *GOOD, *DATA, "--galore_rank", "64"],
         "--galore_rank is an option of GaLore: add --use_galore true"),
    Case("galore-with-lora", ["sft", *GOOD, *DATA, "--use_galore", "true"],
         "--use_galore with --train_type lora: GaLore projects the gradients of whole weight matrices"),
    Case("galore-fsdp", ["sft", *GOOD, *DATA, "--train_type", "full", "--use_galore", "true", "--parallelism",
                         "fsdp", "--nproc_per_node", "2"],
         "--use_galore: GaLore projects each weight's whole gradient (an SVD of the matrix), and --parallelism fsdp"),
    Case("galore-q-galore", ["sft", *GOOD, *DATA, "--train_type", "full", "--use_galore", "true",
                             "--galore_quantization", "true"], "--galore_quantization: Q-GaLore"),
    Case("lora-ga-option-without-it", ["sft", *GOOD, *DATA, "--lora_ga_iters", "4"],
         "--lora_ga_iters is an option of LoRA-GA: add --init_weights lora-ga"),
    Case("lora-ga-zero3", ["sft", *GOOD, *DATA, "--init_weights", "lora-ga", "--parallelism", "zero3",
                           "--nproc_per_node", "2"], "--init_weights lora-ga with --parallelism zero3"),
    Case("lora-ga-qlora", ["sft", *GOOD, *DATA, "--init_weights", "lora-ga", "--train_type", "qlora"],
         "--init_weights lora-ga moves part of each base weight into the adapter"),
    Case("tuner-llamapro-not-divisible", ["sft", *GOOD, *DATA, "--train_type", "llamapro"],
         "--llamapro_num_new_blocks 4: the model's 2 layers are not divisible by it"),
    Case("tuner-llamapro-groups", ["sft", *GOOD, *DATA, "--train_type", "llamapro", "--llamapro_num_new_blocks", "2",
                                   "--llamapro_num_groups", "3"],
         "--llamapro_num_groups 3: the model's 2 layers are not divisible by it"),
    Case("tuner-llamapro-zero-blocks", ["sft", *GOOD, *DATA, "--train_type", "llamapro", "--llamapro_num_new_blocks",
                                        "0"], "--llamapro_num_new_blocks must be >= 1"),
    Case("tuner-llamapro-lora-option", ["sft", *GOOD, *DATA, "--train_type", "llamapro", "--lora_rank", "16"],
         "--lora_rank does not apply to --train_type llamapro"),
    Case("tuner-llamapro-option-on-lora", ["sft", *GOOD, *DATA, "--llamapro_num_groups", "2"],
         "--llamapro_num_groups is an option of --train_type llamapro; this run trains lora"),
    Case("tuner-llamapro-fsdp1", ["sft", *GOOD, *DATA, "--train_type", "llamapro", "--llamapro_num_new_blocks", "2",
                                  "--parallelism", "fsdp1", "--nproc_per_node", "2"],
         "--train_type llamapro with --parallelism fsdp1"),
    Case("tuner-llamapro-rlhf", ["rlhf", "--rlhf_type", "dpo", *GOOD, *DATA, "--train_type", "llamapro",
                                 "--llamapro_num_new_blocks", "2"], "--train_type llamapro with swiftlite rlhf"),
    Case("tuner-adapter-option-on-lora", ["sft", *GOOD, *DATA, "--adapter_length", "64"],
         "--adapter_length is an option of --train_type adapter; this run trains lora"),
    Case("tuner-adapter-bad-act", ["sft", *GOOD, *DATA, "--train_type", "adapter", "--adapter_act", "swishy"],
         "--adapter_act swishy: not an activation of transformers' ACT2CLS"),
    Case("tuner-adapter-fsdp1", ["sft", *GOOD, *DATA, "--train_type", "adapter", "--parallelism", "fsdp1",
                                 "--nproc_per_node", "2"], "--train_type adapter with --parallelism fsdp1"),
    Case("tuner-adapter-save-only-model-deepspeed", ["sft", *GOOD, *DATA, "--train_type", "adapter", "--parallelism",
                                                     "zero2", "--save_only_model", "true", "--nproc_per_node", "2"],
         "--save_only_model with --train_type adapter under --parallelism zero2"),
    Case("lisa-on-lora", ["sft", *GOOD, *DATA, "--lisa_activated_layers", "2"],
         "--lisa_activated_layers 2 with --train_type lora: LISA samples the decoder layers of a full fine-tune"),
    Case("lisa-interval-alone", ["sft", *GOOD, *DATA, "--train_type", "full", "--lisa_step_interval", "5"],
         "--lisa_step_interval 5 without --lisa_activated_layers"),
    Case("lisa-more-layers-than-model", ["sft", *GOOD, *DATA, "--train_type", "full", "--lisa_activated_layers", "3"],
         "--lisa_activated_layers 3: the model has 2 decoder layers"),
    Case("lisa-ddp", ["sft", *GOOD, *DATA, "--train_type", "full", "--lisa_activated_layers", "1", "--parallelism",
                      "ddp", "--nproc_per_node", "2"], "--lisa_activated_layers with --parallelism ddp: "),
    Case("lisa-fsdp-and-negative-interval", ["sft", *GOOD, *DATA, "--train_type", "full", "--lisa_activated_layers", "1",
                                             "--lisa_step_interval", "0", "--parallelism", "fsdp", "--nproc_per_node", "2"],
         "--lisa_step_interval 0: must be >= 1", more=("--lisa_activated_layers with --parallelism fsdp: ",)),
    Case("msswift-loss-scale-weighted-all", ["sft", *GOOD, *DATA, "--loss_scale", "all+hermes"],
         "--loss-scale all+hermes: 'hermes' weights parts of the answers, and `all` trains every token"),
    Case("msswift-message-loss-on-a-user-turn", ["sft", *GOOD, "--dataset", "fields.jsonl"],
         "fields.jsonl:1: messages[0].loss: only an assistant turn (or a tool_call) is trained or weighted",
         setup=write("fields.jsonl", json.dumps({"messages": [{"role": "user", "content": "q", "loss": True},
                                                              {"role": "assistant", "content": "a"}]}) + "\n")),
    Case("msswift-message-loss-scale-in-dpo", ["rlhf", "--rlhf_type", "dpo", *GOOD, "--dataset", "pairs.jsonl"],
         "pairs.jsonl:1: a message's 'loss_scale' field chooses and weighs sft's targets; preference training",
         setup=write("pairs.jsonl", json.dumps({"messages": [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": "a", "loss_scale": 2}],
                                                "rejected_response": "b"}) + "\n")),
    Case("msswift-grpo-unknown-rm-plugin", ["rlhf", "--rlhf_type", "grpo", *GOOD, *DATA, "--reward_model", "rm",
                                            "--reward_model_plugin", "my_rm"],
         "--reward_model_plugin my_rm: unknown reward-model plugin (registered: default, genrm; a plugin file adds "
         "one with rm_plugins['name'] = Cls",
         setup=write("rm/config.json", '{"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}')),
    Case("msswift-grpo-genrm-needs-a-chat-model", ["rlhf", "--rlhf_type", "grpo", *GOOD, *DATA, "--reward_model", "rm",
                                                   "--reward_model_plugin", "genrm"],
         "--reward_model rm: a Qwen2ForSequenceClassification; the genrm plugin asks a causal LM",
         setup=write("rm/config.json", '{"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}')),
    Case("msswift-grpo-reward-model-not-a-classifier", ["rlhf", "--rlhf_type", "grpo", *GOOD, *DATA,
                                                        "--reward_model", "lm"],
         "--reward_model lm: a LlamaForCausalLM with 2 outputs",
         setup=write("lm/config.json", '{"architectures": ["LlamaForCausalLM"]}')),
    Case("msswift-is-binary-loss-scale-pt", ["pt", *GOOD, *DATA, "--is_binary_loss_scale", "false"],
         "--is-binary-loss-scale false: loss weights are for sft's chat rows; pt has its own targets"),
    Case("msswift-loss-scale-weighted-liger", ["sft", *GOOD, *DATA, "--loss_scale", "react", "--loss_impl", "liger"],
         "--loss-scale react with --loss-impl liger: the fused kernel returns only the summed loss"),
    Case("msswift-loss-scale-unknown", ["sft", *GOOD, *DATA, "--loss_scale", "last_round+nope"],
         "--loss-scale last_round+nope: unknown loss scale 'nope'"),
    Case("msswift-loss-scale-pt", ["pt", *GOOD, *DATA, "--loss_scale", "default"],
         "--loss-scale default: pt trains every token of plain-text rows (all)"),
    Case("msswift-loss-type-dpo-in-sft", ["sft", *GOOD, *DATA, "--loss_type", "sigmoid"],
         "--loss-type sigmoid is a loss of `swiftlite rlhf`"),
    Case("msswift-dft-with-fused-kernel", ["sft", *GOOD, *DATA, "--enable_dft_loss", "true", "--loss_impl", "cce"],
         "--enable-dft-loss with --loss-impl cce: the fused kernel returns only the summed loss"),
    Case("msswift-quant-gptq", ["sft", *GOOD, *DATA, "--quant_method", "gptq", "--quant_bits", "4"],
         "--quant_method gptq: quantizing at load time is bitsandbytes (--quant_method bnb --quant_bits 4|8) or HQQ"),
    Case("msswift-quant-method-no-bits", ["sft", *GOOD, *DATA, "--quant_method", "bnb"],
         "--quant-method bnb needs --quant-bits 4 or 8"),
    Case("msswift-compute-dtype", ["sft", *GOOD, *DATA, "--qlora", "--bnb_4bit_compute_dtype", "bfloat16"],
         "--bnb-4bit-compute-dtype bf16 differs from --torch-dtype fp32"),
    Case("msswift-bnb-without-4bit", ["sft", *GOOD, *DATA, "--bnb_4bit_quant_type", "fp4"],
         "--bnb-4bit-quant-type applies to a 4-bit base"),
    Case("msswift-gc-kwargs-json", ["sft", *GOOD, *DATA, "--gradient_checkpointing", "--gradient_checkpointing_kwargs",
                                    "{use_reentrant: false}"], "gradient_checkpointing_kwargs: not valid JSON"),
    Case("msswift-gc-kwargs-key", ["sft", *GOOD, *DATA, "--gradient_checkpointing", "--gradient_checkpointing_kwargs",
                                   '{"reentrant": false}'], "--gradient-checkpointing-kwargs: unknown key 'reentrant'"),
    Case("msswift-gc-kwargs-alone",
         ["sft", *GOOD, *DATA, "--gradient_checkpointing", "false", "--gradient_checkpointing_kwargs",
          '{"use_reentrant": false}'],
         "--gradient-checkpointing-kwargs needs --gradient-checkpointing true"),
    Case("msswift-all-refusals-at-once", ["sft", *GOOD, *DATA, "--galore_quantization", "true", "--enable_channel_loss",
                                          "--optim_target_modules", "x", "--frobnicate", "3", "--use_hf", "false"],
         "error: --galore_quantization: Q-GaLore (int8 weights and projections",
         more=("error: --enable_channel_loss: channel losses are not available",
               "error: --optim_target_modules: HF's per-optimizer target modules are not read", "error: unknown option --frobnicate",
               "error: --use_hf false: swiftlite downloads from the Hugging Face hub only")),
    Case("msswift-fsdp-file-refusals", ["sft", *GOOD, *DATA, "--fsdp", "fsdp.json", "--deepspeed", "zero2"],
         "error: --fsdp fsdp.json: auto_wrap_policy 'SIZE_BASED_WRAP': swiftlite wraps each decoder layer",
         setup=write("fsdp.json", '{"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2, '
                                  '"auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000000}}'),
         more=("error: --fsdp fsdp.json: min_num_params 1000000: size-based wrapping is not available",
               "error: --fsdp fsdp.json with --deepspeed zero2: ms-swift refuses FSDP with DeepSpeed too")),
    Case("msswift-rlhf-ppo", ["rlhf", *GOOD, *DATA, "--rlhf_type", "ppo", "--num_ppo_epochs", "2"],
         "error: --rlhf_type ppo: PPO is not available",
         more=("error: --num_ppo_epochs: PPO (--rlhf_type ppo) is not available",)),
    Case("longlora-packing", ["sft", *GOOD, *DATA, "--tuner_type", "longlora", "--packing", "true"],
         "error: --packing with --train_type longlora: S2-Attn groups the positions of one row"),
    Case("grpo-response-prefix", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                  "--response_prefix", "<think>"],
         "--response_prefix: GRPO's rollouts are generated from the chat template's generation prompt"),
    Case("grpo-multi-turn-scheduler", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                       "--multi_turn_scheduler", "openenv_scheduler"],
         "error: --multi-turn-scheduler openenv_scheduler: not available here: it drives an OpenEnv environment "
         "server"),
    Case("grpo-gym-env-unknown", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--multi_turn_scheduler",
                                  "gym_scheduler", "--gym_env", "sudoku"],
         "error: --gym_env sudoku: no environment of that name; built in: math_env"),
    Case("grpo-use-gym-env-alone", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--use_gym_env", "true"],
         "error: --use-gym-env trains on the total reward of a gym scheduler's environment"),
    Case("grpo-top-entropy-quantile-range", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                             "--top_entropy_quantile", "0"],
         "error: --top-entropy-quantile 0: the fraction of tokens that keep their policy term, must be in (0, 1]"),
    Case("grpo-top-entropy-quantile-real", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                            "--top_entropy_quantile", "0.2", "--loss_type", "real"],
         "error: --top-entropy-quantile with --loss-type real: REAL's group loss has no per-token policy term"),
    # GRPO with vLLM: colocate needs a CUDA GPU and the vllm package (neither here); server mode needs a server
    Case("grpo-vllm-no-gpu", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format", "--use_vllm",
                              "true", "--vllm_mode", "colocate"],
         "error: --use-vllm needs a CUDA GPU and the vllm package (pip install vllm)"),
    Case("grpo-vllm-server-no-host", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                      "--use_vllm", "true", "--vllm_mode", "server"],
         "error: --vllm-mode server needs --vllm-server-host HOST [HOST ...] (or --vllm-server-base-url URL ...)"),
    Case("grpo-vllm-server-colocate-option", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                              "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host",
                                              "127.0.0.1", "--vllm_gpu_memory_utilization", "0.5"],
         "error: --vllm-gpu-memory-utilization configures the colocated vLLM engine; with --vllm-mode server the "
         "rollout server has its own"),
    Case("grpo-vllm-server-ports", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                    "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1",
                                    "127.0.0.2", "--vllm_server_port", "8000"],
         "error: --vllm-server-host gives 2 host(s) and --vllm-server-port 1 port(s): give one port per host"),
    Case("grpo-vllm-server-option-in-colocate", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs",
                                                 "format", "--use_vllm", "true", "--vllm_mode", "colocate",
                                                 "--vllm_server_host", "127.0.0.1"],
         "error: --vllm-server-host applies to --vllm-mode server (a `swiftlite rollout` server); drop it"),
    Case("grpo-vllm-server-async", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                    "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1",
                                    "--async_generate", "true"],
         "error: --async_generate true: asynchronous generation (the next round sampled from the previous weights"),
    # the run starts and waits --vllm_server_timeout for the server: none answers on that port
    Case("grpo-vllm-server-not-running", ["rlhf", *GOOD, "--dataset", "prompts.jsonl", "--rlhf_type", "grpo",
                                          "--reward_funcs", "format",
                                          "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host",
                                          "127.0.0.1", "--vllm_server_port", "9", "--vllm_server_timeout", "1",
                                          "--num_generations", "2", "--per_device_train_batch_size", "2",
                                          "--output-dir", "out"],
         "error: --vllm-mode server: no `swiftlite rollout` answered at http://127.0.0.1:9 within 1 s",
         setup=write("prompts.jsonl", "".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                                              for i in range(8)))),
    Case("rollout-refused-options", ["rollout", "--model", "tiny-llama-2l", "--context_manager", "summary",
                                     "--vllm_max_lora_rank", "16", "--bogus", "1"],
         "error: --context_manager: a context manager rewrites a trajectory's earlier turns",
         more=("error: --vllm_max_lora_rank: the server always gets the run's merged weights",
               "error: --bogus: not an option of swiftlite rollout")),
    Case("rollout-unregistered-scheduler", ["rollout", "--model", "tiny-llama-2l", "--infer_backend", "transformers",
                                            "--multi_turn_scheduler", "tool_call_scheduler", "--max_turns", "5"],
         "error: --multi_turn_scheduler tool_call_scheduler: no scheduler of that name; built in: math_tip_trick"),
    Case("rollout-vllm-no-gpu", ["rollout", "--model", "tiny-llama-2l"],
         "error: swiftlite rollout --infer_backend vllm needs a CUDA GPU and the vllm package"),
    Case("rollout-data-parallel-gpus", ["rollout", "--model", "tiny-llama-2l", "--vllm_data_parallel_size", "2"],
         "error: --vllm_data_parallel_size 2 x --vllm_tensor_parallel_size 1: vLLM needs 2 CUDA GPUs, 0 visible"),
    Case("rollout-data-parallel-zero", ["rollout", "--model", "tiny-llama-2l", "--infer_backend", "transformers",
                                        "--data_parallel_size", "0"],
         "error: --vllm_data_parallel_size 0: 1 or more"),
    # --packing / --padding_free true: dpo, orpo, simpo, cpo take them; the other rlhf types name themselves
    Case("rlhf-kto-packing", ["rlhf", *GOOD, *DATA, "--rlhf_type", "kto", "--packing", "true"],
         "error: --packing with --rlhf-type kto: not available in swiftlite"),
    Case("rlhf-rm-padding-free", ["rlhf", *GOOD, *DATA, "--rlhf_type", "rm", "--padding_free", "true"],
         "error: --padding-free true with --rlhf-type rm: ms-swift does not support it for reward modelling"),
    Case("msswift-export-push-to-hub", ["export", "--ckpt", "runs/x", "--push_to_hub", "true"],
         "error: --push_to_hub: nothing is uploaded: upload the exported folder yourself"),
    Case("msswift-plugin-file", ["sft", *GOOD, *DATA, "--external_plugins", "plugin.py", "--dry-run"],
         "error: --external_plugins plugin.py:2: `from swift.llm import get_model_tokenizer` failed (No module named "
         "'swift.llm')",
         setup=write("plugin.py", "from swift.rewards import ORM, orms\nfrom swift.llm import get_model_tokenizer\n")),
    # GRPO's teacher (rlhf/teacher.py): --teacher_deepspeed off DeepSpeed, a teacher's option without one
    Case("grpo-teacher-deepspeed-on-ddp", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--teacher_model", "tiny-llama",
                                           "--num_generations", "1", "--teacher_deepspeed", "zero3",
                                           "--parallelism", "ddp", "--offload_teacher_model", "true"],
         "error: --offload_teacher_model: an option of a teacher form swiftlite does not have (teacher adapters, CPU "
         "offloading of the teacher)",
         more=("error: --teacher-deepspeed zero3 applies to a DeepSpeed run (--deepspeed zero2, ...)",)),
    # GKD (rlhf/gkd.py): no teacher, deprecated sequence-level KD, vLLM generation: all three at once
    Case("gkd-no-teacher", ["rlhf", *GOOD, *DATA, "--rlhf_type", "gkd", "--seq_kd", "true", "--use_vllm", "true"],
         "error: --rlhf-type gkd needs --teacher-model (the model to distil",
         more=("error: --seq-kd true: sequence-level KD", "error: --use-vllm true needs --vllm-mode colocate or server")),
    Case("gkd-multi-turn-no-sampling", ["rlhf", *GOOD, *DATA, "--rlhf_type", "gkd", "--teacher_model", "tiny-llama",
                                        "--lmbda", "0", "--multi_turn_scheduler", "math_tip_trick"],
         "error: --multi-turn-scheduler math_tip_trick with --lmbda 0: no step samples completions"),
    Case("grpo-unregistered-scheduler", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                         "--stop_words", "Observation:", "--multi_turn_scheduler", "tool_call_scheduler"],
         "error: --multi_turn_scheduler tool_call_scheduler: no scheduler of that name; built in: math_tip_trick"),
    Case("grpo-variant-options-misused", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                          "--max_resample_times", "2", "--fipo_clip_range", "0.3"],
         "error: --max-resample-times applies to --dynamic-sample true",
         more=("error: --fipo-clip-range applies to --loss-type fipo",)),
    Case("gkd-teacher-server-no-topk", ["rlhf", *GOOD, *DATA, "--rlhf_type", "gkd", "--teacher_model_server",
                                        "http://127.0.0.1:9"],
         "error: --teacher-model-server needs --gkd-logits-topk K"),
    Case("grpo-teacher-server", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--reward_funcs", "format",
                                 "--teacher_model_server", "http://127.0.0.1:9"],
         "error: --teacher-model-server: a teacher server is GKD's here"),
    Case("gkd-packing-on-policy", ["rlhf", *GOOD, *DATA, "--rlhf_type", "gkd", "--teacher_model", "tiny-llama",
                                   "--packing", "true"],
         "error: --packing with --lmbda 0.5: an on-policy step replaces each row's response by a sampled one"),
    Case("grpo-no-rewards-no-teacher", ["rlhf", *GOOD, *DATA, "--rlhf_type", "grpo", "--num_generations", "1"],
         "error: --rlhf-type grpo needs --reward-funcs (built-in: accuracy, format, cosine, repetition, soft_overlong), "
         "--reward-model, --use-gym-env (a gym scheduler's environment rewards) or --teacher-model (on-policy "
         "distillation)"),
    # --quant_method hqq (models/hqq.py): sharding backends, HQQ's bit widths, bitsandbytes options
    Case("hqq-fsdp", ["sft", *GOOD, *DATA, "--quant_method", "hqq", "--quant_bits", "4", "--parallelism", "fsdp",
                      "--nproc_per_node", "2"],
         "error: --quant-method hqq with --parallelism fsdp: HQQ layers keep their packed weights and their scales "
         "in separate objects, which FSDP and ZeRO-3 cannot shard"),
    Case("hqq-bits-and-bnb-option", ["sft", *GOOD, *DATA, "--quant_method", "hqq", "--quant_bits", "6",
                                     "--bnb_4bit_quant_type", "fp4"],
         "error: --quant-bits with --quant-method hqq must be 1, 2, 3, 4 or 8 (HQQ's bit widths), got 6",
         more=("error: --bnb-4bit-quant-type is a bitsandbytes option",)),
    Case("msswift-awq-folder", ["sft", "--model", "awq", "--max-steps", "2", *DATA],
         "error: --model awq: a pre-quantized AWQ model (config.json quantization_config)",
         setup=both(write("awq/config.json", json.dumps({"model_type": "llama", "quantization_config": {
             "quant_method": "awq", "bits": 4}})), write("awq/model.safetensors", ""))),
    # Issue 22, acceptance 5: the refusals of every stage (flags, value rules, plugins, preflight) in one run;
    # a stage passes over only what an earlier refusal made unusable.
    Case("stages-flag-and-rule", ["sft", *GOOD, *DATA, "--optimizer", "lorap", "--temperature", "0.7"],
         "error: --optimizer lorap: give --lorap_lr_ratio",
         more=("error: --temperature is an option of `swiftlite rlhf`",)),
    Case("stages-rule-plugin-and-target", ["sft", *GOOD, *DATA, "--learning_rate", "-1", "--external_plugins",
                                           "plugin.py", "--target_modules", "foo"],
         "error: --learning-rate must be > 0, got -1.0",
         setup=write("plugin.py", "from swift.template import register_template\n"),
         more=("error: --external_plugins plugin.py:1: `from swift.template import register_template` failed",
               "error: --target-modules foo: foo is not a module of tiny-llama-2l")),
    Case("stages-rule-and-target", ["sft", *GOOD, *DATA, "--warmup_ratio", "2", "--target_modules", "q_proj", "norm"],
         "error: --warmup-ratio must be in [0, 1), got 2.0",
         more=("norm is a LlamaRMSNorm, which LoRA cannot adapt",)),
    # a refused --train_type: the rule on --quant_method bnb, which depends on it, is not run
    Case("stages-refused-flag-not-judged", ["sft", *GOOD, *DATA, "--train_type", "reft", "--quant_method", "bnb"],
         "error: --train_type reft: ReFT runs on pyreft, whose release (0.1.0) requires transformers 4.45.1"),
    # a refused model folder is not inspected for --target_modules; the value rule is still judged
    Case("stages-refused-folder-not-inspected", ["sft", "--model", "awq", "--max-steps", "2", *DATA,
                                                 "--target_modules", "foo", "--weight_decay", "-1"],
         "error: --weight-decay must be >= 0, got -1.0",
         setup=both(write("awq/config.json", json.dumps({"model_type": "llama", "quantization_config": {
             "quant_method": "awq", "bits": 4}})), write("awq/model.safetensors", "")),
         more=("error: --model awq: a pre-quantized AWQ model (config.json quantization_config)",)),
    Case("msswift-target-not-adaptable", ["sft", *GOOD, *DATA, "--target_modules", "q_proj", "norm"],
         "norm is a LlamaRMSNorm, which LoRA cannot adapt"),
    Case("msswift-truncation-split", ["sft", *GOOD, *DATA, "--truncation_strategy", "split"],
         "--truncation-strategy split is for pt (ms-swift's rule: pre-training only)"),
    Case("msswift-all-rows-deleted", ["sft", *GOOD, *DATA, "--max_length", "16"],
         "no usable rows (read 200, skipped 0, 0 without an answer, 200 longer than --max-length deleted)"),
    Case("msswift-full-lora-rank", ["sft", *GOOD, *DATA, "--train_type", "full", "--lora_rank", "16"],
         "--lora-rank needs --train-type lora/qlora"),
    Case("msswift-full-target-modules", ["sft", *GOOD, *DATA, "--full", "--target_modules", "all-linear"],
         "--target-modules needs --train-type lora/qlora"),
    Case("msswift-full-lora-in-config", ["sft", "--config", "run.yaml", *GOOD, *DATA], "--lora-alpha needs",
         setup=write("run.yaml", "train_type: full\nlora_alpha: 64\n")),
    Case("msswift-save-strategy-no-steps", ["sft", *GOOD, *DATA, "--save_strategy", "no", "--save_steps", "5"],
         "--save-steps with --save-strategy no"),
    Case("msswift-eval-no-with-val", ["sft", *GOOD, *DATA, "--eval_strategy", "no", "--val_dataset", "data/val.jsonl"],
         "--eval-strategy no with validation data"),
    Case("msswift-system-pt", ["pt", *GOOD, "--dataset", "text.jsonl", "--system", "Be brief."],
         "--system applies to sft", setup=write("text.jsonl", '{"text": "hello"}\n')),
    Case("msswift-system-file-missing", ["sft", *GOOD, *DATA, "--system", "prompt.txt"],
         "--system prompt.txt: file not found"),
    Case("config-alias-twice", ["sft", "--config", "run.yaml", *GOOD, *DATA],
         "run.yaml: lr and learning_rate both given",
         setup=write("run.yaml", "lr: 1e-4\nlearning_rate: 2e-4\n")),
    Case("config-msswift-no-meaning", ["sft", "--config", "run.yaml", *GOOD, *DATA],
         "run.yaml: model_type: 'qwen2_5': swiftlite reads the architecture",
         setup=write("run.yaml", "model_type: qwen2_5\n")),
    Case("sft-nnodes-without-master-addr", ["sft", *GOOD, *DATA, "--nnodes", "2"],
         "--nnodes 2 needs --master-addr", env={"SLURM_JOB_ID": "", "SLURM_NODELIST": "", "SLURM_JOB_NODELIST": ""}),
    Case("sft-preset-typo", ["sft", *DATA, "--model", "qwen2.5-7bb"],
         "--model qwen2.5-7bb: unknown preset (did you mean qwen2.5-7b?"),
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
                                     "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "1"],
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
         setup=write("run.yaml", "model: tiny-llama-2l\nlerning_rate: 1e-4\n"),
         more=("error: --dataset is required",)),   # the file's other mistake, in the same run
    Case("config-unknown-key-nested", ["sft", "--config", "run.yaml"], "run.yaml: unknown option 'warp_speed'",
         setup=write("run.yaml", "train:\n  max_steps: 2\n  warp_speed: 9\n"), more=("error: --dataset is required",)),
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
    Case("recipe-full-quant", ["sft", *GOOD, *DATA, "--train-type", "full", "--quant-bits", "4"],
         "--quant-bits needs --train-type lora/qlora"),
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
    # -- multi-node backends and their knobs (hsdp, zero3pp, FSDP2) -------------------------------
    Case("hsdp-shard-size-not-a-divisor", ["sft", *GOOD, *DATA, "--parallelism", "hsdp", "--nproc-per-node", "4",
                                           "--hsdp-shard-size", "3"], "--hsdp-shard-size 3 must divide the 4 processes"),
    Case("hsdp-shard-size-zero", ["sft", *GOOD, *DATA, "--parallelism", "hsdp", "--hsdp-shard-size", "0"],
         "--hsdp-shard-size must be >= 1, got 0"),
    Case("hsdp-shard-size-on-fsdp", ["sft", *GOOD, *DATA, "--parallelism", "fsdp", "--nproc-per-node", "2",
                                     "--hsdp-shard-size", "2"], "--hsdp-shard-size applies to hsdp"),
    Case("hsdp-cpu-offload-on-cpu", ["sft", *GOOD, *DATA, "--parallelism", "hsdp", "--nproc-per-node", "2",
                                     "--cpu-offload"], "--cpu-offload moves parameters from the GPU to the CPU"),
    Case("reshard-after-forward-not-a-divisor", ["sft", *GOOD, *DATA, "--parallelism", "fsdp", "--nproc-per-node",
                                                 "4", "--reshard-after-forward", "3"],
         "--reshard-after-forward 3: with --parallelism fsdp each parameter is sharded over 4 ranks"),
    Case("reshard-after-forward-word", ["sft", *GOOD, *DATA, "--reshard-after-forward", "sometimes"],
         "--reshard-after-forward sometimes: expected true, false or a number of ranks"),
    Case("reshard-after-forward-int-on-fsdp1", ["sft", *GOOD, *DATA, "--parallelism", "fsdp1", "--nproc-per-node",
                                                "4", "--reshard-after-forward", "2"], "partial resharding is FSDP2's"),
    Case("reshard-after-forward-on-zero3", ["sft", *GOOD, *DATA, "--parallelism", "zero3",
                                            "--reshard-after-forward", "false"],
         "--reshard-after-forward applies to fsdp/fsdp1/hsdp"),
    Case("prefetch-on-ddp", ["sft", *GOOD, *DATA, "--parallelism", "ddp", "--nproc-per-node", "2",
                             "--forward-prefetch", "2"], "--forward-prefetch applies to fsdp/hsdp"),
    Case("prefetch-zero", ["sft", *GOOD, *DATA, "--parallelism", "fsdp", "--backward-prefetch", "0"],
         "--backward-prefetch must be >= 1, got 0"),
    Case("zero3pp-qwz-on-cpu", ["sft", *GOOD, *DATA, "--parallelism", "zero3pp", "--nproc-per-node", "2",
                                "--zero-quantized-weights"],
         "--zero-quantized-weights (ZeRO++ quantized communication) needs DeepSpeed's CUDA quantizer kernels"),
    Case("zero3pp-qgz-json-on-cpu", ["sft", *GOOD, *DATA, "--deepspeed", "ds.json", "--nproc-per-node", "2"],
         "zero_optimization.zero_quantized_gradients=true (ZeRO++ quantized communication)",
         setup=write("ds.json", json.dumps({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}))),
    Case("zero3pp-quantized-on-zero3", ["sft", *GOOD, *DATA, "--parallelism", "zero3", "--zero-quantized-gradients"],
         "--zero-quantized-gradients applies to zero3pp"),
    Case("hpz-not-a-divisor", ["sft", *GOOD, *DATA, "--deepspeed", "ds.json", "--nproc-per-node", "4"],
         "zero_hpz_partition_size 3 (ZeRO++ hpZ: processes per node) must divide the 4 processes",
         setup=write("ds.json", json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}))),
    Case("hpz-on-zero2", ["sft", *GOOD, *DATA, "--deepspeed", "ds.json", "--nproc-per-node", "2"],
         "zero_hpz_partition_size 2 (ZeRO++ hpZ) needs ZeRO stage 3",
         setup=write("ds.json", json.dumps({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}))),
    # -- other commands --------------------------------------------------------------------------
    Case("estimate-unknown-model", ["estimate", "--model", "gpt-17"], "--model gpt-17: unknown preset"),
    Case("estimate-bad-memory", ["estimate", "--gpu-memory", "lots"], "--gpu-memory: cannot read 'lots' as a size"),
    Case("estimate-zero-gpus", ["estimate", "--gpus", "0"], "--gpus must be a positive integer, got 0"),
    Case("estimate-wrong-type", ["estimate", "--max-length", "long"], "Invalid value for '--max-length'"),
    Case("estimate-bad-train-type", ["estimate", "--train-type", "half"], "--train-type 'half': choose from"),
    Case("estimate-bad-quant-bits", ["estimate", "--train-type", "qlora", "--quant-bits", "3"],
         "--quant-bits must be 4 or 8, got 3"),
    Case("estimate-hsdp-shard-not-dividing", ["estimate", "--gpus-per-node", "8", "--nnodes", "4",
                                               "--hsdp-shard-size", "5"],
         "--hsdp-shard-size 5: it must divide the 32 GPUs"),
    Case("export-cached-dataset-training-flag", ["export", "--to_cached_dataset", "true", *GOOD[:2], *DATA,
                                                 "--learning_rate", "1e-4", "--output_dir", "exp"],
         "--learning_rate: an option of the training run"),
    Case("export-fp8-quant-bits", ["export", "--ckpt", "runs/x", "--quant_method", "fp8", "--quant_bits", "8"],
         "--quant_bits: FP8's format has no such setting"),
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
    Case("infer-revision-of-a-preset", ["infer", "--model", "tiny-llama-2l", "--prompt", "hi", "--model_revision", "v2"],
         "--model_revision v2: applies to a hub model id; --model tiny-llama-2l is a built-in preset"),
    Case("infer-bad-dtype", ["infer", "--model", "tiny-llama-2l", "--prompt", "hi", "--dtype", "fp7"],
         "--dtype fp7: choose auto, bf16, fp16 or fp32"),
    Case("infer-wrong-type", ["infer", "--model", "tiny-llama-2l", "--prompt", "hi", "--max-new-tokens", "many"],
         "Invalid value for '--max-new-tokens'"),
    Case("infer-missing-adapter", ["infer", "--model", "tiny-llama-2l", "--adapters", "nope", "--prompt", "hi"],
         "--adapters nope: not a peft adapter folder"),
    Case("bench-unknown-backend", ["bench", "--parallelism", "ddp,warp"], "--parallelism warp: unknown backend 'warp'"),
    Case("bench-too-few-steps", ["bench", "--steps", "0"], "--steps 0: needs at least"),
    Case("bench-bad-dtype", ["bench", "--torch-dtype", "fp9"], "--torch-dtype 'fp9': choose from"),
    Case("bench-zero-nodes", ["bench", "--nnodes", "0", "--parallelism", "hsdp"],
         "--nnodes must be a positive integer, got 0"),
    Case("bench-unknown-model", ["bench", "--model", "tiny-lama", "--parallelism", "ddp", "--steps", "8"],
         "--model tiny-lama: unknown preset"),
    Case("models-unknown-flag", ["models", "--all"], "No such option: --all"),
    Case("unknown-command", ["fine-tune"], "No such command 'fine-tune'", real=True),
]
