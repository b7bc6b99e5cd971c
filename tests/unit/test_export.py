"""Unit tests of swiftlite.export and the export/infer CLI registration (no training, a few seconds)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swiftlite import checkpoint as ckpt
from swiftlite import export as ex
from swiftlite.errors import UserError
from swiftlite.models.presets import TINY_TOKENIZER, get_preset

ROOT = Path(__file__).resolve().parents[2]


def tiny_config(**over):
    from transformers import AutoConfig
    return AutoConfig.for_model(**{**get_preset("tiny-llama-2l").config, **over})


def save_base(folder: Path, seed: int = 0, **over) -> torch.nn.Module:
    """A random tiny Llama saved as an HF folder (safetensors) with the shipped tokenizer."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(**over), dtype=torch.float32)
    model.save_pretrained(folder)
    for f in TINY_TOKENIZER.iterdir():
        shutil.copy(f, folder / f.name)
    return model


# -- CLI registration ---------------------------------------------------------------------------

def test_cli_modules_import_light_and_register():
    code = ("import sys, typer, swiftlite.cli.export as e, swiftlite.cli.infer as i\n"
            "heavy = [m for m in ('torch', 'transformers', 'peft', 'deepspeed') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "app = typer.Typer(); e.register(app); i.register(app)\n"
            "print(sorted(c.name for c in app.registered_commands))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "['export', 'infer']" in out.stdout


def test_help_lists_both_spellings():
    out = subprocess.run([sys.executable, "-m", "swiftlite", "export", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0
    for flag in ("--max-shard-size", "--max_shard_size", "--merge-lora", "--merge_lora", "--base-model",
                 "--base_model", "--verify", "--overwrite", "--dtype"):
        assert flag in out.stdout
    out = subprocess.run([sys.executable, "-m", "swiftlite", "infer", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    for flag in ("--max-new-tokens", "--max_new_tokens", "--adapters", "--dataset", "--metric", "--prompt"):
        assert flag in out.stdout


# -- resolving --ckpt / --output ------------------------------------------------------------------

def _fake_checkpoint(run: Path, step: int) -> Path:
    c = run / f"checkpoint-{step}"
    (c / "dcp").mkdir(parents=True)
    (c / "dcp" / ".metadata").write_bytes(b"x")
    (c / "trainer_state.json").write_text(json.dumps({"global_step": step, "train_type": "full"}))
    ckpt.write_manifest(c)
    return c


def test_resolve_checkpoint_forms(tmp_path):
    run = tmp_path / "run"
    c1, c2 = _fake_checkpoint(run, 1), _fake_checkpoint(run, 2)
    ckpt.write_latest(run, c1.name)
    assert ex.resolve_checkpoint(str(run)) == (c1.resolve(), "checkpoint")   # latest wins, not the newest
    assert ex.resolve_checkpoint(str(c2)) == (c2.resolve(), "checkpoint")
    (c1 / "trainer_state.json").write_text("{}")                           # size no longer matches manifest
    with pytest.raises(UserError, match="latest checkpoint checkpoint-1 is not usable"):
        ex.resolve_checkpoint(str(run))
    (run / "latest").unlink()
    assert ex.resolve_checkpoint(str(run))[0] == c2.resolve()               # no latest: newest good one
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="not a checkpoint"):
        ex.resolve_checkpoint(str(empty))
    with pytest.raises(UserError, match="no such folder"):
        ex.resolve_checkpoint(str(tmp_path / "missing"))
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(UserError, match="a file"):
        ex.resolve_checkpoint(str(tmp_path / "f.txt"))
    partial = run / ".tmp-checkpoint-3"
    partial.mkdir()
    with pytest.raises(UserError, match="incomplete"):
        ex.resolve_checkpoint(str(partial))


def test_prepare_output_refuses_existing_and_protects_source(tmp_path):
    src = ex.Source(arg="x", path=tmp_path / "run" / "checkpoint-1", form="checkpoint", run_dir=tmp_path / "run")
    src.path.mkdir(parents=True)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        ex.prepare_output(str(out), False, src)
    with pytest.raises(UserError, match="holds the checkpoint"):
        ex.prepare_output(str(tmp_path / "run"), True, src)
    # a stale temp folder of a dead export is removed; ours is hidden and next to the output
    stale = tmp_path / ".out.export-tmp-999999999"
    stale.mkdir()
    final, tmp = ex.prepare_output(str(out), True, src)
    assert not stale.exists() and tmp.parent == final.parent and tmp.name.startswith(".out.export-tmp-")


# -- adapters and merging -------------------------------------------------------------------------

def test_peft_names():
    assert ex.peft_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert ex.peft_name("base_model.model.lm_head.modules_to_save.default.weight") == "base_model.model.lm_head.weight"
    assert ex.peft_name("base_model.model.lm_head.original_module.weight") is None
    assert ex.peft_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") is None


def test_adapter_scale_patterns():
    a = ex.Adapter({"lora_alpha": 16, "alpha_pattern": {"q_proj": 64}}, {}, "t")
    assert a.scale("model.layers.0.mlp.up_proj", 8) == 2.0
    assert a.scale("model.layers.0.self_attn.q_proj", 8) == 8.0
    assert ex.Adapter({"lora_alpha": 16, "use_rslora": True}, {}, "t").scale("x", 4) == 8.0


@pytest.mark.parametrize("rslora", [False, True])
def test_merge_matches_peft_merge_and_unload(tmp_path, rslora):
    """A bare adapter folder + --base-model folder, merged by export, equals peft's own merge
    (LoRA on every linear with random non-zero B, alpha_pattern, modules_to_save on lm_head)."""
    from peft import LoraConfig, get_peft_model
    base_dir = tmp_path / "base"
    base = save_base(base_dir)
    orig = {k: v.clone() for k, v in base.state_dict().items()}
    conf = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False,
                      use_rslora=rslora, alpha_pattern={"down_proj": 8}, modules_to_save=["lm_head"],
                      task_type="CAUSAL_LM")
    torch.manual_seed(1)
    peft_model = get_peft_model(base, conf)
    with torch.no_grad():
        peft_model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)
    adir = tmp_path / "adapter"
    peft_model.save_pretrained(adir)
    merged = peft_model.merge_and_unload().state_dict()
    out = tmp_path / "out"
    res = ex.export(ex.ExportOptions(ckpt=str(adir), output=str(out), base_model=str(base_dir), merge_lora=True,
                                     max_shard_size="64KB", verify=True, log=lambda m: None))
    assert res.kind == "model" and res.verify["checks"] == "passed"
    from transformers import AutoModelForCausalLM
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(got) == set(merged)
    for k, v in merged.items():
        # exact up to bf16 rounding of the fp32 merge: at most one bf16 ulp
        torch.testing.assert_close(got[k], v.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6, msg=k)
    for k in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight"):  # replaced / merged, not the base
        assert (got[k] - orig[k]).abs().max() > 0.05, k
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [n for n in names if any(m in n for m in ex.PEFT_MARKERS)]
    assert not [f for f in ex.ADAPTER_FILES if (out / f).exists()]


def test_adapter_base_mismatch_is_user_error(tmp_path):
    from peft import LoraConfig, get_peft_model
    base_dir, other = tmp_path / "base", tmp_path / "other"
    base = save_base(base_dir)
    save_base(other, hidden_size=32, intermediate_size=88, num_attention_heads=2, num_key_value_heads=1)
    adir = tmp_path / "adapter"
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")).save_pretrained(adir)
    with pytest.raises(UserError, match="adapter/base architecture mismatch"):
        ex.export(ex.ExportOptions(ckpt=str(adir), output=str(tmp_path / "o"), base_model=str(other),
                                   merge_lora=True, log=lambda m: None))
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.export-tmp-*"))


# -- files ---------------------------------------------------------------------------------------

def test_write_config_keeps_legacy_rope_and_dtype_keys(tmp_path):
    from transformers import AutoConfig
    conf = AutoConfig.for_model(**get_preset("llama-1b").config)
    d = ex.write_config(conf, "LlamaForCausalLM", tmp_path, torch.bfloat16, tie=True)
    assert d["dtype"] == d["torch_dtype"] == "bfloat16" and d["tie_word_embeddings"] is True
    assert d["rope_theta"] == 500000.0 and d["rope_scaling"]["rope_type"] == "llama3"
    assert "quantization_config" not in d and d["use_cache"] is True
    back = AutoConfig.from_pretrained(tmp_path)
    assert back.rope_parameters["rope_type"] == "llama3" and back.rope_parameters["factor"] == 32.0


def test_tokenizer_files_readable_by_older_transformers(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
    assert ex.write_tokenizer(tok, tmp_path)
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and tc["chat_template"] == tok.chat_template
    back = AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [{"role": "user", "content": "hi"}]
    assert back.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)


def test_generation_config_has_every_eos(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
    gen = ex.write_generation_config(tmp_path, {"eos_token_id": 7, "pad_token_id": None}, tok, None)
    assert gen["eos_token_id"] == [7, tok.eos_token_id] and gen["pad_token_id"] == tok.pad_token_id


def test_check_files_reports_problems(tmp_path):
    from safetensors.torch import save_file
    save_file({"model.layers.0.q_proj.lora_A.weight": torch.zeros(2, 2, dtype=torch.bfloat16),
               "empty": torch.zeros(0, dtype=torch.bfloat16), "w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "adapter_config.json").write_text("{}")
    probs = " | ".join(ex.check_files(tmp_path, "model", torch.bfloat16))
    for want in ("missing config.json", "stray adapter files", "peft name", "zero-size", "w is torch.float32"):
        assert want in probs


def test_fp16_overflow_is_refused():
    with pytest.raises(UserError, match="fp16 range"):
        ex.cast_checked("w", torch.tensor([1e6]), torch.float16)
    assert ex.cast_checked("w", torch.tensor([1e6]), torch.bfloat16).dtype == torch.bfloat16


# -- readers ---------------------------------------------------------------------------------------

def test_dcp_reader_reads_model_entries_a_batch_at_a_time(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    sd = {f"layer{i}.weight": torch.randn(8, 4) for i in range(5)}
    state = {"model": sd, "optim": {"state": {k: {"exp_avg": torch.zeros(8, 4)} for k in sd}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    r = ex.DCPReader(tmp_path)
    assert r.names() == list(sd)  # optimizer entries are not model weights
    from swiftlite.checkpoint.readers import batches
    assert [len(b) for b in batches(r, r.names(), budget=2 * 8 * 4 * 4)] == [2, 2, 1]
    got = dict(ex.stream(r, r.names(), budget=1))
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_dcp_reader_refuses_unsafe_metadata(tmp_path):
    import pickle
    (tmp_path / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(UserError, match="unsafe pickle"):
        ex.DCPReader(tmp_path)


def test_verify_failure_exits_1_and_publishes_nothing(tmp_path, monkeypatch, capsys):
    """A merge that forgets the adapter is caught by --verify (weights and logits), exit 1, no folder."""
    from peft import LoraConfig, get_peft_model

    from swiftlite.cli import main
    base_dir = tmp_path / "base"
    base = save_base(base_dir)
    torch.manual_seed(3)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False,
                                    task_type="CAUSAL_LM")).save_pretrained(tmp_path / "adapter")
    monkeypatch.setattr("swiftlite.export.model.merge_lora", lambda w, parts, scale, fan: w)  # the bug: no merge
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(["export", "--ckpt", str(tmp_path / "adapter"), "--base-model", str(base_dir), "--merge-lora",
               "--output", str(out), "--verify"])
    err = capsys.readouterr().err
    assert rc == 1 and "--verify failed" in err and "differ from the training-side model" in err
    assert err.strip().count("\n") == 0
    assert not out.exists() and not list(tmp_path.glob(".out.export-tmp-*"))
