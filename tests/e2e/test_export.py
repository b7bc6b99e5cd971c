"""`swiftlite export` / `swiftlite infer` end to end on checkpoints written by real training runs.

Each checkpoint kind is trained once (module fixture, `swiftlite sft` in a subprocess, 3 steps of the
2-layer tiny Llama, a large learning rate so the weights and LoRA deltas really move):

  single  one process, DCP            ddp    2 processes, DCP          fsdp   FSDP2 x 2, bf16, DCP
  fsdp1   FSDP1 x 2, DCP              zero2 / zero3  DeepSpeed x 2, ds/ (ZeRO partitions)
  lora    LoRA under FSDP2 x 2        qlora  QLoRA (nf4 base), one process

Exports run through `swiftlite.cli.main` in this process (the real entry point, exit codes and
stderr included) except where a real subprocess matters (kill -9, the one-line error contract).

Tolerances: full fine-tunes must export bit-exactly (every tensor equals the checkpoint's own HF copy
cast to bf16); LoRA merges within one bf16 rounding (2^-7 relative) of peft's merge; reloaded logits
within 3% of the logit scale of the training-side model in fp32 (measured: 0.5-0.7%).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_env, run_cli, spawn_cli

pytestmark = pytest.mark.slow

LOGIT_RTOL = 0.03
COMMON = ["--model", "tiny-llama-2l", "--train-type", "full", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "3", "--per-device-train-batch-size", "2",
          "--learning-rate", "5e-3", "--max-length", "64", "--logging-steps", "1"]
KINDS = {
    "single": ["--parallelism", "single"],
    "ddp": ["--parallelism", "ddp", "--nproc-per-node", "2"],
    "fsdp": ["--parallelism", "fsdp", "--nproc-per-node", "2", "--torch-dtype", "bf16"],
    "fsdp1": ["--parallelism", "fsdp1", "--nproc-per-node", "2"],
    "zero2": ["--parallelism", "zero2", "--nproc-per-node", "2"],
    "zero3": ["--parallelism", "zero3", "--nproc-per-node", "2"],
    "lora": ["--parallelism", "fsdp", "--nproc-per-node", "2", "--lora", "--learning-rate", "2e-2"],
    "qlora": ["--parallelism", "single", "--qlora", "--learning-rate", "2e-2"],
}
FULL = ["single", "ddp", "fsdp", "fsdp1", "zero2", "zero3"]


def _has(mod: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(mod) is not None


class Runs:
    """Trains each kind on first use (once per module)."""

    def __init__(self, root: Path):
        from swiftlite.demo import write_demo_data
        self.root = root
        self.train, self.val = write_demo_data(root / "data", n_train=48, n_val=8)
        self.done: dict[str, Path] = {}

    def __call__(self, kind: str) -> Path:
        if kind not in self.done:
            if kind.startswith("zero") and not _has("deepspeed"):
                pytest.skip("deepspeed not installed")
            if kind == "qlora" and not _has("bitsandbytes"):
                pytest.skip("bitsandbytes not installed")
            out = self.root / f"run_{kind}"
            run_cli(["sft", *COMMON, "--dataset", self.train, *KINDS[kind], "--output-dir", out], timeout=600,
                    env=cli_env(SWIFTLITE_CACHE=str(self.root / "cache")))
            self.done[kind] = out
        return self.done[kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("export_runs"))


def cli(args: list, capsys=None) -> tuple[int, str, str]:
    """swiftlite.cli.main in this process -> (exit code, stdout, stderr)."""
    from swiftlite.cli import main
    if capsys is not None:
        capsys.readouterr()
    rc = main([str(a) for a in args])
    if capsys is None:
        return rc, "", ""
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def export(capsys, *args) -> tuple[str, str]:
    rc, out, err = cli(["export", *args], capsys)
    assert rc == 0, f"export {args} exited {rc}\n{out[-3000:]}\n{err[-3000:]}"
    return out, err


def state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def prompt_ids(folder: Path) -> torch.Tensor:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template([{"role": "user", "content": "reverse: abcdef"}], tokenize=False,
                                   add_generation_prompt=True) + "fedcba"
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def assert_close_logits(got: torch.Tensor, ref: torch.Tensor, rtol: float = LOGIT_RTOL) -> float:
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert rel < rtol, f"logits differ by {rel:.2%} of the logit scale (tolerance {rtol:.0%})"
    return rel


def assert_hf_folder(out: Path, *, sharded: bool) -> None:
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md"} <= names
    assert not names & {"adapter_config.json", "adapter_model.safetensors"}
    assert all((out / n).stat().st_mode & 0o044 for n in names)  # readable by a server running as another user
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["dtype"] == "bfloat16"
    assert conf["tie_word_embeddings"] is False and "quantization_config" not in conf
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 258
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    readme = (out / "README.md").read_text()
    assert "## Training config (args.json)" in readme and "## Verification" in readme
    if sharded:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.export-")]
    assert not leftovers


# -- full fine-tunes ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", FULL)
def test_full_checkpoint_exports_exactly(kind, runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    run = runs(kind)
    ckpt_dir = run / "checkpoint-3"
    out = tmp_path / "hf"
    log, _ = export(capsys, "--ckpt", run, "--output", out, "--max_shard_size", "100KB", "--verify")
    assert ("ds (ZeRO-" in log) if kind.startswith("zero") else ("dcp (torch.distributed.checkpoint" in log)
    assert "verify: checks: passed" in log
    assert_hf_folder(out, sharded=True)
    # Bit-exact: the export equals the checkpoint's own HF copy (written from the live model at save
    # time) cast to bf16, so the DCP / ZeRO readers reassembled every shard correctly.
    got, ref = state(out), state(ckpt_dir / "model")
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k].to(torch.bfloat16)), k
    # and the training really moved the weights (the check above is not comparing two initial states)
    from swiftlite.config import build_config
    from swiftlite.models.loading import load_model
    init = load_model(build_config({"model": "tiny-llama-2l", "torch_dtype": "fp32"})).state_dict()
    assert (ref["model.layers.0.mlp.up_proj.weight"].float() - init["model.layers.0.mlp.up_proj.weight"]).abs().max() > 1e-3
    # reloads with transformers and reproduces the trained model's logits
    ids = prompt_ids(out)
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.bfloat16
    trained = AutoModelForCausalLM.from_pretrained(ckpt_dir / "model", dtype=torch.float32)
    assert_close_logits(logits(exported, ids), logits(trained, ids))
    if kind.startswith("zero"):
        # what DeepSpeed's own (whole-model, non-lazy) zero_to_fp32 reconstructs
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        ds = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag="ds")
        for k, v in got.items():
            assert torch.equal(v, ds[k].to(torch.bfloat16)), k


def test_fp16_export_and_single_file(runs, tmp_path, capsys):
    out = tmp_path / "fp16"
    log, _ = export(capsys, "--ckpt", runs("single") / "checkpoint-3", "--output", out, "--dtype", "fp16", "--verify")
    assert "verify: checks: passed" in log
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert {v.dtype for v in state(out).values()} == {torch.float16}


# -- LoRA / QLoRA ---------------------------------------------------------------------------------

def _reference_peft(run: Path):
    """The training-side LoRA model: the base as the run built it + the checkpoint's adapter."""
    from peft import PeftModel

    from swiftlite.config import load_args
    from swiftlite.models.loading import load_model
    cfg = load_args(run / "args.json")
    base = load_model(cfg)
    from swiftlite.models.quant import disable_cpu_repack
    disable_cpu_repack(base)
    return PeftModel.from_pretrained(base, str(run / "checkpoint-3" / "adapter")).eval(), cfg


