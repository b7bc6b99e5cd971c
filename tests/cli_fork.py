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
warnings they print the first time were printed then. So a command is forked only from a helper whose
variables a library may read at import (`IMPORT_TIME_PREFIXES`) are the command's: a worker starts one helper
per distinct set of them (the fault tests' HF_HUB_OFFLINE=1, ...), up to MAX_HELPERS. A command that sets
allocator or loader variables (a memory measurement), or whose test asks for a fresh interpreter, gets one
(`run_cli`'s subprocess); SWIFTLITE_TEST_SUBPROCESS=1 sends every command to a real interpreter,
SWIFTLITE_TEST_FORK=0 those that would be forked.

Several commands may run at once (`start`: the nodes of a two-node run, a rollout server and the run that uses
it): the helper answers each request with the child's pid at once and reports each exit when it happens.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
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
#: modes, accelerators, loggers): a command is forked only from a helper whose values of these are its own.
IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "HF_", "HUGGINGFACE", "TRANSFORMERS_",
                        "TORCH", "PYTORCH_", "DS_", "CUDA", "NCCL_", "LD_", "MODELSCOPE", "DATASETS_",
                        "TOKENIZERS_", "MALLOC_", "BNB_", "MPL", "WANDB_", "ACCELERATE_")

#: Variables read when a process starts (the allocator, the dynamic loader, CUDA's caching allocator): a
#: command that sets one is a memory measurement or a loader setting and gets a fresh interpreter.
FRESH_PREFIXES = ("MALLOC_", "LD_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

#: Helpers one pytest worker keeps at most (one per distinct set of import-time values, ~0.5 GB each); a
#: command that would need another gets a fresh interpreter.
MAX_HELPERS = 3


def needs_fresh(env: dict[str, str]) -> bool:
    """True when a command with environment `env` must get a fresh interpreter whatever helpers run."""
    return (os.environ.get("SWIFTLITE_TEST_SUBPROCESS") == "1" or os.environ.get("SWIFTLITE_TEST_FORK") == "0"
            or any(k.startswith(FRESH_PREFIXES) for k in env))


#: Variables under those prefixes that no library reads at import: torch and DeepSpeed read the extension
#: folder when they build an op, torchrun's run id is for the ranks of one job.
RUNTIME_VARS = ("TORCH_EXTENSIONS_DIR", "TORCHELASTIC_RUN_ID")


def import_time_values(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(IMPORT_TIME_PREFIXES) and k not in RUNTIME_VARS))


def forkable(env: dict[str, str], base: dict[str, str]) -> bool:
    """True when a command with environment `env` may be forked from a helper started with `base`. A fault
    injected with SWIFTLITE_FAULT may: swiftlite/faults.py reads it when the trainer asks, not at import."""
    return not needs_fresh(env) and import_time_values(env) == import_time_values(base)


class Forked:
    """A forked command, as much of subprocess.Popen as the tests use: `pid` (also its process group: the
    child starts a session of its own), `poll`, `wait`, `communicate` (its output, read from the files it
    wrote once it has ended), `send_signal`/`terminate`/`kill` (the command's process) and `kill_group`."""

    def __init__(self, srv: ForkServer, pid: int, args: list[str], folder: Path | None):
        self.srv, self.pid, self.args, self._folder = srv, pid, args, folder   # folder: its output files
        self.returncode: int | None = None
        self._output: tuple[str, str] | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.srv._await(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.srv._await(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once the command has ended; stderr is "" when it was merged into stdout, both are
        "" when the output went to a log file."""
        self.wait(timeout)
        if self._output is None:
            self._output = ("", "")
            if self._folder is not None:
                out, err = self._folder / "stdout", self._folder / "stderr"
                self._output = tuple(p.read_text(errors="replace") if p.exists() else "" for p in (out, err))
                shutil.rmtree(self._folder, ignore_errors=True)
        return self._output

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_group(self) -> None:
        """SIGKILL to the command and every process it started (its session's process group)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ForkServer:
    """One helper interpreter; `run` forks a command from it and waits for it like subprocess.run."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.env = dict(env)
        # its own output (the libraries' import-time messages) goes to a file, read when it fails to start
        self.log = tempfile.NamedTemporaryFile(prefix="swiftlite-fork-helper-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_fork"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=self.env, cwd=cwd)
        self._buf = b""
        self._exits: dict[int, int] = {}   # exit codes the helper reported, by process id, not yet collected
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

    def _kept(self, line: str | None) -> bool:
        """True when `line` is an exit line ("rc PID CODE"), whose code is then kept for its handle."""
        if line is None or not line.startswith("rc "):
            return False
        _, pid, code = line.split()
        self._exits[int(pid)] = int(code)
        return True

    def _next(self, timeout: float | None) -> str | None:
        """The helper's next line about a start ("pid N"), keeping the exit lines that come before it; None
        when `timeout` (s) passes first."""
        while self._kept(line := self._line(timeout)):
            pass
        return line

    def _await(self, pid: int, timeout: float | None) -> int | None:
        """Command `pid`'s exit code, None when `timeout` (s) passes first."""
        end = None if timeout is None else time.monotonic() + timeout
        while pid not in self._exits:
            line = self._line(None if end is None else max(0.0, end - time.monotonic()))
            if line is None:
                return None
            self._kept(line)
        return self._exits.pop(pid)

    def start(self, args: list[str], env: dict[str, str], cwd: str | Path | None, merge_stderr: bool = False,
              log: Path | None = None, script: Path | None = None, procs: int = 1) -> Forked:
        """`python -m swiftlite ARGS` forked now (with `script`: that worker script on `procs` ranks, as
        torchrun runs it); the returned handle waits for it as a Popen does. With `log`, stdout and stderr
        both go to that file (communicate gives "" for both)."""
        d = None if log is not None else Path(tempfile.mkdtemp(prefix="swiftlite-fork-"))
        out = Path(log) if d is None else d / "stdout"
        err = out if merge_stderr or d is None else d / "stderr"
        req = {"args": args, "env": env, "cwd": str(cwd or os.getcwd()), "out": str(out), "err": str(err)}
        if script is not None:
            req.update(script=str(script), procs=procs)
        self.proc.stdin.write(json.dumps(req).encode() + b"\n")
        self.proc.stdin.flush()
        pid = self.last_pid = int(self._next(timeout=60).split()[1])
        cmd = [sys.executable, str(script), *args] if script is not None else [sys.executable, "-m", "swiftlite", *args]
        return Forked(self, pid, cmd, d)

    def run(self, args: list[str], env: dict[str, str], cwd: str | Path | None,
            timeout: float) -> subprocess.CompletedProcess:
        """As subprocess.run(capture_output=True, text=True, timeout=...) of the command; a timeout kills the
        command's process group (the ranks it started too)."""
        cmd = self.start(args, env, cwd)
        try:
            stdout, stderr = cmd.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            cmd.kill_group()
            stdout, stderr = cmd.communicate(timeout=60)
            raise subprocess.TimeoutExpired(cmd.args, timeout, output=stdout, stderr=stderr) from None
        return subprocess.CompletedProcess(cmd.args, cmd.returncode, stdout, stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


_SERVERS: dict[tuple[tuple[str, str], ...], ForkServer] = {}


def server(env: dict[str, str], base: dict[str, str] | None = None) -> ForkServer | None:
    """This process's helper for commands with `env`'s import-time values: started the first time with `base`
    (the tests' usual environment) but for those values, which are `env`'s; None where `env` needs a fresh
    interpreter (`needs_fresh`) or MAX_HELPERS already run for other values."""
    if needs_fresh(env):
        return None
    key = import_time_values(env)
    srv = _SERVERS.get(key)
    if srv is None:
        if len(_SERVERS) >= MAX_HELPERS:
            return None
        start_env = {k: v for k, v in (base or env).items() if not k.startswith(IMPORT_TIME_PREFIXES)}
        srv = _SERVERS[key] = ForkServer({**start_env, **dict(key)}, Path(__file__).resolve().parents[1])
        atexit.register(srv.close)
    return srv


def run(args: list[str], env: dict[str, str], base: dict[str, str], cwd: str | Path | None,
        timeout: float) -> subprocess.CompletedProcess | None:
    """`python -m swiftlite ARGS` forked from this process's helper for `env` (`server(env, base)`), waited
    for; None when the command must have a real interpreter."""
    srv = server(env, base)
    return None if srv is None else srv.run(args, env, cwd, timeout)


def start(args: list[str], env: dict[str, str], base: dict[str, str], cwd: str | Path | None,
          merge_stderr: bool = False, log: Path | None = None, script: Path | None = None,
          procs: int = 1) -> Forked | None:
    """`python -m swiftlite ARGS` (with `script`: that worker script on `procs` ranks) forked from this
    process's helper for `env` and left running (a node of a two-node run, a server); None when the command
    must have a real interpreter."""
    srv = server(env, base)
    return None if srv is None else srv.start(args, env, cwd, merge_stderr, log, script, procs)


# --- the helper interpreter ---------------------------------------------------------------------------


def _as_main(call) -> int:
    """`call()` as an interpreter's main: its exit code (a SystemExit's too), then what the interpreter does
    at exit (join the non-daemon threads, run the exit handlers)."""
    try:
        rc = call()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    import threading
    threading._shutdown()
    atexit._run_exitfuncs()
    return rc if isinstance(rc, int) else 1


def _flush_and_exit(rc: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # noqa: BLE001
            pass
    os._exit(rc)


def _ranks(req: dict) -> int:
    """A test's worker script as `python SCRIPT ARGS` runs it, or with "procs" N > 1 as `torchrun --standalone
    --nproc-per-node=N SCRIPT ARGS` does: N ranks forked here with torchrun's variables (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID), their output
    the command's; a rank that fails ends the others, as torchrun's default does. The exit code is the first
    failure's (1 for a signal), else 0."""
    import runpy
    import socket
    import uuid
    script = str(Path(req["script"]).resolve())
    sys.argv = [script, *req["args"]]
    sys.path[0] = str(Path(script).parent)   # `python SCRIPT` puts the script's folder first on the path

    def main() -> int:
        runpy.run_path(script, run_name="__main__")
        return 0

    procs = int(req.get("procs", 1))
    if procs == 1:
        return _as_main(main)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    world = {"WORLD_SIZE": str(procs), "LOCAL_WORLD_SIZE": str(procs), "GROUP_RANK": "0",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": uuid.uuid4().hex}
    ranks: dict[int, int] = {}
    for rank in range(procs):
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                os.environ.update(world, RANK=str(rank), LOCAL_RANK=str(rank))
                rc = _as_main(main)
            except BaseException:   # noqa: BLE001 - printed as the interpreter prints an uncaught exception
                import traceback
                traceback.print_exc()
            finally:
                _flush_and_exit(rc)
        ranks[pid] = rank
    rc = 0
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and rc == 0:
            rc = code if code > 0 else 1
            for other in ranks:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return rc


def _child(req: dict, wakeup: tuple[int, int]) -> None:
    """In the forked child: become `python -m swiftlite ARGS` (with "script": that worker script, on "procs"
    ranks) in the request's environment; never returns."""
    rc = 1
    try:
        os.setsid()   # its own process group: a timeout kills it and the ranks it forked
        signal.set_wakeup_fd(-1)   # the helper's child-exit wake-up is the helper's alone
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wakeup:
            os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)   # one open file for both where stderr is merged into stdout, as Popen's STDOUT
        os.dup2(out if req["err"] == req["out"] else
                os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        if req.get("script"):
            rc = _ranks(req)
        else:
            sys.path[0] = req["cwd"]    # `python -m` puts the working directory first on the path
            import swiftlite.__main__ as entry
            sys.argv = [entry.__file__, *req["args"]]
            from swiftlite.cli.main import main
            rc = _as_main(lambda: main(list(req["args"])))
    except BaseException:   # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        import traceback
        traceback.print_exc()
        rc = 1
    finally:
        _flush_and_exit(rc if isinstance(rc, int) else 1)


def _serve() -> None:
    """Import WARM, say "ready", then for each request line fork a command and answer "pid N"; when a command
    ends, "rc PID CODE" (several commands may run at once: two nodes, a server and its client)."""
    import importlib
    for name in WARM:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    wakeup = os.pipe()   # a child's exit (SIGCHLD) wakes the select below
    for fd in wakeup:
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wakeup[1])
    running: set[int] = set()
    buf = b""
    os.write(1, b"ready\n")
    while True:
        ready = select.select([0, wakeup[0]], [], [])[0]
        if wakeup[0] in ready:
            while True:
                try:
                    if not os.read(wakeup[0], 512):
                        break
                except BlockingIOError:
                    break
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            os.write(1, f"rc {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        if 0 not in ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:   # the tests are done: nothing forked outlives the helper
            for pid in running:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                _child(json.loads(line), wakeup)
            running.add(pid)
            os.write(1, f"pid {pid}\n".encode())


if __name__ == "__main__":
    _serve()
