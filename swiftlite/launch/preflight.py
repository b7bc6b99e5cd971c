"""Every check that needs no process group, run once in the launching process before anything is
created: a run that fails validation leaves nothing behind and starts no rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swiftlite.checkpoint.run_dir import check_output_dir
from swiftlite.config import RunConfig
from swiftlite.errors import Refusals, UserError

if TYPE_CHECKING:
    from swiftlite.job import Resolved


def check_lora_targets(cfg: RunConfig, source: Any) -> None:
    """--target-modules names (not all-linear alone) checked against the model built on the meta device
    (no weights read): a name that is not in the model or not adaptable fails here, not in the rank."""
    tuner = cfg.train.train_type in ("boft", "bone")   # their blocks against the layers: models/lora.check_tuner
    if not cfg.is_peft or (cfg.lora.target_modules == ["all-linear"] and not tuner) or source.kind == "hub":
        return  # all-linear is checked with the loaded model; a hub model's config may not be here yet
    import torch

    from swiftlite.models.loading import model_config
    from swiftlite.models.lora import check_targets, check_tuner
    from swiftlite.models.sharded import _empty_model
    model = _empty_model(model_config(cfg, source), torch.float32, {})
    check_tuner(model, cfg, check_targets(model, cfg))


def resolve_for_launch(cfg: RunConfig, world_size: int) -> "Resolved":
    """The run, resolved in the launching process (swiftlite/job.py): its GPUs stand for the job's; a
    rank resolves again only if the smallest GPU of the whole job differs (mixed machines)."""
    from swiftlite.job import resolve_run
    from swiftlite.parallel.resolve import local_gpu_memory
    return resolve_run(cfg, world_size, gpu_memory=local_gpu_memory, gpus_per_node=cfg.parallel.nproc_per_node)


def preflight(cfg: RunConfig, world_size: int | None, *, data: bool = True,
              refusals: Refusals | None = None) -> "Resolved | None":
    """Validate everything a run can get wrong before any process starts or any file is written:
    output folder, resume checkpoint (intact and free of unsafe pickles), model, DeepSpeed config,
    and (data=True) the datasets themselves: every row read, converted and tokenized (which fills the
    tokenization cache the ranks then read), the usable-row count against one global batch.
    Creates nothing but cache files. Returns the job's facts (the backend choice among them), which
    the launcher hands to the ranks.

    Every check runs, and all their refusals are raised together, with the run's earlier ones
    (`refusals`: the flags' and the rules', errors.Refusals), one line each: a check whose input was
    refused (a field it reads, the model folder, the output folder, the world size) is passed over.
    The datasets are read only when nothing was refused (their reading depends on most of the config,
    and it writes the tokenization cache)."""
    from swiftlite.checkpoint.run_dir import resume_point
    from swiftlite.config import field_reads
    from swiftlite.data.sources import check_spec
    found = refusals if refusals is not None else Refusals(watch=field_reads)
    run_dir = found.check(check_output_dir, cfg)
    from swiftlite.parallel.loss import check_loss_options
    found.check(check_loss_options, cfg)
    resume = found.check(resume_point, cfg, run_dir, log=lambda *_: None) if run_dir is not None else None
    for spec in cfg.data.dataset:
        found.check(check_spec, spec, "--dataset")
    for spec in cfg.data.val_dataset:
        found.check(check_spec, spec, "--val-dataset")
    for spec in cfg.rlhf.chord_sft_dataset:
        found.check(check_spec, spec, "--chord-sft-dataset")
    from swiftlite.data import cached
    for flag, specs in (("--cached_dataset", cfg.data.cached_dataset), ("--cached_val_dataset", cfg.data.cached_val_dataset)):
        for spec in specs:
            found.check(cached.check_spec, spec, flag)
    from swiftlite.models.loading import check_attn_impl, resolve_model
    source = None if found.blocked(("model",)) else found.check(resolve_model, cfg.model.model, about=("model",))
    if source is not None:
        if cfg.is_peft and cfg.lora.init_weights == "loftq" and source.kind == "preset":
            from swiftlite.models.lora import apply_loftq
            found.check(apply_loftq, None, cfg, None)   # the one-line refusal, before launch
        # a local folder: weights, no code of its own
        if found.check(lambda: source.check_folder(cfg.model.trust_remote_code) or True, about=("model",)):
            found.check(check_lora_targets, cfg, source)
            from swiftlite.models.llamapro import check_model
            found.check(check_model, cfg, source)
            from swiftlite.models.adapter import check_model as check_adapter_model
            found.check(check_adapter_model, cfg, source)
            from swiftlite.models.loading import check_moe_options
            found.check(check_moe_options, cfg, source)
            from swiftlite.train.lisa import check_layers
            found.check(check_layers, cfg, source)
    # --torch-dtype auto, the model's context length (where they need the model's config or the GPU)
    # and the backend, once (swiftlite/job.py); a backend may come from a plugin
    facts = None
    if world_size is not None and source is not None:
        facts = found.check(resolve_for_launch, cfg, world_size, needs=("external_plugins",))
    run_cfg = facts.config if facts is not None else cfg   # the concrete config, once resolved
    found.check(check_attn_impl, run_cfg)
    if facts is not None:
        from swiftlite.train.run import skeleton_mode
        found.check(skeleton_mode, run_cfg, facts.choice)   # refuses an adapter peft computes from weights a skeleton lacks
        from swiftlite.optim import optim_problem
        found.check(_refuse, optim_problem, run_cfg, facts.choice)
        from swiftlite.train.adalora import adalora_problem
        found.check(_refuse, adalora_problem, run_cfg, facts.choice)
        from swiftlite.models.lora_ga import lora_ga_problem
        found.check(_refuse, lora_ga_problem, run_cfg, facts.choice)
        from swiftlite.models.llamapro import backend_problem
        found.check(_refuse, backend_problem, run_cfg, facts.choice)
        from swiftlite.models.adapter import backend_problem as adapter_backend
        found.check(_refuse, adapter_backend, run_cfg, facts.choice)
        from swiftlite.train.lisa import lisa_problem
        found.check(_refuse, lisa_problem, run_cfg, facts.choice)
        from swiftlite.models.hqq import hqq_problem
        found.check(_refuse, hqq_problem, run_cfg, facts.choice)
        if run_cfg.parallel.sequence_parallel_size > 1:   # the world and the heads it splits
            from swiftlite.models.loading import model_config
            from swiftlite.parallel.sequence import problem as sequence_problem
            found.check(_refuse, sequence_problem, run_cfg.parallel.sequence_parallel_size, world_size,
                        model_config(run_cfg, source))
        if resume is not None:
            from swiftlite.checkpoint.state import weights_only_problem
            # a --save_only_model checkpoint, another format
            found.check(_refuse, weights_only_problem, resume, run_cfg, facts.choice)
    from swiftlite.metrics import check_report_to
    from swiftlite.optim import check_scheduler
    found.check(check_report_to, run_cfg)
    found.check(check_scheduler, run_cfg)
    from swiftlite.train.tasks import task_of
    task = task_of(run_cfg)
    found.check(task.check, run_cfg, needs=("external_plugins",))   # GRPO: reward names (plugins register theirs)
    found.raise_all()
    task.wait_for_services(run_cfg)          # GRPO's rollout servers: once all else passed
    if facts is not None and world_size is not None:   # a server's multi-turn scheduler (ms-swift's split)
        from swiftlite.launch.server_turns import adopt
        facts = adopt(facts, world_size, resolve_for_launch)
        run_cfg = facts.config
    d, t = run_cfg.data, run_cfg.train
    if t.eval_strategy != "no" and "eval_strategy" in cfg.explicit and not (d.val_dataset or d.split_dataset_ratio > 0):
        # ms-swift's rule (sft_args.py): without validation data the eval strategy becomes no
        print(f"--eval_strategy {t.eval_strategy}: no validation data (--val_dataset or --split_dataset_ratio), so "
              "nothing is evaluated (ms-swift's rule)", flush=True)
    if not data:
        return facts
    from swiftlite.models.loading import load_tokenizer
    tokenizer = load_tokenizer(run_cfg, source)
    from swiftlite.parallel.sequence import data_world   # a sequence-parallel group shares its rows
    data_size = world_size if world_size is None else data_world(0, world_size, run_cfg.parallel.sequence_parallel_size)[1]
    prepared = task_of(run_cfg).prepare_data(run_cfg, tokenizer, data_size)   # sft/pt: data.pipeline.prepare_datasets
    if run_cfg.train.train_type == "adalora":   # its schedule against the run's steps, known from here on
        from swiftlite.models.tuners import check_schedule
        from swiftlite.train.run import total_steps
        check_schedule(run_cfg, total_steps(run_cfg, prepared[2].steps_per_epoch))
    return facts


def _refuse(problem: Any, *args: Any) -> None:
    """A check that returns its refusal (or None) as one that raises it."""
    why = problem(*args)
    if why:
        raise UserError(why)
