"""`python -m swiftlite ARGS` as a process forked from a warm interpreter: the tests' launch of a command
that needs a process of its own (ranks, DeepSpeed, a platform's world) without paying the imports again.

A fresh interpreter spends about 5 s of this 2-core class of machine importing torch, transformers, peft
and DeepSpeed before a tiny run does 2-3 s of work, and the suite starts a few hundred of them. Each pytest
worker starts one helper interpreter (`python -m tests.cli_fork`) that imports those libraries and then only
forks: each command is a child of it, in a session of its own, with the command's environment, working
directory, argv and output files, run as `python -m swiftlite` runs it (`swiftlite.cli.main`, non-daemon
threads joined and exit handlers run before it ends). This is what swiftlite's own launcher does for ranks
(launch/fork.py): the helper imports and never computes, so a fork inherits no thread pool.

What a fork cannot give is a fresh import: modules were imported with the helper's environment, and the
warnings they print the first time were printed then. So `forkable` sends a command to a real interpreter
(`run_cli`'s subprocess) when its environment differs from the helper's in a variable a library may read at
import, when it sets allocator variables (a memory measurement), injects a fault, or when the test asks for
its own process; SWIFTLITE_TEST_SUBPROCESS=1 sends every command to a real interpreter, SWIFTLITE_TEST_FORK=0
those that would be forked.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Imported by the helper before it forks anything: what a training, export or launch command imports.
WARM = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
        "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
        "transformers.models.qwen2.modeling_qwen2", "peft", "deepspeed", "swiftlite.cli.main",
        "swiftlite.launch.fork", "swiftlite.train.loop", "swiftlite.parallel.torch_engine",
        # the end-of-run charts' (swiftlite/metrics.plot_run): ~0.6 s a command otherwise; importing pyplot
        # chooses no backend (the product sets Agg before its first figure)
        "matplotlib", "matplotlib.pyplot", "matplotlib.ticker")

#: Variables whose prefix marks them as possibly read when a library is imported (thread pools, caches, hub
#: modes, accelerators, loggers): a command whose environment differs from the helper's in one of them runs
#: in a real interpreter.
IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "HF_", "HUGGINGFACE", "TRANSFORMERS_",
                        "TORCH", "PYTORCH_", "DS_", "CUDA", "NCCL_", "LD_", "MODELSCOPE", "DATASETS_",
                        "TOKENIZERS_", "MALLOC_", "BNB_", "MPL", "WANDB_", "ACCELERATE_")


def forkable(env: dict[str, str], base: dict[str, str]) -> bool:
    """True when a command with environment `env` may be forked from a helper started with `base`."""
    if (os.environ.get("SWIFTLITE_TEST_SUBPROCESS") == "1" or os.environ.get("SWIFTLITE_TEST_FORK") == "0"
            or env.get("SWIFTLITE_FAULT")):
        return False
    keys = {k for k in (*env, *base) if k.startswith(IMPORT_TIME_PREFIXES)}
    return all(env.get(k) == base.get(k) for k in keys)


class ForkServer:
    """One helper interpreter; `run` forks a command from it and waits for it like subprocess.run."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.env = dict(env)
        # its own output (the libraries' import-time messages) goes to a file, read when it fails to start
        self.log = tempfile.NamedTemporaryFile(prefix="swiftlite-fork-helper-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_fork"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=self.env, cwd=cwd)
        self._buf = b""
        self.last_pid: int | None = None   # the last command's process (and process group)
        try:
            ready = self._line(timeout=300)
        except RuntimeError:
            ready = None
        if ready != "ready":
            raise RuntimeError(f"the fork helper did not start ({ready!r}):\n"
                               f"{Path(self.log.name).read_text(errors='replace')[-4000:]}")

    def _line(self, timeout: float | None) -> str | None:
        """The helper's next line, None when `timeout` (s) passes first."""
        end = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the fork helper ended (exit {self.proc.wait()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def run(self, args: list[str], env: dict[str, str], cwd: str | Path | None,
            timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="swiftlite-fork-") as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            req = {"args": args, "env": env, "cwd": str(cwd or os.getcwd()), "out": str(out), "err": str(err)}
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            pid = self.last_pid = int(self._line(timeout=60).split()[1])
            status = self._line(timeout=timeout)
            timed_out = status is None
            if timed_out:   # as subprocess.run's timeout, and the ranks the command started too
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                status = self._line(timeout=60)
            rc = int(status.split()[1])
            stdout, stderr = (p.read_text(errors="replace") if p.exists() else "" for p in (out, err))
        cmd = [sys.executable, "-m", "swiftlite", *args]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, rc, stdout, stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


_SERVER: ForkServer | None = None


def server(base: dict[str, str]) -> ForkServer | None:
    """This process's helper, started with environment `base` the first time; None where nothing is forked
    (SWIFTLITE_TEST_SUBPROCESS=1, SWIFTLITE_TEST_FORK=0)."""
    global _SERVER
    if _SERVER is None:
        if not forkable(base, base):
            return None
        _SERVER = ForkServer(base, Path(__file__).resolve().parents[1])
        atexit.register(_SERVER.close)
    return _SERVER


def run(args: list[str], env: dict[str, str], base: dict[str, str], cwd: str | Path | None,
        timeout: float) -> subprocess.CompletedProcess | None:
    """`python -m swiftlite ARGS` forked from this process's helper (`server(base)`); None when the command
    must have a real interpreter (`forkable`)."""
    srv = server(base)
    if srv is None or not forkable(env, srv.env):
        return None
    return srv.run(args, env, cwd, timeout)


# --- the helper interpreter ---------------------------------------------------------------------------


def _child(req: dict) -> None:
    """In the forked child: become `python -m swiftlite ARGS` in the request's environment; never returns."""
    rc = 1
    try:
        os.setsid()   # its own process group: a timeout kills it and the ranks it forked
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, req["out"]), (2, req["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.path[0] = req["cwd"]    # `python -m` puts the working directory first on the path
        import swiftlite.__main__ as entry
        sys.argv = [entry.__file__, *req["args"]]
        from swiftlite.cli.main import main
        try:
            rc = main(list(req["args"]))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        import threading
        threading._shutdown()   # what the interpreter does at exit: join the non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:   # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        import traceback
        traceback.print_exc()
        rc = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:   # noqa: BLE001
                pass
        os._exit(rc if isinstance(rc, int) else 1)


def _serve() -> None:
    import importlib
    for name in WARM:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    buf = b""
    os.write(1, b"ready\n")
    while True:
        while b"\n" not in buf:
            chunk = os.read(0, 65536)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        os.write(1, f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(1, f"rc {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    _serve()
