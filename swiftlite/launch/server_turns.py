"""A rollout server's multi-turn scheduler, taken by the GRPO run it serves (ms-swift's split of the options).

In ms-swift the scheduler is an option of `swift rollout` (`--multi_turn_scheduler`, `--max_turns`,
`--external_plugins` on the server command), and the training command in `--vllm_mode server` names none:
its scripts (examples/train/grpo/plugin/run_external_scheduler.sh) start the server with the scheduler and
the training without. swiftlite's server samples what it is asked and the run drives the turns
(rlhf/multi_turn.py), so the run reads the servers' scheduler (their /get_world_size/ answer) once, before
launch, after it waited for them (launch/preflight.py), and makes it a fact of the job: `Resolved.turns`,
which job.concrete_config applies to the config every stage and every rank reads (as it applies the dtype),
with the server's plugin files added to --external_plugins. The memory plan is made again with the turns.

Rules: every server names the same scheduler (or none); a run that names its own must name the same one;
GRPO only (GKD's sampled steps take --multi_turn_scheduler on their own command).
"""

from __future__ import annotations

from typing import Any

from swiftlite.errors import UserError

#: what a server's /get_world_size/ answer holds about its scheduler (rollout/server.RolloutOptions)
KEYS = ("multi_turn_scheduler", "max_turns", "external_plugins", "use_gym_env", "gym_env")


def server_turns(cfg: Any) -> dict | None:
    """The scheduler the run's rollout servers name ({KEYS}), or None (no server, or none names one)."""
    r = cfg.rlhf
    if not (r.use_vllm and r.vllm_mode == "server"):
        return None
    from swiftlite.rlhf.rollout_client import _get, server_urls
    urls = server_urls(r)
    named = []
    for url in urls:
        info = _get(url + "/get_world_size/", timeout=30)
        named.append({k: info.get(k) for k in KEYS} if info.get("multi_turn_scheduler") else None)
    first = named[0]
    other = next((i for i, n in enumerate(named) if n != first), None)
    if other is not None:
        raise UserError(f"the rollout servers name different multi-turn schedulers ({urls[0]}: {_said(first)}; "
                        f"{urls[other]}: {_said(named[other])}): start them with the same ones")
    if first is None:
        return None
    if r.rlhf_type != "grpo":
        raise UserError(f"the rollout server at {urls[0]} names {_said(first)}: {r.rlhf_type}'s sampled steps take "
                        "--multi_turn_scheduler on the training command; start the server without it")
    mine = (r.multi_turn_scheduler, r.max_turns)
    if r.multi_turn_scheduler is not None and mine != (first["multi_turn_scheduler"], first["max_turns"]):
        said = _said({"multi_turn_scheduler": r.multi_turn_scheduler, "max_turns": r.max_turns})
        raise UserError(f"{said}: the rollout server at {urls[0]} names {_said(first)}; give the scheduler on one "
                        "command only")
    first["external_plugins"] = list(first.get("external_plugins") or [])
    return first


def _check_rewards(cfg: Any) -> None:
    """What the GRPO rules left to the servers' answer: rewards to train on (a server's gym rewards, where
    the run has none of its own) and one --reward_weights value each."""
    from swiftlite.config.multi_turn_options import gym_on, reward_weights_problem
    from swiftlite.config.rules_teacher import NO_REWARDS
    r = cfg.rlhf
    if r.rlhf_type != "grpo":
        return
    if not (r.reward_funcs or r.reward_model or r.teacher_model or gym_on(r)):
        raise UserError(NO_REWARDS + "; the rollout server gives no gym rewards (its --use_gym_env)")
    why = reward_weights_problem(r)
    if why:
        raise UserError(why)


def _said(t: dict | None) -> str:
    if t is None:
        return "no scheduler"
    return f"--multi_turn_scheduler {t['multi_turn_scheduler']}" + (
        f" --max_turns {t['max_turns']}" if t.get("max_turns") is not None else "")


def adopt(facts: Any, world_size: int, resolve: Any, log: Any = print) -> Any:
    """The job's facts with the servers' scheduler (as they were without one), resolved again by
    `resolve(config, world_size)` (preflight's) with its turns; its plugin files loaded here."""
    from dataclasses import replace
    turns = server_turns(facts.config)
    if turns is None:
        _check_rewards(facts.config)
        return facts
    from swiftlite.parallel.base import load_missing_plugins
    from swiftlite.rlhf.multi_turn import SCHEDULERS
    name = turns["multi_turn_scheduler"]
    # every file the server loaded: it may register the scheduler, or (a built-in gym scheduler) its environment
    load_missing_plugins(turns["external_plugins"])
    if name in SCHEDULERS:   # as GrpoTask.check checks a scheduler the run names itself
        from swiftlite.rlhf.multi_turn import check_installed
        check_installed(name)
    else:
        from swiftlite.rlhf.plugin_turns import check_scheduler
        check_scheduler(name)
    from swiftlite.config.multi_turn_options import taken_turns
    said = facts.said
    again = resolve(said.with_values(**taken_turns(said, turns)), world_size)
    _check_rewards(again.config)
    if again.config.rlhf.gym_env is not None:
        from swiftlite.rlhf.plugin_turns import check_gym_env
        check_gym_env(again.config.rlhf.gym_env)
    log(f"rollout server: {_said(turns)}" + (f" (from {', '.join(turns['external_plugins'])})"
                                              if turns["external_plugins"] else "") + "; this run drives the turns")
    return replace(again, turns=turns, said=said)


__all__ = ["KEYS", "adopt", "server_turns"]
