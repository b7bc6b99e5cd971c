"""Run here, fork the ranks from here, or re-execute under torchrun / the DeepSpeed launcher.

Already inside a launcher (RANK and WORLD_SIZE set)? Run directly. Otherwise, with more than one
process asked for (--nproc-per-node / --nnodes or ms-swift's env vars):

- one node (`--launcher auto`, the default, or `fork`): the ranks are forked from this process by
  torch.multiprocessing (start method "fork") once the preflight is done. They inherit what the
  preflight already paid for: the imported torch / transformers / peft (3-5 s per interpreter on a
  small machine), the tokenizer and the tokenized data. torchrun would start a fresh interpreter
  per rank and import all of it again, all ranks at once.
- several nodes, an elastic rendezvous, or `--launcher torchrun`: the same command line runs again
  under `python -m torch.distributed.run`, as an argument list (never a shell string).
- `--launcher deepspeed`: the DeepSpeed launcher (hostfile runs).

A failed rank stops the job; each rank writes its error to <output_dir>/logs/rank<r>.err and the
launcher shows the first failing rank's error as one line.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from swiftlite.checkpoint.run_dir import check_output_dir  # noqa: F401 (preflight; importable from here)
from swiftlite.config import RunConfig
from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.parallel.base import BackendChoice


@dataclass(frozen=True)
class LaunchPlan:
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    command: list[str] | None  # the launcher to re-run under; None: this process runs or forks the ranks
    fork: bool = False         # fork the ranks of a one-node job from this process

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def inside_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(addr: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return True
    return False


def gpu_torch_build() -> bool:
    """Whether the installed torch is a CUDA or ROCm build, read from torch/version.py without
    importing torch. `--launcher auto` forks ranks only on CPU builds: a process that has touched
    CUDA cannot be forked safely, and GPU runs keep torchrun's fresh interpreters."""
    import importlib.util
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    try:
        text = (Path(spec.origin).parent / "version.py").read_text(encoding="utf-8")
    except OSError:
        return True  # unknown: take the launcher that is safe everywhere
    return bool(re.search(r"^(cuda|hip)\s*:.*=\s*['\"]", text, re.MULTILINE))


def plan_launch(cfg: RunConfig, argv: list[str]) -> LaunchPlan:
    """Decide how to start the job; `argv` is the swiftlite command line after the program name."""
    p = cfg.parallel
    nproc = p.nproc_per_node or 1
    nnodes = p.nnodes or 1
    node_rank = p.node_rank or 0
    addr = p.master_addr or "127.0.0.1"
    if inside_launcher() or nproc * nnodes == 1:
        return LaunchPlan(nproc, nnodes, node_rank, addr, p.master_port, None)
    port = p.master_port
    if port is None:
        if nnodes > 1:
            port = 29500  # every node must agree on it: a fixed default, as torchrun's
        else:
            port = free_port()
    elif node_rank == 0 and _is_local(addr) and port_in_use(addr, port):
        raise UserError(f"--master-port {port}: already in use on {addr}; pick another port or leave it unset")
    if nnodes == 1 and not p.rdzv_backend and (p.launcher == "fork" or
                                                (p.launcher == "auto" and not gpu_torch_build())):
        return LaunchPlan(nproc, nnodes, node_rank, addr, port, None, fork=True)
    if p.launcher == "fork":
        raise UserError("--launcher fork: forks the processes of one node only; use --launcher torchrun "
                        "for --nnodes > 1 or a rendezvous backend")
    if p.launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
               "--master_port", str(port)]
        if p.hostfile:
            if not Path(p.hostfile).is_file():
                raise UserError(f"--hostfile {p.hostfile}: file not found")
            cmd += ["--hostfile", p.hostfile, "--master_addr", addr]
        cmd += ["--module", "swiftlite", *argv]
    else:
        cmd = [sys.executable, "-m", "swiftlite.torchrun", f"--nproc-per-node={nproc}",
               f"--nnodes={nnodes}"]
        if p.rdzv_backend:
            cmd += [f"--rdzv-backend={p.rdzv_backend}", f"--rdzv-endpoint={p.rdzv_endpoint or f'{addr}:{port}'}",
                    f"--rdzv-id={p.rdzv_id or 'swiftlite'}"]
        else:
            cmd += [f"--node-rank={node_rank}", f"--master-addr={addr}", f"--master-port={port}"]
        cmd += ["-m", "swiftlite", *argv]
    return LaunchPlan(nproc, nnodes, node_rank, addr, port, cmd)


