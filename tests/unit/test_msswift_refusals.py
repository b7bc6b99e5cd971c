"""Every option of ms-swift's argument dataclasses is a swiftlite flag or refused with its reason, never a
bare "unknown option"; one command line reports every refused flag at once; a suggestion only for a
misspelling. The names are a copy of ms-swift's (tests/unit/data/msswift_args_3602360a.json: its commit,
classes and transformers version in `_source`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from swiftlite.cli import parse_run_args
from swiftlite.config import field_specs, load_config
from swiftlite.config.load import alias_keys
from swiftlite.config.msswift import NO_MEANING
from swiftlite.config.msswift_unsupported import MSSWIFT_COMMIT, UNSUPPORTED, misspelling_of
from swiftlite.errors import UserError, UserErrors
from tests.conftest import cli_env, run_cli

NAMES = json.loads((Path(__file__).parent / "data" / "msswift_args_3602360a.json").read_text())
GRPO_ONLY = set(NAMES["grpo_only"])  # --rlhf_type grpo's own options: not this table's


def _error(argv: list[str]) -> str:
    try:
        parse_run_args(argv)
    except UserError as e:
        return str(e)
    return ""


def test_table_names_its_source():
    assert MSSWIFT_COMMIT.startswith("3602360a") and "3602360a56" in NAMES["_source"]


@pytest.mark.parametrize("command", ["sft", "pt", "rlhf"])
def test_every_msswift_option_is_a_flag_or_refused_with_a_reason(command):
    from swiftlite.config.msswift import APPENDS
    known = set(field_specs()) | set(alias_keys()) | set(NO_MEANING) | set(APPENDS)
    missing = []
    for name in NAMES[command]:
        if name in GRPO_ONLY or name.startswith("_"):
            continue
        msg = _error([f"--{name}", "1"])
        if "unknown option" in msg or (name not in known and name not in UNSUPPORTED):
            missing.append(f"--{name}: {msg or 'accepted but not in any table'}")
    assert not missing, "\n".join(missing)


def test_a_flag_shadows_its_refusal_row(monkeypatch):
    """An option implemented later is a field: the field wins over its row here (and over NO_MEANING)."""
    from swiftlite.config import msswift_unsupported
    monkeypatch.setitem(msswift_unsupported.UNSUPPORTED, "lora_rank", "refused")
    assert _error(["--lora_rank", "4"]) == ""
    assert load_config(None, {"dataset": ["d.jsonl"], "lora_rank": "4"}, validate_paths=False).lora.lora_rank == 4


def test_every_refusal_says_what_to_do():
    for name, why in UNSUPPORTED.items():
        says = ("--", "`", "drop the flag", "drop \n", "use ", "pass ", "set ", "rename", "add ", "upload", "hide ")
        assert len(why) > 30 and any(w in why for w in says), f"{name}: {why}"


def test_every_msswift_export_option_is_taken_or_refused_with_a_reason():
    from swiftlite.cli.export import refuse_msswift_options
    from swiftlite.cli.main import click_command
    export = click_command().commands["export"]
    taken = {o for p in export.params for o in p.opts}
    bare = []
    for name in NAMES["export"]:
        flag = f"--{name}"
        if flag in taken or name.startswith("_"):
            continue
        try:
            refuse_msswift_options([flag, "1"], taken)
        except UserError as e:
            assert str(e).startswith(flag + ": ") and len(str(e)) > len(flag) + 30, str(e)
        else:
            bare.append(flag)
    assert not bare, f"export options that would get click's bare 'No such option': {bare}"


def test_every_refused_flag_reported_at_once_in_order():
    with pytest.raises(UserErrors) as e:
        parse_run_args(["--dataset", "d.jsonl", "--galore_quantization", "--galore_proj_bits", "8", "--optim_target_modules", "x",
                        "--frobnicate", "3", "--lora_rnak", "4", "--use_ray", "true", "--lora-rank", "8"])
    lines = e.value.lines
    assert [ln.split(":")[0].split(" (")[0] for ln in lines] == [
        "--galore_quantization", "--galore_proj_bits", "--optim_target_modules", "unknown option --frobnicate",
        "unknown option --lora_rnak",
        "--use_ray"]
    assert "Q-GaLore" in lines[0] and "is not available" in lines[0] and "--use_galore true" in lines[0]
    assert lines[3] == "unknown option --frobnicate"                      # no suggestion: nothing alike
    assert lines[4] == "unknown option --lora_rnak (did you mean --lora_rank?)"


@pytest.mark.parametrize("flag", ["--use_galore", "--optimizer", "--agent_template", "--num_iterations",
                                  "--vllm_server_port", "--enable_channel_loss"])
def test_no_suggestion_of_a_flag_with_another_meaning(flag):
    """ms-swift's --use_galore is not a typo of --use_rslora, nor --optimizer of --optim."""
    msg = _error(["--dataset", "d.jsonl", flag, "1"])
    assert "did you mean" not in msg, msg
    names = [*field_specs(), *alias_keys(), *NO_MEANING]
    assert misspelling_of(flag, names) is None


