#!/usr/bin/env python
"""Crash soak: SIGKILL a training run again and again, resume it each time, and check that

  * every kill leaves only intact checkpoints (each `checkpoint-N` verifies against its manifest,
    `latest` names one of them; a half-written save exists only as `.tmp-checkpoint-N`);
  * every run resumes (exit 0 in the end) from where the last good checkpoint left it;
  * the final weights equal those of an uninterrupted run, bit for bit (CPU, fp32).

Kills are seeded and of four kinds, aimed at one of the next three steps (so that the kills of
an episode spread over the whole run):
  timed    wait for the log line of step k, then SIGKILL after a random fraction of one step +
           save (lands in the next step's compute, in checkpoint-k's DCP/HF/manifest write, in the
           rename, in the prune of an old checkpoint);
  fault    SIGKILL injected by SWIFTLITE_FAULT inside the write of checkpoint-k (sharded state and
           HF folder written, manifest not yet);
  step     SIGKILL injected by SWIFTLITE_FAULT inside training step k (after its optimizer step,
           before its loss is logged and its checkpoint started);
  startup  at a random moment of start-up (imports, model build, verifying and loading the resume
           checkpoint).
An episode is one run folder: at most --kills-per-episode kills, then the run is let finish and
its final weights are compared with the uninterrupted run's. Episodes repeat until --kills.

    python scripts/fault_soak.py --kills 20 --seed 0        # prints one line per kill, then a summary
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swiftlite import checkpoint as ckpt  # noqa: E402


def train_cmd(data: Path, out: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "swiftlite", "sft", "--model", "tiny-llama-2l", "--train-type", "full",
            "--dataset", str(data),
            "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", str(steps), "--save-steps", "1", "--save-total-limit", "2", "--logging-steps", "1",
            "--torch-dtype", "fp32", "--seed", "7", "--output-dir", str(out), "--resume", "auto"]


def env_for(work: Path, fault: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"SWIFTLITE_CACHE": str(work / "cache"), "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.pop("SWIFTLITE_FAULT", None)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    if fault:
        env["SWIFTLITE_FAULT"] = fault
    return env


def weights(run: Path, steps: int) -> dict:
    from safetensors.torch import load_file
    return load_file(str(run / f"checkpoint-{steps}" / "model" / "model.safetensors"))


def same_bits(a: dict, b: dict) -> bool:
    import torch
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                         and torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.uint8
                                                         else a[k], b[k].view(torch.uint8)) for k in a)


def audit(run: Path) -> tuple[list[str], list[str], str | None]:
    """(problems, leftovers, latest): problems are corrupt or half-written checkpoints."""
    problems = []
    if not run.is_dir():
        return problems, [], None
    for c in ckpt.list_checkpoints(run):
        why = ckpt.verify_checkpoint(c)
        if why:
            problems.append(f"{c.name}: {why}")
    latest = ckpt.read_latest(run) if (run / ckpt.LATEST).exists() else None
    if (run / ckpt.LATEST).exists():
        if latest is None:
            problems.append("latest is unreadable")
        elif not (run / latest).is_dir():
            problems.append(f"latest names {latest}, which does not exist")
    leftovers = sorted(p.name for p in run.iterdir() if p.name.startswith((".tmp-", ".del-")))
    return problems, leftovers, latest


def run_until_killed(cmd: list[str], env: dict, mode: str, delay: float, timeout: float = 300,
                     target: int | None = None) -> tuple[int, bool, list[str]]:
    """Start `cmd`; SIGKILL it `delay` s after start (mode "startup") or after it logs step `target`
    (mode "timed"); mode "fault" lets SWIFTLITE_FAULT kill it. Returns (rc, killed_by_us, output)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    started = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if target is not None and line.startswith(f"step={target} "):
                started.set()
        started.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    killed = False
    t0 = time.monotonic()
    if mode in ("timed", "startup"):
        if mode == "timed":
            started.wait(timeout)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed = True
    try:
        rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    t.join(5)
    return rc, killed, lines


def _leftovers(run: Path) -> dict[str, int]:
    if not run.is_dir():
        return {}
    return {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name.startswith((".tmp-", ".del-"))}