# -- preflight: every check that needs no process group, before anything is created ------------------

def _check_model_folder(cfg: RunConfig, folder: Path) -> None:
    """A local model folder has weights, and needs no code of its own unless --trust-remote-code."""
    import json
    arg = cfg.model.model
    try:
        conf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"--model {arg}: config.json is not valid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise UserError(f"--model {arg}: config.json must hold a JSON object")
    if not cfg.model.trust_remote_code:
        from transformers import CONFIG_MAPPING
        mtype = conf.get("model_type")
        if mtype not in CONFIG_MAPPING:
            extra = " and ships its own Python code (auto_map)" if conf.get("auto_map") else ""
            raise UserError(f"--model {arg}: model_type {mtype!r} is not built into transformers{extra}; "
                            "swiftlite runs no code from a model folder unless you pass --trust-remote-code")
    weights = [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")]
    if not weights:
        raise UserError(f"--model {arg}: folder has config.json but no weights (*.safetensors, pytorch_model.bin)")


def resolve_for_launch(cfg: RunConfig, world_size: int) -> "BackendChoice":
    """The backend, resolved in the launching process (its GPUs stand for the job's: the ranks resolve
    again with the smallest GPU of the whole job, which can only differ on mixed machines)."""
    from swiftlite.parallel.resolve import local_gpu_memory, resolve_backend
    return resolve_backend(cfg, world_size, local_gpu_memory, gpus_per_node=cfg.parallel.nproc_per_node)


def preflight(cfg: RunConfig, world_size: int, *, data: bool = True) -> "BackendChoice":
    """Validate everything a run can get wrong before any process starts or any file is written:
    output folder, resume checkpoint (intact and free of unsafe pickles), model, DeepSpeed config,
    and (data=True) the datasets themselves: every row read, converted and tokenized (which fills the
    tokenization cache the ranks then read), the usable-row count against one global batch.
    Raises a one-line UserError; creates nothing but cache files. Returns the backend choice."""
    from swiftlite import checkpoint as ckpt
    from swiftlite.data.sources import check_spec
    run_dir = check_output_dir(cfg)
    if cfg.checkpoint.resume_from:
        ckpt.resolve_resume_arg(cfg.checkpoint.resume_from, log=lambda *_: None)
    elif cfg.checkpoint.resume and run_dir.is_dir():
        ckpt.find_resume(run_dir, log=lambda *_: None)
    for spec in cfg.data.dataset:
        check_spec(spec, "--dataset")
    for spec in cfg.data.val_dataset:
        check_spec(spec, "--val-dataset")
    choice = resolve_for_launch(cfg, world_size)
    from swiftlite.models.loading import resolve_model
    source = resolve_model(cfg.model.model)
    if source.kind == "folder":
        _check_model_folder(cfg, Path(source.ref))
    if not data:
        return choice
    from swiftlite.data.pipeline import prepare_datasets
    from swiftlite.models.loading import load_tokenizer
    tokenizer = load_tokenizer(cfg, source)
    prepare_datasets(cfg, tokenizer, world_size)
    return choice


def _is_local(addr: str) -> bool:
    return addr in ("127.0.0.1", "localhost", "0.0.0.0") or addr == socket.gethostname()


SECRET_FLAG = re.compile(r"token|secret|password|passwd|api[-_]?key|credential", re.IGNORECASE)
SECRET_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,})\b")
REDACTED = "***"


