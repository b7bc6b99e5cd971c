"""The `swiftlite` command line (`cli/main.py`: the command table and the entry point).

- `main.py`: COMMANDS (name -> "module:function"), the Typer app built from it, the error funnel,
  the sft/pt fast path.
- `run_flags.py`: sft/pt flags and `--help`, generated from the config fields.
- `train.py`: sft/pt (check, then --dry-run plan, launch, or train here).
- `export.py`, `infer.py`, `bench.py`, `estimate.py` (also `models`): the other commands' flags.

`swiftlite.cli.main` is the entry-point function (it hides the submodule of the same name; reach
the module with `importlib.import_module("swiftlite.cli.main")`).
"""

from swiftlite.cli.main import main
from swiftlite.cli.run_flags import parse_run_args

__all__ = ["main", "parse_run_args"]
