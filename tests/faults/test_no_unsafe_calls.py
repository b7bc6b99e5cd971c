"""No shell strings, no os.system, no unpickling outside the allow-listed safe paths.

Checked on the syntax tree of every module of the package (so docstrings and comments that
*describe* these calls do not count)."""

import ast
from pathlib import Path

import swiftlite

PKG = Path(swiftlite.__file__).parent

FORBIDDEN_CALLS = {  # dotted callee -> why
    "os.system": "runs a shell", "os.popen": "runs a shell", "subprocess.getoutput": "runs a shell",
    "subprocess.getstatusoutput": "runs a shell", "pickle.load": "unpickles untrusted bytes",
    "pickle.loads": "unpickles untrusted bytes", "marshal.loads": "untrusted code objects",
    "yaml.load": "yaml.load can build objects: use yaml.safe_load", "yaml.unsafe_load": "builds objects",
    "eval": "evaluates strings", "exec": "executes strings", "os.execv": "replaces the process",
    "os.execvp": "replaces the process", "os.execl": "replaces the process",
}
FORBIDDEN_KEYWORDS = {  # keyword=True/False constant -> why
    ("shell", True): "a shell string", ("allow_pickle", True): "numpy pickles",
    ("trust_remote_code", True): "runs a model folder's code", ("weights_only", False): "full unpickling",
}
ALLOWED_IMPORTS_OF = {"pickle": {"checkpoint/safety.py"}}  # only the allow-list unpickler imports pickle


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(PKG).as_posix(), ast.parse(path.read_text(), filename=str(path))


def test_no_forbidden_calls_or_keywords():
    hits = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _dotted(node.func)
                if name in FORBIDDEN_CALLS:
                    hits.append(f"{rel}:{node.lineno}: {name}() ({FORBIDDEN_CALLS[name]})")
                for kw in node.keywords:
                    if isinstance(kw.value, ast.Constant) and (kw.arg, kw.value.value) in FORBIDDEN_KEYWORDS:
                        hits.append(f"{rel}:{node.lineno}: {kw.arg}={kw.value.value} "
                                    f"({FORBIDDEN_KEYWORDS[(kw.arg, kw.value.value)]})")
    assert not hits, "unsafe calls:\n" + "\n".join(hits)


def test_every_torch_load_is_weights_only():
    hits = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _dotted(node.func) == "torch.load":
                ok = any(kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True
                         for kw in node.keywords)
                if not ok:
                    hits.append(f"{rel}:{node.lineno}")
    assert not hits, "torch.load without weights_only=True: " + ", ".join(hits)


def test_pickle_is_imported_only_by_the_allow_list_unpickler():
    hits = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                if n in ALLOWED_IMPORTS_OF and rel not in ALLOWED_IMPORTS_OF[n]:
                    hits.append(f"{rel}:{node.lineno}: import {n}")
    assert not hits, hits


def test_the_checker_catches_what_it_should(tmp_path):
    """The AST walk itself: a module with each forbidden form is flagged."""
    src = ("import os, subprocess, torch, pickle\nos.system('x')\nsubprocess.run('x', shell=True)\n"
           "torch.load('f')\npickle.loads(b'')\neval('1')\n")
    tree = ast.parse(src)
    calls = {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert {"os.system", "pickle.loads", "eval", "torch.load"} <= calls
    kws = {(k.arg, k.value.value) for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords}
    assert ("shell", True) in kws


def test_trust_remote_code_is_off_by_default():
    from swiftlite.config import RunConfig, field_specs
    assert RunConfig().model.trust_remote_code is False
    assert field_specs()["trust_remote_code"].default is False
