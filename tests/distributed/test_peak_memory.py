"""The memory model's peak (planner/memory.py `estimate`) against the measured training peak on CPU.

Measured: each rank resets the kernel's peak-RSS mark just before the model is built and reads it
after three optimizer steps (logs/memory_rank<r>.json, written by the trainer): the memory of
model states, activations and buffers on top of the interpreter, libraries and data. glibc's
MALLOC_MMAP_THRESHOLD_ is fixed at 64 KiB so freed tensors leave the RSS at once. The backend's
libraries load before the mark is reset (DeepSpeed and the torch.compile machinery its engine
imports were ~70 MiB of the zero2/zero3 peaks when they loaded inside the window): each case checks
that none of them is among the modules the record says were first imported inside the window.

Estimated: `plan.estimate(...).total` for the same workload with no CUDA overhead (`cpu=True`:
CPU dropout keeps a noise tensor instead of a 1-byte mask). The model is a 24M-parameter Llama
(512 hidden x 8 layers) so that training memory (0.5-0.8 GiB) dwarfs allocator noise; sequences are
packed to exactly --max-length so the activations are the estimator's max_length x micro_batch.
Acceptance (issue 7): every rank's measured peak within 25 % of the estimate. Ratios seen on the
2-core CPU (estimate / measured, rank 0 / rank 1, 2026-12-01): single full 0.98, LoRA 1.00, QLoRA
0.85, ddp 0.84 / 0.85, fsdp 0.88 / 0.89, zero2 0.88 / 0.89, zero3 0.83 / 0.84 (before the window
opened after DeepSpeed's imports: zero2 0.80, zero3 0.74-0.76). What zero2/zero3 still lack is
shared with the other backends (docs/estimate.md, "Checked against measurement"): ~25 MiB of
library pages touched while training and ~75 MiB of activations the formula does not count.

The loss (issue 14, acceptance 5): the same 512 x 8 Llama with a 65,536-token vocabulary (the
tokenizer's 260 ids are a subset), where the logits matter: --loss-impl plain holds 1024 x 65,536 x
12 B = 768 MiB of them, the chunked loss (the default) 256-row chunks of 64 MiB. Each case is trained
and estimated with its own --loss-impl. Ratios seen (2026-12-01): LoRA chunked 1.19, LoRA plain 1.09,
full chunked 1.09, fsdp x2 LoRA chunked 0.84 / 0.85 (1.02 / 1.04 since sharded loading gave the untied
embedding and lm_head FSDP units of their own, afternoon: the root-unit buffer term, which counts
them unsharded together, was not re-derived). The plain - chunked difference is estimated at
700 MiB and measured at 707 MiB; the LoRA cases' excess is probably the frozen embedding rows of the
ids the tiny tokenizer never produces (>= 260, 128 MiB): their memory-mapped pages are never read.

bf16 with fp32 master weights (issue 21): ddp x 2 (autocast's weight copies and fp32 residual stream,
planner/transients.py) 0.84 / 0.85, and zero2_offload x 2 (estimated as GPU total + host states:
on CPU they are one memory) 0.81 / 0.82; without those terms the estimates were 0.74 and 0.69.
The load phase: fsdp x 2 on a 91M-parameter Llama in four safetensors files and in one, the
trainer's `load_peak` against planner/load.py's `load_one_memory` (2026-12-01): see
docs/estimate.md, "Loading".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cases, cli_env, run_cli

TOLERANCE = 0.25
MAX_LENGTH, MICRO_BATCH = 256, 4
#: Packages whose import inside the memory window is library code, not training memory.
LIBRARY_CODE = ("torch._dynamo", "torch._inductor", "deepspeed.runtime.zero.muon")

CASES = [  # (id, --parallelism, --train-type, processes)
    ("single-full", "ddp", "full", 1),
    ("single-lora", "ddp", "lora", 1),
    ("single-qlora", "ddp", "qlora", 1),
    ("ddp-full", "ddp", "full", 2),
    ("fsdp-full", "fsdp", "full", 2),
    ("zero2-full", "zero2", "full", 2),
    ("zero3-full", "zero3", "full", 2),
]


def _mid_llama(out: Path, vocab: int, max_shard_size: str | None = None) -> Path:
    """A Llama folder (512 hidden x 8 layers, random weights) with the shipped tiny tokenizer, in
    safetensors files of at most `max_shard_size` (default: one file)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER
    conf = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=2048, eos_token_id=258,
                       pad_token_id=259, bos_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(conf).save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    AutoTokenizer.from_pretrained(str(TINY_TOKENIZER)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> Path:
    """A 24M-parameter Llama folder (random weights) with the shipped tiny tokenizer."""
    return _mid_llama(tmp_path_factory.mktemp("mid_llama"), 260)


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory) -> Path:
    """The same Llama with a 65,536-token vocabulary (91M parameters, 67M of them embeddings + head)."""
    return _mid_llama(tmp_path_factory.mktemp("mid_llama_64k"), 65_536)