def test_lora_adapter_only_by_default(runs, tmp_path, capsys):
    run = runs("lora")
    out = tmp_path / "adapter"
    log, _ = export(capsys, "--ckpt", run, "--output", out, "--verify")
    assert "adapter only" in log and "verify: checks: passed" in log
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= names
    assert not [n for n in names if n.startswith("model")]
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == "tiny-llama-2l" and conf["inference_mode"] is True
    src = state(run / "checkpoint-3" / "adapter")
    got = state(out)
    assert set(got) == set(src) and all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in src.items())


def _merged_reference(peft_model) -> dict[str, torch.Tensor]:
    from swiftlite.export import reference_weights
    return reference_weights(peft_model)


def _lora_layer(peft_model, name: str):
    return peft_model.get_base_model().get_submodule(name)


def max_delta(peft_model) -> float:
    from peft.tuners.lora import LoraLayer
    return max(float(m.get_delta_weight("default").abs().max()) for m in peft_model.get_base_model().modules()
               if isinstance(m, LoraLayer))


def test_lora_merge(runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    run = runs("lora")
    out = tmp_path / "merged"
    log, _ = export(capsys, "--ckpt", run, "--output", out, "--merge-lora", "--verify")
    assert "verify: checks: passed" in log and "LoRA merged" in (out / "README.md").read_text()
    assert_hf_folder(out, sharded=False)
    got = state(out)
    assert not [k for k in got if any(m in k for m in ("lora_", "base_layer", "modules_to_save"))]
    assert all(v.numel() > 0 for v in got.values())
    ref_model, cfg = _reference_peft(run)
    want = _merged_reference(ref_model)  # peft's own base + get_delta_weight, fp32
    for k, v in got.items():
        torch.testing.assert_close(v.float(), want[k].float(), rtol=2**-7, atol=1e-8, msg=k)
    assert max_delta(ref_model) > 1e-3  # the LoRA deltas are real, so a missing merge could not pass
    ids = prompt_ids(out)
    assert_close_logits(logits(AutoModelForCausalLM.from_pretrained(out), ids), logits(ref_model, ids))

    # Same export from the sharded trainable tensors when the checkpoint has no adapter/ folder.
    from swiftlite import checkpoint as ckpt
    bare = tmp_path / "bare_run"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("adapter"))
    ckpt.write_manifest(bare / "checkpoint-3")
    out2 = tmp_path / "merged_from_dcp"
    export(capsys, "--ckpt", bare, "--output", out2, "--merge-lora")
    got2 = state(out2)
    assert set(got2) == set(got) and all(torch.equal(got2[k], got[k]) for k in got)


