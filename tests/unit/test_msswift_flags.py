"""ms-swift users' flags mean what they mean in ms-swift: spellings, values and defaults from ms-swift's
command-line documentation (docs/source_en/Instruction/Command-line-parameters.md), each resolved to
a config field and value or refused with its one line; the docs/usage.md table checked row by row."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from swiftlite.cli import parse_run_args
from swiftlite.config import field_specs, load_config
from swiftlite.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--model", "tiny-llama-2l", "--dataset", "d.jsonl"]
ACCEPTED = object()  # accepted with nothing to set


def resolve(argv: list[str], **kw):
    config_file, values = parse_run_args([*BASE, *argv])
    return load_config(config_file, values, validate_paths=False, **kw)


# (ms-swift flags as typed, expected): expected is (field, value), ACCEPTED, or the start of the error line.
TABLE = [
    # model and dtype
    ("--model Qwen/Qwen2.5-7B-Instruct", ("model", "Qwen/Qwen2.5-7B-Instruct")),
    ("--model_revision v1.0", ("model_revision", "v1.0")),
    ("--torch_dtype bfloat16", ("torch_dtype", "bf16")),
    ("--torch_dtype float16", ("torch_dtype", "fp16")),
    ("--torch_dtype float32", ("torch_dtype", "fp32")),
    ("--torch_dtype auto", ("torch_dtype", "fp32")),          # a CPU build of torch: fp32
    ("--torch-dtype bf16", ("torch_dtype", "bf16")),
    ("--torch_dtype fp8", "flags: torch_dtype='fp8' is not one of bf16, fp16, fp32, auto"),
    ("--attn_impl flash_attn", ("attn_impl", "flash_attention_2")),
    ("--attn_impl flash_attention_2", ("attn_impl", "flash_attention_2")),
    ("--attn_impl sdpa", ("attn_impl", "sdpa")),
    ("--attn_impl eager", ("attn_impl", "eager")),
    # tuners
    ("--seed 1", ("train_type", "lora")),                      # ms-swift's default train type
    ("--train_type lora", ("train_type", "lora")),
    ("--train_type full", ("train_type", "full")),
    ("--tuner_type full", ("train_type", "full")),
    ("--train_type adalora", ("train_type", "adalora")),
    ("--train_type boft", ("train_type", "boft")),
    ("--train_type llamapro", ("train_type", "llamapro")),
    ("--tuner_type llamapro --llamapro_num_new_blocks 2", ("llamapro_num_new_blocks", 2)),
    ("--tuner_type llamapro --llamapro_num_groups 2", ("llamapro_num_groups", 2)),
    ("--train_type llamapro --llamapro_num_new_blocks -1", "--llamapro_num_new_blocks must be >= 1"),
    ("--train_type llamapro --lora_alpha 16", "--lora_alpha does not apply to --train_type llamapro"),
    ("--tuner_type bone", ("train_type", "bone")),
    ("--train_type bone --reft_rank 8", ("reft_rank", 8)),
    ("--train_type bone --init_weights bat", ("init_weights", "bat")),
    ("--train_type bone --init_weights pissa", "--init_weights pissa: a LoRA initialisation; --train_type bone"),
    ("--reft_rank 8", "--reft_rank is the rank of --train_type bone here"),
    ("--train_type reft", "--train_type reft: ReFT runs on pyreft, whose release (0.1.0) requires transformers 4.45.1"),
    ("--train_type longlora", ("train_type", "longlora")),
    ("--train_type vera", "--train_type vera: swiftlite trains full, lora, qlora"),
    ("--tuner_backend peft", ACCEPTED),
    ("--tuner_backend unsloth", "--tuner_backend unsloth: peft is the only tuner backend"),
    ("--lora_rank 8", ("lora_rank", 8)),
    ("--lora_alpha 32", ("lora_alpha", 32)),
    ("--lora_dropout 0.05", ("lora_dropout", 0.05)),
    ("--target_modules all-linear", ("target_modules", ["all-linear"])),
    ("--target_modules q_proj k_proj v_proj", ("target_modules", ["q_proj", "k_proj", "v_proj"])),
    ("--modules_to_save embed_tokens lm_head", ("modules_to_save", ["embed_tokens", "lm_head"])),
    ("--train_type full --lora_rank 8", "--lora-rank needs --train-type lora/qlora"),
    ("--train_type full --lora_alpha 32", "--lora-alpha needs --train-type lora/qlora"),
    ("--train_type full --lora_dropout 0.05", "--lora-dropout needs --train-type lora/qlora"),
    ("--train_type full --target_modules all-linear", "--target-modules needs --train-type lora/qlora"),
    ("--train_type full --modules_to_save lm_head", "--modules-to-save needs --train-type lora/qlora"),
    ("--use_dora true", ("use_dora", True)),
    ("--use_rslora true", ("use_rslora", True)),
    ("--init_weights pissa", ("init_weights", "pissa")),
    ("--init_weights True", ("init_weights", "true")),
    ("--lorap_lr_ratio 16", ("lorap_lr_ratio", 16.0)),
    ("--lora_bias all", ("lora_bias", "all")),
    ("--lora_bias none", ACCEPTED),
    # quantization
    ("--quant_bits 4", ("quant_bits", 4)),
    ("--quant_method bnb --quant_bits 4", ("quant_method", "bnb")),
    ("--quant_method bnb --quant_bits 8", ("quant_bits", 8)),
    ("--train_type qlora", ("quant_bits", 4)),
    ("--quant_method gptq --quant_bits 4", "--quant_method gptq: quantizing at load time is bitsandbytes"),
    ("--quant_method awq --quant_bits 4", "--quant_method awq: quantizing at load time is bitsandbytes"),
    ("--quant_method hqq --quant_bits 4", ("quant_method", "hqq")),
    ("--quant_method hqq --quant_bits 3 --hqq_axis 0", ("hqq_axis", 0)),
    ("--quant_method bnb", "--quant-method bnb needs --quant-bits 4 or 8"),
    ("--train_type full --quant_bits 4", "--quant-bits needs --train-type lora/qlora"),
    ("--quant_bits 4 --bnb_4bit_quant_type fp4", ("bnb_4bit_quant_type", "fp4")),
    ("--quant_bits 4 --bnb_4bit_use_double_quant false", ("bnb_4bit_use_double_quant", False)),
    ("--quant_bits 4 --torch_dtype bfloat16 --bnb_4bit_compute_dtype bfloat16", ("bnb_4bit_compute_dtype", "bf16")),
    ("--quant_bits 4 --torch_dtype float32 --bnb_4bit_compute_dtype float32", ("bnb_4bit_compute_dtype", "fp32")),
    ("--quant_bits 4 --torch_dtype bfloat16 --bnb_4bit_compute_dtype float16",
     "--bnb-4bit-compute-dtype fp16 differs from --torch-dtype bf16"),
    ("--quant_bits 8 --bnb_4bit_compute_dtype float32", "--bnb-4bit-compute-dtype applies to a 4-bit base"),
    ("--quant_bits 4 --torch_dtype bfloat16 --bnb_4bit_quant_storage bfloat16", ("bnb_4bit_quant_storage", "bf16")),
    ("--quant_bits 4 --torch_dtype bfloat16 --bnb_4bit_quant_storage uint8",
     "flags: bnb_4bit_quant_storage='uint8' is not one of bf16, fp16, fp32"),
    # data and template
    ("--template qwen2_5", "--template qwen2_5: ms-swift template names are not used here"),
    ("--system 'You are a helpful assistant.'", ("system", "You are a helpful assistant.")),
    ("--max_length 2048", ("max_length", 2048)),
    ("--seed 2", ("max_length", 2048)),                        # the model's context (tiny-llama-2l)
    ("--truncation_strategy delete", ("truncation_strategy", "delete")),
    ("--truncation_strategy left", ("truncation_strategy", "left")),
    ("--truncation_strategy right", ("truncation_strategy", "right")),
    ("--seed 3", ("truncation_strategy", "delete")),           # ms-swift's default
    ("--truncation_strategy split", "--truncation-strategy split is for pt"),
    ("--dataset a.jsonl b.jsonl#500", ("dataset", ["a.jsonl", "b.jsonl#500"])),
    ("--val_dataset v.jsonl", ("val_dataset", ["v.jsonl"])),
    ("--split_dataset_ratio 0.01", ("split_dataset_ratio", 0.01)),
    ("--dataset_num_proc 4", ("dataset_num_proc", 4)),
    ("--packing true", ("packing", True)),
    ("--padding_free true", ("padding_free", True)),
    ("--streaming true --max_steps 10", ("streaming", True)),
    ("--streaming", "--streaming needs --max-steps"),
    ("--streaming true --packing true --max_steps 10", ("packing", True)),   # ms-swift's pretrain/train.sh
    ("--lazy_tokenize true", ("lazy_tokenize", True)),
    ("--lazy_tokenize false", ACCEPTED),
    ("--load_from_cache_file true", ("load_from_cache_file", True)),
    ("--load_from_cache_file false", ACCEPTED),
    ("--model_author swift ModelScope", ("model_author", ["swift", "ModelScope"])),
    ("--model_name 'Xiao Huang'", ("model_name", ["Xiao Huang"])),
    ("--use_hf true", ACCEPTED),
    ("--use_hf", ACCEPTED),
    ("--use_hf false", "--use_hf false: swiftlite downloads from the Hugging Face hub only"),
    ("--model_type qwen2_5", "--model_type qwen2_5: swiftlite reads the architecture"),
    ("--dataloader_num_workers 4", ("dataloader_num_workers", 4)),
    ("--dataloader_num_workers 0", ("dataloader_num_workers", 0)),
    ("--dataloader_pin_memory false", ("dataloader_pin_memory", False)),
    ("--dataloader_num_workers 4 --dataloader_prefetch_factor 4", ("dataloader_prefetch_factor", 4)),
    ("--loss_scale last_round", ("loss_scale", "last_round")),
    ("--loss_scale default", ("loss_scale", "default")),
    ("--loss_scale ignore_empty_think", ("loss_scale", "ignore_empty_think")),
    ("--loss_scale hermes", ("loss_scale", "hermes")),
    ("--loss_scale last_round+react", ("loss_scale", "last_round+react")),
    ("--is_binary_loss_scale false", ("is_binary_loss_scale", False)),
    ("--loss_scale all+qwen", "--loss-scale all+qwen: 'qwen' weights parts of the answers"),
    ("--loss_scale all --loss_type loss_scale", ("loss_type", "loss_scale")),
    ("--loss_type cross_entropy", ("loss_type", "cross_entropy")),
    ("--loss_type sigmoid", "--loss-type sigmoid is a loss of `swiftlite rlhf`"),
    ("--template default", ("template", "default")),
    ("--template qwen2_5", "--template qwen2_5: ms-swift template names are not used here (but default)"),
    # training arguments
    ("--num_train_epochs 3", ("num_train_epochs", 3.0)),
    ("--num_train_epochs=2", ("num_train_epochs", 2.0)),
    ("--max_steps 100", ("max_steps", 100)),
    ("--per_device_train_batch_size 2", ("per_device_train_batch_size", 2)),
    ("--per_device_eval_batch_size 1", ("per_device_eval_batch_size", 1)),
    ("--gradient_accumulation_steps 16", ("gradient_accumulation_steps", 16)),
    ("--learning_rate 1e-4", ("learning_rate", 1e-4)),
    ("--lr_scheduler_type cosine", ("lr_scheduler", "cosine")),
    ("--lr_scheduler_type linear", ("lr_scheduler", "linear")),
    ("--warmup_ratio 0.05", ("warmup_ratio", 0.05)),
    ("--warmup_steps 10", ("warmup_steps", 10)),
    ("--weight_decay 0.1", ("weight_decay", 0.1)),
    ("--adam_beta1 0.9", ("adam_beta1", 0.9)),
    ("--adam_beta2 0.95", ("adam_beta2", 0.95)),
    ("--max_grad_norm 1", ("max_grad_norm", 1.0)),
    ("--seed 42", ("seed", 42)),
    ("--data_seed 42", "--data_seed 42: --seed sets the data order"),
    ("--gradient_checkpointing true", ("gradient_checkpointing", True)),
    ("--gradient_checkpointing --gradient_checkpointing_kwargs '{\"use_reentrant\": false}'",
     ("gradient_checkpointing_kwargs", {"use_reentrant": False})),
    ("--gradient_checkpointing_kwargs '{\"use_reentrant\": false}'",      # checkpointing is on by default
     ("gradient_checkpointing_kwargs", {"use_reentrant": False})),
    ("--gradient_checkpointing false --gradient_checkpointing_kwargs '{\"use_reentrant\": false}'",
     "--gradient-checkpointing-kwargs needs --gradient-checkpointing true"),
    ("--gradient_checkpointing --gradient_checkpointing_kwargs '{use_reentrant: false}'",
     "flags: gradient_checkpointing_kwargs: not valid JSON"),
    ("--gradient_checkpointing --gradient_checkpointing_kwargs '[1]'",
     "flags: gradient_checkpointing_kwargs: expected a JSON object"),
    ("--gradient_checkpointing --gradient_checkpointing_kwargs '{\"reentrant\": false}'",
     "--gradient-checkpointing-kwargs: unknown key 'reentrant'"),
    ("--output_dir output/qwen", ("output_dir", "output/qwen")),
    ("--add_version false", ACCEPTED),
    ("--add_version true", ("add_version", True)),
    ("--logging_steps 5", ("logging_steps", 5)),
    ("--logging_dir runs", "--logging_dir runs: TensorBoard events are written to <output-dir>/runs"),
    ("--report_to tensorboard", ("report_to", ["tensorboard"])),
    ("--save_strategy steps", ("save_strategy", "steps")),
    ("--save_strategy epoch", ("save_strategy", "epoch")),
    ("--save_strategy no", ("save_strategy", "no")),
    ("--save_strategy no --save_steps 500", "--save-steps with --save-strategy no"),
    ("--save_steps 500", ("save_steps", 500)),
    ("--save_total_limit 2", ("save_total_limit", 2)),
    ("--eval_strategy steps --val_dataset v.jsonl", ("eval_strategy", "steps")),
    ("--eval_strategy epoch --split_dataset_ratio 0.1", ("eval_strategy", "epoch")),
    ("--eval_strategy no", ("eval_strategy", "no")),
    ("--eval_strategy no --val_dataset v.jsonl", "--eval-strategy no with validation data"),
    ("--eval_strategy steps", ("eval_strategy", "steps")),   # no validation data: nothing evaluated, as ms-swift
    ("--eval_strategy epoch --eval_steps 10 --val_dataset v.jsonl", "--eval-steps with --eval-strategy epoch"),
    ("--eval_steps 500", ("eval_steps", 500)),
    ("--save_only_model true", ("save_only_model", True)),
    ("--save_only_model", ("save_only_model", True)),
    ("--save_only_model false", ACCEPTED),
    ("--resume_from_checkpoint output/checkpoint-100", ("resume_from", "output/checkpoint-100")),
    ("--ignore_data_skip true", ("ignore_data_skip", True)),
    ("--deepspeed zero2", ("deepspeed", "zero2")),
    ("--deepspeed zero3_offload", ("deepspeed", "zero3_offload")),
    ("--ddp_timeout 18000", ("ddp_timeout", 18000)),
    ("--ddp_backend nccl", "--ddp_backend nccl: the process-group backend is chosen automatically"),
    ("--external_plugins plugin.py", ("external_plugins", ["plugin.py"])),
    ("--neftune_noise_alpha 5", ("neftune_noise_alpha", 5.0)),
    ("--val_dataset v.jsonl --early_stop_interval 3", ("early_stop_interval", 3)),
    ("--early_stop_interval 3", "--early_stop_interval 3 stops when the validation metric stops improving"),
    ("--metric_for_best_model loss", ("metric_for_best_model", "loss")),
    ("--greater_is_better false", ("greater_is_better", False)),
    ("--dataloader_drop_last false", ("dataloader_drop_last", False)),
    ("--neftune_noise_alpha -1", "--neftune_noise_alpha must be >= 0"),
    ("--optim adamw_torch", ("optim", "adamw_torch")),
    ("--optim adamw_torch_fused", ACCEPTED),
    ("--optim sgd", ("optim", "sgd")),
    ("--optim adamw_8bit", "--optim adamw_8bit: not available: --optim takes"),
    ("--bf16 true", "--bf16 true: use --torch_dtype bfloat16"),
    ("--fp16 true", "--fp16 true: use --torch_dtype float16"),
    ("--use_liger_kernel true", ("use_liger_kernel", True)),
    ("--max_new_tokens 64", "--max_new_tokens 64: training never generates"),
    ("--sequence_parallel_size 1", ACCEPTED),
    ("--sequence_parallel_size 4", ("sequence_parallel_size", 4)),
    ("--sequence_parallel_size 0", "--sequence_parallel_size 0: give 1 (off)"),
    ("--use_logits_to_keep false", ("loss_impl", "plain")),
    ("--use_logits_to_keep true", ACCEPTED),
    ("--use_logits_to_keep false --loss_impl chunked", "--use_logits_to_keep false computes every position's logits"),
    ("--push_to_hub true", "--push_to_hub true: upload the exported folder yourself"),
    ("--freeze_vit true", "--freeze_vit true: multimodal models are not supported"),
]


def _field(cfg, name):
    if name == "learning_rate":
        return cfg.learning_rate
    return cfg.flat()[name]


def _run_field(cfg, name: str):
    """The value the run uses: the user's, or, where the user said nothing, the one the run settles
    (job.resolve_run: the model's context for --max_length)."""
    got = _field(cfg, name)
    if got is None and name == "max_length":
        from swiftlite.job import resolve_run
        got = _field(resolve_run(cfg, 1, gpu_memory=None, gpus_per_node=1).config, name)
    return got


@pytest.mark.parametrize("flags,expected", TABLE, ids=[t[0] for t in TABLE])
def test_msswift_flag(flags, expected):
    argv = shlex.split(flags)
    if isinstance(expected, str):
        with pytest.raises(UserError) as e:
            resolve(argv)
        assert str(e.value).startswith(expected), str(e.value)
        assert "\n" not in str(e.value)
        return
    cfg = resolve(argv)
    if expected is ACCEPTED:
        assert cfg.to_dict() == resolve([]).to_dict()  # nothing to set
        return
    name, value = expected
    got = _run_field(cfg, name)
    assert got == value and type(got) is type(value), (name, got)


def test_table_is_big_enough():
    assert len(TABLE) >= 60 and len({t[0].split()[0] for t in TABLE}) >= 60


def test_underscore_and_dash_spellings_agree():
    for flags, expected in TABLE:
        if isinstance(expected, tuple):
            dashed = [a.replace("_", "-") if a.startswith("--") else a for a in shlex.split(flags)]
            assert resolve(dashed).to_dict() == resolve(shlex.split(flags)).to_dict(), flags


# -- the docs/usage.md table -----------------------------------------------------------------------

def _doc_rows() -> list[tuple[str, str, str]]:
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text.split("## ms-swift flags", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`--"):
            rows.append((cells[0].strip("`"), cells[1].strip("`"), cells[2].strip("`")))
    return rows


DOC_ROWS = _doc_rows()


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


@pytest.mark.parametrize("flag,example,expect", DOC_ROWS, ids=[f"{r[0]}:{r[1]}" for r in DOC_ROWS])
def test_doc_table_row(flag, example, expect):
    argv = shlex.split(example)
    if expect.startswith("error: "):
        with pytest.raises(UserError) as e:
            resolve(argv)
        assert str(e.value).startswith(expect[len("error: "):]), str(e.value)
        return
    cfg = resolve(argv)
    if expect == "accepted":
        assert cfg.to_dict() == resolve([]).to_dict()
        return
    name, _, value = expect.partition("=")
    got, want = _run_field(cfg, name), _value(value)
    assert got == want, (name, got, want)


def test_doc_table_covers_every_msswift_name():
    from swiftlite.config.msswift import NO_MEANING
    from swiftlite.config.load import alias_keys
    flags = {r[0] for r in DOC_ROWS}
    assert len(DOC_ROWS) >= 60
    missing = [n for n in NO_MEANING if f"--{n}" not in flags]
    assert not missing, f"docs/usage.md 'ms-swift flags' lacks {missing}"
    ms_aliases = [a for a in alias_keys() if a in ("tuner_type", "lr_scheduler_type", "resume_from_checkpoint")]
    assert all(f"--{a}" in flags for a in ms_aliases)


# -- config files: the same names as keys ----------------------------------------------------------

def test_aliases_and_refusals_as_config_keys(tmp_path):
    import yaml
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({"lr_scheduler_type": "linear", "tuner_type": "full", "torch_dtype": "bfloat16",
                                 "resume_from_checkpoint": "out/checkpoint-3", "use_hf": True,
                                 "dataset": ["d.jsonl"]}))
    cfg = load_config(str(p), {}, validate_paths=False)
    assert (cfg.optim.lr_scheduler, cfg.train.train_type, cfg.model.torch_dtype, cfg.checkpoint.resume_from) == \
        ("linear", "full", "bf16", "out/checkpoint-3")
    assert load_config(str(p), {"lr_scheduler": "cosine"}, validate_paths=False).optim.lr_scheduler == "cosine"
    p.write_text("dataset: [d.jsonl]\nlr: 1e-4\nlearning_rate: 2e-4\n")
    with pytest.raises(UserError, match=r"run.yaml: lr and learning_rate both given"):
        load_config(str(p), {}, validate_paths=False)
    p.write_text("dataset: [d.jsonl]\nmodel_type: qwen2_5\n")
    with pytest.raises(UserError, match=r"run.yaml: model_type: 'qwen2_5': swiftlite reads the architecture"):
        load_config(str(p), {}, validate_paths=False)
    p.write_text("dataset: [d.jsonl]\ntrain_type: full\ntarget_modules: [q_proj]\n")
    with pytest.raises(UserError, match=r"--target-modules needs --train-type lora/qlora"):
        load_config(str(p), {}, validate_paths=False)


def test_explicit_keys_exclude_defaults_and_env(monkeypatch):
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    for k in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    cfg = resolve(["--full", "--seed", "3"])
    assert cfg.explicit == {"model", "dataset", "train_type", "seed"}
    assert "explicit" not in cfg.to_dict()


def test_help_states_the_msswift_defaults():
    from swiftlite.cli.run_flags import run_help
    lines = {ln.split()[0]: ln for ln in run_help("sft").splitlines() if ln.startswith("  --")}
    assert "[default: lora]" in lines["--train-type"]
    assert "[default: auto]" in lines["--torch-dtype"] and "fp32 on CPU" in lines["--torch-dtype"]
    assert "[default: delete]" in lines["--truncation-strategy"]
    assert "max_position_embeddings" in lines["--max-length"]
    assert "--gradient-checkpointing-kwargs JSON" in lines["--gradient-checkpointing-kwargs"]


def test_every_new_field_has_both_spellings():
    specs = field_specs()
    for name in ("system", "truncation_strategy", "quant_method", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage",
                 "gradient_checkpointing_kwargs", "eval_strategy", "save_strategy"):
        assert {f"--{name}", f"--{name.replace('_', '-')}"} <= set(specs[name].flags)


# -- defaults that come from the model ---------------------------------------------------------------

@pytest.mark.parametrize("declared,cuda,bf16_ok,want", [
    ("bfloat16", True, True, "bf16"), ("float16", True, True, "bf16"), ("float32", True, True, "bf16"),
    ("float16", True, False, "fp32"),
    (None, True, True, "bf16"), ("bfloat16", True, False, "fp32"), ("bfloat16", False, True, "fp32"),
    ("torch.bfloat16", True, True, "bf16"),
])
def test_auto_dtype(declared, cuda, bf16_ok, want):
    from swiftlite.config import build_config
    from swiftlite.models.loading import auto_dtype
    cfg = build_config({"model": "tiny-llama-2l"})
    cfg.model.torch_dtype = "auto"  # as on a GPU build of torch, where config.load leaves it
    name, why = auto_dtype(cfg, {"torch_dtype": declared} if declared else {}, cuda, bf16_ok=bf16_ok)
    assert name == want and why.startswith(f"auto: {want}")
    assert cfg.model.torch_dtype == "auto"   # the answer goes into the run's copy (job.resolve_run), not here
    assert auto_dtype(build_config({"model": "tiny-llama-2l", "torch_dtype": "bf16"}), {}, cuda) is None


def test_max_length_from_the_model(tmp_path):
    from types import SimpleNamespace

    from swiftlite.config import build_config
    from swiftlite.models.loading import context_max_length
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    from swiftlite.job import resolve_run

    def resolved_length(model):
        said = build_config({"model": model})
        assert said.data.max_length is None      # the user's config keeps what was said: nothing
        return resolve_run(said, 1, gpu_memory=None, gpus_per_node=1).max_length
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096,
                                                      "hidden_size": 64, "num_attention_heads": 4,
                                                      "num_hidden_layers": 1, "intermediate_size": 128,
                                                      "vocab_size": 256}))
    assert resolved_length(str(tmp_path)) == 4096                               # a local folder
    assert resolved_length("llama-8b") == 131072                                # a preset
    cfg = build_config({"model": "org/hub-model"})
    assert cfg.data.max_length is None                                          # a hub id: its config, later
    n, _ = context_max_length(cfg, SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=8192)))
    assert n == 8192 and cfg.data.max_length is None
    with pytest.raises(UserError, match="declares no context length"):
        context_max_length(cfg, {})