def _check(name, model, backend, train_type, nproc, demo_data, tmp_path, loss_impl=None, dtype="fp32",
           training=True, max_length=MAX_LENGTH, micro_batch=MICRO_BATCH, sp=1):
    from swiftlite import planner as plan
    from swiftlite.planner.load import largest_shard_file
    out = tmp_path / name
    loss = ["--loss-impl", loss_impl] if loss_impl else []
    run_cli(["sft", "--model", model, "--dataset", demo_data[0], "--train-type", train_type,
             "--parallelism", backend, "--nproc-per-node", nproc, "--torch-dtype", dtype,
             "--max-length", max_length, "--packing", "true", "--per-device-train-batch-size", micro_batch,
             "--sequence_parallel_size", sp,
             *(["--lora-dropout", "0.05"] if train_type != "full" else []), "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", 3, "--output-dir", out,
             "--logging-steps", 1, *loss],
            env=cli_env(MALLOC_MMAP_THRESHOLD_="65536"))
    shape = plan.shape_from_model_arg(str(model))
    # Padding-free batches (the default) compute only their real tokens: the largest step's count per
    # rank (one micro-batch per step here) is what the activation model is told.
    logged = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    # (a sequence-parallel group of sp ranks shares its micro-batch: the estimator divides it by sp)
    real = max(r["real_tokens"] for r in logged if "real_tokens" in r) // (nproc // sp)
    w = plan.Workload(train_type=train_type, dtype=dtype, max_length=max_length, micro_batch=micro_batch,
                      sequence_parallel=sp,
                      world_size=nproc, overhead_bytes=0, lora_dropout=0.05, cpu=True,
                      tokens_per_micro_batch=real, shard_file_bytes=largest_shard_file(str(model)),
                      **({"loss_impl": loss_impl} if loss_impl else {}))
    est = plan.estimate(shape, w, "single" if nproc == 1 else backend)
    # On CPU the accelerator and the host are one memory: offloaded states count in the same peak.
    predicted = est.total + est.cpu_offloaded
    records = [json.loads(p.read_text()) for p in sorted((out / "logs").glob("memory_rank*.json"))]
    assert len(records) == nproc
    for r, rec in enumerate(records):
        assert rec["exact"] and rec["steps"] == 3
        # Library code loaded inside the window would be measured as training memory: DeepSpeed itself
        # and torch.compile's machinery (which DeepSpeed's engine imports, ~70 MiB) load before it.
        late = [m for m in rec["imported_in_window"] if m == "deepspeed" or m.startswith(LIBRARY_CODE)]
        assert not late, f"{name} rank{r}: imported inside the memory window: {late[:5]}"
        if not training:
            continue
        measured = rec["training_peak"]
        ratio = predicted / measured
        assert abs(ratio - 1) <= TOLERANCE, (
            f"{name} rank{r}: estimate {predicted / 2**20:.0f} MiB (states "
            f"{(est.params + est.grads + est.optimizer) / 2**20:.0f}, activations {est.activations / 2**20:.0f}, "
            f"buffers {est.temp_buffers / 2**20:.0f}, step {est.step_transient / 2**20:.0f}, host "
            f"{est.cpu_offloaded / 2**20:.0f}) vs measured {measured / 2**20:.0f} MiB: ratio {ratio:.2f}")
    return est, records


@pytest.mark.parametrize("case", cases(CASES, long=("single-lora", "single-qlora", "ddp-full", "zero2-full")))
def test_estimated_peak_within_25_percent_of_measured(case, mid_model, demo_data, tmp_path):
    name, backend, train_type, nproc = case
    _check(name, mid_model, backend, train_type, nproc, demo_data, tmp_path)


LOSS_CASES = [  # (id, --parallelism, --train-type, processes, --loss-impl)
    ("64k-single-lora-chunked", "ddp", "lora", 1, "chunked"),
    ("64k-single-lora-plain", "ddp", "lora", 1, "plain"),
    ("64k-single-full-chunked", "ddp", "full", 1, "chunked"),
    ("64k-fsdp-lora-chunked", "fsdp", "lora", 2, "chunked"),
]


@pytest.mark.parametrize("case", cases(LOSS_CASES, long=("64k-single-lora-chunked", "64k-single-full-chunked",
                                                          "64k-fsdp-lora-chunked")))
def test_estimated_peak_with_the_loss_impl_within_25_percent(case, big_vocab_model, demo_data, tmp_path):
    name, backend, train_type, nproc, loss_impl = case
    _check(name, big_vocab_model, backend, train_type, nproc, demo_data, tmp_path, loss_impl)


