"""swiftlite's GRPO loss against TRL's GRPOTrainer `_compute_loss` on the same fixed batches, per --loss_type.

    python scripts/compare_grpo_trl.py [--trl-python /path/to/trl-venv/bin/python] [--tol 1e-6]

Two layouts of a generation round, per-token policy log-probs, old log-probs (a reused generation round)
and reference log-probs drawn from a seeded generator, rewards of two reward functions (one None for a
completion), weights (1.0, 0.5):

- single: 2 prompts x G = 3 completions of up to 7 tokens (lengths 7, 3, 5, 1, 6, 4 after the first
  EOS), one process, one micro-batch (GA = steps_per_generation = 1): the formulas themselves.
- round: 4 prompts x G = 4 completions (lengths from 1 to 7) over 2 processes, per-device batch 2,
  gradient accumulation 2, steps_per_generation 4 (each process's 8 completions are 4 micro-batches, a
  round serves 2 optimizer steps): every micro-batch of both processes. Here the normalisers differ:
  grpo/bnpo/dr_grpo divide by GA, dapo by the round's tokens on all processes (TRL's
  num_items_in_batch) / processes x GA / steps_per_generation, which differs from bnpo's.

swiftlite computes the group advantages (rlhf/grpo_loss.advantages) over the whole round and, per
micro-batch, what it backpropagates (rlhf/grpo_loss.micro_batch_loss) and its gradient with respect to
the policy log-probs; TRL's side runs GRPOTrainer._compute_loss itself (its method, on a stand-in
trainer object holding the options it reads: accelerator.num_processes, current_gradient_accumulation_steps,
args.steps_per_generation, ...; the model's per-token log-probs replaced by the fixed ones) on the same
micro-batches, and its advantages with TRL's own nanstd as `_generate_and_score_completions` forms them.
Cases: each layout x every loss type x (beta 0.04 with old log-probs, beta 0 without: the on-policy
shortcut), epsilon 0.2 / epsilon_high 0.28. Also printed: each optimizer step's loss (the sum of its GA
micro-batches' on each process, averaged over the processes, as the backends average gradients).
Exit status 1 when a loss, an advantage or a gradient differs by more than --tol.
TRL runs in its own virtual environment (--trl-python, else $TRL_PYTHON, else
compare_dpo_trl.DEFAULT_TRL_PYTHON: $SWIFTLITE_PEERS_DIR/trl/bin/python); this file is its entry point
too (`--trl-side`, importing nothing from swiftlite).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_dpo_trl import DEFAULT_TRL_PYTHON  # noqa: E402  (one default for every compare_*_trl.py)

T, EPS, EPS_HIGH, MAX_COMPLETION = 7, 0.2, 0.28, 7
WEIGHTS = [1.0, 0.5]
LAYOUTS = {
    "single": {"lengths": [7, 3, 5, 1, 6, 4], "G": 3, "procs": 1, "per_device": 6, "ga": 1, "spg": 1,
               "rewards": [[1.0, 0.5], [0.0, None], [1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.0]]},
    "round": {"lengths": [7, 1, 2, 7, 3, 6, 1, 5, 7, 7, 2, 4, 1, 1, 6, 3], "G": 4, "procs": 2, "per_device": 2,
              "ga": 2, "spg": 4,
              "rewards": [[1.0, 0.5], [0.0, None], [1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.0], [1.0, 1.0],
                          [0.0, 0.5], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.5, 1.0],
                          [1.0, None], [0.0, 0.5]]},
}
CASES = [(lay, lt, beta, old) for lay in LAYOUTS for lt in ("grpo", "bnpo", "dr_grpo", "dapo")
         for beta, old in ((0.04, True), (0.0, False))]


def micro_batches(lay: dict) -> list[tuple[int, list[int]]]:
    """(process, completion indices) of every micro-batch of the round, process by process; TRL's
    process r holds the round's r-th slice, cut into steps_per_generation micro-batches in order."""
    local = lay["per_device"] * lay["spg"]
    out = []
    for r in range(lay["procs"]):
        for k in range(lay["spg"]):
            first = r * local + k * lay["per_device"]
            out.append((r, list(range(first, first + lay["per_device"]))))
    return out


