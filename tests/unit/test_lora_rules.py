"""LoRA / QLoRA: the combination rules (config/rules.py, backend records), target checks (models/lora.py), the 4-bit base
(models/quant.py: trap 1) and FSDP1's dtype cast (parallel/fsdp1.py). Fast: no training here; the
2-process runs are in tests/distributed/test_lora.py."""

from __future__ import annotations

import json

import pytest

from swiftlite.planner import choose_backend as resolve_backend
from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from tests.conftest import run_cli

DATA = ["--dataset", "train.jsonl", "--model", "tiny-llama-2l"]


def cfg_from(argv):
    """Parse, validate, and resolve --parallelism (as preflight does) on the planned world."""
    config_file, values = parse_run_args([*DATA, *argv])
    cfg = load_config(config_file, values, validate_paths=False)
    resolve_backend(cfg, (cfg.parallel.nproc_per_node or 1) * (cfg.parallel.nnodes or 1))
    return cfg


# -- the rule table ----------------------------------------------------------------------------------

ACCEPTED = [
    ["--qlora", "--parallelism", "fsdp"],
    ["--qlora", "--parallelism", "fsdp1"],
    ["--qlora", "--parallelism", "ddp"],
    ["--qlora", "--parallelism", "zero3"],
    ["--qlora", "--parallelism", "zero2"],
    ["--qlora", "--parallelism", "zero2_offload"],          # optimizer offload only: the base stays put
    ["--qlora", "--parallelism", "fsdp", "--torch-dtype", "bf16", "--mixed-precision", "bf16"],
    ["--qlora", "--parallelism", "fsdp", "--mixed-precision", "none"],
    ["--lora", "--parallelism", "fsdp", "--mixed-precision", "bf16"],     # no packed weights to scramble
    ["--lora", "--parallelism", "fsdp1", "--cpu-offload", "--nproc-per-node", "2"],
    ["--lora", "--parallelism", "zero3_offload"],
    ["--lora", "--quant-bits", "8", "--parallelism", "zero3"],
    ["--lora", "--quant-bits", "8", "--parallelism", "ddp"],      # checkpoints hold the adapters only
    ["--lora", "--quant-bits", "8"],
    ["--lora", "--target-modules", "q_proj", "v_proj"],
    ["--lora", "--target-modules", "all-linear", "embed_tokens", "lm_head"],   # ms-swift's spelling: adds those two
]


@pytest.mark.parametrize("argv", ACCEPTED, ids=lambda a: " ".join(a))
def test_supported_combinations_pass(argv, monkeypatch):
    if "--cpu-offload" in argv:  # offloads from a GPU: on this CPU machine it is refused (tests/unit/test_fsdp_knobs.py)
        import torch
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg_from(argv)