def test_strategies_become_steps():
    from swiftlite.job import resolve_run
    cfg = resolve(["--save_strategy", "epoch", "--eval_strategy", "epoch", "--split_dataset_ratio", "0.1"])
    cad = resolve_run(cfg, 1, gpu_memory=None, gpus_per_node=1).cadence(7)
    assert (cad.save_steps, cad.eval_steps) == (7, 7)
    cfg = resolve(["--save_strategy", "no"])
    assert resolve_run(cfg, 1, gpu_memory=None, gpus_per_node=1).cadence(7).save_steps is None
    cfg = resolve(["--save_steps", "3"])
    assert resolve_run(cfg, 1, gpu_memory=None, gpus_per_node=1).cadence(7).save_steps == 3


# -- truncation strategies and --system in tokenization --------------------------------------------

@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    t = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    return t


def _rows(path: Path, n: int, long_every: int = 2) -> str:
    rows = []
    for i in range(n):
        q = "x" * (200 if i % long_every == 0 else 5)
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_truncation_strategies_count_rows(tmp_path, tok):
    from swiftlite.data.pipeline import tokenize_specs
    spec = _rows(tmp_path / "d.jsonl", 6)
    got = {s: tokenize_specs([spec], tok, task="sft", max_length=64, packing=False, skip_bad_rows=False,
                             use_cache=False, truncation_strategy=s) for s in ("delete", "left", "right")}
    assert len(got["delete"].rows) == 3 and got["delete"].stats.deleted == 3 and got["delete"].stats.truncated == 0
    assert len(got["left"].rows) == 6 and got["left"].stats.truncated == 3 and got["left"].stats.deleted == 0
    # right truncation cuts the answer off the long rows: they have no target left and are dropped
    assert got["right"].stats.truncated == 3 and got["right"].stats.no_target == 3
    assert all(len(r["input_ids"]) <= 64 for r in got["left"].rows)
    assert any(x != -100 for x in got["left"].rows[0]["labels"])  # left keeps the answer


