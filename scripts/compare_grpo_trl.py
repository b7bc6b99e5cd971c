"""swiftlite's GRPO loss against TRL's GRPOTrainer `_compute_loss` on the same fixed batch, per --loss_type.

    python scripts/compare_grpo_trl.py [--trl-python /path/to/trl-venv/bin/python] [--tol 1e-6]

The batch: 2 prompts x G = 3 completions of up to 7 tokens (lengths 7, 3, 5, 1, 6, 4 after the
first EOS), per-token policy log-probs, old log-probs (a reused generation round) and reference
log-probs drawn from a seeded generator, rewards of two reward functions (one None for a completion),
weights (1.0, 0.5). swiftlite computes the group advantages (rlhf/grpo_loss.advantages) and each
loss type's micro-batch loss and its gradient with respect to the policy log-probs; TRL's side runs
GRPOTrainer._compute_loss itself (its method, on a stand-in trainer object holding the options it
reads, with the model's per-token log-probs replaced by the fixed ones) on the same inputs, and its
advantages with TRL's own nanstd as `_generate_and_score_completions` forms them. Cases: every loss
type x (beta 0.04 with old log-probs, beta 0 without: the on-policy shortcut), epsilon 0.2 /
epsilon_high 0.28. Exit status 1 when a loss, an advantage or a gradient differs by more than --tol.
TRL runs in its own virtual environment (TRL_PYTHON, --trl-python); this file is its entry point too
(`--trl-side`, importing nothing from swiftlite).
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
LENGTHS = [7, 3, 5, 1, 6, 4]
G, T, EPS, EPS_HIGH, MAX_COMPLETION = 3, 7, 0.2, 0.28, 7
REWARDS = [[1.0, 0.5], [0.0, None], [1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.0]]
WEIGHTS = [1.0, 0.5]
CASES = [(lt, beta, old) for lt in ("grpo", "bnpo", "dr_grpo", "dapo") for beta, old in ((0.04, True), (0.0, False))]


def fixed_inputs() -> dict:
    import torch
    g = torch.Generator().manual_seed(1234)
    B = len(LENGTHS)
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + (torch.rand(B, T, generator=g) - 0.5) * 0.6        # some ratios outside [0.8, 1.28]
    ref = logps + (torch.rand(B, T, generator=g) - 0.5) * 0.4
    mask = torch.tensor([[1 if t < n else 0 for t in range(T)] for n in LENGTHS])
    return {"logps": logps.tolist(), "old": old.tolist(), "ref": ref.tolist(), "mask": mask.tolist()}


def swiftlite_side(inp: dict) -> dict:
    import torch
    sys.path.insert(0, str(ROOT))
    from swiftlite.rlhf.grpo_loss import GrpoLoss, advantages, aggregate, token_terms
    rpf = torch.tensor([[float("nan") if v is None else v for v in r] for r in REWARDS])
    adv, _, _ = advantages(rpf, torch.tensor(WEIGHTS), G, "group")
    mask = torch.tensor(inp["mask"])
    out = {"advantages": adv.tolist(), "cases": []}
    for lt, beta, use_old in CASES:
        logps = torch.tensor(inp["logps"], requires_grad=True)
        o = GrpoLoss(lt, beta, EPS, EPS_HIGH, MAX_COMPLETION)
        terms = token_terms(o, logps, torch.tensor(inp["old"]) if use_old else None,
                            torch.tensor(inp["ref"]) if beta else None, adv)
        # one micro-batch = the whole generation round on one process (GA = steps_per_generation = 1)
        loss = aggregate(o, terms.per_token_loss, mask, dapo_tokens=float(mask.sum()))
        loss.backward()
        out["cases"].append({"loss": float(loss.detach()), "grad": logps.grad.tolist()})
    return out


def trl_side(inp: dict) -> dict:
    import types
    from collections import defaultdict

    import torch
    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd
    # advantages as _generate_and_score_completions forms them (scale_rewards "group", sum_then_normalize)
    rpf = torch.tensor([[float("nan") if v is None else v for v in r] for r in REWARDS])
    unscorable = torch.isnan(rpf).all(dim=1)
    rewards = (rpf * torch.tensor(WEIGHTS).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    adv = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    mask = torch.tensor(inp["mask"])
    B = mask.shape[0]
    out = {"advantages": adv.tolist(), "cases": [], "trl": __import__("trl").__version__}
    for lt, beta, use_old in CASES:
        logps = torch.tensor(inp["logps"], requires_grad=True)
        acc = types.SimpleNamespace(num_processes=1, reduce=lambda t, reduction="sum": t, gather=lambda t: t,
                                    gather_for_metrics=lambda t: t)
        fake = types.SimpleNamespace(
            beta=beta, loss_type=lt, epsilon_low=EPS, epsilon_high=EPS_HIGH, top_entropy_quantile=1.0,
            off_policy_mask_threshold=None, importance_sampling_level="token", use_vllm=False,
            vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
            current_gradient_accumulation_steps=1, max_completion_length=MAX_COMPLETION, accelerator=acc,
            _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
            args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
            _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None))
        inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
                  "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
                  "advantages": adv, "num_items_in_batch": mask.sum()}
        if use_old:
            inputs["old_per_token_logps"] = torch.tensor(inp["old"])
        if beta:
            inputs["ref_per_token_logps"] = torch.tensor(inp["ref"])
        loss = GRPOTrainer._compute_loss(fake, None, inputs)
        loss.backward()
        out["cases"].append({"loss": float(loss.detach()), "grad": logps.grad.tolist()})
    return out


def _maxdiff(a, b) -> float:
    if isinstance(a, list):
        return max((_maxdiff(x, y) for x, y in zip(a, b)), default=0.0)
    return abs(a - b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", "/tmp/trlvenv/bin/python"))
    ap.add_argument("--tol", type=float, default=1e-6)
    ap.add_argument("--trl-side", metavar="INPUTS_JSON", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_side:
        print(json.dumps(trl_side(json.loads(Path(a.trl_side).read_text()))))
        return 0
    inp = fixed_inputs()
    mine = swiftlite_side(inp)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "inputs.json"
        p.write_text(json.dumps(inp))
        proc = subprocess.run([a.trl_python, __file__, "--trl-side", str(p)], capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 2
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    worst = _maxdiff(mine["advantages"], theirs["advantages"])
    print(f"TRL {theirs['trl']}: advantages max |diff| {worst:.2e}")
    for (lt, beta, old), m, t in zip(CASES, mine["cases"], theirs["cases"]):
        dl, dg = abs(m["loss"] - t["loss"]), _maxdiff(m["grad"], t["grad"])
        worst = max(worst, dl, dg)
        print(f"{lt:8s} beta {beta:<5g} old log-probs {'yes' if old else 'no ':3s}  swiftlite {m['loss']:+.9f}  "
              f"TRL {t['loss']:+.9f}  |loss diff| {dl:.2e}  max |grad diff| {dg:.2e}")
    print(f"worst {worst:.2e} (tolerance {a.tol:g})")
    return 0 if worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
