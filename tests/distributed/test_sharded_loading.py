"""Sharded loading (models/sharded.py): no rank holds the whole model, and nothing else changes.

1. Equality: fsdp x 2 (and fsdp1 x 2, hsdp, a tied-embedding preset) loaded the sharded way trains
   exactly as the whole-model path (`--sharded-loading false`) does in fp32: every logged loss and
   gradient norm equal to the bit, for LoRA (adapters drawn from --seed on the skeleton) and a full
   fine-tune, on a model folder split into several safetensors files.
2. Memory (issue 21, acceptance 1), on scripts/loading_memory.py's 157M-parameter, 4-file fp32 Llama:
   each rank's peak RSS above its own start, over the model's bytes, is at most 0.6 with LoRA and at
   most 1.35 for a full fine-tune (fp32 AdamW state alone is 1.0 of it at N = 4), and at load (before
   the first step) at most 1/N + the largest file + 10% of the model. hsdp 2 x 2 shards over groups of
   2, so every rank holds 1/2 of the model by design: its bounds are the same formula with N = 2 for
   the sharded part (0.5 + 0.35 for LoRA, 2.0 + 0.35 for a full fine-tune).
   Measured on the 2-core CPU machine (2026-12-01, max over ranks, load / peak): fsdp x 4 LoRA
   0.42 / 0.48, full 0.38 / 1.08; fsdp1 x 4 LoRA 0.38 / 0.48; hsdp 2 x 2 full 0.68 / 2.09
   (docs/benchmarks.md).
   This is a memory measurement, not a timing one: RSS is counted by the kernel.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, cases, run_cli

pytestmark = pytest.mark.distributed


def _script():
    spec = importlib.util.spec_from_file_location("loading_memory", ROOT / "scripts" / "loading_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _split_llama(out: Path, tied: bool) -> Path:
    """A small Llama folder (random weights) split into several safetensors files."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER
    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
    conf = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, tie_word_embeddings=tied,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        LlamaForCausalLM(conf).save_pretrained(out, max_shard_size="400KB")
    tok.save_pretrained(out)
    assert len(list(out.glob("*.safetensors"))) >= 3
    return out


@pytest.fixture(scope="module")
def split_model(tmp_path_factory) -> Path:
    return _split_llama(tmp_path_factory.mktemp("split_llama"), tied=False)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    """lm_head and the embeddings are one parameter (saved once, under the embeddings' name)."""
    return _split_llama(tmp_path_factory.mktemp("tied_llama"), tied=True)


def _train(model, data, out, backend, nproc, train_type, *extra) -> tuple[list[dict], str]:
    proc = run_cli(["sft", "--model", model, "--dataset", data, "--train-type", train_type,
                    "--parallelism", backend, "--nproc-per-node", nproc, "--torch-dtype", "fp32",
                    "--max-length", 64, "--per-device-train-batch-size", 2, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", 3,
                    "--learning-rate", "1e-3", "--logging-steps", 1, "--save-strategy", "no",
                    "--output-dir", out, *extra])
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], proc.stdout


CASES = [  # (id, backend, processes, train type, extra flags, model: "split"/"tied" folder or a preset name)
    ("fsdp-full", "fsdp", 2, "full", (), "split"),
    ("fsdp-lora", "fsdp", 2, "lora", (), "split"),
    ("fsdp-tied-full", "fsdp", 2, "full", (), "tied"),
    ("fsdp1-lora", "fsdp1", 2, "lora", (), "split"),
    ("fsdp1-tied-full", "fsdp1", 2, "full", (), "tied"),
    ("hsdp-full", "hsdp", 2, "full", ("--hsdp-shard-size", "2"), "split"),
    ("fsdp-preset-lora", "fsdp", 2, "lora", (), "tiny-llama"),
    ("fsdp-qlora", "fsdp", 2, "qlora", (), "split"),      # 4-bit: quantized as each weight arrives
    ("fsdp1-qlora", "fsdp1", 2, "qlora", (), "split"),
    ("fsdp-adapter", "fsdp", 2, "adapter", ("--adapter-length", "8"), "split"),   # Houlsby adapters, real, on a meta base
]


