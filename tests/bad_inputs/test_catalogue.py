"""Every bad input gets one line (one per mistake when several), exit code 2, no traceback, and leaves nothing behind (bad_input_cases.py)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bad_input_cases import CASES, Case

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RUN_COMMANDS = ("sft", "pt")


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under `folder` with its size and mtime (folders: 0 and mtime)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


def base_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE",
                        "NNODES", "NODE_RANK", "SWIFTLITE_FAULT", "SWIFTLITE_PREFLIGHT_DONE",
                        "TORCHELASTIC_RUN_ID")}
    env.update({"SWIFTLITE_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    return env


class Zygote:
    """The forking runner (_zygote.py): imports once, one forked child per case."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-u", str(HERE / "_zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> tuple[int, str, str]:
        out, err = cwd.parent / f"{cwd.name}.out", cwd.parent / f"{cwd.name}.err"
        req = {"argv": argv, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            raise AssertionError(f"case did not finish within {timeout} s: {argv}")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the case runner died: {err.read_text() if err.exists() else ''}")
        return json.loads(line)["rc"], out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from swiftlite.demo import write_demo_data
    root = tmp_path_factory.mktemp("bad_inputs")
    write_demo_data(root / "_data", n_train=200, n_val=20)
    env = base_env(root / "_cache")
    z = Zygote(env)
    yield root, env, z
    z.close()


def fill(s: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        s = s.replace("{" + k + "}", v)
    return s


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(reason=c.xfail)) if c.xfail else c
                                  for c in CASES], ids=[c.id for c in CASES])
def test_bad_input(case: Case, workspace) -> None:
    root, env, zygote = workspace
    d = root / case.id
    shutil.copytree(root / "_data", d / "data")
    if case.setup:
        case.setup(d)
    argv = list(case.argv)
    if not case.script and argv[0] in RUN_COMMANDS and not any(a.startswith(("--output-dir", "--output_dir")) for a in argv):
        argv += ["--output-dir", "out"]
    out_dir_existed = (d / "out").exists()
    with (case.holds(d) if case.holds else contextlib.nullcontext()) as held:
        values = {"port": str(held.port)} if held is not None and hasattr(held, "port") else {}
        argv = [fill(a, values) for a in argv]
        expect = fill(case.expect, values)
        before = snapshot(d)
        run_env = {**env, **case.env}
        if case.script:
            run_env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + run_env.get("PATH", "")
            r = subprocess.run(["bash", str(ROOT / case.script), *argv], cwd=d, env=run_env,
                               capture_output=True, text=True, timeout=120)
            rc, stdout, stderr = r.returncode, r.stdout, r.stderr
        elif case.real:
            r = subprocess.run([sys.executable, "-m", "swiftlite", *argv], cwd=d, env=run_env,
                               capture_output=True, text=True, timeout=120)
            rc, stdout, stderr = r.returncode, r.stdout, r.stderr
        else:
            rc, stdout, stderr = zygote.run(argv, d, run_env)
    after = snapshot(d)
    shown = f"argv={argv}\nrc={rc}\nstderr:\n{stderr}\nstdout:\n{stdout[-2000:]}"
    assert "Traceback" not in stderr and "Traceback" not in stdout, shown
    lines = stderr.splitlines()
    assert len(lines) == 1 + len(case.more) and lines[0].strip(), \
        f"stderr must be exactly {1 + len(case.more)} line(s), one per mistake\n{shown}"
    assert expect in lines[0], f"expected {expect!r} in the error\n{shown}"
    for want, line in zip(case.more, lines[1:]):
        assert want in line, f"expected {want!r} in {line!r}\n{shown}"
    assert all(line.startswith("error: ") for line in lines), shown
    assert rc == 2, shown
    assert (d / "out").exists() == out_dir_existed, f"output folder created\n{shown}"
    assert before == after, f"files changed: {sorted(set(before) ^ set(after)) or 'modified'}\n{shown}"
    assert not (d / "REMOTE_CODE_RAN").exists(), "the model folder's own code ran"


def test_catalogue_covers_every_command() -> None:
    """The catalogue spans the commands, config files, DeepSpeed configs and recipe flags."""
    firsts = {c.argv[0] for c in CASES if not c.script}
    assert {"sft", "pt", "estimate", "models"} <= firsts
    ids = {c.id.split("-")[0] for c in CASES}
    assert {"config", "ds", "recipe"} <= ids
    assert len(CASES) >= 30