def test_misspelling_suggests_the_flag():
    assert _error(["--learning_rat", "1e-4"]) == "unknown option --learning_rat (did you mean --learning_rate?)"


def test_config_file_keys_all_reported(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("dataset: [d.jsonl]\ngalore_quantization: true\nwarp_speed: 9\nmax_lenght: 5\n")
    with pytest.raises(UserErrors) as e:
        load_config(str(p), {}, validate_paths=False)
    assert e.value.lines[0].startswith(f"{p}: galore_quantization: Q-GaLore")
    assert e.value.lines[1] == f"{p}: unknown option 'warp_speed'"
    assert e.value.lines[2] == f"{p}: unknown option 'max_lenght' (did you mean 'max_length'?)"


def test_rlhf_types_not_implemented_say_so():
    """ms-swift's rlhf types that swiftlite lacks get their reason (an implemented one is a choice)."""
    from swiftlite.config.msswift import REFUSED_VALUES
    from swiftlite.config.schema import RLHF_TYPES
    missing = {"ppo": "PPO is not available", "gkd": "GKD"}   # rm is implemented (rlhf/rm.py)
    rows = {v for k, v in REFUSED_VALUES if k == "rlhf_type"}
    assert rows <= set(missing) and set(missing) - set(RLHF_TYPES) <= rows   # an implemented type has no row
    for value, expect in missing.items():
        msg = _error(["--rlhf_type", value])
        if value in RLHF_TYPES:
            assert msg == "", msg
        else:
            assert msg.startswith(f"--rlhf_type {value}: {expect}") and "--rlhf_type takes dpo" in msg, msg


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a process of its own (exit code, stderr as the user sees them), offline."""
    return run_cli(argv, cwd=cwd, env=cli_env(HF_HUB_OFFLINE="1"), check=False, timeout=120, own_process=True)


def test_cli_lists_every_refusal_one_line_each(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}, '
                                      '{"role": "assistant", "content": "b"}]}\n')
    r = _cli(["sft", "--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--galore_quantization", "true",
              "--enable_channel_loss", "true", "--frobnicate", "--output_dir", "out"], tmp_path)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 3 and all(ln.startswith("error: ") for ln in lines), r.stderr
    assert lines[0].startswith("error: --galore_quantization: Q-GaLore") and lines[1].startswith("error: --enable_channel_loss: channel losses")
    assert lines[2] == "error: unknown option --frobnicate"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]     # nothing written
    r = _cli(["export", "--ckpt", "out", "--push_to_hub", "true", "--hub_model_id", "me/m"], tmp_path)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 2, r.stderr
    assert lines[0] == ("error: --push_to_hub: nothing is uploaded: upload the exported folder yourself "
                        "(huggingface-cli upload REPO DIR)")


def test_custom_register_path_adds_plugin_files_after_external_plugins(tmp_path):
    """ms-swift's BaseArguments: external_plugins += custom_register_path, from flags and from a config file."""
    from swiftlite.cli import parse_run_args
    _, values = parse_run_args(["--dataset", "d.jsonl", "--custom_register_path", "b.py", "c.py",
                                "--external_plugins", "a.py"])
    assert values["external_plugins"] == ["a.py", "b.py", "c.py"]
    conf = tmp_path / "run.yaml"
    conf.write_text("dataset: [d.jsonl]\nexternal_plugins: [a.py]\ncustom_register_path: b.py\n")
    assert load_config(conf, {}, validate_paths=False).parallel.external_plugins == ["a.py", "b.py"]
