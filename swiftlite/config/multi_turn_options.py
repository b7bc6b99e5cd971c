"""GRPO's (and GKD's sampled steps') multi-turn rollout options (ms-swift's `--multi_turn_scheduler`, `--max_turns`,
`--completion_length_limit_scope`: swift/rlhf_trainers/args_mixin.py, its names and defaults). A base of
schema.RlhfConfig, kept here so that schema.py stays short; rlhf/multi_turn.py runs the turns,
`multi_turn_problem` (config/rules.py's GRPO rule) says which values run. Import-light (no torch).

The schedulers: ms-swift's built-in `math_tip_trick`, and in GRPO any name a plugin file registers in ms-swift's
`multi_turns` (a MultiTurnScheduler with step/check_finished: rlhf/plugin_turns.py). A plugin's name is known
only once --external_plugins ran, so here it is taken as given and checked before launch (GrpoTask.check).
ms-swift's `gym_scheduler` runs too (msswift_api/rollout.GYMScheduler, its environments `--gym_env`:
msswift_api/gym_env.py), and `--use_gym_env` trains on the environments' total rewards. ms-swift's
`thinking_tips_scheduler` runs (msswift_api/rollout.ThinkingModelTipsScheduler: one training row per turn,
rlhf/grpo_rows.py). ms-swift's `openenv_scheduler` is refused with the reason: it drives an OpenEnv
environment server.
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt

#: The schedulers swiftlite has (rlhf/multi_turn.SCHEDULERS implements them).
MULTI_TURN_SCHEDULERS = ("math_tip_trick",)
#: ms-swift's other built-in schedulers (swift/rollout/multi_turn.py `multi_turns`) and why each is refused.
OTHER_SCHEDULERS = {
    "openenv_scheduler": "drives an OpenEnv environment server, which swiftlite does not have",
}
LIMIT_SCOPES = ("per_round", "total")
#: the built-ins that verify an answer against the row's `solution` and give one tip: at most two turns
TIPPED = ("math_tip_trick", "thinking_tips_scheduler")
#: the built-in that makes each turn a training row of its own (ms-swift's dynamic_num_samples)
TURN_ROWS = "thinking_tips_scheduler"


@dataclass(kw_only=True)
class MultiTurnOptions(Section):
    multi_turn_scheduler: str | None = opt(None, "GRPO, GKD multi-turn rollouts: math_tip_trick (ms-swift's built-in): a "
                                           "completion whose answer does not verify against the row's `solution` "
                                           "(math_verify) is cut at its first <answer> or </think>, gets \"But "
                                           "wait... It seems I made a mistake,\" appended (not trained on: out of "
                                           "the loss) and is continued by the policy; the tip is given once. GRPO "
                                           "also: thinking_tips_scheduler (ms-swift's: a wrong answer gets a tip as "
                                           "the user's next message, once; each turn is a training row of its own, "
                                           "its earlier answers without their reasoning; with --loss-scale "
                                           "last_round each row trains its own turn), gym_scheduler (ms-swift's: "
                                           "--gym-env's environment writes the "
                                           "prompt, answers each turn and scores it), or a name an "
                                           "--external_plugins file registers (ms-swift's multi_turns[name] = a "
                                           "MultiTurnScheduler with step/check_finished). "
                                           "ms-swift's default: none (one turn).")
    max_turns: int | None = opt(None, "GRPO, GKD with --multi-turn-scheduler: most turns per completion (ms-swift's "
                                "default: none, the scheduler decides; math_tip_trick and thinking_tips_scheduler "
                                "stop after 2; the memory plan counts one turn of a plugin's scheduler without "
                                "it).")
    vllm_server_pass_dataset: bool = opt(False, "GRPO with --vllm-mode server and a --multi-turn-scheduler other than "
                                         "math_tip_trick (thinking_tips_scheduler, gym_scheduler, a plugin's): "
                                         "the scheduler's request.data_dict holds the row's columns (ms-swift's "
                                         "default false: an empty data_dict in server mode; colocated, it always "
                                         "holds them).")
    use_gym_env: bool | None = opt(None, "GRPO: train on each trajectory's total environment reward (a gym "
                                   "scheduler's rollout_infos['total_reward'], its steps' rewards summed) as one more "
                                   "reward, `gym_reward`, after --reward-funcs (the last --reward-weights value; the "
                                   "only reward without --reward-funcs). ms-swift's default: none: true when "
                                   "--gym-env is given, and in --vllm-mode server what the rollout server says.")
    gym_env: str | None = opt(None, "GRPO with --multi-turn-scheduler gym_scheduler: the environment each trajectory "
                              "plays (ms-swift's math_env, or a name an --external_plugins file registers in envs; a "
                              "row's env_config.name overrides it). ms-swift's default: none.")
    completion_length_limit_scope: str = opt("per_round", "GRPO, GKD with --multi-turn-scheduler: per_round (ms-swift's "
                                             "default): every turn generates up to --max-completion-length tokens; "
                                             "total: all turns together, the tip included.",
                                             choices=LIMIT_SCOPES)


#: The keys above (config/rules.py lists them among GRPO's own).
MULTI_TURN_KEYS = ("multi_turn_scheduler", "max_turns", "completion_length_limit_scope", "use_gym_env", "gym_env")


def gym_on(r: object) -> bool:
    """--use_gym_env as ms-swift resolves it: as given, else true when --gym_env is given."""
    return bool(r.use_gym_env) if r.use_gym_env is not None else r.gym_env is not None


def multi_turn_problem(r: object, explicit: set[str] | frozenset[str]) -> str | None:
    """The options' rule: a scheduler swiftlite has; the other two only with one; --use_gym_env in GRPO
    with a scheduler (in --vllm-mode server the rollout server's, known once it answers)."""
    s = r.multi_turn_scheduler
    if gym_on(r):
        if r.rlhf_type != "grpo":
            return f"--use-gym-env: a gym environment's reward trains GRPO, not {r.rlhf_type}: drop it"
        if s is None and not (r.use_vllm and r.vllm_mode == "server"):
            return ("--use-gym-env trains on the total reward of a gym scheduler's environment: add "
                    "--multi-turn-scheduler gym_scheduler (with --gym-env math_env or a plugin's) or a plugin's")
    elif r.gym_env is not None:
        return f"--gym-env {r.gym_env} with --use-gym-env false: the environment would give no reward; drop one"
    if s is None:
        given = [k for k in MULTI_TURN_KEYS[1:3] if k in explicit]
        return (f"--{given[0].replace('_', '-')} applies to multi-turn rollouts (--multi-turn-scheduler "
                f"{MULTI_TURN_SCHEDULERS[0]}): drop it or give the scheduler") if given else None
    if s in OTHER_SCHEDULERS:
        return (f"--multi-turn-scheduler {s}: not available here: it {OTHER_SCHEDULERS[s]}; swiftlite has "
                f"{', '.join(MULTI_TURN_SCHEDULERS)} and the schedulers --external_plugins files register")
    if s not in MULTI_TURN_SCHEDULERS and r.rlhf_type != "grpo":
        return (f"--multi-turn-scheduler {s}: runs in GRPO (it reads the prompt's messages, which "
                f"{r.rlhf_type}'s rows do not keep); {r.rlhf_type} has {', '.join(MULTI_TURN_SCHEDULERS)}")
    if r.max_turns is not None and r.max_turns < 1:
        return f"--max-turns {r.max_turns}: out of range (1 or more; none lets the scheduler decide)"
    return None


def split_problem(c: object) -> str | None:
    """Why this run cannot train a scheduler's several rows per request (thinking_tips_scheduler's, a plugin's
    that returns several rollouts for one: rlhf/grpo_rows.py), or None: what counts a micro-batch's rows."""
    if c.parallel.sequence_parallel_size > 1:
        return (f"--sequence-parallel-size {c.parallel.sequence_parallel_size} shares out a micro-batch's completions "
                "one row each; use 1")
    if c.data.padding_free:
        return "--padding-free true is not supported with them (ms-swift refuses it too); drop it"
    if c.rlhf.dynamic_sample:
        return "--dynamic-sample true replaces groups of one row per completion; drop it"
    if c.rlhf.loss_type == "real":
        return "--loss-type real weighs one row per completion; use another loss type"
    return None


def reward_weights_problem(r: object) -> str | None:
    """One --reward_weights value per reward: --reward_funcs, --reward_model, then --use_gym_env's."""
    n = len(r.reward_funcs) + len(r.reward_model or []) + gym_on(r)
    if r.reward_weights is None or len(r.reward_weights) == n:
        return None
    return (f"--reward-weights has {len(r.reward_weights)} values for {len(r.reward_funcs)} --reward-funcs and "
            f"{len(r.reward_model or [])} --reward-model" + (" and the gym reward (--use-gym-env)" if gym_on(r) else "")
            + " (one weight each, in that order)")


def scheduler_columns(r: object) -> tuple[str, ...]:
    """The dataset columns the run's scheduler reads from each row (math_tip_trick: `solution`;
    gym_scheduler with --gym_env math_env: `problem` and `solution`)."""
    if r.multi_turn_scheduler == "gym_scheduler" and r.gym_env == "math_env":
        return ("problem", "solution")
    return ("solution",) if r.multi_turn_scheduler in TIPPED else ()


def turn_bound(r: object) -> int:
    """The most turns a completion can take (the scheduler's own limit, --max-turns): what the memory
    planner multiplies --max-completion-length by under --completion-length-limit-scope per_round."""
    if r.multi_turn_scheduler is None:
        return 1
    if r.multi_turn_scheduler not in TIPPED:   # a plugin's: --max_turns, else one (said in the plan)
        return r.max_turns or 1
    most = 2    # math_tip_trick and thinking_tips_scheduler give their tip once: one more turn at most
    return most if r.max_turns is None else min(most, r.max_turns)


def rows_per_completion(r: object) -> int:
    """The training rows a completion can become: one per turn under thinking_tips_scheduler (the memory plan
    counts a micro-batch of that many rows, each as long as the whole completion), else one."""
    return turn_bound(r) if r.multi_turn_scheduler == TURN_ROWS else 1


def completion_tokens(r: object) -> int:
    """The longest completion a round can hold: --max_completion_length, per turn under per_round."""
    per_turn = r.completion_length_limit_scope == "per_round"
    return r.max_completion_length * (turn_bound(r) if per_turn else 1)


def describe_turns(r: object) -> str:
    """The run line's and --dry-run's words for the turns ('' for one-turn rounds)."""
    if r.multi_turn_scheduler is None:
        return ""
    if r.multi_turn_scheduler not in TIPPED and r.max_turns is None:
        return (f", multi-turn: {r.multi_turn_scheduler} (turns as the scheduler decides; the memory plan counts one "
                "turn: give --max-turns to count them)")
    rows = ", each turn a training row" if r.multi_turn_scheduler == TURN_ROWS else ""
    return (f", multi-turn: {r.multi_turn_scheduler} (up to {turn_bound(r)} turns{rows}, --max-completion-length "
            f"{'per turn' if r.completion_length_limit_scope == 'per_round' else 'in all'})")


def taken_turns(said: object, turns: dict) -> dict:
    """The config values a run takes with its rollout server's scheduler (launch/server_turns.py): the
    scheduler, --max_turns, --gym_env, --use_gym_env unless the run gave it (ms-swift's rule), and the
    server's plugin files after the run's own (`with_values` names)."""
    plugins = list(said.parallel.external_plugins)
    plugins += [p for p in turns["external_plugins"] if p not in plugins]
    out = {"multi_turn_scheduler": turns["multi_turn_scheduler"], "max_turns": turns["max_turns"],
           "external_plugins": plugins, "gym_env": turns.get("gym_env") or said.rlhf.gym_env}
    if said.rlhf.use_gym_env is None:
        out["use_gym_env"] = bool(turns.get("use_gym_env"))
    return out


__all__ = ["LIMIT_SCOPES", "MULTI_TURN_KEYS", "MULTI_TURN_SCHEDULERS", "MultiTurnOptions", "TIPPED", "TURN_ROWS",
           "completion_tokens", "describe_turns", "gym_on", "multi_turn_problem", "reward_weights_problem",
           "rows_per_completion", "scheduler_columns", "split_problem", "taken_turns", "turn_bound"]
