"""What an ms-swift plugin file's `swift.*` imports mean while swiftlite runs it (`--external_plugins`).

ms-swift's own example plugins (examples/train/grpo/plugin/gsm8k/gsm8k_plugin.py, plugin.py, ...) begin
with `from swift.rewards import ORM, orms` and register their rewards in that `orms`. swiftlite's reward
registry has the same shape (swiftlite.plugin: `ORM(args)`, `__call__(completions, **columns)`,
`orms[name] = cls`), so while a plugin file runs, `swift.rewards` (and `swift.rewards.orm`) *is*
swiftlite.plugin: such a file runs unedited and its rewards land where `--reward_funcs` looks. The other
parts of ms-swift that plugin files import for their rewards and reward-model plugins (inference
engines, templates, the reward-model plugin registry, swift.utils, and the scheduler and gym registries
they may also register into) are swiftlite.msswift_api's modules (ALIASES; that package says what each
implements).

Any other `swift.*` module a plugin imports (model registrations, ms-swift's template registry, ...) fails
to import as it would without ms-swift, and the loader turns that into one line naming the import and
what to do instead (`plugin_import_error`). The aliases exist only while a plugin's code runs: while its
file executes, and around each call swiftlite makes into what it registered (building and calling a
reward or reward-model plugin: `msswift_aliases`), so an import inside a function body resolves as at
the top. Outside those blocks they are taken out of `sys.modules`, so an installed ms-swift is neither
shadowed for other code nor used by the plugin (its registrations would land in ms-swift's registry,
where this run never looks: a reward that silently does not exist). An import inside a function of a
module that has no counterpart here is refused before launch with its line (`deferred_import_error`).
"""

from __future__ import annotations

import ast
import contextlib
import re
import sys
import types
from pathlib import Path
from typing import Iterator

#: ms-swift module -> the swiftlite module that stands for it while a plugin's code runs
ALIASES = {"swift.rewards": "swiftlite.plugin", "swift.rewards.orm": "swiftlite.plugin",
           "swift.rewards.rm_plugin": "swiftlite.msswift_api.rm_plugin",
           "swift.infer_engine": "swiftlite.msswift_api.engine",
           "swift.infer_engine.protocol": "swiftlite.msswift_api.protocol",
           "swift.template": "swiftlite.msswift_api.template",
           "swift.utils": "swiftlite.msswift_api.utils",
           "swift.rollout.multi_turn": "swiftlite.msswift_api.rollout",
           "swift.rollout.gym_env": "swiftlite.msswift_api.gym_env",
           "swift.dataset": "swiftlite.msswift_api.dataset"}

#: the list a refusal gives of what a plugin file can import
AVAILABLE = ("of ms-swift, plugin files here can import swift.rewards (ORM, AsyncORM, orms, rm_plugins), "
             "swift.rewards.rm_plugin, swift.infer_engine (TransformersEngine, RequestConfig), swift.template "
             "(Template), swift.utils (get_logger, to_device), swift.dataset (register_dataset, DatasetMeta, "
             "RowPreprocessor, ResponsePreprocessor) and the scheduler and gym registries (swiftlite.msswift_api)")

#: What an ms-swift plugin file's other imports become here (the part of ms-swift a plugin uses -> swiftlite's).
PORTS = {
    "swift.rewards": "swift.rewards here is swiftlite.plugin, which has ORM, AsyncORM, orms and rm_plugins "
                     "(docs/rlhf.md); other reward kinds (PRM) are not available",
    "swift.template": "ms-swift's Python templates are not used: conversations are rendered with the tokenizer's "
                      "chat template (or --template FILE.jinja); drop the registration",
    "swift.model": "ms-swift's model registrations are not used: swiftlite reads the architecture from the model "
                   "folder's config.json; drop the registration",
}


class _SwiftParent(types.ModuleType):
    """The `swift` package a plugin sees: only the aliased submodules exist under it."""

    __path__: list[str] = []     # a package, so `import swift.rewards` looks for the submodule