def redact_argv(argv: list[str]) -> list[str]:
    """A command line safe to print or log: values of token/secret/password flags and anything
    shaped like a hub token become ***."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        if hide_next and not a.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if a.startswith("--") and SECRET_FLAG.search(a.partition("=")[0]):
            if "=" in a:
                a = a.partition("=")[0] + "=" + REDACTED
            else:
                hide_next = True
        out.append(SECRET_VALUE.sub(REDACTED, a))
    return out


# Error text of a rank that failed only because another rank stopped answering.
_COLLECTIVE = re.compile(r"timed out|timeout|connection (closed|reset)|broken pipe|DistBackendError|"
                         r"gloo|nccl|ProcessGroup|peer|watchdog", re.IGNORECASE)
PREFLIGHT_ENV = "SWIFTLITE_PREFLIGHT_DONE"


def clear_rank_logs(cfg: RunConfig) -> Path:
    """Remove an earlier launch's rank errors and stack dumps; return the logs folder."""
    logs = Path(cfg.train.output_dir).expanduser() / "logs"
    for old in [*logs.glob("rank*.err"), *logs.glob("rank*.stack")] if logs.is_dir() else []:
        old.unlink()
    return logs


def run_launched(plan: LaunchPlan, cfg: RunConfig) -> int:
    """Run the launcher; on failure name the rank that caused it (see `explain_failure`)."""
    import threading
    import time
    assert plan.command is not None
    print("launching: " + shlex.join(redact_argv(plan.command)), flush=True)
    logs = clear_rank_logs(cfg)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env[PREFLIGHT_ENV] = "1"
    t0 = time.monotonic()
    tail: list[str] = []
    try:
        # stderr passes through line by line; its tail is kept to read the launcher's failure summary
        proc = subprocess.Popen(plan.command, env=env, stderr=subprocess.PIPE, text=True, errors="replace")

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                sys.stderr.write(line)
                sys.stderr.flush()
                tail.append(line)
                del tail[:-200]
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        rc = proc.wait()
        t.join(10)
    except KeyboardInterrupt:
        return 130
    if rc == 0:
        return 0
    msg, code = explain_failure(logs, plan.world_size, "".join(tail), cfg.parallel.ddp_timeout,
                                time.monotonic() - t0)
    print(f"error: {msg}", file=sys.stderr)
    return code if code else (rc if rc > 0 else 1)


def run_rank(cfg: RunConfig) -> None:
    """The body of one rank (or of a single-process run): train, and on failure leave the rank's
    error where the launcher looks for it."""
    install_rank_diagnostics(cfg)
    try:
        from swiftlite.trainer import train
        train(cfg)
    except UserError as e:
        record_rank_failure(cfg, str(e), user_error=True)
        raise
    except BaseException as e:
        import traceback
        record_rank_failure(cfg, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", user_error=False)
        raise
    finally:
        finish_rank_diagnostics()
        from swiftlite import profiling
        profiling.finish()  # a forked rank ends in os._exit: atexit handlers would not run
        from swiftlite.distributed import teardown
        teardown()


def warm_imports(cfg: RunConfig, choice: "BackendChoice") -> None:
    """Import, before forking, what every rank imports: paid once here instead of once per rank.
    Best effort: a module that fails to import here fails in the rank with its real error."""
    import importlib
    names = ["torch", "torch.distributed", "swiftlite.trainer", "swiftlite.data.collate",
             "swiftlite.data.loader", "swiftlite.metrics", "transformers.modeling_utils"]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - see the docstring
            pass
    try:  # the engine's module (the torch backends share torch_engine; DeepSpeed is left to the ranks)
        if not choice.is_deepspeed:
            importlib.import_module("swiftlite.parallel.torch_engine")
    except Exception:  # noqa: BLE001
        pass
    try:  # the model's modeling module (modeling_llama, ...): looking its class up imports it
        from swiftlite.models.loading import model_config, resolve_model
        source = resolve_model(cfg.model.model)
        if source.kind in ("preset", "folder"):  # never the network here: a hub config is the ranks' job
            from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
            MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config(cfg, source))]
    except Exception:  # noqa: BLE001
        pass
    if cfg.is_peft:
        try:
            from swiftlite.models.quant import peft_without_bnb
            with peft_without_bnb(quantized=cfg.quant.quant_bits is not None):
                pass
        except Exception:  # noqa: BLE001
            pass