def test_delete_explains_no_usable_rows(tmp_path, tok):
    from swiftlite.data.pipeline import prepare_datasets
    spec = _rows(tmp_path / "long.jsonl", 4, long_every=1)
    cfg = resolve(["--dataset", spec, "--max_length", "64"])
    with pytest.raises(UserError, match=r"no usable rows \(read 4, skipped 0, 0 without an answer, 4 longer than "
                                        r"--max-length deleted\)"):
        prepare_datasets(cfg, tok, 1)


def test_system_prompt_for_rows_without_one(tmp_path, tok):
    from swiftlite.data.pipeline import tokenize_specs
    from swiftlite.data.tokenize import encode_messages, system_prompt
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]
    own = [{"role": "system", "content": "mine"}, *conv]
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"messages": conv}) + "\n" + json.dumps({"messages": own}) + "\n")
    out = tokenize_specs([str(p)], tok, task="sft", max_length=512, packing=False, skip_bad_rows=False,
                         use_cache=False, system="Be brief.")
    want = encode_messages(tok, [{"role": "system", "content": "Be brief."}, *conv], 512)
    assert out.rows[0]["input_ids"] == want.input_ids
    assert out.rows[1]["input_ids"] == encode_messages(tok, own, 512).input_ids  # a row's own system wins
    f = tmp_path / "system.txt"
    f.write_text("From a file.\n")
    assert system_prompt(str(f)) == "From a file."
    with pytest.raises(UserError, match="applies to sft"):
        resolve(["--system", "x"], task="pt")