@pytest.mark.parametrize("merge", [False, True])
def test_qlora(runs, tmp_path, capsys, merge):
    run = runs("qlora")
    out = tmp_path / "q"
    log, _ = export(capsys, "--ckpt", run, "--output", out, "--verify", *(["--merge-lora"] if merge else []))
    assert "verify: checks: passed" in log
    if not merge:
        assert (out / "adapter_model.safetensors").is_file() and "4-bit" in (out / "README.md").read_text()
        return
    # the log and the card say which base the adapter was merged into
    assert "quantized nf4" in log and "dequantize_4bit" in log
    assert "dequantized weights" in (out / "README.md").read_text()
    got = state(out)
    ref_model, cfg = _reference_peft(run)
    want = _merged_reference(ref_model)  # dequantized 4-bit base + delta
    for k, v in got.items():
        torch.testing.assert_close(v.float(), want[k].float(), rtol=2**-7, atol=1e-8, msg=k)
    # ... and not into the original (unquantized) weights: those differ by the nf4 error
    from swiftlite.config import build_config
    from swiftlite.models.loading import load_model
    orig = load_model(build_config({"model": "tiny-llama-2l", "torch_dtype": "fp32", "seed": cfg.train.seed}))
    name = "model.layers.0.mlp.up_proj"
    into_original = orig.state_dict()[f"{name}.weight"] + _lora_layer(ref_model, name).get_delta_weight("default")
    assert float((got[f"{name}.weight"].float() - into_original).abs().max()) > 1e-3
    assert max_delta(ref_model) > 1e-3


# -- failures -------------------------------------------------------------------------------------