def _forked_rank(local_rank: int, cfg: RunConfig, plan: LaunchPlan, threads: int) -> None:
    """Entry point of a forked rank: the environment torchrun would have given it, then the rank."""
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": "0",
                       "WORLD_SIZE": str(plan.world_size), "LOCAL_WORLD_SIZE": str(plan.nproc_per_node),
                       "MASTER_ADDR": plan.master_addr, "MASTER_PORT": str(plan.master_port),
                       PREFLIGHT_ENV: "1"})
    import torch
    torch.set_num_threads(threads)  # the parent's torch chose its thread count before OMP_NUM_THREADS
    try:
        run_rank(cfg)
    except UserError:
        sys.exit(2)  # the one-line message is in logs/rank<r>.err; the parent prints it
    except BaseException:
        sys.exit(1)


def run_forked(plan: LaunchPlan, cfg: RunConfig) -> int:
    """Fork the ranks of a one-node job from this process and wait for them; on failure, stop the
    others (SIGTERM, so a hung rank dumps its stack) and name the rank that caused it."""
    import gc
    import logging
    import time

    import torch.multiprocessing as tmp
    warm_imports(cfg, resolve_for_launch(cfg, plan.world_size))
    logs = clear_rank_logs(cfg)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Forked children must not share the tokenizer's Rust thread pool; saying so up front also
    # silences the warning tokenizers prints in each child otherwise.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    omp = os.environ["OMP_NUM_THREADS"]
    threads = max(1, int(omp)) if omp.isdigit() else 1
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process ..."
    print(f"launching: {plan.nproc_per_node} processes forked from this one "
          f"(master {plan.master_addr}:{plan.master_port})", flush=True)
    sys.stderr.flush()
    t0 = time.monotonic()
    # Everything imported so far moves to the collector's permanent generation: the ranks' garbage
    # collections then skip the millions of inherited objects (modules, tokenizer) instead of
    # walking them, and leave their pages shared (Python's gc.freeze recipe for fork).
    gc.freeze()
    ctx = tmp.start_processes(_forked_rank, args=(cfg, plan, threads), nprocs=plan.nproc_per_node,
                              join=False, start_method="fork")
    try:
        while not ctx.join():
            pass
        return 0
    except KeyboardInterrupt:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
        return 130
    except Exception:  # noqa: BLE001 - ProcessRaisedException / ProcessExitedException: explained below
        pass
    for proc in ctx.processes:
        proc.join(30)
    codes = {r: proc.exitcode for r, proc in enumerate(ctx.processes) if proc.exitcode not in (None, 0)}
    msg, code = explain_failure(logs, plan.world_size, "", cfg.parallel.ddp_timeout, time.monotonic() - t0,
                                codes=codes)
    print(f"error: {msg}", file=sys.stderr)
    return code if code else 1


def _first_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[0].strip() if lines else ""


def _where_stuck(stack: str) -> str:
    """The innermost frame of the main thread in a faulthandler dump."""
    blocks = stack.split("\n\n")
    main = (next((b for b in blocks if "Current thread" in b), None)
            or next((b for b in blocks if "most recent call first" in b), ""))
    for line in main.splitlines():
        m = re.search(r'File "([^"]+)", line (\d+) in (\S+)', line)
        if m:
            return f"{Path(m.group(1)).name}:{m.group(2)} in {m.group(3)}()"
    return "an unknown place"