@pytest.mark.parametrize("case", cases(CASES, long=("fsdp-preset-lora", "fsdp1-tied-full", "fsdp1-qlora")))
def test_sharded_loading_trains_bit_for_bit_like_the_whole_model(case, split_model, tied_model, demo_data,
                                                                  tmp_path):
    name, backend, nproc, train_type, extra, which = case
    model = {"split": split_model, "tied": tied_model}.get(which, which)
    sharded, out_s = _train(model, demo_data[0], tmp_path / "sharded", backend, nproc, train_type, *extra)
    whole, out_w = _train(model, demo_data[0], tmp_path / "whole", backend, nproc, train_type, *extra,
                          "--sharded-loading", "false")
    assert "sharded loading is off" not in out_s, out_s
    assert len(sharded) == len(whole) == 3
    for a, b in zip(sharded, whole):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (name, a, b)
    assert sharded[-1]["loss"] < sharded[0]["loss"]   # and it trains


def test_a_checkpoint_named_differently_from_the_model_is_loaded_whole_and_says_so(split_model, demo_data,
                                                                                     tmp_path):
    """A folder whose tensor names are not the model's own (here renamed by hand, as a converted
    architecture's would be): the whole-model path, and rank 0 says why in one line."""
    import shutil

    from safetensors.torch import load_file, save_file
    folder = tmp_path / "renamed"
    shutil.copytree(split_model, folder)
    for f in folder.glob("*.safetensors"):
        sd = load_file(f)
        save_file({k.replace("model.norm.weight", "model.final_norm.weight"): v for k, v in sd.items()}, f,
                  metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k.replace("model.norm.weight", "model.final_norm.weight"): v
                           for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = run_cli(["sft", "--model", folder, "--dataset", demo_data[0], "--parallelism", "fsdp",
                    "--nproc-per-node", 2, "--torch-dtype", "fp32", "--max-length", 64, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", 1,
                    "--save-strategy", "no", "--output-dir", tmp_path / "out"], check=False, own_process=True)
    lines = [ln for ln in proc.stdout.splitlines() if "sharded loading is off" in ln]
    assert len(lines) == 1 and "model.norm.weight" in lines[0], proc.stdout + proc.stderr


MEMORY_CASES = [  # (backend, processes, train type, sharded part of the model each rank holds)
    ("fsdp", 4, "lora", 1 / 4),
    ("fsdp", 4, "full", 1 / 4),
    ("fsdp1", 4, "lora", 1 / 4),
    ("hsdp", 4, "full", 1 / 2),
]
#: the bounds of the module docstring, over the sharded part
LORA_PEAK, FULL_PEAK, LOAD_SLACK = 0.6 - 1 / 4, 1.35 - 1.0, 0.10


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    return _script().build_model(tmp_path_factory.mktemp("llama157m") / "model")


@pytest.mark.slow
@pytest.mark.parametrize("case", cases(MEMORY_CASES, long=("fsdpx4-lora", "fsdp1x4-lora", "hsdpx4-full"),
                                   ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}"))
def test_no_rank_holds_the_whole_model(case, big_model, demo_data, tmp_path):
    backend, nproc, train_type, part = case
    script = _script()
    r = script.run_case(big_model, demo_data[0], backend, nproc, train_type, tmp_path / "run")
    assert r["sharded_loading"] and len(r["ranks"]) == nproc
    largest = r["largest_file_mib"] / r["model_mib"]
    # model states the rank holds for good: its part of the weights, and for a full fine-tune the
    # gradients and the two AdamW moments of that part (4 x)
    states = part * (4 if train_type == "full" else 1)
    peak_bound = states + (FULL_PEAK if train_type == "full" else LORA_PEAK)
    load_bound = part + largest + LOAD_SLACK
    for rank, m in enumerate(r["ranks"]):
        assert m["load"] <= load_bound, f"rank {rank}: load {m['load']:.2f} of the model > {load_bound:.2f}"
        assert m["peak"] <= peak_bound, f"rank {rank}: peak {m['peak']:.2f} of the model > {peak_bound:.2f}"


def _params_per_rank(out: Path) -> list[int]:
    """Parameter bytes each rank holds, counted from its tensors on the first step."""
    return [json.loads(f.read_text())["params"] for f in sorted((out / "logs").glob("state_rank*.json"))]


@pytest.mark.parametrize("backend", ["fsdp", pytest.param("zero3", marks=pytest.mark.long)])
def test_qlora_base_bytes_per_rank_are_one_nth_of_one_process(backend, split_model, demo_data, tmp_path):
    """Issue 21, acceptance 3: the 4-bit base is sharded (fsdp: quantized as it arrives, the packed
    bytes sharded; zero3: partitioned by deepspeed.initialize, its storage dtype being the compute
    dtype), so each of 2 ranks holds half of what one process holds, within 10%."""
    if backend == "zero3":
        # the zero3 preset with nothing kept whole: on a model this small, DeepSpeed's persistence
        # threshold would keep every norm and adapter gathered on all ranks (docs/design.md)
        from swiftlite.parallel.ds_config import load_ds_config
        ds = load_ds_config("zero3")
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        backend = str(tmp_path / "zero3_release.json")
        Path(backend).write_text(json.dumps(ds))
    held = {}
    for n in (1, 2):
        _train(split_model, demo_data[0], tmp_path / f"n{n}", backend, n, "qlora")
        held[n] = _params_per_rank(tmp_path / f"n{n}")
    assert len(held[1]) == 1 and len(held[2]) == 2
    for rank, b in enumerate(held[2]):
        assert abs(b / (held[1][0] / 2) - 1) <= 0.10, (backend, rank, b, held[1][0])


def _zero3_scaled(tmp_path: Path, model_params: float) -> str:
    """The zero3 preset with its gathered-parameter caps scaled to the model. The preset's (ms-swift's)
    stage3_max_live_parameters / stage3_max_reuse_distance are 1e9 elements: 1/70 of a 70B model, but
    more than the whole 157M test model, on which ZeRO-3 would then keep every gathered layer until
    the step ends by design. Scaled to the same share of this model, and with nothing kept whole by the
    persistence threshold, the test sees what a real-size model sees."""
    from swiftlite.parallel.ds_config import load_ds_config
    ds = load_ds_config("zero3")
    cap = int(model_params * 1e9 / 70e9)
    ds["zero_optimization"].update(stage3_max_live_parameters=cap, stage3_max_reuse_distance=cap,
                                   stage3_param_persistence_threshold=0)
    path = tmp_path / "zero3_scaled.json"
    path.write_text(json.dumps(ds))
    return str(path)


@pytest.mark.long
@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_qlora_peak_per_rank_falls_from_one_to_two_to_four_processes(backend, big_model, demo_data, tmp_path):
    """Issue 21, acceptance 3, on the 157M model: QLoRA, the worst rank's peak (load and training) at
    N = 1, 2, 4. Measured (2-core CPU, 2026-12-01): fsdp 745, 294, 267 MiB (parameters per rank 106,
    53, 27 MiB); zero3 (caps scaled, see `_zero3_scaled`) 258, 226, 190 MiB (parameters 106, 53, 27 MiB).
    zero3 falls only since checkpointing is reentrant by default: non-reentrant, bitsandbytes' 4-bit
    matmul kept each layer's gathered weight on its autograd ctx until backward (313 MiB at N = 2)."""
    script = _script()
    if backend == "zero3":
        backend = _zero3_scaled(tmp_path, 157e6)
    peaks, params = [], []
    for n in (1, 2, 4):
        r = script.run_case(big_model, demo_data[0], backend, n, "qlora", tmp_path / f"n{n}")
        peaks.append(max(max(m["load_mib"], m["peak_mib"]) for m in r["ranks"]))
        params.append(max(m["params_mib"] for m in r["ranks"]))
    assert peaks[0] > peaks[1] > peaks[2], peaks
    assert params[1] <= params[0] / 2 * 1.1 and params[2] <= params[0] / 4 * 1.1, params
