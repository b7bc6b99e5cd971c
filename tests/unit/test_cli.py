"""The command line's own habits: the command table, --version, -h, bare `swiftlite`, the sft/pt help
text, and light imports for --help."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from swiftlite.cli import main

ROOT = Path(__file__).resolve().parents[2]
cli_main = importlib.import_module("swiftlite.cli.main")  # the module (swiftlite.cli.main is the function)


def test_version(capsys):
    from importlib.metadata import PackageNotFoundError, version

    import swiftlite
    try:
        expected = version("swiftlite")
    except PackageNotFoundError:
        expected = swiftlite.__version__
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"swiftlite {expected}\n"


def test_short_help_is_help(capsys):
    assert main(["-h"]) == 0
    short = capsys.readouterr()
    assert main(["--help"]) == 0
    assert short.out == capsys.readouterr().out and "Usage: swiftlite" in short.out and not short.err
    assert main(["export", "-h"]) == 0
    assert "--max-shard-size" in capsys.readouterr().out
    assert main(["sft", "-h"]) == 0
    assert capsys.readouterr().out.startswith("Usage: swiftlite sft [OPTIONS]")


def test_bare_command_prints_help_and_succeeds(capsys):
    assert main([]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Usage: swiftlite") and "Commands:" in out.out
    assert out.err == ""


def test_run_help_shows_zero_defaults_and_choices():
    from swiftlite.cli.run_flags import run_help
    lines = {ln.split()[0]: ln for ln in run_help("sft").splitlines() if ln.startswith("  --")}
    assert "[default: 0]" in lines["--warmup-steps"]
    assert "[default: 0.0]" in lines["--warmup-ratio"]
    assert "[choices: full, lora, qlora, longlora, boft, adalora, bone, llamapro, adapter]" in lines["--train-type"] and "[default: lora]" in lines["--train-type"]
    assert "[choices:" in lines["--torch-dtype"] and "fp32" in lines["--torch-dtype"]
    assert "[default:" not in lines["--template"]  # None: nothing to show
    assert "[default: False]" not in run_help("pt")  # an off switch shows no default


def test_every_table_entry_is_a_command_and_in_help(capsys):
    assert list(cli_main.click_command().commands) == list(cli_main.COMMANDS)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli_main.COMMANDS:
        assert f"\n  {name} " in out


@pytest.mark.parametrize("name", [n for n in cli_main.COMMANDS])
def test_every_command_answers_help(name, capsys):
    """`swiftlite NAME --help` prints the command's usage and exits 0 (a command that parses its own
    argv, as rollout's refusal table does, must still let --help through)."""
    code = main([name, "--help"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"swiftlite {name}" in out.out + out.err


def test_missing_command_module_is_an_import_error(monkeypatch):
    """A table entry whose module is missing fails loudly; it is never silently left out."""
    monkeypatch.setitem(cli_main.COMMANDS, "ghost", "swiftlite.cli.no_such_module:ghost_cmd")
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        cli_main.build_app()
    monkeypatch.setitem(cli_main.COMMANDS, "ghost", "swiftlite.cli.export:no_such_function")
    with pytest.raises(ImportError, match="no_such_function"):
        cli_main.build_app()


def test_table_and_app_must_agree(monkeypatch):
    import typer
    app = typer.Typer()
    app.command("sft")(lambda: None)
    with pytest.raises(RuntimeError, match="differ from COMMANDS"):
        cli_main.check_commands(typer.main.get_command(app))
    app.command("pt")(lambda: None)
    with pytest.raises(RuntimeError, match="differ from COMMANDS"):
        cli_main.check_commands(typer.main.get_command(app))


def test_help_imports_nothing_heavy():
    """--help of every command imports no torch/transformers; sft/pt skip even Typer."""
    code = ("import sys\n"
            "from swiftlite.cli import main\n"
            "assert main(['sft', '--help']) == 0 and main(['pt', '--help']) == 0\n"
            "assert 'typer' not in sys.modules, 'the sft fast path imported typer'\n"
            "for cmd in ('models', 'estimate', 'export', 'infer', 'bench'):\n"
            "    assert main([cmd, '--help']) == 0\n"
            "assert main(['--help']) == 0 and main([]) == 0\n"
            "heavy = [m for m in ('torch', 'transformers', 'peft', 'deepspeed') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_torchrun_module_name_still_runs_the_launcher():
    """plan_launch runs `python -m swiftlite.torchrun`: that module is the launch/torchrun.py entry."""
    from swiftlite import torchrun
    from swiftlite.launch import torchrun as launch_torchrun
    assert torchrun.main is launch_torchrun.main