def test_gradient_checkpointing_kwargs_reach_the_model(monkeypatch):
    from transformers import PreTrainedModel

    from swiftlite.config import build_config
    from swiftlite.models.loading import prepare_model
    seen = []
    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable",
                        lambda self, gradient_checkpointing_kwargs=None: seen.append(gradient_checkpointing_kwargs))
    cfg = build_config({"model": "tiny-llama-2l", "train_type": "full", "gradient_checkpointing": True,
                        "gradient_checkpointing_kwargs": '{"use_reentrant": true}'})
    prepare_model(cfg, reentrant=False)                 # the flag wins over the backend's default
    cfg.train.gradient_checkpointing_kwargs = None
    prepare_model(cfg)                                  # ms-swift's default: reentrant
    prepare_model(cfg, reentrant=False)                 # multi-process DDP's default
    assert seen == [{"use_reentrant": True}, {"use_reentrant": True}, {"use_reentrant": False}]


# -- launch and models ---------------------------------------------------------------------------------

def test_nnodes_needs_master_addr_outside_slurm(monkeypatch):
    from swiftlite.launch import plan_launch
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_JOB_NODELIST",
              "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    cfg = resolve(["--nnodes", "2", "--nproc_per_node", "2"])
    with pytest.raises(UserError, match=r"^--nnodes 2 needs --master-addr"):
        plan_launch(cfg, [])
    assert plan_launch(resolve(["--nnodes", "2", "--master_addr", "10.0.0.1"]), []).master_addr == "10.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    assert plan_launch(resolve(["--nnodes", "2"]), []).master_addr == "10.0.0.2"
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert plan_launch(resolve(["--nnodes", "2"]), []).nnodes == 2