BF16_CASES = [  # (id, --parallelism, --train-type, processes): fp32 master weights, bf16 compute
    # ddp: autocast's cached bf16 weight copies next to the gradient buckets, and the fp32 residual
    # stream (planner/transients.py); the estimate without them was 1.14x under (docs/estimate.md)
    ("ddp-bf16-full", "ddp", "full", 2),
    # optimizer-only offload: the fp32 master, moments and gradients in host memory (the same RSS here)
    ("zero2_offload-bf16-full", "zero2_offload", "full", 2),
]


@pytest.mark.parametrize("case", cases(BF16_CASES, long=("ddp-bf16-full", "zero2_offload-bf16-full")))
def test_estimated_peak_bf16_within_25_percent(case, mid_model, demo_data, tmp_path):
    name, backend, train_type, nproc = case
    est, records = _check(name, mid_model, backend, train_type, nproc, demo_data, tmp_path, dtype="bf16")
    if backend == "ddp":
        assert est.temp_buffers > 0 and est.step_transient == 0
        # the load phase of a whole-model family: every rank holds the whole (fp32 master) model, and
        # DDP allocates its gradient buckets when it wraps, before the first step (measured 197 MiB
        # against 92 + 92 predicted, 2026-12-01)
        assert est.load_method == "whole model" and est.load_one_memory >= est.params
        for r, rec in enumerate(records):
            ratio = (est.load_one_memory + est.grads) / rec["load_peak"]
            assert abs(ratio - 1) <= TOLERANCE, f"rank{r}: ddp load phase ratio {ratio:.2f}"
    else:
        assert est.cpu_offloaded > 0 and est.optimizer == 0


@pytest.fixture(scope="module")
def sharded_files_model(tmp_path_factory) -> Path:
    """The 65,536-token Llama (91M parameters, 364 MB in fp32) in safetensors files of <= 100 MB: the
    embedding and lm_head (134 MB each) are the largest tensors, one file each."""
    return _mid_llama(tmp_path_factory.mktemp("mid_llama_64k_sharded"), 65_536, max_shard_size="100MB")


@pytest.mark.long
@pytest.mark.parametrize("files", ["four", "one"])
def test_load_phase_fsdp_sharded_reads(files, sharded_files_model, big_vocab_model, demo_data, tmp_path):
    """fsdp x 2 loads by sharded reads (planner/load.py): each rank holds its half of the fp32 weights
    plus, in host memory, its rows of every tensor of the open file (the pages it touched stay mapped
    until the next file is opened), never the whole model. The trainer's `load_peak` (the RSS peak
    above the window's start, just before the first step) within 25% of `load_one_memory`, for the
    checkpoint in four files of <= 100 MB and in one file of 364 MB (half of it mapped per rank)."""
    model = sharded_files_model if files == "four" else big_vocab_model
    est, records = _check(f"load-fsdp-{files}-files", model, "fsdp", "full", 2, demo_data, tmp_path,
                          training=False)
    whole = est.params * 2    # what every rank held before sharded loading: the whole model
    for r, rec in enumerate(records):
        assert "load_peak" in rec, f"rank{r}: the trainer wrote no load_peak into {sorted(rec)}"
        ratio = est.load_one_memory / rec["load_peak"]
        assert abs(ratio - 1) <= TOLERANCE, (
            f"rank{r}: load estimate {est.load_one_memory / 2**20:.0f} MiB ({est.load_method}) vs "
            f"measured {rec['load_peak'] / 2**20:.0f} MiB: ratio {ratio:.2f}")
        if files == "four":  # with one file, its mapped half is as large as the rank's half of the model
            assert rec["load_peak"] < 0.8 * whole


#: --sequence_parallel_size (parallel/sequence.py): one 2048-token pack per step shared by 2 ranks, each
#: computing 1024 of its tokens, where activations (~300 KiB a token here) outweigh the sharded states.
SP_CASES = [  # (id, --parallelism, processes, --sequence_parallel_size)
    ("fsdp-sp2-full", "fsdp", 2, 2),
]


@pytest.mark.parametrize("case", cases(SP_CASES))
def test_estimated_peak_sequence_parallel_within_25_percent(case, mid_model, demo_data, tmp_path):
    name, backend, nproc, sp = case
    est, _ = _check(name, mid_model, backend, "full", nproc, demo_data, tmp_path, max_length=2048, micro_batch=1,
                    sp=sp)
    from swiftlite import planner as plan
    whole = plan.estimate(plan.shape_from_model_arg(str(mid_model)),
                          plan.Workload(train_type="full", dtype="fp32", max_length=2048, micro_batch=1, world_size=2,
                                        overhead_bytes=0, cpu=True, tokens_per_micro_batch=2048), backend)
    assert est.activations < 0.55 * whole.activations   # half the tokens per rank: about half the activations
