"""ModelSource (swiftlite/models/source.py) owns what --model is and the model's facts (issue 24):
its config dict, transformers config, shape, folder checks, hub snapshot and hub id.

Checked from the source too: outside the owner, no module looks up a preset (`get_preset(`) or reads
a "config.json" to answer what --model is. Before, six places did, each with its own precedence and
errors (infer looked for a folder before a preset, estimate had its own JSON errors, preflight read
config.json again).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from swiftlite.errors import UserError
from swiftlite.models.presets import PRESETS, param_count
from swiftlite.models.source import ModelSource, resolve_model

PKG = Path(__file__).resolve().parents[2] / "swiftlite"
#: Modules that own the answer: the presets table and ModelSource.
OWNERS = {"models/presets.py", "models/source.py"}
#: Modules that name "config.json" for something other than --model, each with why.
CONFIG_JSON_ELSEWHERE = {
    "hf_io.py": "writes an exported or checkpointed model folder's config.json",
    "export/source.py": "tells a checkpoint's HF folder (model/) and an HF export input from other forms",
    "export/verify.py": "re-reads the config.json export has just written",
    "rlhf/vllm_gen.py": "writes the policy's config.json for the vLLM engine it builds (no weights, no --model)",
    "export/quantize.py": "adds the quantization_config to the config.json of the export it quantizes",
    "export/fp8.py": "adds the FP8 quantization_config to the config.json of the export it quantizes",
}
REPO = "acme/tiny-llama-like"


def _uses(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name == "get_preset":
                out.append((node.lineno, "get_preset("))
        elif isinstance(node, ast.Constant) and node.value == "config.json":
            out.append((node.lineno, '"config.json"'))
    return out


def test_only_model_source_answers_what_model_is():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel in OWNERS:
            continue
        for line, what in _uses(ast.parse(path.read_text(encoding="utf-8"))):
            if what == '"config.json"' and rel in CONFIG_JSON_ELSEWHERE:
                continue
            found.append(f"swiftlite/{rel}:{line}: {what}")
    assert found == [], "use resolve_model(arg).<method> (models/source.py): " + "; ".join(found)


def test_the_check_sees_both_kinds_of_use():
    src = 'from x import get_preset\np = get_preset("a")\nq = d / "config.json"\nmsg = "see config.json"\n'
    assert _uses(ast.parse(src)) == [(2, "get_preset("), (3, '"config.json"')]


# -- the facts, for each kind of source -------------------------------------------------------------

def test_preset():
    src = resolve_model("TINY-LLAMA")
    assert (src.kind, src.name, src.hub_id) == ("preset", "TINY-LLAMA", None)
    assert src.config_dict() == PRESETS["tiny-llama"].config
    assert src.config().model_type == "llama"
    assert src.shape().n_params == param_count(PRESETS["tiny-llama"].config)
    src.check_folder()                  # nothing to check
    assert src.snapshot() is src        # nothing to download


def test_preset_with_hub_id_is_a_hub_model_read_offline():
    src = resolve_model("llama-8b")
    assert (src.kind, src.hub_id) == ("hub", PRESETS["llama-8b"].hub_id)
    assert src.shape().n_params == param_count(PRESETS["llama-8b"].config)   # from the preset, no network


def _folder(tmp_path, conf, weights=True):
    (tmp_path / "config.json").write_text(json.dumps(conf) if isinstance(conf, dict) else conf)
    if weights:
        (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def test_folder(tmp_path):
    conf = PRESETS["tiny-llama-2l"].config
    src = resolve_model(str(_folder(tmp_path, conf)))
    assert (src.kind, src.ref, src.hub_id) == ("folder", str(tmp_path), None)
    assert src.config_dict() == conf
    assert src.config().num_hidden_layers == conf["num_hidden_layers"]
    assert src.shape().n_params == param_count(conf)
    src.check_folder()


@pytest.mark.parametrize("conf, weights, words", [
    ("{oops", True, ["config.json:1:2: invalid JSON"]),
    ("[1, 2]", True, ["must hold a JSON object"]),
    ({"model_type": "llama"}, False, ["folder has config.json but no weights"]),
    ({"model_type": "not-a-real-arch", "auto_map": {}}, True, ["not-a-real-arch", "--trust-remote-code"]),
])
def test_folder_refusals(tmp_path, conf, weights, words):
    src = resolve_model(str(_folder(tmp_path, conf, weights)))
    with pytest.raises(UserError) as e:
        src.check_folder()
    assert str(e.value).startswith(f"--model {tmp_path}: ")
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("arg, words", [
    ("./models/nope", "--model ./models/nope: model folder not found"),
    ("tiny-lama", "--model tiny-lama: unknown preset (did you mean tiny-llama?"),
])
def test_missing_folder_and_unknown_preset(arg, words):
    with pytest.raises(UserError) as e:
        resolve_model(arg)
    assert words in str(e.value)


def test_folder_without_config_and_a_file(tmp_path):
    with pytest.raises(UserError, match="folder has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(UserError, match="is a file; pass the model folder"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_a_preset_wins_over_a_folder_of_its_name(tmp_path, monkeypatch):
    """The one precedence (resolve_model's docstring), infer included."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-llama").mkdir()
    assert resolve_model("tiny-llama").kind == "preset"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """REPO in a huggingface_hub cache of its own (config and an empty weights file), the hub offline
    (as tests/unit/test_job_facts.py)."""
    import huggingface_hub.constants as hub
    cache = tmp_path / "hub"
    snap = cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(PRESETS["tiny-llama-2l"].config))
    (snap / "model.safetensors").write_bytes(b"")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_hub_id(hub_cache):
    src = resolve_model(REPO)
    assert (src.kind, src.ref, src.hub_id) == ("hub", REPO, REPO)
    assert src.config_dict() is None                      # only with the hub client
    with pytest.raises(UserError, match="never downloads"):
        src.shape()                                       # estimate: offline
    assert src.shape(offline=False).n_params == param_count(PRESETS["tiny-llama-2l"].config)
    assert src.config().model_type == "llama"
    snap = src.snapshot()
    assert (snap.kind, Path(snap.ref), snap.hub_id, snap.name) == ("folder", hub_cache, REPO, REPO)
    assert snap.config_dict() == PRESETS["tiny-llama-2l"].config
    snap.check_folder()


def test_built_directly_it_names_its_reference():
    assert ModelSource("folder", "/m").name == "/m"
