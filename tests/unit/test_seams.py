"""The seams hold, checked from the source (issue 24): code outside `swiftlite/parallel/` uses an
engine only through the `Engine` Protocol (parallel/base.py `ENGINE_SURFACE`), and only
swiftlite/train/tasks.py switches on the command (`cfg.task == ...`).

Why from the source: a plugin backend that implements the documented Protocol must get the same
resume, `--nan-policy` and rlhf behaviour as a built-in one, and a task switch written anywhere else
is a task the task classes do not know about. Neither shows up as a failing run until a plugin or a
new task meets it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from swiftlite.parallel.base import ENGINE_SURFACE

PKG = Path(__file__).resolve().parents[2] / "swiftlite"
#: The attribute `parallel/torch_engine.autocast_forward` sets on a module: private to parallel/.
AUTOCAST_MARKER = "_swiftlite_autocast"


def _is_engine(node: ast.AST) -> bool:
    """An expression that names an engine: `engine`, `ds_engine`, `run.engine`, `self._engine`, ..."""
    if isinstance(node, ast.Name):
        return node.id == "engine" or node.id.endswith("_engine")
    if isinstance(node, ast.Attribute):
        return node.attr in ("engine", "_engine") or node.attr.endswith("_engine")
    return False


def engine_leaks(source: str) -> list[str]:
    """Every use of an engine attribute outside the Protocol in `source`, as 'line: what'."""
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_engine(node.value):
            if node.attr not in ENGINE_SURFACE and not node.attr.startswith("__"):
                out.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name, args = node.func.id, node.args
            if name in ("getattr", "hasattr", "setattr") and len(args) >= 2 and _is_engine(args[0]):
                for c in ast.walk(args[1]):  # a constant, or constants inside an expression
                    if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value not in ENGINE_SURFACE:
                        out.append(f"{node.lineno}: {name}(..., {c.value!r})")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "signature":
            if any(isinstance(a, ast.Attribute) and _is_engine(a.value) for a in node.args):
                out.append(f"{node.lineno}: inspects an engine method's signature")
        if isinstance(node, ast.Constant) and node.value == AUTOCAST_MARKER:
            out.append(f"{node.lineno}: reads the autocast marker")
    return out


def task_switches(source: str) -> list[str]:
    """Comparisons of a task name (`cfg.task == "sft"`, `task != "rlhf"`) in `source`, as 'line: ...'."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        if not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        for side in (node.left, *node.comparators):
            if (isinstance(side, ast.Attribute) and side.attr == "task") or \
                    (isinstance(side, ast.Name) and side.id == "task"):
                out.append(f"{node.lineno}: {ast.unparse(node)}")
                break
    return out


def _sources(skip: tuple[str, ...]) -> dict[str, str]:
    return {str(p.relative_to(PKG.parent)): p.read_text(encoding="utf-8") for p in sorted(PKG.rglob("*.py"))
            if not str(p.relative_to(PKG.parent)).startswith(skip)}


def test_the_checks_see_what_they_look_for():
    """Each pattern of today's leaks is found (so an empty result below means something)."""
    leaks = engine_leaks("def f(engine, run):\n"
                         "    engine.inner.x\n"
                         "    run.engine.ds_config\n"
                         "    getattr(engine, '_frozen_ok', False) or hasattr(engine, 'inner' if a else 'root')\n"
                         "    inspect.signature(engine.load)\n"
                         "    m.__dict__.get('_swiftlite_autocast')\n"
                         "    engine.load(p, model_only=True); engine.root(); engine.skips_nonfinite\n")
    assert sorted(int(x.split(":")[0]) for x in leaks) == [2, 3, 4, 4, 5, 6]
    assert len(task_switches("a = cfg.task == 'sft'\nb = task != 'pt'\nc = cfg.task\nd = x == 'sft'\n")) == 2


def test_no_engine_internals_outside_parallel():
    # swiftlite/msswift_api mirrors ms-swift's plugin API, whose `engine` is an inference engine
    # (TransformersEngine.infer), not the training Engine of this seam
    found = {path: leaks for path, src in _sources(("swiftlite/parallel/", "swiftlite/msswift_api/")).items()
             if (leaks := engine_leaks(src))}
    assert found == {}


#: Task switches left where they are, by file: how many. Both files were being changed by others
#: when the switches went; each needs one import and one line (`task_spec(cfg.task)` from
#: config/tasks.py: `.needs_chat_template` in load_tokenizer, which also makes rlhf refuse a tokenizer
#: without a chat template; `.sequences_per_sample` in workload_from_config). Remove the entry then.
KNOWN_SWITCHES: dict[str, int] = {}


def test_no_task_switch_outside_the_task_module():
    found = {path: hits for path, src in _sources(("swiftlite/train/tasks.py",)).items()
             if (hits := task_switches(src)) and len(hits) != KNOWN_SWITCHES.get(path)}
    assert found == {}