def test_interrupted_export_leaves_nothing_that_looks_complete(runs, tmp_path):
    run = runs("single")
    out = tmp_path / "killed"
    env = cli_env(SWIFTLITE_EXPORT_THROTTLE_S="0.4")
    proc = spawn_cli(["export", "--ckpt", str(run), "--output", str(out), "--max-shard-size", "20KB"], env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # wait until the first shard is on disk, then kill -9
            tmps = list(tmp_path.glob(".killed.export-tmp-*"))
            if tmps and list(tmps[0].glob("*.tmp")):
                break
            assert proc.poll() is None, "export finished before it could be interrupted"
            time.sleep(0.05)
        else:
            pytest.fail("export never started writing")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert not out.exists()
    visible = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert visible == []
    (partial,) = list(tmp_path.glob(".killed.export-tmp-*"))
    assert not (partial / "config.json").exists() and not list(partial.glob("model*.safetensors"))
    # the next export removes the dead one's leftovers and publishes a complete folder
    from swiftlite.export import ExportOptions, export as do_export
    do_export(ExportOptions(ckpt=str(run), output=str(out), log=lambda m: None))
    assert (out / "config.json").is_file() and not partial.exists()


def test_not_a_checkpoint_is_one_line_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_cli(["export", "--ckpt", tmp_path / "empty", "--output", tmp_path / "o"], check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: --ckpt")
    assert "not a checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_user_errors_are_one_line_exit_2(runs, tmp_path, capsys):
    run = runs("lora")

    def fails(*args) -> str:
        rc, _out, err = cli(["export", *args], capsys)
        assert rc == 2 and err.strip().count("\n") == 0 and err.startswith("error: "), (rc, err)
        return err

    # base model missing: named on the command line, or recorded in args.json and gone since
    err = fails("--ckpt", run, "--output", tmp_path / "a", "--merge-lora", "--base-model", tmp_path / "gone")
    assert "base model" in err and "not available" in err and "--base-model" in err
    moved = tmp_path / "moved_run"
    shutil.copytree(run, moved)
    args = json.loads((moved / "args.json").read_text())
    args["model"]["model"] = str(tmp_path / "deleted_base")
    (moved / "args.json").write_text(json.dumps(args))
    err = fails("--ckpt", moved, "--output", tmp_path / "b", "--merge-lora")
    assert "from args.json" in err and "not available" in err
    # adapter trained on tiny-llama-2l (64 hidden) against tiny-llama (256 hidden)
    err = fails("--ckpt", run, "--output", tmp_path / "c", "--merge-lora", "--base-model", "tiny-llama")
    assert "adapter/base architecture mismatch" in err
    # output exists
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    err = fails("--ckpt", runs("single"), "--output", existing)
    assert "already exists" in err and "--overwrite" in err and (existing / "keep.txt").exists()
    export(capsys, "--ckpt", runs("single"), "--output", existing, "--overwrite")
    assert not (existing / "keep.txt").exists() and (existing / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# -- infer ----------------------------------------------------------------------------------------

def test_infer_prompt_dataset_and_checkpoint(runs, tmp_path, capsys):
    run = runs("single")
    out = tmp_path / "hf"
    export(capsys, "--ckpt", run, "--output", out)
    rc, stdout, _ = cli(["infer", "--model", out, "--dataset", runs.val, "--limit", "4", "--max-new-tokens", "4",
                         "--metric", "exact_match"], capsys)
    assert rc == 0 and stdout.strip().splitlines()[-1].startswith("exact_match: ")
    assert "(" in stdout and "/4)" in stdout
    # a preset with random weights (the "before" model of the quickstart), and a run folder
    rc, stdout, _ = cli(["infer", "--model", "tiny-llama-2l", "--seed", "42", "--prompt", "reverse: abc",
                         "--max-new-tokens", "3"], capsys)
    assert rc == 0 and len(stdout.strip().splitlines()) == 1
    rc, a, _ = cli(["infer", "--model", run, "--prompt", "reverse: abc", "--max-new-tokens", "5", "--dtype", "fp32"],
                   capsys)
    rc2, b, _ = cli(["infer", "--model", run / "checkpoint-3" / "model", "--prompt", "reverse: abc",
                     "--max-new-tokens", "5", "--dtype", "fp32"], capsys)
    assert rc == rc2 == 0 and a == b  # the run folder means its latest checkpoint's weights
    # --response_prefix starts the answer; a run folder's own (its args.json, from training) is used
    rc, c, _ = cli(["infer", "--model", run, "--prompt", "reverse: abc", "--max-new-tokens", "5", "--dtype", "fp32",
                    "--response_prefix", "Final Answer:"], capsys)
    assert rc == 0 and c.startswith("Final Answer:")
    copy = tmp_path / "run_with_prefix"
    shutil.copytree(run, copy)
    args = json.loads((copy / "args.json").read_text())
    args["data"]["response_prefix"] = "Final Answer:"
    (copy / "args.json").write_text(json.dumps(args))
    rc, d, _ = cli(["infer", "--model", copy, "--prompt", "reverse: abc", "--max-new-tokens", "5", "--dtype", "fp32"],
                   capsys)
    assert rc == 0 and d == c
    rc, _, err = cli(["infer", "--model", tmp_path / "nope", "--prompt", "x"], capsys)
    assert rc == 2 and err.startswith("error: --model")


def test_infer_lora_adapters(runs, tmp_path, capsys):
    run = runs("lora")
    rc, a, _ = cli(["infer", "--model", run, "--prompt", "reverse: abc", "--max-new-tokens", "5"], capsys)
    rc2, b, _ = cli(["infer", "--model", "tiny-llama-2l", "--seed", "42", "--adapters",
                     run / "checkpoint-3" / "adapter", "--prompt", "reverse: abc", "--max-new-tokens", "5"], capsys)
    assert rc == rc2 == 0 and a == b