def _launcher_exit_codes(tail: str) -> dict[int, int]:
    """rank -> exit code from torchrun's failure summary ("rank: 1 (local_rank: 1)" / "exitcode: -9")."""
    codes: dict[int, int] = {}
    for m in re.finditer(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", tail):
        codes[int(m.group(2))] = int(m.group(1))  # one node: local rank = rank
    for m in re.finditer(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*exitcode\s*:\s*(-?\d+)", tail, re.IGNORECASE):
        codes[int(m.group(1))] = int(m.group(2))
    return codes


def explain_failure(logs: Path, world_size: int, launcher_tail: str, ddp_timeout: int,
                    elapsed: float, codes: dict[int, int] | None = None) -> tuple[str, int]:
    """One line naming the rank that brought the job down, and the exit code (2: a user error).

    Ranks write logs/rank<r>.err when they raise, and dump their stack to logs/rank<r>.stack when
    the launcher terminates them. A rank whose error is only a failed collective (timeout, peer
    gone) is a victim: the culprit is then a rank that reported nothing (killed, or hung: its stack
    says where it was stuck)."""
    errs: dict[int, str] = {}
    stacks: dict[int, str] = {}
    for kind, store in ((".err", errs), (".stack", stacks)):
        for f in sorted(logs.glob(f"rank*{kind}")) if logs.is_dir() else []:
            try:
                text = f.read_text(errors="replace").strip()
                r = int(f.stem[4:])
            except (OSError, ValueError):
                continue
            if text:
                store[r] = text
    codes = {**_launcher_exit_codes(launcher_tail), **(codes or {})}
    primary = [r for r, t in sorted(errs.items()) if not _COLLECTIVE.search(_first_line(t))]
    if primary:
        r = primary[0]
        text = errs[r]
        user = text.startswith("user error:")
        line = _first_line(text[len("user error:"):] if user else text)
        return f"rank{r} failed: {line}", (2 if user else 1)
    silent = [r for r in range(world_size) if r not in errs]
    victims = sorted(errs)
    if victims and silent:
        c = silent[0]
        v = victims[0]
        code = codes.get(c)
        if c in stacks and (code is None or code in (-15, 143, 1)):
            what = (f"rank{c} hung: stopped answering collectives (stuck at {_where_stuck(stacks[c])} "
                    f"when the job was stopped)")
        elif code is not None and code < 0:
            what = f"rank{c} died from signal {-code} without reporting an error"
        elif code is not None:
            what = f"rank{c} exited with code {code} without reporting an error"
        else:
            what = f"rank{c} stopped without reporting an error (killed or crashed in native code)"
        timed_out = re.search(r"timed out|timeout", errs[v], re.IGNORECASE)
        after = f" after --ddp-timeout {ddp_timeout}s" if timed_out else ""
        return f"{what}; rank{v} gave up{after}: {_first_line(errs[v])[:300]}", 1
    if victims:
        v = victims[0]
        return f"rank{v} failed: {_first_line(errs[v])[:300]}", 1
    if codes:
        r, code = sorted(codes.items())[0]
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        return f"rank{r} ended with {how} without reporting an error", 1
    return f"the launcher failed after {elapsed:.0f} s with no rank reporting an error (see the output above)", 0


def record_rank_failure(cfg: RunConfig | None, message: str, user_error: bool) -> None:
    """Called in a rank that fails: write its error where the launcher looks for it."""
    rank = os.environ.get("RANK")
    if rank is None or cfg is None:
        return
    logs = Path(cfg.train.output_dir).expanduser() / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"rank{rank}.err").write_text(("user error: " if user_error else "") + message + "\n")
    except OSError:
        pass


_stack_file = None


def install_rank_diagnostics(cfg: RunConfig) -> None:
    """In a launched rank: when the launcher terminates it (SIGTERM), dump every thread's stack to
    logs/rank<r>.stack first, even if it is blocked inside a collective, so a hung rank can be named
    and located. Removed again by `finish_rank_diagnostics` when the rank ends normally."""
    global _stack_file
    import faulthandler
    import signal
    rank = os.environ.get("RANK")
    if rank is None or _stack_file is not None:
        return
    logs = Path(cfg.train.output_dir).expanduser() / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        _stack_file = (logs / f"rank{rank}.stack").open("w")
        faulthandler.register(signal.SIGTERM, file=_stack_file, all_threads=True, chain=True)
    except (OSError, RuntimeError, ValueError):
        _stack_file = None


def finish_rank_diagnostics() -> None:
    global _stack_file
    if _stack_file is None:
        return
    import faulthandler
    import signal
    try:
        faulthandler.unregister(signal.SIGTERM)
        name = _stack_file.name
        _stack_file.close()
        if os.path.getsize(name) == 0:
            os.unlink(name)
    except (OSError, RuntimeError, ValueError):
        pass
    _stack_file = None
