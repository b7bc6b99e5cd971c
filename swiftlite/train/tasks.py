"""What each training command runs: its data pipeline, its batches, its step, its validation and the
engine setup it needs, as one small class per kind of task. sft and pt are `TokenTask`s (token-level
next-token loss on rows); rlhf is a `PreferenceTask` (pairs, swiftlite/rlhf/). Preflight and the
trainer both ask `task_of(cfg)`, so what is checked before launch is what trains:

    task = task_of(cfg)
    train, val, plan = task.prepare_data(cfg, tokenizer, world_size, progress=...)
    batches = task.make_batches(cfg, train, plan, tokenizer, world)   # what task.step_fn() consumes
    engine = task.setup_engine(run)         # rlhf: the reference (frozen copy, adapter off, precomputed)
    stats = task.step_fn()(engine, batches, step, data_step=..., before_optimizer=...)
    metrics = task.run_evaluate(run)        # {"eval_loss": ..., ...}

What the layers below the trainer need to know about a command (a row or a pair, a chat template or
plain text, the options only it takes) is its `spec` (config/tasks.py, import-free, so that config,
data, models, the planner and export read it without importing the trainer). Only this module
switches on the command; tests/unit/test_seams.py checks that nothing else compares `cfg.task`.

The methods import what they call inside their bodies: preflight asks for the data pipeline only, and
`swiftlite --help` imports no torch.
"""

from __future__ import annotations

from typing import Any, Callable

from swiftlite.config.tasks import TaskSpec, task_spec


