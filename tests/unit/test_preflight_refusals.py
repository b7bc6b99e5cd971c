"""Refused before launch, never in a rank: plugin files whose imports fail (ms-swift's `swift` named
with what to change), pre-quantized AWQ/GPTQ/HQQ folders, LoRA targets the model lacks or peft cannot
adapt; and ms-swift's `all-linear embed_tokens lm_head` adapts those two as peft does."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from swiftlite.parallel.base import load_plugins
from tests.conftest import run_cli


def _cfg(argv):
    config_file, values = parse_run_args(["--dataset", "d.jsonl", "--model", "tiny-llama-2l", *argv])
    return load_config(config_file, values, validate_paths=False)


def test_msswift_reward_plugin_runs_unedited_and_registers_here(tmp_path, monkeypatch):
    """ms-swift's gsm8k_plugin.py shape: `from swift.rewards import ORM, orms` is swiftlite.plugin's registry."""
    import sys
    import types

    from swiftlite.plugin import ORM, orms
    p = tmp_path / "msswift_plugin.py"
    p.write_text("from typing import List\n\nfrom swift.rewards import ORM, orms\n\n\n"
                 "class Exact(ORM):\n"
                 "    def __call__(self, completions, solution, **kwargs) -> List[float]:\n"
                 "        return [float(c == s) for c, s in zip(completions, solution)]\n\n\n"
                 "orms['msswift_exact'] = Exact\n")
    # an installed ms-swift must neither receive the registration nor be replaced for other code
    fake = types.ModuleType("swift")
    fake.marker = True
    monkeypatch.setitem(sys.modules, "swift", fake)
    monkeypatch.delitem(orms, "msswift_exact", raising=False)
    load_plugins([str(p)])
    cls = orms["msswift_exact"]
    assert issubclass(cls, ORM)
    assert cls(None)(["4", "5"], solution=["4", "4"]) == [1.0, 0.0]
    assert sys.modules["swift"] is fake and "swift.rewards" not in sys.modules
    del orms["msswift_exact"]


def test_msswift_plugin_importing_more_of_ms_swift_names_the_import(tmp_path):
    p = tmp_path / "plugin.py"
    p.write_text("import re\n\nfrom swift.rewards import ORM, orms\nfrom swift.template import register_template\n")
    with pytest.raises(UserError) as e:
        load_plugins([str(p)])
    assert str(e.value) == (
        f"--external_plugins {p}:4: `from swift.template import register_template` failed (swift.template here is "
        "swiftlite.msswift_api.template, which has no register_template): this ms-swift plugin imports a part of "
        "ms-swift swiftlite does not have; ms-swift's Python templates are not used: conversations are rendered with "
        "the tokenizer's chat template (or --template FILE.jinja); drop the registration")
    p.write_text("from swift.rewards import prms\n")
    with pytest.raises(UserError, match=r"plugin\.py:1: `from swift.rewards import prms` failed \(swift.rewards here is "
                                        r"swiftlite.plugin, which has no prms\).*other reward kinds \(PRM\) are not"):
        load_plugins([str(p)])
    p.write_text("from swift.llm import get_model_tokenizer\n")
    with pytest.raises(UserError, match=r"plugin\.py:1: `from swift.llm import get_model_tokenizer` failed \(No module "
                                        r"named 'swift.llm'\).*of ms-swift, plugin files here can import swift.rewards"):
        load_plugins([str(p)])


def test_msswift_import_inside_a_function_resolves_when_it_is_called_or_is_refused_before_launch(tmp_path):
    """Such an import runs in the rank, when the reward is built or called: inside the aliases there (a
    counterpart with the names imported), refused now otherwise."""
    import sys

    from swiftlite.plugin import build_rewards, orms
    p = tmp_path / "lazy.py"
    p.write_text("from swift.rewards import ORM, orms\n\n\nclass R(ORM):\n    def __call__(self, completions, **kw):\n"
                 "        from swift.llm import get_model_tokenizer\n        return [0.0] * len(completions)\n")
    with pytest.raises(UserError) as e:
        load_plugins([str(p)])
    assert str(e.value).startswith(f"--external_plugins {p}:6: `from swift.llm import get_model_tokenizer` inside a "
                                   "function runs when it is called and would fail there; of ms-swift, plugin files")
    p.write_text("def reward(completions, **kw):\n    from swift.utils import is_master\n    return [0.0]\n")
    with pytest.raises(UserError, match=r"lazy\.py:2: .* swift.utils here \(swiftlite.msswift_api.utils\) has no "
                                        r"is_master"):
        load_plugins([str(p)])
    # ms-swift's plugin.py: MultiTurnThinkingTips imports MathAccuracy in its __init__
    p.write_text("from swift.rewards import ORM, orms\n\n\nclass Lazy(ORM):\n    def __init__(self, args=None):\n"
                 "        from swift.rewards.orm import Format\n        import swift.utils\n"
                 "        self.inner, self.log = Format(), swift.utils.get_logger()\n\n"
                 "    def __call__(self, completions, **kw):\n        from swift.rewards import orms as o\n"
                 "        return self.inner(completions) if 'format' in o else None\n\n\norms['lazy_fmt'] = Lazy\n")
    load_plugins([str(p)])
    try:
        r, = build_rewards(["lazy_fmt"], None)
        assert r(["<think>a</think><answer>b</answer>", "no"]) == [1.0, 0.0]
        assert "swift.rewards" not in sys.modules      # the aliases are gone again after the call
    finally:
        del orms["lazy_fmt"]
    p.write_text("def reward(completions, **kw):\n    import json\n    return [0.0] * len(completions)\n")
    load_plugins([str(p)])              # other lazy imports are the file's own business


def test_plugin_with_a_missing_package_names_it(tmp_path):
    p = tmp_path / "p.py"
    p.write_text("def f():\n    pass\nimport not_installed_pkg.sub\n")
    with pytest.raises(UserError, match=r"p\.py:3: `import not_installed_pkg.sub` failed \(No module named "
                                        r"'not_installed_pkg'\): install not_installed_pkg in this environment"):
        load_plugins([str(p)])


def test_a_plugin_imports_the_modules_next_to_it_as_in_msswift(tmp_path):
    """ms-swift's import_external_file puts the plugin's folder on sys.path (treepo's plugin imports its
    tree_rollout.py): so does the loader, after the installed packages."""
    import sys
    d = tmp_path / "treepo"
    d.mkdir()
    (d / "sibling_helper_mod.py").write_text("VALUE = 41\n")
    (d / "plug.py").write_text("from sibling_helper_mod import VALUE\nfrom swiftlite.plugin import orms\n"
                               "orms['sibling_value'] = lambda completions, **kw: [VALUE + 1.0] * len(completions)\n")
    from swiftlite.plugin import orms
    try:
        load_plugins([str(d / "plug.py")])
        assert orms["sibling_value"](["a"]) == [42.0]
        assert sys.path.index(str(d.resolve())) > sys.path.index(next(p for p in sys.path if "site-packages" in p))
    finally:
        orms.pop("sibling_value", None)
        sys.modules.pop("sibling_helper_mod", None)
        sys.path.remove(str(d.resolve()))


@pytest.mark.parametrize("method", ["awq", "gptq", "hqq"])
def test_prequantized_folder_is_refused_with_what_is_supported(tmp_path, method):
    from swiftlite.models.presets import PRESETS
    from swiftlite.models.source import resolve_model
    conf = {**PRESETS["tiny-llama-2l"].config, "quantization_config": {"quant_method": method, "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError) as e:
        resolve_model(str(tmp_path)).check_folder(trust_remote_code=False)
    assert f"a pre-quantized {method.upper()} model" in str(e.value)
    assert "bitsandbytes (--train-type qlora, or lora with --quant-bits 4|8)" in str(e.value)


@pytest.mark.parametrize("targets,msg", [
    (["q_proj", "nope"], "nope is not a module of tiny-llama-2l"),
    (["norm"], "norm is a LlamaRMSNorm, which LoRA cannot adapt (peft adapts Linear, Embedding and Conv layers; "
               "train it in full with --modules-to-save norm)"),
])
def test_targets_checked_on_the_meta_model_before_launch(targets, msg):
    from swiftlite.launch.preflight import check_lora_targets
    from swiftlite.models.loading import resolve_model
    cfg = _cfg(["--target-modules", *targets])
    with pytest.raises(UserError) as e:
        check_lora_targets(cfg, resolve_model(cfg.model.model))
    assert msg in str(e.value) and "embed_tokens" in str(e.value) and "lm_head" in str(e.value)


def test_all_linear_plus_names_lists_them_for_peft():
    from swiftlite.models.loading import load_model
    from swiftlite.models.lora import check_targets
    cfg = _cfg(["--target-modules", "all-linear", "embed_tokens", "lm_head"])
    targets = check_targets(load_model(cfg), cfg)
    assert targets == ["down_proj", "embed_tokens", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj",
                       "v_proj"]


def test_embed_tokens_and_lm_head_trained_as_peft_adapts_them(tmp_path, demo_data):
    """Two steps; the adapter holds an embedding LoRA for embed_tokens and a linear one for lm_head, and
    both moved from their initialisation (B starts at zero)."""
    train, _ = demo_data
    out = tmp_path / "o"
    run_cli(["sft", "--model", "tiny-llama-2l", "--dataset", f"{train}#16", "--target_modules", "all-linear",
             "embed_tokens", "lm_head", "--max_steps", "2", "--torch_dtype", "fp32", "--learning_rate", "1e-2",
             "--gradient_accumulation_steps", "1", "--output_dir", str(out)], timeout=300)
    ckpt = sorted(out.glob("checkpoint-*"))[-1]
    sd = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    emb_b = [k for k in sd if "embed_tokens.lora_embedding_B" in k]
    head_b = [k for k in sd if "lm_head.lora_B" in k]
    assert emb_b and head_b and any("q_proj.lora_A" in k for k in sd), sorted(sd)[:20]
    assert sd[emb_b[0]].abs().max() > 0 and sd[head_b[0]].abs().max() > 0


def test_eval_strategy_without_validation_data_says_nothing_is_evaluated(tmp_path, capsys):
    """ms-swift turns --eval_strategy steps into no when there is no validation data (its GRPO scripts rely
    on it); here the run goes on and says so in one line, before launch."""
    from swiftlite.launch.preflight import preflight
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                                               {"role": "assistant", "content": "b"}]}) + "\n")
    config_file, values = parse_run_args(["--dataset", str(tmp_path / "d.jsonl"), "--model", "tiny-llama-2l",
                                          "--eval_strategy", "steps", "--output_dir", str(tmp_path / "o")])
    cfg = load_config(config_file, values)
    preflight(cfg, 1, data=False)
    out = capsys.readouterr().out
    assert ("--eval_strategy steps: no validation data (--val_dataset or --split_dataset_ratio), so nothing is "
            "evaluated (ms-swift's rule)") in out
    config_file, values = parse_run_args(["--dataset", str(tmp_path / "d.jsonl"), "--model", "tiny-llama-2l",
                                          "--output_dir", str(tmp_path / "o")])
    preflight(load_config(config_file, values), 1, data=False)
    assert "nothing is evaluated" not in capsys.readouterr().out   # the default strategy says nothing