def soak(work: Path, *, kills: int = 20, seed: int = 0, steps: int = 10, log=print,
         modes: list[str] | None = None, kills_per_episode: int = 5) -> dict:
    """Run the soak in `work`; returns a summary dict (ok: bool). `modes` fixes the kinds of the
    first kills (timed, startup, fault); the rest are drawn from the seed."""
    from swiftlite.demo import write_demo_data
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    data, _ = write_demo_data(work / "data", n_train=200, n_val=20)

    ref_dir = work / "reference"
    shutil.rmtree(ref_dir, ignore_errors=True)
    t0 = time.monotonic()
    r = subprocess.run(train_cmd(data, ref_dir, steps), env=env_for(work), capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"reference run failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    ref_time = time.monotonic() - t0
    ref = weights(ref_dir, steps)
    recs = [json.loads(x) for x in (ref_dir / "logging.jsonl").read_text().splitlines() if x.strip()]
    el = {rec["step"]: rec["elapsed_s"] for rec in recs if "elapsed_s" in rec}
    per_step = max(0.05, (el[steps] - el[1]) / max(1, steps - 1))
    startup = el[1]
    log(f"reference: {steps} steps uninterrupted in {ref_time:.1f} s ({startup:.1f} s to the first step, "
        f"{per_step:.2f} s per step + save)")

    summary = {"kills": 0, "episodes": 0, "launches": 1, "problems": [], "mismatches": [],
               "kinds": {"timed": 0, "startup": 0, "fault": 0, "step": 0}, "landed": {}, "resumed_from": []}
    episode = 0
    while summary["kills"] < kills:
        episode += 1
        run = work / f"episode{episode}"
        shutil.rmtree(run, ignore_errors=True)
        summary["episodes"] = episode
        episode_kills = 0
        while True:
            done = ckpt.find_resume(run, log=lambda *_: None) if run.is_dir() else None
            at = ckpt.step_of(done) if done else 0
            target = None
            if summary["kills"] >= kills or episode_kills >= kills_per_episode or at >= steps:
                mode, fault, delay = "finish", None, 0.0
            else:
                mode = rng.choices(["timed", "startup", "fault", "step"], weights=[5, 1, 2, 2])[0]
                if modes and summary["kills"] < len(modes):
                    mode = modes[summary["kills"]]
                fault, delay = None, 0.0
                if mode == "timed":
                    target = rng.randint(at + 1, min(steps, at + 3))
                    delay = rng.uniform(0.0, per_step)
                elif mode == "startup":
                    delay = rng.uniform(0.3, startup)
                elif mode == "fault":
                    fault = f"step={rng.randint(at + 1, min(steps, at + 3))},phase=checkpoint,kind=kill"
                else:
                    fault = f"step={rng.randint(at + 1, min(steps, at + 3))},phase=step,kind=kill"
            before = _leftovers(run)
            rc, killed, out = run_until_killed(train_cmd(data, run, steps), env_for(work, fault),
                                               "fault" if fault else mode, delay, target=target)
            summary["launches"] += 1
            problems, leftovers, latest = audit(run)
            if rc == 0:
                if killed:
                    summary["problems"].append(f"episode {episode}: killed yet exited 0")
                if not (run / f"checkpoint-{steps}").is_dir():
                    summary["problems"].append(f"episode {episode}: exited 0 without checkpoint-{steps}")
                    break
                ok = same_bits(ref, weights(run, steps))
                if not ok:
                    summary["mismatches"].append(f"episode {episode}")
                summary["problems"] += [f"episode {episode} end: {p}" for p in problems]
                log(f"episode {episode}: finished from {done.name if done else 'scratch'}, final weights "
                    f"{'bitwise equal to' if ok else 'DIFFERENT from'} the uninterrupted run")
                break
            if rc != -signal.SIGKILL:
                tail = " | ".join(out[-3:])
                summary["problems"].append(f"episode {episode}: exit code {rc} (not a kill): {tail}")
                break
            summary["kills"] += 1
            episode_kills += 1
            kind = mode
            new = {k for k, v in _leftovers(run).items() if before.get(k) != v}
            summary["kinds"][kind] += 1
            last_step = max([int(x.split()[0][5:]) for x in out if x.startswith("step=")], default=None)
            if kind == "step":
                landed = "inside a training step (before its checkpoint)"
            elif any(x.startswith(".tmp-") for x in new):
                landed = "inside a checkpoint write"
            elif any(x.startswith(".del-") for x in new):
                landed = "inside a checkpoint delete (prune)"
            elif last_step is None:
                landed = "during start-up/resume"
            elif any(x.startswith("saved ") for x in out):
                landed = "after the final save"
            elif latest == f"{ckpt.PREFIX}{last_step}":
                landed = "after a checkpoint was complete (before the next step)"
            else:
                landed = "in a training step (before its checkpoint)"
            summary["landed"][landed] = summary["landed"].get(landed, 0) + 1
            summary["resumed_from"].append(done.name if done else "scratch")
            summary["problems"] += [f"kill {summary['kills']}: {p}" for p in problems]
            aim = fault if fault else (f"step={target} +{delay:.2f}s" if target else f"+{delay:.2f}s")
            log(f"kill {summary['kills']:2d} ({kind:7s} {aim}): "
                f"started from {done.name if done else 'scratch':13s} last logged step {last_step}, "
                f"landed {landed}; latest={latest} leftovers={leftovers or '-'} "
                f"{'OK' if not problems else 'PROBLEMS: ' + '; '.join(problems)}")
    summary["ok"] = not summary["problems"] and not summary["mismatches"] and summary["kills"] >= kills
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kills-per-episode", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="kept afterwards when given (default: a temp dir)")
    a = ap.parse_args()
    tmp = None
    if a.workdir:
        work = Path(a.workdir)
    else:
        tmp = tempfile.mkdtemp(prefix="swiftlite-soak-")
        work = Path(tmp)
    t0 = time.monotonic()
    try:
        s = soak(work, kills=a.kills, seed=a.seed, steps=a.steps, kills_per_episode=a.kills_per_episode)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: v for k, v in s.items() if k != "resumed_from"}, indent=1))
    print(f"{'PASS' if s['ok'] else 'FAIL'}: {s['kills']} SIGKILLs (seed {a.seed}) over {s['episodes']} episode(s), "
          f"{s['launches']} launches, {len(s['problems'])} corrupt/half-written checkpoints, "
          f"{len(s['mismatches'])} final-weight mismatches, {time.monotonic() - t0:.0f} s")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
