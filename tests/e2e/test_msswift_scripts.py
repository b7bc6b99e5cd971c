"""ms-swift-style commands, as its example scripts write them (issue 22, acceptance 1).

Every flag found in ms-swift's `examples/train` text-LLM sft/pt/rlhf (dpo, orpo, simpo) and `examples/export`
scripts (ms-swift 3602360a, 2026-08-22; the names are copied below, SCRIPT_FLAGS, as
scripts/msswift_examples.py extracts them) is either used by one of the commands here, each with
`--max_steps 2` on a local tiny Qwen2 folder, which must exit 0 and show the value given in its args.json,
or is in REFUSED, where one run gives them all and gets one `error:` line per flag, exit 2.

Speed: the single-process commands run in this process, one after another (swiftlite's CLI entry,
`swiftlite.cli.main`, in a fresh output folder each, os.environ and the working directory restored after
each); test_in_process_is_what_a_subprocess_does checks that one of them gives the same args.json and the
same losses as `python -m swiftlite` in a subprocess. Only the multi-process commands (NPROC_PER_NODE=2)
are subprocesses.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_env, main_in_process, read_losses, run_cli

#: The flags of ms-swift's text-LLM sft/pt/rlhf(dpo, orpo, simpo)/export example scripts at 3602360a.
SCRIPT_FLAGS = frozenset("""
adapters agent_template attn_impl bnb_4bit_compute_dtype bnb_4bit_quant_type bnb_4bit_use_double_quant
cached_dataset cached_val_dataset dataloader_num_workers dataset dataset_num_proc deepspeed device_map
early_stop_interval enable_dft_loss eval_steps experts_impl galore_optim_per_parameter galore_quantization
gradient_accumulation_steps gradient_checkpointing gradient_checkpointing_kwargs hub_model_id hub_token
init_weights lazy_tokenize learning_rate lisa_activated_layers llamapro_num_new_blocks load_data_args
load_from_cache_file logging_steps lora_alpha lora_ga_batch_size lora_ga_direction lora_ga_iters
lora_ga_max_length lora_ga_scale lora_ga_stable_gamma lora_rank loss_scale loss_type max_length
max_model_len max_steps merge_lora metric_for_best_model model model_author model_name modules_to_save
neftune_noise_alpha new_special_tokens num_train_epochs optim_args optimizer output_dir packing padding_free
per_device_eval_batch_size per_device_train_batch_size push_to_hub quant_batch_size quant_bits quant_method
quant_n_samples reft_intervention_type response_prefix rlhf_type rope_scaling router_aux_loss_coef rpo_alpha
save_only_model save_steps save_total_limit sequence_parallel_size split_dataset_ratio streaming system
target_modules template to_cached_dataset to_ollama torch_dtype truncation_strategy tuner_backend tuner_type
use_chat_template use_dora use_galore use_hf use_liger_kernel use_logits_to_keep warmup_ratio
""".split())

# The commands: (id, command, {args.json field: resolved value}). {M} {O} and the data names are filled in.
# Most pass --gradient_accumulation_steps (ms-swift's scripts do; its default, ceil(16 / (batch x world)),
# would make each of the two steps 16 micro-batches) and a short --max_length (the rows are short; the
# tokenizer is byte-level: a token per byte).
_C = "--model {M} --max_length 256 --gradient_accumulation_steps 1 --per_device_train_batch_size 1 --output_dir {O}"
_LORA = "--tuner_type lora --lora_rank 8 --lora_alpha 32 --target_modules all-linear"
SFT = [
    ("lora", f"sft {_C} {_LORA} --dataset {{alpaca}}#16 --torch_dtype bfloat16 --num_train_epochs 1 "
             "--learning_rate 1e-4 --warmup_ratio 0.05 --logging_steps 5 --eval_steps 50 --save_steps 50 "
             "--save_total_limit 2 --split_dataset_ratio 0.2 --per_device_eval_batch_size 1 "
             "--system 'You are a helpful assistant.'",
     {"train_type": "lora", "lora_rank": 8, "lora_alpha": 32, "target_modules": ["all-linear"],
      "torch_dtype": "bf16", "num_train_epochs": 1, "learning_rate": 1e-4, "warmup_ratio": 0.05,
      "logging_steps": 5, "eval_steps": 50, "save_steps": 50, "save_total_limit": 2, "split_dataset_ratio": 0.2,
      "per_device_eval_batch_size": 1, "system": "You are a helpful assistant.", "max_steps": 2}),
    ("full", f"sft {_C} --tuner_type full --dataset {{alpaca}}#8 {{alpaca}}#8 --torch_dtype bfloat16 "
             "--learning_rate 1e-5 --num_train_epochs 2",
     {"train_type": "full", "torch_dtype": "bf16", "learning_rate": 1e-5, "num_train_epochs": 2}),
    # examples/train/tuners/lora-ga/train.sh
    ("lora_ga", f"sft {_C} --tuner_type lora --dataset {{self_cognition}}#16 --num_train_epochs 1 --learning_rate 1e-4 "
                "--lora_rank 8 --lora_alpha 32 --init_weights lora-ga --lora_ga_batch_size 2 --lora_ga_iters 2 "
                "--lora_ga_max_length 1024 --lora_ga_direction ArB2r --lora_ga_scale stable --lora_ga_stable_gamma 16 "
                "--model_author swift --model_name swift-robot",
     {"init_weights": "lora-ga", "lora_ga_batch_size": 2, "lora_ga_iters": 2, "lora_ga_max_length": 1024,
      "lora_ga_direction": "ArB2r", "lora_ga_scale": "stable", "lora_ga_stable_gamma": 16}),
    # examples/train/tuners/galore/train_galore.sh
    ("galore", f"sft {_C} --tuner_type full --dataset {{self_cognition}}#16 --learning_rate 1e-5 --use_galore true "
               "--galore_optim_per_parameter true --model_author swift --model_name swift-robot",
     {"use_galore": True, "galore_optim_per_parameter": True, "galore_rank": 128}),
    ("self_cognition", f"sft {_C} {_LORA} --dataset {{alpaca}}#8 {{self_cognition}}#8 --model_author swift "
                       "--model_name swift-robot",
     {"model_author": ["swift"], "model_name": ["swift-robot"]}),
    # examples/train/tuners/bone/train.sh: ms-swift's Bone, peft's MiSS here, with ms-swift's defaults
    ("bone", f"sft {_C} --tuner_type bone --dataset {{self_cognition}}#16 --num_train_epochs 1 --learning_rate 1e-4 "
             "--eval_steps 100 --save_steps 100 --save_total_limit 2 --logging_steps 5 --model_author swift "
             "--model_name swift-robot",
     {"train_type": "bone", "reft_rank": 4, "init_weights": "true", "model_author": ["swift"]}),
    ("self_cognition_zh_en", f"sft {_C} --dataset {{self_cognition}}#8 --model_author 魔搭 ModelScope "
                             "--model_name 小黄 'Xiao Huang'",
     {"model_author": ["魔搭", "ModelScope"], "model_name": ["小黄", "Xiao Huang"]}),
    ("workers", f"sft {_C} --dataset {{messages}}#16 --dataloader_num_workers 4 --dataset_num_proc 4",
     {"dataloader_num_workers": 4, "dataset_num_proc": 4}),
    ("cache_true", f"sft {_C} --dataset {{messages}}#16 --load_from_cache_file true", {"load_from_cache_file": True}),
    ("cache_false", f"sft {_C} --dataset {{messages}}#16 --load_from_cache_file false",
     {"load_from_cache_file": False}),
    ("lazy", f"sft {_C} --dataset {{alpaca}}#16 --lazy_tokenize true", {"lazy_tokenize": True}),
    ("streaming", f"sft {_C} --dataset {{messages}} --streaming true --dataloader_num_workers 2",
     {"streaming": True, "dataloader_num_workers": 2}),
    # examples/train/streaming/streaming.sh: `#N` on a stream is its first N rows (ms-swift's take(N))
    ("streaming_n", f"sft {_C} --dataset {{self_cognition}}#20 --streaming true --model_author swift "
                    "--model_name swift-robot",
     {"streaming": True, "model_author": ["swift"]}),
    ("packing", f"sft {_C} --dataset {{alpaca}}#16 --packing true --max_length 512",
     {"packing": True, "max_length": 512}),
    ("padding_free", f"sft {_C} --dataset {{alpaca}}#16 --padding_free true", {"padding_free": True}),
    # examples/train/sequence_parallel/sequence_parallel_512k.sh's context flags (models/rope.py)
    ("rope_yarn", f"sft {_C} {_LORA} --dataset {{alpaca}}#16 --packing true --rope_scaling yarn --max_model_len 65536",
     {"rope_scaling": "yarn", "max_model_len": 65536, "packing": True}),
    ("save_only_model", f"sft {_C} --dataset {{messages}}#16 --save_only_model true --save_steps 2",
     {"save_only_model": True, "save_steps": 2}),
    ("checkpointing_on", f"sft {_C} --dataset {{messages}}#16 --gradient_checkpointing true",
     {"gradient_checkpointing": True}),
    ("checkpointing_kwargs", f"sft {_C} --dataset {{messages}}#16 --gradient_checkpointing true "
                             "--gradient_checkpointing_kwargs '{{\"use_reentrant\": false}}'",
     {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}),
    ("checkpointing_off", f"sft {_C} --dataset {{messages}}#16 --gradient_checkpointing false",
     {"gradient_checkpointing": False}),
    ("dora", f"sft {_C} {_LORA} --dataset {{messages}}#16 --use_dora true", {"use_dora": True}),
    ("pissa", f"sft {_C} {_LORA} --dataset {{messages}}#16 --init_weights pissa", {"init_weights": "pissa"}),
    ("olora", f"sft {_C} {_LORA} --dataset {{messages}}#16 --init_weights olora", {"init_weights": "olora"}),
    ("neftune", f"sft {_C} --dataset {{messages}}#16 --neftune_noise_alpha 15", {"neftune_noise_alpha": 15.0}),
    ("muon", f"sft {_C} {_LORA} --dataset {{messages}}#16 --optimizer muon", {"optimizer": "muon"}),
    # examples/train/optimizer/muonclip.sh
    ("muonclip", f"sft {_C} {_LORA} --dataset {{messages}}#16 --optimizer muonclip --optim_args qk_clip_threshold=10000",
     {"optimizer": "muonclip", "optim_args": "qk_clip_threshold=10000"}),
    ("early_stop", f"sft {_C} --dataset {{messages}}#32 --split_dataset_ratio 0.25 --eval_steps 1 "
                   "--early_stop_interval 3 --metric_for_best_model loss",
     {"early_stop_interval": 3, "metric_for_best_model": "loss", "eval_steps": 1}),
    # examples/train/tuners/lisa/train.sh: full training, 2 of the tiny folder's 4 decoder layers at a time
    ("lisa", f"sft {_C} --tuner_type full --dataset {{self_cognition}}#16 --lisa_activated_layers 2 "
             "--num_train_epochs 1 --learning_rate 1e-5 --eval_steps 100 --save_steps 100 --save_total_limit 2 "
             "--logging_steps 5 --model_author swift --model_name swift-robot",
     {"train_type": "full", "lisa_activated_layers": 2, "lisa_step_interval": 20, "model_author": ["swift"]}),
    # examples/train/plugins/loss_scale.sh, think_model/*.sh, full/dft.sh, base_to_chat/lora.sh
    ("loss_scale_all", f"sft {_C} {_LORA} --dataset {{self_cognition}}#16 --model_author swift "
                       "--model_name swift-robot --loss_scale all --loss_type loss_scale",
     {"loss_scale": "all", "loss_type": "loss_scale"}),
    ("loss_scale_think", f"sft {_C} --dataset {{messages}}#16 --loss_scale ignore_empty_think",
     {"loss_scale": "ignore_empty_think"}),
    ("loss_scale_last_round", f"sft {_C} --dataset {{messages}}#16 --loss_scale last_round",
     {"loss_scale": "last_round"}),
    ("dft", f"sft {_C} --tuner_type full --dataset {{messages}}#16 --torch_dtype bfloat16 --enable_dft_loss true",
     {"enable_dft_loss": True, "train_type": "full"}),
    ("template_default", f"sft {_C} {_LORA} --dataset {{alpaca}}#16 --template default "
                         "--system 'You are a helpful assistant.'",
     {"template": "default", "system": "You are a helpful assistant."}),
    # examples/train/agent/qwen2_5.sh, glm4.sh: ms-swift's agent rows (function-calling-chatml) as hermes turns
    ("agent_hermes", f"sft {_C} --tuner_type full --dataset {{agent}}#16 --load_from_cache_file true "
                     "--split_dataset_ratio 0.25 --agent_template hermes --torch_dtype bfloat16 --packing true "
                     "--save_only_model true --per_device_eval_batch_size 1 --max_length 1024",
     {"agent_template": "hermes", "packing": True, "max_length": 1024}),
    # examples/train/agent/loss_scale/train.sh: ms-swift's weighted hermes scale (tool calls weigh 2)
    ("agent_loss_scale", f"sft {_C} {_LORA} --dataset {{agent}}#16 --load_from_cache_file true "
                         "--split_dataset_ratio 0.25 --loss_scale hermes --agent_template hermes "
                         "--modules_to_save embed_tokens lm_head --max_length 1024",
     {"loss_scale": "hermes", "agent_template": "hermes", "modules_to_save": ["embed_tokens", "lm_head"]}),
    # examples/train/agent/deepseek_r1.sh: ReAct turns, Action text weighted 2, no response prefix
    ("agent_react", f"sft {_C} --tuner_type full --dataset {{agent}}#16 --load_from_cache_file true "
                    "--split_dataset_ratio 0.25 --agent_template react_en --loss_scale react "
                    "--response_prefix '' --torch_dtype bfloat16 --packing true --max_length 1024",
     {"agent_template": "react_en", "loss_scale": "react", "response_prefix": "", "packing": True}),
    # examples/train/tuners/longlora/train.sh (its --attn_impl flash_attn needs a GPU: left out here)
    ("longlora", f"sft {_C} --tuner_type longlora --dataset {{alpaca}}#16 --load_from_cache_file true "
                 "--split_dataset_ratio 0.25 --lora_rank 8 --lora_alpha 32 --eval_steps 1",
     {"train_type": "longlora", "lora_rank": 8, "lora_alpha": 32}),
    # examples/train/new_special_tokens/train.sh (its tokens file given as tokens here)
    ("new_special_tokens", f"sft {_C} {_LORA} --dataset {{messages}}#16 --new_special_tokens '<|0|>' '<|1|>' "
                           "--modules_to_save embed_tokens lm_head",
     {"new_special_tokens": ["<|0|>", "<|1|>"], "modules_to_save": ["embed_tokens", "lm_head"]}),
    # examples/train/moe/qwen3_moe.sh: LoRA on a mixture of experts with the router's aux loss
    ("moe", f"sft {_C.replace('{M}', '{MOE}')} {_LORA} --dataset {{messages}}#16 --router_aux_loss_coef 1e-3 "
            "--experts_impl grouped_mm",
     {"router_aux_loss_coef": 1e-3, "experts_impl": "grouped_mm", "target_modules": ["all-linear"]}),
    ("modules_to_save", f"sft {_C} {_LORA} --dataset {{messages}}#16 --modules_to_save embed_tokens lm_head",
     {"modules_to_save": ["embed_tokens", "lm_head"]}),
    ("qlora", f"sft {_C} {_LORA} --dataset {{messages}}#16 --torch_dtype bfloat16 --quant_bits 4 "
              "--quant_method bnb --bnb_4bit_compute_dtype bfloat16 --bnb_4bit_quant_type nf4 "
              "--bnb_4bit_use_double_quant true",
     {"quant_bits": 4, "quant_method": "bnb", "bnb_4bit_compute_dtype": "bf16", "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_use_double_quant": True}),
    ("sdpa", f"sft {_C} --dataset {{messages}}#16 --attn_impl sdpa", {"attn_impl": "sdpa"}),
    # peft is the only tuner backend: accepted, no field of its own
    ("tuner_backend", f"sft {_C} --dataset {{messages}}#16 --tuner_backend peft", {"train_type": "lora"}),
    ("truncation", f"sft {_C} --dataset {{messages}}#16 --max_length 128 --truncation_strategy right",
     {"truncation_strategy": "right", "max_length": 128}),
    ("truncation_delete", f"sft {_C} --dataset {{messages}}#16 --truncation_strategy delete",
     {"truncation_strategy": "delete"}),
    ("max_steps_epochs", f"sft {_C} --dataset {{query_response}}#16 --num_train_epochs 5",
     {"num_train_epochs": 5, "max_steps": 2}),
    ("pt_full", f"pt {_C} --tuner_type full --dataset {{text}}#16 --torch_dtype bfloat16 --packing true "
                "--max_length 512 --learning_rate 1e-5",
     {"train_type": "full", "packing": True, "max_length": 512}),
    ("pt_streaming", f"pt {_C} --tuner_type full --dataset {{text}} --streaming true",
     {"streaming": True, "train_type": "full"}),
    # examples/train/pretrain/train.sh, full/qwen2_5_32b.sh: a stream packed as it is read
    ("pt_streaming_packing", f"pt {_C} --tuner_type full --dataset {{text}} --streaming true --packing true "
                             "--max_length 512 --dataloader_num_workers 4 --save_only_model true",
     {"streaming": True, "packing": True, "max_length": 512, "train_type": "full"}),
    # examples/train/cached_dataset/pretrained.sh's truncation: long documents in --max_length pieces
    ("pt_split", f"pt {_C} --tuner_type full --dataset {{text}}#16 --max_length 64 --truncation_strategy split",
     {"truncation_strategy": "split", "max_length": 64}),
    ("pt_truncation", f"pt {_C} --dataset {{text}}#16 --max_length 96 --truncation_strategy right",
     {"truncation_strategy": "right", "max_length": 96}),
    ("dpo_lora", f"rlhf --rlhf_type dpo {_C} {_LORA} --dataset {{preference}}#16 --rpo_alpha 0.1 "
                 "--split_dataset_ratio 0.2 --load_from_cache_file true --dataloader_num_workers 4 "
                 "--dataset_num_proc 4 --save_only_model true --eval_steps 100 --save_steps 100",
     {"rlhf_type": "dpo", "rpo_alpha": 0.1, "save_only_model": True, "dataloader_num_workers": 4}),
    ("dpo_full", f"rlhf --rlhf_type dpo {_C} --tuner_type full --dataset {{preference}}#16 --torch_dtype bfloat16 "
                 "--learning_rate 1e-5 --per_device_eval_batch_size 4",
     {"rlhf_type": "dpo", "train_type": "full", "per_device_eval_batch_size": 4}),
    ("dpo_rpo0", f"rlhf --rlhf_type dpo {_C} --dataset {{preference}}#16 --rpo_alpha 0.0", {"rpo_alpha": 0.0}),
    # examples/train/packing/dpo.sh (whole pairs packed, a pack per micro-batch) and rlhf/dpo/full.sh
    ("dpo_packing", f"rlhf --rlhf_type dpo {_C} --tuner_type full --dataset {{preference}}#16 --torch_dtype bfloat16 "
                    "--rpo_alpha 0.1 --split_dataset_ratio 0.2 --per_device_eval_batch_size 1 --packing true",
     {"rlhf_type": "dpo", "packing": True, "rpo_alpha": 0.1}),
    ("dpo_padding_free", f"rlhf --rlhf_type dpo {_C} --tuner_type full --dataset {{preference}}#16 "
                         "--per_device_eval_batch_size 4 --rpo_alpha 0.1 --padding_free true",
     {"rlhf_type": "dpo", "padding_free": True}),
    ("orpo", f"rlhf --rlhf_type orpo {_C} {_LORA} --dataset {{preference}}#16 --learning_rate 1e-4",
     {"rlhf_type": "orpo", "learning_rate": 1e-4}),
    ("simpo", f"rlhf --rlhf_type simpo {_C} {_LORA} --dataset {{preference}}#16",
     {"rlhf_type": "simpo"}),
    ("simpo_full", f"rlhf --rlhf_type simpo {_C} --tuner_type full --dataset {{preference}}#16 --warmup_ratio 0.05",
     {"rlhf_type": "simpo", "train_type": "full", "warmup_ratio": 0.05}),
    # examples/train/tuners/llamapro/train.sh (the tiny folder has 4 layers, so 4 new blocks divide them)
    ("llamapro", f"sft {_C} --tuner_type llamapro --dataset {{self_cognition}}#16 --llamapro_num_new_blocks 4 "
                 "--num_train_epochs 1 --learning_rate 1e-4 --eval_steps 100 --save_steps 100 --save_total_limit 2 "
                 "--logging_steps 5 --model_author swift --model_name swift-robot",
     {"train_type": "llamapro", "llamapro_num_new_blocks": 4, "llamapro_num_groups": None}),
    # examples/train/tuners/adapter/train.sh (ms-swift's defaults: --adapter_length 128, --adapter_act gelu)
    ("adapter", f"sft {_C} --tuner_type adapter --dataset {{self_cognition}}#16 --num_train_epochs 1 "
                "--learning_rate 1e-4 --eval_steps 100 --save_steps 100 --save_total_limit 2 --logging_steps 5 "
                "--model_author swift --model_name swift-robot",
     {"train_type": "adapter", "adapter_length": 128, "adapter_act": "gelu"}),
    ("orpo_messages", f"rlhf --rlhf_type orpo {_C} --dataset {{preference}}#8 --num_train_epochs 1",
     {"rlhf_type": "orpo", "num_train_epochs": 1}),
]
#: Multi-process ones, as ms-swift's scripts launch them (NPROC_PER_NODE=2): subprocesses.
MULTI = [
    ("zero2", "NPROC_PER_NODE=2", f"sft {_C} {_LORA} --dataset {{alpaca}}#16 --deepspeed zero2",
     {"deepspeed": "zero2", "nproc_per_node": 2}),
    ("zero3_dpo", "NPROC_PER_NODE=2", f"rlhf --rlhf_type dpo {_C} --tuner_type full --dataset {{preference}}#16 "
                                      "--deepspeed zero3",
     {"deepspeed": "zero3", "rlhf_type": "dpo", "nproc_per_node": 2}),
    # examples/train/sequence_parallel/sequence_parallel.sh (8 ranks there)
    ("sequence_parallel", "NPROC_PER_NODE=2", f"sft {_C} {_LORA} --dataset {{alpaca}}#16 --torch_dtype bfloat16 "
                                              "--sequence_parallel_size 2 --use_logits_to_keep false --padding_free true",
     {"sequence_parallel_size": 2, "loss_impl": "plain", "padding_free": True, "nproc_per_node": 2}),
]

#: examples/train/cached_dataset/{sft,pretrained}.sh: `swift export --to_cached_dataset true`, then the run on
#: its folders: (id, export command, training command, {args.json field: value}); {C} is the export's folder.
CACHED = [
    ("cached_sft", "export --model {M} --dataset {messages}#16 --dataset_num_proc 64 --split_dataset_ratio 0.25 "
                   "--to_cached_dataset true --output_dir {C}",
     f"sft {_C} --tuner_type full --cached_dataset {{C}}/train --cached_val_dataset {{C}}/val --torch_dtype bfloat16 "
     "--packing true --eval_steps 200 --save_only_model true --dataset_num_proc 8",
     {"cached_dataset": ["{C}/train"], "cached_val_dataset": ["{C}/val"], "packing": True}),
    ("cached_pt", "export --model {M} --dataset {text}#16 --dataset_num_proc 64 --to_cached_dataset true "
                  "--truncation_strategy split --max_length 64 --split_dataset_ratio 0.25 --use_chat_template false "
                  "--loss_scale all --output_dir {C}",
     f"pt {_C} --tuner_type full --cached_dataset {{C}}/train --cached_val_dataset {{C}}/val --truncation_strategy split "
     "--packing true --max_length 64",
     {"cached_dataset": ["{C}/train"], "truncation_strategy": "split", "max_length": 64}),
]

#: Flags of those scripts that swiftlite refuses, with a value the scripts give: (command, flag and value,
#: a word the refusal line must hold). One run of each command gives all of them.
REFUSED = {
    "sft": [
        ("--agent_template glm4", "hermes, react_en, react_zh, react_grpo are"),

        ("--galore_quantization true", "Q-GaLore"),
        ("--reft_intervention_type LoreftIntervention", "tuner"), ("--template_backend jinja", "template"),
        ("--truncation_strategy split", "split"), ("--tuner_backend unsloth", "peft"),
    ],
    "export": [
        ("--device_map cpu", "device_map"), ("--hub_model_id m", "upload"), ("--hub_token t", "upload"),
        ("--push_to_hub true", "upload"), ("--use_hf true", "upload"), ("--load_data_args true", "args.json"),
        ("--quant_method awq", "or fp8"), ("--quant_bits 4", "quantized export"),
        ("--quant_n_samples 256", "quantized export"), ("--quant_batch_size 1", "quantized export"),
        ("--bnb_4bit_quant_type nf4", "quantized export"), ("--bnb_4bit_use_double_quant true", "quantized export"),
        
        ("--use_chat_template false", "args.json"), ("--dataset d.jsonl", "args.json"),
        ("--dataset_num_proc 4", "args.json"), ("--max_length 2048", "args.json"),
        ("--split_dataset_ratio 0.01", "args.json"), ("--truncation_strategy split", "args.json"),
        ("--loss_scale all", "args.json"),
    ],
}

#: Refused by a later check (a value's choices, the value rules, the preflight of the machine): each its own
#: line, exit 2, alone and in the same run as REFUSED["sft"]'s (every stage's refusals are listed together).
REFUSED_LATER = [
    ("--attn_impl flash_attn", "GPU"), ("--use_liger_kernel true", "GPU"),
]


def _flags(command: str) -> set[str]:
    return {t[2:] for t in shlex.split(command) if t.startswith("--")}


def test_every_script_flag_is_run_or_refused():
    used = set().union(*(_flags(c) for _, c, _ in SFT), *(_flags(c) for _, _, c, _ in MULTI),
                       *(_flags(e) | _flags(c) for _, e, c, _ in CACHED),
                       {"adapters", "merge_lora", "max_steps", "to_ollama"})   # test_export_*; every command
    refused = {f[2:].split()[0] for rows in [*REFUSED.values(), REFUSED_LATER] for f, _ in rows}
    assert SCRIPT_FLAGS - used - refused == set()
    assert len(SFT) + len(MULTI) + 2 * len(CACHED) + 1 >= 40


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny model folder and the data files (the formats of ms-swift's hub datasets the scripts use)."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("msswift_examples", ROOT / "scripts" / "msswift_examples.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool   # its dataclasses look their module up
    spec.loader.exec_module(tool)
    root = tmp_path_factory.mktemp("msswift_scripts")
    models = tool.build_models(root / "models")
    files = tool.write_data(root / "data", n=32)
    return root, models["qwen2"], {**{k: str(v) for k, v in files.items()}, "MOE": str(models["moe"])}


def _fill(command: str, model: Path, files: dict, out: Path) -> list[str]:
    return shlex.split(command.format(M=model, O=out, **files))


def in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    """(exit code, stderr) of `swiftlite ARGV` run in this process in `cwd` (conftest.main_in_process)."""
    p = main_in_process(argv, cwd=cwd)
    return p.returncode, p.stderr


def _resolved(run: Path) -> dict:
    args = json.loads((run / "args.json").read_text())
    flat = {}
    for section in args.values():
        if isinstance(section, dict):
            flat.update(section)
    return flat


def _check(run: Path, expected: dict, argv: list[str]) -> None:
    got = _resolved(run)
    for key, want in expected.items():
        have = got.get(key)
        if isinstance(want, float):
            assert have == pytest.approx(want), (key, have, want)
        else:
            assert have == want, (key, have, want)
    # the datasets as given, `#N` kept
    if "--dataset" in argv:
        i = argv.index("--dataset") + 1
        given = []
        while i < len(argv) and not argv[i].startswith("--"):
            given.append(argv[i])
            i += 1
        assert [str(d) for d in got["dataset"]] == given
    assert got["max_steps"] == 2
    assert got["model"] == argv[argv.index("--model") + 1]
    assert Path(got["output_dir"]) == run


def test_single_process_commands(world):
    root, model, files = world
    failures = []
    for name, command, expected in SFT:
        out = root / "runs" / name
        argv = _fill(command, model, files, out) + ["--max_steps", "2"]
        rc, err = in_process(argv, root)
        if rc != 0:
            failures.append(f"{name}: exit {rc}: {err.strip().splitlines()[-3:]}")
            continue
        try:
            _check(out, expected, argv)
            assert max(read_losses(out)) == 2, f"{name}: did not train 2 steps"
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)


def test_in_process_is_what_a_subprocess_does(world, tmp_path):
    """The same command in this process and in `python -m swiftlite`: the same resolved args and losses."""
    root, model, files = world
    command = SFT[0][1]
    a, b = tmp_path / "inproc", tmp_path / "subproc"
    rc, err = in_process(_fill(command, model, files, a) + ["--max_steps", "2", "--logging_steps", "1"], root)
    assert rc == 0, err
    run_cli(_fill(command, model, files, b) + ["--max_steps", "2", "--logging_steps", "1"], cwd=root,
            env=cli_env(SWIFTLITE_CACHE=os.environ["SWIFTLITE_CACHE"]), fresh=True)
    ra, rb = _resolved(a), _resolved(b)
    ra.pop("output_dir"), rb.pop("output_dir")
    assert ra == rb
    la, lb = read_losses(a), read_losses(b)
    assert la.keys() == lb.keys() == {1, 2}
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("name,export,command,expected", CACHED, ids=[c[0] for c in CACHED])
def test_cached_dataset_commands(world, name, export, command, expected):
    """The export writes the tokenized folders; the run trains on them alone (no --dataset)."""
    root, model, files = world
    cache, out = root / "cached" / name, root / "runs" / name
    rc, err = in_process(shlex.split(export.format(M=model, C=cache, **files)), root)
    assert rc == 0, err
    assert (cache / "train" / "swiftlite_cached.json").is_file() and (cache / "val").is_dir()
    argv = shlex.split(command.format(M=model, O=out, C=cache, **files)) + ["--max_steps", "2"]
    rc, err = in_process(argv, root)
    assert rc == 0, err
    _check(out, {k: [x.format(C=cache) for x in v] if isinstance(v, list) else v for k, v in expected.items()}, argv)
    assert max(read_losses(out)) == 2


@pytest.mark.parametrize("name,env,command,expected", MULTI, ids=[m[0] for m in MULTI])
def test_multi_process_commands(world, name, env, command, expected):
    root, model, files = world
    out = root / "runs" / name
    argv = _fill(command, model, files, out) + ["--max_steps", "2"]
    k, _, v = env.partition("=")
    run_cli(argv, cwd=root, timeout=900, env=cli_env(**{k: v, "SWIFTLITE_CACHE": os.environ["SWIFTLITE_CACHE"]}))
    _check(out, expected, argv)
    assert max(read_losses(out)) == 2


def test_export_merge_lora(world):
    """`swift export --adapters <ckpt> --merge_lora true` (examples/export/merge_lora.sh): <ckpt>-merged."""
    root, model, files = world
    run = root / "runs" / "for_export"
    rc, err = in_process(_fill(f"sft {_C} {_LORA} --dataset {{messages}}#16 --save_steps 2", model, files, run)
                              + ["--max_steps", "2"], root)
    assert rc == 0, err
    ckpt = run / "checkpoint-2"
    rc, err = in_process(["export", "--adapters", str(ckpt), "--merge_lora", "true"], root)
    assert rc == 0, err
    merged = Path(f"{ckpt}-merged")
    cfg = json.loads((merged / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and list(merged.glob("*.safetensors"))
    assert not (merged / "adapter_config.json").exists()


def test_export_ollama(world):
    """examples/export/ollama.sh: `swift export --model M --to_ollama true --output_dir D` writes D/Modelfile
    FROM M (tests/e2e/test_export_ollama.py checks its TEMPLATE against the chat template)."""
    root, model, files = world
    out = root / "Qwen2.5-1.5B-Instruct-ollama"
    rc, err = in_process(["export", "--model", str(model), "--to_ollama", "true", "--output_dir", str(out)], root)
    assert rc == 0, err
    assert (out / "Modelfile").read_text().splitlines()[0] == f"FROM {Path(model).resolve()}"


@pytest.mark.parametrize("sub", sorted(REFUSED))
def test_refused_flags_all_in_one_run(world, sub, tmp_path):
    """Every refused flag of the scripts, given together: one `error:` line each, exit 2, nothing written
    (sft: with the refusals of the later stages, REFUSED_LATER, in the same run)."""
    root, model, files = world
    rows = REFUSED[sub] + (REFUSED_LATER if sub == "sft" else [])
    out = tmp_path / "out"
    if sub == "export":
        argv = ["export", "--adapters", str(tmp_path / "missing-ckpt"), "--output_dir", str(out)]
    else:
        argv = _fill(f"sft {_C} --dataset {{messages}}", model, files, out)
    for flag, _ in rows:
        argv += shlex.split(flag)
    rc, err = in_process(argv, tmp_path)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err, err
    assert all(ln.startswith("error: ") for ln in lines), err
    for flag, word in rows:
        _named(flag, word, lines, err)
    assert not out.exists()


def _named(flag: str, word: str, lines: list[str], err: str) -> None:
    name = flag.split()[0]
    hit = [ln for ln in lines if f"{name} " in ln + " " or f"{name}:" in ln
           or name.replace("_", "-") in ln or f"{name[2:]}=" in ln]
    assert hit, f"no refusal line names {name}:\n{err}"
    assert any(word.lower() in ln.lower() for ln in hit), f"{name}: {hit}"


@pytest.mark.parametrize("flag,word", REFUSED_LATER, ids=[f.split()[0] for f, _ in REFUSED_LATER])
def test_refused_later_one_line(world, flag, word, tmp_path):
    root, model, files = world
    out = tmp_path / "out"
    argv = _fill(f"sft {_C} --dataset {{messages}}", model, files, out) + shlex.split(flag)
    rc, err = in_process(argv, tmp_path)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    _named(flag, word, lines, err)
    assert not out.exists()