REJECTED = [
    (["--qlora", "--quant-bits", "3"], "--quant-bits must be 4 or 8"),
    (["--lora", "--quant-bits", "16"], "--quant-bits must be 4 or 8"),
    (["--train-type", "full", "--quant-bits", "4"], "--quant-bits needs --train-type lora/qlora"),
    (["--qlora", "--parallelism", "fsdp", "--cpu-offload"], "--cpu-offload with a bitsandbytes-quantized base"),
    (["--qlora", "--parallelism", "fsdp1", "--cpu-offload"], "--cpu-offload with a bitsandbytes-quantized base"),
    (["--qlora", "--parallelism", "zero3_offload"], "DeepSpeed offload cannot move bitsandbytes-quantized"),
    (["--qlora", "--parallelism", "zero3_offload_nvme"], "DeepSpeed offload cannot move bitsandbytes-quantized"),
    (["--lora", "--quant-bits", "8", "--deepspeed", "zero3_offload"], "DeepSpeed offload cannot move"),
    (["--qlora", "--compile"], "--compile with a bitsandbytes-quantized base"),
    (["--lora", "--quant-bits", "8", "--parallelism", "fsdp"], "FSDP re-wraps every parameter"),
    (["--lora", "--quant-bits", "8", "--parallelism", "fsdp1"], "FSDP re-wraps every parameter"),
    (["--qlora", "--parallelism", "fsdp", "--mixed-precision", "bf16"], "scramble them"),
    (["--qlora", "--parallelism", "fsdp1", "--torch-dtype", "bf16", "--mixed-precision", "fp16"], "scramble"),
    (["--lora", "--lora-rank", "0"], "--lora-rank must be > 0"),
    (["--lora", "--lora-alpha", "0"], "--lora-alpha must be > 0"),
    (["--lora", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
]


@pytest.mark.parametrize("argv,msg", REJECTED, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_unsupported_combinations_name_the_reason(argv, msg):
    with pytest.raises(UserError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        cfg_from(argv)


def test_deepspeed_json_with_param_offload_is_read(tmp_path):
    """A user JSON (any name) is looked into: offload_param is what matters, not the file name."""
    from swiftlite.parallel.ds_config import load_ds_config
    ds = load_ds_config("zero3_offload")
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(ds))
    with pytest.raises(UserError, match="offload_param to cpu"):
        cfg_from(["--qlora", "--parallelism", str(p)])
    ds["zero_optimization"].pop("offload_param")
    p.write_text(json.dumps(ds))
    cfg_from(["--qlora", "--parallelism", str(p)])  # optimizer offload only


def _train_file(folder):
    """DATA's train.jsonl in `folder` (the run's working directory): a missing dataset would be a
    refusal of its own, reported in the same run."""
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}
    (folder / "train.jsonl").write_text(json.dumps(row) + "\n")
    return folder


def test_cli_bad_quant_bits_is_one_line_exit_2(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(["sft", *DATA, "--qlora", "--quant-bits", "3", "--output-dir", str(out)], check=False,
                   timeout=120, cwd=_train_file(tmp_path), own_process=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --quant-bits must be 4 or 8"), proc.stderr
    assert not out.exists()


def test_cli_qlora_with_offload_is_one_line_exit_2(tmp_path):
    proc = run_cli(["sft", *DATA, "--qlora", "--parallelism", "fsdp", "--cpu-offload", "--nproc-per-node", "2",
                    "--output-dir", str(tmp_path / "o")],
                   check=False, timeout=120, cwd=_train_file(tmp_path), own_process=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--cpu-offload with a bitsandbytes" in proc.stderr


def test_cli_target_modules_that_match_nothing_is_one_line_exit_2(tmp_path, demo_data):
    """Checked once the model is built (after the config): still one line and exit code 2."""
    train, _ = demo_data
    proc = run_cli(["sft", "--model", "tiny-llama-2l", "--dataset", f"{train}#4", "--qlora", "--target-modules",
                    "query_key_value", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false",
                    "--max-steps", "1", "--output-dir", str(tmp_path / "o")], check=False, timeout=300,
                   own_process=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: --target-modules query_key_value: query_key_value is not a module of tiny-llama-2l (its adaptable "
        "modules: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; or "
        "all-linear)"], proc.stderr
    assert not (tmp_path / "o").exists()   # refused in preflight, before the run folder or any rank


# -- target checks (models/lora.py) --------------------------------------------------------------------

def _tiny(argv=()):
    from swiftlite.models.loading import load_model
    cfg = cfg_from(["--lora", *argv])
    return cfg, load_model(cfg)


def test_model_without_linear_layers_is_refused():
    import torch

    from swiftlite.models.lora import apply_lora

    class NoLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.norm = torch.nn.LayerNorm(4)

    cfg = cfg_from(["--qlora"])
    with pytest.raises(UserError, match="has no linear layers to adapt"):
        apply_lora(NoLinear(), cfg)


def test_target_modules_that_match_nothing_list_what_exists():
    from swiftlite.models.lora import apply_lora
    cfg, model = _tiny(["--target-modules", "q_proj", "query_key_value"])
    with pytest.raises(UserError) as e:
        apply_lora(model, cfg)
    msg = str(e.value)
    assert msg.startswith("--target-modules q_proj query_key_value: query_key_value is not a module of")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in msg
    assert "\n" not in msg


def test_targets_match_like_peft_by_dotted_suffix():
    from swiftlite.models.lora import apply_lora
    cfg, model = _tiny(["--target-modules", "self_attn.q_proj", "layers.1.mlp.down_proj"])
    peft_model = apply_lora(model, cfg)
    adapted = sorted(n for n, _ in peft_model.named_modules() if n.endswith("lora_A"))
    assert len(adapted) == 3, adapted  # q_proj in 2 layers + one down_proj


def test_modules_to_save_must_exist():
    from swiftlite.models.lora import apply_lora
    cfg, model = _tiny(["--modules-to-save", "score_head"])
    with pytest.raises(UserError, match="--modules-to-save score_head: no such module"):
        apply_lora(model, cfg)


def test_adapter_init_depends_on_seed_only():
    """Every rank draws the same LoRA A, whatever its own RNG state (ranks are seeded seed+rank)."""
    import torch

    from swiftlite.models.lora import apply_lora
    weights = []
    for rank_seed in (0, 1):
        cfg, model = _tiny()
        torch.manual_seed(rank_seed)
        pm = apply_lora(model, cfg)
        weights.append({n: p.detach().clone() for n, p in pm.named_parameters() if "lora_A" in n})
    assert weights[0].keys() == weights[1].keys() and weights[0]
    for n in weights[0]:
        assert torch.equal(weights[0][n], weights[1][n]), n


# -- the 4-bit base (models/quant.py) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def qlora_model():
    pytest.importorskip("bitsandbytes")
    from swiftlite.models.loading import prepare_model
    cfg = cfg_from(["--qlora", "--torch-dtype", "bf16"])
    return cfg, prepare_model(cfg)


def _bnb_4bit(model):
    import bitsandbytes as bnb
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _bits(t):
    """The raw bytes of a tensor (packed 4-bit data seen as bf16 holds NaN patterns: compare bits)."""
    return t.detach().contiguous().view(-1).view(__import__("torch").uint8)


def test_quantized_preset_has_4bit_layers_stored_in_the_run_dtype(qlora_model):
    import torch
    _cfg, model = qlora_model
    q = _bnb_4bit(model)
    assert len(q) == 14  # 7 projections x 2 layers
    assert all(m.weight.dtype == torch.bfloat16 for m in q)  # bnb_4bit_quant_storage = --torch-dtype
    assert model.config.name_or_path == ""  # not the deleted temp folder (peft would look it up online)


def test_eval_forward_does_not_repack_the_4bit_weights(qlora_model):
    """Trap 1: on AVX512-BF16 CPUs bitsandbytes repacks 4-bit weights in place on an eval()+no_grad
    forward; disable_cpu_repack must leave the weights (and their layout) untouched."""
    import torch
    _cfg, model = qlora_model
    q = _bnb_4bit(model)
    assert q and all(m.support_avx512bf16_for_cpu is False for m in q)
    before = [_bits(m.weight.data).clone() for m in q]
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    model.train()
    for m, w in zip(q, before):
        assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False)
        assert torch.equal(_bits(m.weight.data), w)


def test_fsdp1_cast_makes_one_dtype_and_leaves_packed_weights_alone(qlora_model):
    import torch

    from swiftlite.parallel.fsdp1 import cast_to_uniform_dtype, check_uniform_dtype
    _cfg, model = qlora_model
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}  # peft keeps the adapter in fp32
    packed = {n: _bits(p.data).clone() for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    assert len(packed) == 14
    cast = cast_to_uniform_dtype(model, torch.bfloat16)
    assert cast and all("lora_" in n for n in cast)
    check_uniform_dtype(model)
    for n, p in model.named_parameters():
        if n in packed:
            assert torch.equal(_bits(p.data), packed[n])