@contextlib.contextmanager
def msswift_aliases() -> Iterator[None]:
    """`swift` and `swift.rewards` resolve to swiftlite's counterparts inside the block; sys.modules after
    the block is as before it (an installed ms-swift's entries are put back)."""
    import importlib
    names = ["swift", "swift.rollout", *ALIASES]
    saved = {n: sys.modules[n] for n in names if n in sys.modules}
    # an installed ms-swift's other submodules stay reachable through sys.modules only by their full
    # name; hide them too, so `from swift.utils import x` fails the same way with or without ms-swift
    hidden = {n: sys.modules.pop(n) for n in list(sys.modules) if n.startswith("swift.") and n not in ALIASES}
    parent = _SwiftParent("swift", "ms-swift's plugin-facing modules, as swiftlite provides them")
    sys.modules["swift"] = parent
    rollout = _SwiftParent("swift.rollout", "ms-swift's rollout registries")
    sys.modules["swift.rollout"] = rollout
    for name, target in ALIASES.items():
        mod = importlib.import_module(target)
        sys.modules[name] = mod
        head, _, tail = name.partition(".")[2].partition(".")
        if not tail:   # `import swift.utils` then `swift.utils.x`
            setattr(parent, head, mod)
    parent.rollout = rollout  # type: ignore[attr-defined]
    rollout.multi_turn = sys.modules["swift.rollout.multi_turn"]  # type: ignore[attr-defined]
    rollout.gym_env = sys.modules["swift.rollout.gym_env"]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)
        for n in [n for n in sys.modules if n.startswith("swift.")]:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
        sys.modules.update(hidden)


def plugin_import_error(given: str, path: Path, e: ImportError) -> str:
    """`--external_plugins p.py:LINE: import X failed (No module named 'swift.x'): what to change`."""
    import traceback
    line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__))
                 if Path(f.filename).resolve() == path.resolve()), None)
    text = ""
    if line is not None:
        try:
            text = path.read_text(encoding="utf-8").splitlines()[line - 1].strip()
        except (OSError, IndexError, UnicodeDecodeError):
            pass
    where = f"--external_plugins {given}" + (f":{line}" if line else "")
    what = f"`{text}` failed ({e})" if text else str(e)
    alias = next((k for k, v in ALIASES.items() if v == getattr(e, "name", None) and re.search(
        rf"(from|import)\s+{re.escape(k)}(\s|$)", text)), None)
    if alias is not None:   # a name this module's counterpart does not have (ImportError's text names a file)
        name = re.search(r"cannot import name '([^']+)'", str(e))
        what = f"`{text}` failed ({alias} here is {ALIASES[alias]}, which has no {name.group(1) if name else 'such name'})"
    missing = (getattr(e, "name", None) or "").split(".")[0]
    # `from swift.rewards import AsyncORM` fails naming swiftlite.plugin (the alias): still ms-swift's import
    if missing == "swift" or re.match(r"(from|import)\s+swift(\.|\s|$)", text):
        port = next((v for k, v in PORTS.items() if k in text), None)
        return (f"{where}: {what}: this ms-swift plugin imports a part of ms-swift swiftlite does not have; " +
                (port or f"{AVAILABLE}; a backend registers with swiftlite.parallel.base.register_backend"))
    if missing:
        return f"{where}: {what}: install {missing} in this environment, or remove the import"
    return f"{where}: {what}"


def deferred_import_error(given: str, path: Path) -> str | None:
    """One line for the first `import swift...` / `from swift... import` inside a function of the plugin
    file (the file has loaded; its top-level imports succeeded) that will not resolve when the function
    runs, or None. Such an import runs when what the plugin registered is built or called, in a rank,
    inside `msswift_aliases`: a module of ALIASES with the names imported resolves; any other part of
    ms-swift fails as it would at the top, so it is refused now, before launch."""
    import importlib
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError):
        return None     # it has just run; whatever made it unreadable now is not this check's to report
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(fn):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            mod = next((m for m in mods if m == "swift" or m.startswith("swift.")), None)
            if mod is None:
                continue
            if mod in ALIASES:
                target = importlib.import_module(ALIASES[mod])
                names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                missing = [n for n in names if n != "*" and not hasattr(target, n)]
                if not missing:
                    continue
                what = f"{mod} here ({ALIASES[mod]}) has no {', '.join(missing)}; {AVAILABLE}"
            else:
                what = next((v for k, v in PORTS.items() if mod.startswith(k)), AVAILABLE)
            return (f"--external_plugins {given}:{node.lineno}: `{ast.unparse(node)}` inside a function runs when "
                    f"it is called and would fail there; {what}")
    return None
