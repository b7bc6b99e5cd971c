"""The `swiftlite` command line: the command table, the error funnel, and the sft/pt/rlhf fast path.

COMMANDS is the CLI: one entry per command, `name -> "module:function"`. The function's signature
and docstring are its flags and help (Typer). The app is built from the table and checked against
it at start-up; a module that does not import is an ImportError with its traceback (a packaging
bug), never a command silently missing from `--help`.

`sft`, `pt` and `rlhf` parse their own flags (generated from the config fields, `cli/run_flags.py`):
`main` calls their function with the argv directly, without Typer, whose parameter machinery
costs ~0.3 s of start-up on every run and rank. Typer only lists them.

Errors: a UserError is one line on stderr, exit 2; so is a click usage error (unknown option,
bad value); `swiftlite ... | head` ends silently with 0. Heavy imports (torch, transformers)
happen inside commands, and Typer itself only off the fast path: `--help` is fast.
"""
# No `from __future__ import annotations`: the Typer functions built below take their annotations
# (typer.Context) from a local import, which a string annotation could not see.

import importlib
import sys
from typing import Any, Callable

from swiftlite.errors import UserError

HELP = "swiftlite: fine-tune LLMs with FSDP2, DeepSpeed ZeRO or DDP, and ship them."

#: Every command, in `--help` order: name -> "module:function".
COMMANDS = {
    "sft": "swiftlite.cli.train:sft",
    "pt": "swiftlite.cli.train:pt",
    "rlhf": "swiftlite.cli.train:rlhf",
    "models": "swiftlite.cli.estimate:models_cmd",
    "estimate": "swiftlite.cli.estimate:estimate_cmd",
    "export": "swiftlite.cli.export:export_cmd",
    "infer": "swiftlite.cli.infer:infer_cmd",
    "rollout": "swiftlite.cli.rollout:rollout_cmd",
    "deploy": "swiftlite.cli.rollout:deploy_cmd",
    "bench": "swiftlite.cli.bench:bench_cmd",
}
#: Commands whose function takes the raw argv (list[str]) and returns the exit code.
RAW_ARGV = ("sft", "pt", "rlhf")
_RAW_SETTINGS = {"context_settings": {"ignore_unknown_options": True, "allow_extra_args": True,
                                      "help_option_names": []},
                 "add_help_option": False}

_command = None  # the click command built from COMMANDS, once per process


def command_function(name: str) -> Callable[..., Any]:
    """The function COMMANDS names for `name` (its module imported; an import error propagates)."""
    ref = COMMANDS[name]
    module, _, attr = ref.partition(":")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ImportError(f"COMMANDS[{name!r}] = {ref!r}: {module} has no function {attr}")
    return fn


def version() -> str:
    """The installed distribution's version (swiftlite.__version__ when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("swiftlite")
    except PackageNotFoundError:
        from swiftlite import __version__
        return __version__


def _raw_argv_command(fn: Callable[[list[str]], int]) -> Callable[..., None]:
    """A Typer command that hands its argv, untouched, to `fn` (used when the app is called
    directly; `main` takes the fast path)."""
    import typer

    def command(ctx: typer.Context) -> None:
        raise typer.Exit(fn(list(ctx.args)))
    command.__doc__ = fn.__doc__
    return command


def build_app() -> Any:
    """The Typer app with every command of COMMANDS."""
    import typer

    def show_version(value: bool) -> None:
        if value:
            print(f"swiftlite {version()}")
            raise typer.Exit(0)

    app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, help=HELP,
                      context_settings={"help_option_names": ["-h", "--help"]})

    @app.callback()
    def _root(version_flag: bool = typer.Option(False, "--version", is_eager=True, callback=show_version,
                                                help="Print the version and exit.")) -> None:
        """swiftlite: fine-tune LLMs with FSDP2, DeepSpeed ZeRO or DDP, and ship them."""

    for name in COMMANDS:
        fn = command_function(name)
        # The command list shows each docstring's first line whole (click cuts it at 45 characters).
        short = {"short_help": (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else None}
        if name in RAW_ARGV:
            app.command(name, **_RAW_SETTINGS, **short)(_raw_argv_command(fn))
        else:
            app.command(name, **getattr(fn, "command_settings", {}), **short)(fn)
    return app


def check_commands(command: Any) -> None:
    """The commands of the parser built from the app are exactly the table's, in its order."""
    registered = list(getattr(command, "commands", None) or [command.name])
    if registered != list(COMMANDS):
        raise RuntimeError(f"the app's commands {registered} differ from COMMANDS {list(COMMANDS)}")


def click_command() -> Any:
    """The parser of the app (built and checked once per process)."""
    global _command
    if _command is None:
        import typer
        command = typer.main.get_command(build_app())
        check_commands(command)
        _command = command
    return _command


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line errors with exit code 2 for user mistakes, never a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in RAW_ARGV:
            return command_function(argv[0])(argv[1:])
        rc = click_command().main(args=argv or ["--help"], prog_name="swiftlite", standalone_mode=False)
    except UserError as e:
        for line in getattr(e, "lines", None) or [str(e)]:  # UserErrors: one line per mistake
            print(f"error: {line}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `swiftlite ... | head`: the reader left; say nothing more (and let the interpreter's final
        # flush of stdout go nowhere instead of raising again).
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        code = _click_exit_code(e)
        if code is None:
            raise  # a bug or an environment problem: keep the traceback
        return code
    return rc if isinstance(rc, int) else 0


def _click_exit_code(e: Exception) -> int | None:
    """The exit code of one of click's own exceptions (a usage error -- bad option value, unknown
    option or command -- is printed as one line, exit 2); None for any other exception."""
    if hasattr(e, "format_message") and hasattr(e, "exit_code"):
        if type(e).__name__ == "Exit":
            return e.exit_code
        if type(e).__name__ == "Abort":
            return 130
        print(f"error: {e.format_message()}", file=sys.stderr)
        return 2 if e.exit_code in (1, 2) else e.exit_code
    if type(e).__name__ == "Exit":
        return getattr(e, "exit_code", 0)
    return None


if __name__ == "__main__":
    sys.exit(main())