def test_preset_typo_gets_did_you_mean_before_the_hub():
    from swiftlite.models.loading import resolve_model
    with pytest.raises(UserError, match=r"^--model qwen2\.5-7bb: unknown preset \(did you mean qwen2\.5-7b\?"):
        resolve_model("qwen2.5-7bb")
    with pytest.raises(UserError, match=r"did you mean tiny-llama\?"):
        resolve_model("tiny-lama")
    assert resolve_model("qwen2.5-7B").preset.name == "qwen2.5-7b"  # case is not a typo


def test_no_meaning_table_is_consistent():
    from swiftlite.config.msswift import NO_MEANING, REFUSED_VALUES
    specs = field_specs()
    assert not set(NO_MEANING) & set(specs), "a field cannot also be refused"
    for (key, value) in REFUSED_VALUES:
        assert key in specs and value not in specs[key].choices
    for e in NO_MEANING.values():
        assert re.match(r"^[a-z0-9_]+$", e.name) and e.why and not e.why.endswith(".")


def test_on_a_gpu_build_auto_waits_for_the_model_and_the_device(monkeypatch):
    """A CUDA build of torch: config.load cannot know whether a GPU is usable without importing torch, so
    `auto` stays until job.resolve_run (models.loading.model_defaults), or load_model, asks torch and reads
    the model's config; here torch sees no GPU, so fp32."""
    import swiftlite.config.load as load
    from swiftlite.job import resolve_run
    from swiftlite.models.loading import load_model, model_defaults
    monkeypatch.setattr(load, "gpu_torch_build", lambda: True)
    cfg = resolve(["--quant_bits", "4", "--bnb_4bit_compute_dtype", "bfloat16"])
    assert cfg.model.torch_dtype == "auto"
    with pytest.raises(UserError, match="--bnb-4bit-compute-dtype bf16 differs from --torch-dtype fp32"):
        resolve_run(cfg, 1, gpu_memory=None, gpus_per_node=1)  # the dtype rules run again once it is known
    cfg = resolve([])
    assert model_defaults(cfg) == ("fp32", 2048, ["auto: fp32 on CPU", "max length 2048: the model's context"])
    assert cfg.model.torch_dtype == "auto" and cfg.data.max_length is None
    run = resolve_run(cfg, 1, gpu_memory=None, gpus_per_node=1).config
    assert run.model.torch_dtype == "fp32" and run.sealed and not cfg.sealed
    assert model_defaults(run)[2] == []  # nothing left: no model config read, no torch asked
    model = load_model(cfg)  # export/infer build configs without resolving: the loader settles it
    assert next(model.parameters()).dtype == __import__("torch").float32 and cfg.model.torch_dtype == "auto"
