"""The rules about what a run's targets and loss are (ms-swift's --loss_scale, --loss_type for sft/pt,
--truncation_strategy split, --new_special_tokens, --enable_dft_loss, --router_aux_loss_coef): rules
of config/rules.py's table, kept here so that module stays short. Import-light (no torch)."""

from __future__ import annotations

from swiftlite.config.rule_table import rule
from swiftlite.config.schema import RunConfig
from swiftlite.config.tasks import task_spec
from swiftlite.config.loss_scale import LossScale, parse


@rule("loss scale")
def _loss_scale(c: RunConfig):
    v, binary = c.data.loss_scale, c.data.is_binary_loss_scale
    if v is None and binary is None:
        return None
    spec = task_spec(c.task)
    if binary is not None and (spec.plain_text or spec.own_options == "rlhf"):
        return (f"--is-binary-loss-scale {str(binary).lower()}: loss weights are for sft's chat rows; {c.task} "
                "has its own targets; drop the flag")
    if v is None:
        scale = parse(None, binary=binary)
    else:
        try:
            scale = parse(v, binary=binary)
        except ValueError as e:
            return f"--loss-scale {v}: {e}"
        if spec.plain_text and scale != LossScale("all"):
            return f"--loss-scale {v}: {c.task} trains every token of plain-text rows (all); drop the flag"
        if spec.own_options == "rlhf" and c.rlhf.rlhf_type == "gkd":   # sft rows: their targets, unweighted
            if not scale.is_binary:
                return (f"--loss-scale {v}: GKD's divergence takes no per-token weights; use a binary scale "
                        "(last_round, ms-swift's rlhf default; default: every assistant turn)")
        elif spec.own_options == "rlhf" and c.rlhf.rlhf_type == "grpo" and scale in (LossScale("default"),
                                                                                LossScale("last_round")):
            # the completion's tokens the policy sampled, every turn of a multi-turn one (ms-swift's default
            # there: `default`, every assistant turn); one turn is one assistant message, the same under both
            # last_round trains the last assistant message of a scheduler's rollout (its own run(): the rollout's
            # messages, rlhf/own_rollout.py; a plugin's is checked once its file is loaded, train/tasks.GrpoTask)
            from swiftlite.config.multi_turn_options import MULTI_TURN_SCHEDULERS
            if scale == LossScale("last_round") and c.rlhf.multi_turn_scheduler in (*MULTI_TURN_SCHEDULERS,
                                                                                  "gym_scheduler"):
                return (f"--loss-scale {v} with --multi-turn-scheduler {c.rlhf.multi_turn_scheduler}: GRPO trains "
                        "every turn the policy sampled (ms-swift's default with a scheduler: default); last_round "
                        "applies to schedulers that give their rollouts' messages (thinking_tips_scheduler, a "
                        "plugin's own run()); drop the flag")
        elif spec.own_options == "rlhf" and scale != LossScale("last_round"):
            return (f"--loss-scale {v}: rlhf trains on the answer of each pair or completion (last_round, ms-swift's "
                    "default there); drop the flag")
    if not scale.is_binary and c.train.loss_impl in ("liger", "cce"):
        what = f"--loss-scale {v}" if v is not None else "--is-binary-loss-scale false"
        return (f"{what} with --loss-impl {c.train.loss_impl}: the fused kernel returns only the summed "
                "loss, not each token's to weigh; use --loss-impl chunked (the default) or plain")


@rule("new special tokens")
def _new_tokens(c: RunConfig):
    if c.model.new_special_tokens and c.is_peft and not c.lora.modules_to_save:
        return ("--new_special_tokens with LoRA needs --modules_to_save embed_tokens lm_head: the new tokens' "
                "embedding rows are trained and saved there (a LoRA adapter alone leaves them at their "
                "random start)")


@rule("router aux loss")
def _router_aux(c: RunConfig):
    coef = c.train.router_aux_loss_coef
    if coef < 0:
        return f"--router-aux-loss-coef must be >= 0, got {coef:g}"
    if coef and task_spec(c.task).own_options == "rlhf":
        return "--router-aux-loss-coef adds to the token cross-entropy of sft and pt; rlhf has its own losses"


@rule("split truncation")
def _split(c: RunConfig):
    if c.data.truncation_strategy != "split":
        return None
    if not task_spec(c.task).plain_text:
        return ("--truncation-strategy split is for pt (ms-swift's rule: pre-training only); sft takes delete, "
                "left or right")
    if c.data.lazy_tokenize:
        return "--truncation-strategy split with --lazy-tokenize: a row's pieces are known only once it is tokenized"


@rule("dft loss")
def _dft(c: RunConfig):
    if not c.train.enable_dft_loss:
        return None
    if task_spec(c.task).own_options == "rlhf":
        return "--enable-dft-loss weights the token cross-entropy of sft and pt; rlhf has its own losses"
    if c.train.loss_impl in ("liger", "cce"):
        return (f"--enable-dft-loss with --loss-impl {c.train.loss_impl}: the fused kernel returns only the summed "
                "loss, not each token's; use --loss-impl chunked (the default) or plain")


#: This module's rules, as registered (config/rules.py imports this name, which registers them).
TARGET_RULES = (_loss_scale, _new_tokens, _router_aux, _split, _dft)