def fixed_inputs() -> dict:
    import torch
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name, lay in LAYOUTS.items():
        B = len(lay["lengths"])
        assert B == lay["procs"] * lay["per_device"] * lay["spg"] and B % lay["G"] == 0
        logps = -torch.rand(B, T, generator=g) * 3
        old = logps + (torch.rand(B, T, generator=g) - 0.5) * 0.6        # some ratios outside [0.8, 1.28]
        ref = logps + (torch.rand(B, T, generator=g) - 0.5) * 0.4
        mask = torch.tensor([[1 if t < n else 0 for t in range(T)] for n in lay["lengths"]])
        out[name] = {"logps": logps.tolist(), "old": old.tolist(), "ref": ref.tolist(), "mask": mask.tolist()}
    return out


def _step_losses(lay: dict, losses: list[float]) -> list[float]:
    """Each optimizer step's loss: its GA micro-batches summed on each process, averaged over processes."""
    per = lay["spg"]
    steps = per // lay["ga"]
    return [sum(losses[r * per + s * lay["ga"] + i] for r in range(lay["procs"]) for i in range(lay["ga"]))
            / lay["procs"] for s in range(steps)]


def swiftlite_side(inp: dict) -> dict:
    import torch
    sys.path.insert(0, str(ROOT))
    from swiftlite.rlhf.grpo_loss import GrpoLoss, advantages, micro_batch_loss, token_terms
    out = {"advantages": {}, "cases": []}
    for name, lay in LAYOUTS.items():
        rpf = torch.tensor([[float("nan") if v is None else v for v in r] for r in lay["rewards"]])
        adv, _, _ = advantages(rpf, torch.tensor(WEIGHTS), lay["G"], "group")
        out["advantages"][name] = adv.tolist()
    for lay_name, lt, beta, use_old in CASES:
        lay, x = LAYOUTS[lay_name], inp[lay_name]
        adv = torch.tensor(out["advantages"][lay_name])
        mask_all = torch.tensor(x["mask"])
        total = float(mask_all.sum())            # the round's completion tokens on all processes
        o = GrpoLoss(lt, beta, EPS, EPS_HIGH, MAX_COMPLETION)
        losses, grads = [], []
        for _, rows in micro_batches(lay):
            idx = torch.tensor(rows)
            logps = torch.tensor(x["logps"])[idx].requires_grad_(True)
            terms = token_terms(o, logps, torch.tensor(x["old"])[idx] if use_old else None,
                                torch.tensor(x["ref"])[idx] if beta else None, adv[idx])
            loss = micro_batch_loss(o, terms.per_token_loss, mask_all[idx], accumulation=lay["ga"],
                                    round_tokens=total, steps_per_generation=lay["spg"], world_size=lay["procs"])
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append(logps.grad.tolist())
        out["cases"].append({"loss": losses, "grad": grads, "steps": _step_losses(lay, losses)})
    return out