class Task:
    """One training command. Subclasses give the five pieces; the facts come from `spec`."""

    def __init__(self, spec: TaskSpec):
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def unit(self) -> str:
        """What one sample is ("row" or "pair"), for messages."""
        return self.spec.unit

    @property
    def needs_chat_template(self) -> bool:
        return self.spec.needs_chat_template

    @property
    def sequences_per_sample(self) -> int:
        return self.spec.sequences_per_sample

    def check(self, cfg: Any) -> None:
        """The task's own checks that need neither the data nor a process group (preflight runs them,
        --dry-run included); a UserError refuses the run."""

    def wait_for_services(self, cfg: Any) -> None:
        """Wait for what the run needs outside itself (GRPO's rollout servers); preflight calls it once
        every other check has passed, so a missing service refuses the run before anything is written."""

    def prepare_data(self, cfg: Any, tokenizer: Any, world_size: int, *,
                     progress: Callable[[str, int], Any] | None = None) -> Any:
        """(train, validation or None, BatchPlan), with every check a run needs before it starts."""
        raise NotImplementedError

    def make_batches(self, cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> Any:
        """What the step reads: the tokenized samples and the step-indexed order over them."""
        raise NotImplementedError

    def step_fn(self) -> Callable[..., Any]:
        """(engine, batches, step, *, data_step=None, before_optimizer=None) -> StepStats."""
        raise NotImplementedError

    def run_evaluate(self, run: Any) -> dict:
        """{"eval_loss": float, ...} over the validation data, the same on every rank."""
        raise NotImplementedError

    def setup_engine(self, run: Any) -> Any:
        """The engine the loop drives (the backend's engine as built, unless the task adds to it)."""
        return run.engine

    def describe(self, run: Any) -> str:
        """What the first line of a run says about the task before its data (empty for sft/pt)."""
        return ""

    def dry_run_lines(self, cfg: Any) -> list[str]:
        """Lines `--dry-run` adds about the task (after the model line)."""
        return []


class TokenTask(Task):
    """sft and pt: summed next-token loss on target tokens of rows (train/step.py)."""

    def prepare_data(self, cfg: Any, tokenizer: Any, world_size: int, *,
                     progress: Callable[[str, int], Any] | None = None) -> Any:
        from swiftlite.data.pipeline import prepare_datasets
        return prepare_datasets(cfg, tokenizer, world_size, progress=progress)

    def make_batches(self, cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> Any:
        from swiftlite.train.step import token_batches
        return token_batches(cfg, train, plan, tokenizer, world)

    def step_fn(self) -> Callable[..., Any]:
        from swiftlite.train.step import train_step
        return train_step

    def run_evaluate(self, run: Any) -> dict:
        from swiftlite.train.evaluate import evaluate_run
        return evaluate_run(run)


class PreferenceTask(Task):
    """rlhf: DPO, ORPO, SimPO on chosen/rejected pairs (rlhf/step.py), with DPO's reference."""

    def prepare_data(self, cfg: Any, tokenizer: Any, world_size: int, *,
                     progress: Callable[[str, int], Any] | None = None) -> Any:
        from swiftlite.rlhf.data import prepare_pairs
        return prepare_pairs(cfg, tokenizer, world_size, progress=progress)

    def make_batches(self, cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> Any:
        from swiftlite.rlhf.step import pair_batches
        return pair_batches(cfg, train, plan, tokenizer, world)

    def step_fn(self) -> Callable[..., Any]:
        from swiftlite.rlhf.step import preference_step
        return preference_step

    def run_evaluate(self, run: Any) -> dict:
        from swiftlite.rlhf.step import evaluate_pairs
        return evaluate_pairs(run)

    def setup_engine(self, run: Any) -> Any:
        """Attach the reference to the batches; returns the engine the loop drives (rlhf/reference.py)."""
        from swiftlite.rlhf.reference import setup
        return setup(run)

    def describe(self, run: Any) -> str:
        """'dpo (sigmoid, beta 0.1, reference: ...), '."""
        m, ref = run.batches.method, run.batches.reference
        what = f"{m.loss_type}, " if m.kind == "dpo" else ""
        packs = getattr(run.train_data, "packs", None)
        return (f"{m.kind} ({what}beta {m.beta:g}"
                + (f", reference: {ref.kind}" if ref is not None else "") + "), "
                + (f"{len(packs)} packs of whole pairs (the global batch counts packs), " if packs is not None else ""))

    def dry_run_lines(self, cfg: Any) -> list[str]:
        from swiftlite.rlhf.loss import method_of
        m = method_of(cfg)
        return [f"preference:     {m.kind}, beta {m.beta:g}" + (f", {m.loss_type} loss" if m.kind == "dpo" else "")
                + "; batches count pairs"]   # the global batch counts pairs (2 sequences each)


class UnpairedTask(PreferenceTask):
    """rlhf --rlhf_type kto: unpaired rows with a desirable/undesirable label, with DPO's reference
    (rlhf/kto.py); a sample is a row."""

    @property
    def unit(self) -> str:
        return "row"

    def prepare_data(self, cfg: Any, tokenizer: Any, world_size: int, *,
                     progress: Callable[[str, int], Any] | None = None) -> Any:
        from swiftlite.rlhf.kto import prepare_unpaired
        return prepare_unpaired(cfg, tokenizer, world_size, progress=progress)

    def make_batches(self, cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> Any:
        from swiftlite.rlhf.kto import unpaired_batches
        return unpaired_batches(cfg, train, plan, tokenizer, world)

    def step_fn(self) -> Callable[..., Any]:
        from swiftlite.rlhf.kto import kto_step
        return kto_step

    def run_evaluate(self, run: Any) -> dict:
        from swiftlite.rlhf.kto import evaluate_unpaired
        return evaluate_unpaired(run)

    def describe(self, run: Any) -> str:
        m, ref = run.batches.method, run.batches.reference
        return (f"kto (beta {m.beta:g}, desirable_weight {m.desirable_weight:g}, undesirable_weight "
                f"{m.undesirable_weight:g}, reference: {ref.kind}), ")

    def dry_run_lines(self, cfg: Any) -> list[str]:
        from swiftlite.rlhf.kto import kto_method
        m = kto_method(cfg)
        return [f"preference:     kto, beta {m.beta:g}; batches count rows (each also scored against another "
                "row's completion for the KL estimate)"]


class RewardTask(PreferenceTask):
    """rlhf --rlhf_type rm: a reward model (score head) trained on the pairs (rlhf/rm.py); no reference."""

    def make_batches(self, cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> Any:
        from swiftlite.rlhf.rm import reward_batches
        return reward_batches(cfg, train, plan, tokenizer, world)

    def step_fn(self) -> Callable[..., Any]:
        from swiftlite.rlhf.rm import rm_step
        return rm_step

    def run_evaluate(self, run: Any) -> dict:
        from swiftlite.rlhf.rm import evaluate_rewards
        return evaluate_rewards(run)

    def setup_engine(self, run: Any) -> Any:
        return run.engine

    def describe(self, run: Any) -> str:
        c = run.batches.method.center_rewards_coefficient
        return "rm (reward model: score head, pairwise loss" + (f", center_rewards_coefficient {c:g}" if c else "") + "), "

    def dry_run_lines(self, cfg: Any) -> list[str]:
        return ["preference:     rm (a reward model: the causal LM's config with a 1-output score head); batches "
                "count pairs"]


def _wait_for_rollout_servers(cfg: Any) -> None:
    """--use_vllm true --vllm_mode server (GRPO, GKD): the servers answer before any rank starts (ms-swift
    connects at start too)."""
    r = cfg.rlhf
    if r.use_vllm and r.vllm_mode == "server":
        from swiftlite.rlhf.rollout_client import server_urls, wait_for_servers
        wait_for_servers(server_urls(r), r.vllm_server_timeout)


class GrpoTask(Task):
    """rlhf --rlhf_type grpo: online RL on prompts (rlhf/grpo.py): each step's completions are sampled
    from the policy and scored by --reward_funcs; a sample is a completion (the global batch counts them)."""

    def check(self, cfg: Any) -> None:
        from swiftlite.plugin import check_reward_funcs
        from swiftlite.rlhf.teacher import check_teacher
        check_reward_funcs(cfg.rlhf.reward_funcs)
        check_teacher(cfg)
        if cfg.rlhf.multi_turn_scheduler:
            from swiftlite.rlhf.multi_turn import SCHEDULERS, check_installed
            from swiftlite.rlhf.plugin_turns import check_scheduler
            name = cfg.rlhf.multi_turn_scheduler
            check_installed(name) if name in SCHEDULERS else check_scheduler(name)
            if name not in SCHEDULERS:
                from swiftlite.errors import UserError
                from swiftlite.msswift_api.rollout import multi_turns, owns_rollout
                own = owns_rollout(multi_turns[name])
                if own and cfg.parallel.parallelism == "fsdp1" and not cfg.rlhf.use_vllm:
                    from swiftlite.rlhf.own_rollout import OWN_LOCKSTEP
                    raise UserError(f"--multi_turn_scheduler {name}: {multi_turns[name].__name__} {OWN_LOCKSTEP}")
                if not own and cfg.data.loss_scale == "last_round":   # config/rules_targets.py: known only now
                    raise UserError(f"--loss_scale last_round with --multi_turn_scheduler {name}: its turns are driven "
                                    "by swiftlite's turn loop, which trains every turn the policy sampled (ms-swift's "
                                    "default with a scheduler: default); last_round applies to a scheduler whose own "
                                    "run() gives its rollouts' messages; drop the flag")
        if cfg.rlhf.gym_env is not None:   # registered (a plugin's, loaded by now) and able to score
            from swiftlite.rlhf.plugin_turns import check_gym_env
            check_gym_env(cfg.rlhf.gym_env)
            if cfg.rlhf.gym_env == "math_env":
                from swiftlite.math_answers import check_installed as check_math
                check_math("--gym_env math_env")

    def wait_for_services(self, cfg: Any) -> None:
        _wait_for_rollout_servers(cfg)

    def prepare_data(self, cfg: Any, tokenizer: Any, world_size: int, *,
                     progress: Callable[[str, int], Any] | None = None) -> Any:
        from swiftlite.rlhf.grpo_data import prepare_prompts
        return prepare_prompts(cfg, tokenizer, world_size, progress=progress)

    def make_batches(self, cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> Any:
        from swiftlite.rlhf.grpo import grpo_batches
        return grpo_batches(cfg, train, plan, tokenizer, world)

    def step_fn(self) -> Callable[..., Any]:
        from swiftlite.rlhf.grpo import grpo_step
        return grpo_step

    def run_evaluate(self, run: Any) -> dict:
        return {}       # no validation data: prepare_prompts refuses it

    def setup_engine(self, run: Any) -> Any:
        from swiftlite.rlhf.grpo import setup
        return setup(run)

    def describe(self, run: Any) -> str:
        b = run.batches
        o, p = b.loss, b.plan
        ref = f", reference: {b.reference_kind}" if b.reference is not None else ""
        ref += (f", teacher: {b.teacher_kind}, --teacher-kl-coef {b.options.teacher_kl_coef:g}"
                if b.teacher is not None else "")
        ref += (f", CHORD: {len(b.chord.rows)} expert rows, {b.chord.per_device} per micro-batch"
                if b.chord is not None else "")
        from swiftlite.rlhf.grpo import estimator_choices
        scale, in_reward = estimator_choices(b.options)
        adv = (f"; {b.options.advantage_estimator} advantages, scaled by {scale}"
               + (", KL in the rewards" if in_reward and o.beta != 0.0 else ""))
        from swiftlite.config.grpo_variant_options import describe_variants
        from swiftlite.config.multi_turn_options import describe_turns
        return (f"grpo ({o.loss_type} loss{describe_variants(b.options)}, beta {o.beta:g}{ref}{adv}; "
                f"{p.num_generations} completions per prompt, "
                f"{p.round_prompts} prompts per generation round, rewards "
                f"{', '.join(r.key for r in b.rewards) or 'none'}{describe_turns(b.options)}), ")

    def dry_run_lines(self, cfg: Any) -> list[str]:
        from swiftlite.config.grpo_variant_options import describe_variants
        from swiftlite.config.multi_turn_options import describe_turns
        r = cfg.rlhf
        return [f"grpo:           {r.loss_type or 'grpo'} loss{describe_variants(r)}, "
                f"beta {0.04 if r.beta is None else r.beta:g}, "
                f"{r.num_generations} completions per prompt, rewards "
                f"{', '.join([*r.reward_funcs, *(r.reward_model or [])]) or 'none'}"
                + (f", teacher {r.teacher_model} (x {r.teacher_kl_coef:g} per token)" if r.teacher_model else "")
                + describe_turns(r) + "; batches count completions"]


class GkdTask(Task):
    """rlhf --rlhf_type gkd: distillation on sft rows (rlhf/gkd.py): the student learns the teacher's
    next-token distributions on the rows' targets, or (--lmbda) on its own sampled responses."""

    def check(self, cfg: Any) -> None:
        from swiftlite.rlhf.teacher import check_teacher
        check_teacher(cfg)
        if cfg.rlhf.multi_turn_scheduler:
            from swiftlite.rlhf.multi_turn import check_installed
            check_installed(cfg.rlhf.multi_turn_scheduler)

    def wait_for_services(self, cfg: Any) -> None:
        _wait_for_rollout_servers(cfg)
        if cfg.rlhf.teacher_model_server:   # the teacher server answers before anything launches
            from swiftlite.rlhf.teacher_server import wait_for_server
            wait_for_server(cfg.rlhf.teacher_model_server, cfg.rlhf.vllm_server_timeout)

    def prepare_data(self, cfg: Any, tokenizer: Any, world_size: int, *,
                     progress: Callable[[str, int], Any] | None = None) -> Any:
        """sft's rows; their targets by --loss_scale, whose rlhf default is ms-swift's last_round (the
        assistant turns after the last user turn: the response a sampled step replaces). With
        --multi_turn_scheduler the rows keep the column it verifies against (config/multi_turn_options.py)."""
        from swiftlite.config.multi_turn_options import scheduler_columns
        from swiftlite.data.pipeline import prepare_datasets
        from swiftlite.data.teacher_view import COLUMN
        if cfg.data.loss_scale is None:
            cfg = cfg.with_values(loss_scale="last_round")
        # OPSD's teacher_prompt column: the teacher's own prompt, tokenized with each row (data/teacher_view.py)
        from swiftlite.data.pipeline import PROMPTS
        # --lmbda 1: every step samples the responses, so a row may be a prompt alone (OPSD's rows are)
        keep = (*scheduler_columns(cfg.rlhf), COLUMN, *((PROMPTS,) if cfg.rlhf.lmbda >= 1 else ()))
        out = prepare_datasets(cfg, tokenizer, world_size, progress=progress, keep=keep)   # packing refuses it
        if cfg.rlhf.multi_turn_scheduler and not hasattr(out[0], "split"):   # lazy rows: checked as sampled
            from swiftlite.rlhf.gkd import check_columns
            check_columns(cfg.rlhf, out[0].rows)
        return out

    def make_batches(self, cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> Any:
        from swiftlite.rlhf.gkd import gkd_batches
        return gkd_batches(cfg, train, plan, tokenizer, world)

    def step_fn(self) -> Callable[..., Any]:
        from swiftlite.rlhf.gkd import gkd_step
        return gkd_step

    def run_evaluate(self, run: Any) -> dict:
        from swiftlite.rlhf.gkd import evaluate_gkd
        return evaluate_gkd(run)

    def setup_engine(self, run: Any) -> Any:
        from swiftlite.rlhf.gkd import setup
        return setup(run)

    def describe(self, run: Any) -> str:
        from swiftlite.config.multi_turn_options import describe_turns
        b = run.batches
        return (f"gkd (beta {b.beta:g}, lmbda {b.options.lmbda:g}, teacher: {b.teacher_kind}"
                f"{describe_turns(b.options)}), ")

    def dry_run_lines(self, cfg: Any) -> list[str]:
        from swiftlite.config.gkd_options import describe_gkd
        return [f"gkd:            {describe_gkd(cfg.rlhf)}; batches count rows"]


#: rlhf methods whose task is not PreferenceTask's pairs (by --rlhf_type).
RLHF_TASKS: dict[str, Task] = {
    "kto": UnpairedTask(task_spec("rlhf")),
    "rm": RewardTask(task_spec("rlhf")),
    "grpo": GrpoTask(TaskSpec("rlhf", unit="prompt", sequences_per_sample=1, chat=True, own_options="rlhf")),
    "gkd": GkdTask(TaskSpec("rlhf", unit="row", sequences_per_sample=1, chat=True, own_options="rlhf")),
}

TASKS: dict[str, Task] = {
    "sft": TokenTask(task_spec("sft")),
    "pt": TokenTask(task_spec("pt")),
    "rlhf": PreferenceTask(task_spec("rlhf")),
}


def task_of(cfg: Any) -> Task:
    """The command's task: by command, and for rlhf by --rlhf_type (pairs unless RLHF_TASKS says)."""
    task = TASKS[cfg.task]
    if task.spec.own_options == "rlhf":
        return RLHF_TASKS.get(cfg.rlhf.rlhf_type, task)
    return task


__all__ = ["GkdTask", "GrpoTask", "PreferenceTask", "RLHF_TASKS", "TASKS", "Task", "RewardTask", "TokenTask", "UnpairedTask",
           "task_of"]