def trl_side(inp: dict) -> dict:
    import types
    from collections import defaultdict

    import torch
    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd
    out = {"advantages": {}, "cases": [], "trl": __import__("trl").__version__}
    for name, lay in LAYOUTS.items():
        # advantages as _generate_and_score_completions forms them (scale_rewards "group", sum_then_normalize)
        G = lay["G"]
        rpf = torch.tensor([[float("nan") if v is None else v for v in r] for r in lay["rewards"]])
        unscorable = torch.isnan(rpf).all(dim=1)
        rewards = (rpf * torch.tensor(WEIGHTS).unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
        out["advantages"][name] = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0).tolist()
    for lay_name, lt, beta, use_old in CASES:
        lay, x = LAYOUTS[lay_name], inp[lay_name]
        adv = torch.tensor(out["advantages"][lay_name])
        mask_all = torch.tensor(x["mask"])
        # num_items_in_batch: accelerator.gather(completion_mask.sum()).sum() over the generation batch
        num_items = mask_all.sum()
        losses, grads = [], []
        for _, rows in micro_batches(lay):
            idx = torch.tensor(rows)
            logps = torch.tensor(x["logps"])[idx].requires_grad_(True)
            mask = mask_all[idx]
            B = len(rows)
            acc = types.SimpleNamespace(num_processes=lay["procs"], reduce=lambda t, reduction="sum": t,
                                        gather=lambda t: t, gather_for_metrics=lambda t: t, sync_gradients=True)
            fake = types.SimpleNamespace(
                beta=beta, loss_type=lt, epsilon_low=EPS, epsilon_high=EPS_HIGH, top_entropy_quantile=1.0,
                off_policy_mask_threshold=None, importance_sampling_level="token", use_vllm=False,
                vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
                current_gradient_accumulation_steps=lay["ga"], max_completion_length=MAX_COMPLETION,
                accelerator=acc, _entropy_bonus_enabled=False, aux_loss_enabled=False,
                _metrics={"train": defaultdict(list)},
                args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=lay["spg"]),
                _get_per_token_logps_and_entropies=lambda *a, _l=logps, **k: (_l, torch.zeros_like(_l), None))
            inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long),
                      "prompt_mask": torch.ones(B, 2, dtype=torch.long),
                      "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
                      "advantages": adv[idx], "num_items_in_batch": num_items}
            if use_old:
                inputs["old_per_token_logps"] = torch.tensor(x["old"])[idx]
            if beta:
                inputs["ref_per_token_logps"] = torch.tensor(x["ref"])[idx]
            loss = GRPOTrainer._compute_loss(fake, None, inputs)
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append(logps.grad.tolist())
        out["cases"].append({"loss": losses, "grad": grads, "steps": _step_losses(lay, losses)})
    return out


def _maxdiff(a, b) -> float:
    if isinstance(a, list):
        return max((_maxdiff(x, y) for x, y in zip(a, b)), default=0.0)
    return abs(a - b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trl-python", default=DEFAULT_TRL_PYTHON,
                    help="TRL's python (default: $TRL_PYTHON, else $SWIFTLITE_PEERS_DIR/trl/bin/python)")
    ap.add_argument("--tol", type=float, default=1e-6)
    ap.add_argument("--trl-side", metavar="INPUTS_JSON", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_side:
        print(json.dumps(trl_side(json.loads(Path(a.trl_side).read_text()))))
        return 0
    if not Path(a.trl_python).is_file():
        print(f"no TRL venv at {a.trl_python} (set TRL_PYTHON or --trl-python)", file=sys.stderr)
        return 2
    inp = fixed_inputs()
    mine = swiftlite_side(inp)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "inputs.json"
        p.write_text(json.dumps(inp))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([a.trl_python, __file__, "--trl-side", str(p)], capture_output=True, text=True, env=env)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 2
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    worst = 0.0
    for name in LAYOUTS:
        d = _maxdiff(mine["advantages"][name], theirs["advantages"][name])
        worst = max(worst, d)
        print(f"TRL {theirs['trl']}, layout {name}: advantages max |diff| {d:.2e}")
    per_type: dict[str, float] = {}
    for (lay, lt, beta, old), m, t in zip(CASES, mine["cases"], theirs["cases"]):
        dl, dg = _maxdiff(m["loss"], t["loss"]), _maxdiff(m["grad"], t["grad"])
        worst = max(worst, dl, dg)
        per_type[lt] = max(per_type.get(lt, 0.0), dl, dg)
        steps = "  ".join(f"{x:+.9f}/{y:+.9f}" for x, y in zip(m["steps"], t["steps"]))
        print(f"{lay:6s} {lt:8s} beta {beta:<5g} old log-probs {'yes' if old else 'no ':3s}  "
              f"{len(m['loss'])} micro-batch(es): max |loss diff| {dl:.2e}  max |grad diff| {dg:.2e}  "
              f"step loss swiftlite/TRL {steps}")
    print("per loss type, max |diff| (loss, gradient): " + ", ".join(f"{k} {v:.2e}" for k, v in per_type.items()))
    print(f"worst {worst:.2e} (tolerance {a.tol:g})")
    return 0 if worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
