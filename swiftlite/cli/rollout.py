"""`swiftlite rollout` and `swiftlite deploy`: their flags -> `swiftlite.rollout.server.RolloutOptions` (the
server is in swiftlite/rollout/server.py, imported when the command runs). `deploy` is the same server
started with ms-swift's `swift deploy` flags and defaults, for what a GKD run asks a teacher server
(`/v1/completions` with prompt_logprobs, vLLM's OpenAI API).

ms-swift's `swift rollout` flags: both spellings of every multi-word flag, a switch bare or with a
value (`--vllm_enable_prefix_caching true`). ms-swift's rollout options swiftlite's server does not
have are refused all at once, each with its reason (exit 2).
"""

from __future__ import annotations

import sys
from typing import Optional

import typer
import typer.core

from swiftlite.errors import UserError

_SCHEDULER = ("a context manager rewrites a trajectory's earlier turns (ms-swift's scheduler option); swiftlite's runs "
              "continue the sampled tokens turn by turn, so earlier turns stay as sampled: drop the flag")
#: ms-swift rollout options (RolloutArguments and the vLLM part of DeployArguments, ms-swift 3602360a) that
#: swiftlite's server does not take, with their reasons.
REFUSED = {
    "context_manager": _SCHEDULER,
    "vllm_max_lora_rank": "the server always gets the run's merged weights (base + B@A x scale), no LoRA adapter: "
                          "drop the flag",
    **{k: "the server takes the run's prompts as token ids and answers token ids: no chat template, tokenizer or "
          "stop words of its own; drop the flag" for k in ("template", "system", "stop_words", "max_new_tokens",
                                                           "temperature", "top_k", "top_p")},
}
#: ms-swift deploy options (DeployArguments, 3602360a) whose absence a user of `swift deploy` would miss.
DEPLOY_REFUSED = {
    **{k: "the server scores token ids a run sends (/v1/completions with prompt_logprobs) and has no chat template, "
          "adapters or sampling of its own; drop the flag" for k in
       ("adapters", "template", "system", "max_new_tokens", "temperature", "top_k", "top_p", "stream",
        "infer_backend_kwargs", "api_key", "ssl_keyfile", "ssl_certfile")},
}
SWITCHES = ("--vllm_enable_prefix_caching", "--vllm-enable-prefix-caching", "--vllm_enforce_eager",
            "--vllm-enforce-eager", "--vllm_enable_lora", "--vllm-enable-lora", "--vllm_use_async_engine",
            "--vllm-use-async-engine")
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class _RolloutCommand(typer.core.TyperCommand):
    """All of ms-swift's refused options at once, and a bare switch read as `true` (as export's)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        from swiftlite.errors import raise_all
        known = {name for p in self.params for name in p.opts} | set(ctx.help_option_names)
        problems, out = [], []
        for i, a in enumerate(args):
            name = a.partition("=")[0]
            key = name[2:].replace("-", "_") if name.startswith("--") else None
            if key is not None and name not in known:
                cmd = ctx.info_name or "rollout"
                why = (REFUSED if cmd == "rollout" else DEPLOY_REFUSED).get(
                    key, f"not an option of swiftlite {cmd} (swiftlite {cmd} --help)")
                problems.append(f"{name}: {why}")
            out.append(a)
            if a in SWITCHES and (i + 1 == len(args) or args[i + 1].startswith("-")):
                out.append("true")
        raise_all(problems)
        return super().parse_args(ctx, out)


def _switch(flag: str, value: str) -> bool:
    v = value.lower()
    if v not in TRUE + FALSE:
        raise UserError(f"{flag} {value}: true or false")
    return v in TRUE


#: The engine options of --infer_backend vllm (their parameter names in rollout_cmd).
VLLM_ONLY = ("gpu_mem", "max_model_len", "max_num_seqs", "prefix_caching", "enforce_eager")


#: options both commands take (the same typer declarations)
_REVISION = typer.Option(None, "--model_revision", "--model-revision", help="A hub model id's branch, tag or commit.")
_TP = typer.Option(1, "--vllm_tensor_parallel_size", "--vllm-tensor-parallel-size",
                   help="vLLM: GPUs one engine spans (tensor parallel).")
_GPU_MEM = typer.Option(0.9, "--vllm_gpu_memory_utilization", "--vllm-gpu-memory-utilization",
                        help="vLLM: fraction of each GPU's memory the engine may take.")
_MAX_MODEL_LEN = typer.Option(None, "--vllm_max_model_len", "--vllm-max-model-len",
                              help="vLLM: context length (default: the model's).")


def _dtype(torch_dtype: str) -> str:
    """--torch_dtype checked, in swiftlite's short names."""
    if torch_dtype.lower() not in ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"):
        raise UserError(f"--torch_dtype {torch_dtype}: auto, bf16, fp16 or fp32")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(torch_dtype.lower(), torch_dtype.lower())


def rollout_cmd(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", help="The run's --model: an HF folder or hub id (a built-in preset "
                                                   "with --infer_backend transformers)."),
    host: str = typer.Option("0.0.0.0", "--host", help="Address to listen on (ms-swift's default)."),
    port: int = typer.Option(8000, "--port", help="HTTP port (ms-swift's default); the run's --vllm_server_port."),
    infer_backend: str = typer.Option("vllm", "--infer_backend", "--infer-backend",
                                      help="vllm (ms-swift's only rollout engine; a CUDA GPU) or transformers "
                                           "(swiftlite's addition: generate on any device, CPUs included)."),
    torch_dtype: str = typer.Option("auto", "--torch_dtype", "--torch-dtype",
                                    help="auto (the model's for vLLM; bf16 on GPU, fp32 on CPU for transformers), "
                                         "bf16, fp16, fp32."),
    seed: int = typer.Option(42, "--seed", help="Engine seed (each completion has its own seed from the run)."),
    model_revision: Optional[str] = _REVISION,
    tp: int = _TP,
    gpu_mem: float = _GPU_MEM,
    max_model_len: Optional[int] = _MAX_MODEL_LEN,
    max_num_seqs: Optional[int] = typer.Option(None, "--vllm_max_num_seqs", "--vllm-max-num-seqs",
                                               help="vLLM: most sequences at once (default 256)."),
    prefix_caching: str = typer.Option("true", *SWITCHES[:2], help="vLLM: reuse shared prompt prefixes' KV cache."),
    enforce_eager: str = typer.Option("false", *SWITCHES[2:4], help="vLLM: no CUDA graphs."),
    dp: int = typer.Option(1, "--vllm_data_parallel_size", "--vllm-data-parallel-size", "--data_parallel_size",
                           "--data-parallel-size", help="Copies of the engine behind this server, each in its own "
                                                        "process on its own --vllm_tensor_parallel_size GPUs (the "
                                                        "visible ones in order; on CPUs, a share of the threads): "
                                                        "the weights reach all, each request's micro-batches are "
                                                        "dealt among them (ms-swift's)."),
    enable_lora: str = typer.Option("false", *SWITCHES[4:6], help="Accepted for ms-swift's commands: the run sends "
                                                                 "merged weights, so no adapter is loaded."),
    multi_turn_scheduler: Optional[str] = typer.Option(
        None, "--multi_turn_scheduler", "--multi-turn-scheduler",
        help="The multi-turn scheduler of the GRPO runs this server serves (math_tip_trick, gym_scheduler, or "
             "one an --external_plugins file registers). As ms-swift's, it is the server's option; here the run reads it "
             "(with --max_turns and the plugin files) from the server before launch and drives the turns, asking "
             "the server for each one."),
    max_turns: Optional[int] = typer.Option(None, "--max_turns", "--max-turns",
                                            help="With --multi_turn_scheduler: the most turns per completion."),
    external_plugins: list[str] = typer.Option(
        [], "--external_plugins", "--external-plugins",
        help="Python files that register --multi_turn_scheduler's scheduler (ms-swift's flag); the run loads them "
             "too, from the path the server gives (the same machine or a shared file system)."),
    use_gym_env: Optional[str] = typer.Option(
        None, "--use_gym_env", "--use-gym-env",
        help="The served runs train on their gym environments' total rewards (ms-swift's default: true when "
             "--gym_env is given); the run takes it from the server unless it gives its own."),
    gym_env: Optional[str] = typer.Option(
        None, "--gym_env", "--gym-env",
        help="With --multi_turn_scheduler gym_scheduler: the environment each trajectory plays (math_env, or one "
             "an --external_plugins file registers in envs); the run takes it from the server."),
    async_engine: str = typer.Option("false", *SWITCHES[6:],
                                     help="Accepted for ms-swift's commands (its server needs vLLM's async engine to "
                                          "run schedulers): here each turn is one batched request, so no async "
                                          "engine is used (said when true)."),
) -> None:
    """Serve GRPO's generation for runs in --vllm_mode server (ms-swift's `swift rollout`)."""
    from swiftlite.rollout.server import RolloutOptions, serve
    if infer_backend not in ("vllm", "transformers"):
        raise UserError(f"--infer_backend {infer_backend}: vllm or transformers")
    dt = _dtype(torch_dtype)
    if tp < 1 or not 0 < gpu_mem <= 1:
        raise UserError(f"--vllm_tensor_parallel_size {tp} --vllm_gpu_memory_utilization {gpu_mem}: >= 1 and in (0, 1]")
    if dp < 1:
        raise UserError(f"--vllm_data_parallel_size {dp}: 1 or more")
    if tp > 1 and infer_backend == "transformers":
        raise UserError("--vllm_tensor_parallel_size with --infer_backend transformers: one process generates; use vllm")
    if infer_backend == "transformers":
        # by the source's name: typer carries a click of its own, whose ParameterSource is another enum
        given = [p.opts[0] for p in ctx.command.params
                 if p.name in VLLM_ONLY and getattr(ctx.get_parameter_source(p.name), "name", "") != "DEFAULT"]
        if given:   # ms-swift's commands carry them; the transformers engine has no such settings: said
            print(f"{', '.join(given)}: vLLM engine options, not used by --infer_backend transformers",
                  file=sys.stderr, flush=True)
    plugins = _turn_options(multi_turn_scheduler, max_turns, external_plugins)
    gym = _switch("--use_gym_env", use_gym_env) if use_gym_env is not None else gym_env is not None
    if (gym or gym_env) and multi_turn_scheduler is None:
        raise UserError(f"{'--gym_env' if gym_env else '--use_gym_env'} applies to a gym scheduler's runs: give "
                        "--multi_turn_scheduler gym_scheduler (or a plugin's) or drop the flag")
    if gym_env is not None:
        from swiftlite.rlhf.plugin_turns import check_gym_env
        check_gym_env(gym_env)
    if _switch("--vllm_use_async_engine", async_engine):   # ms-swift's multi-turn scripts carry it: said
        print("--vllm_use_async_engine true: the run asks for each turn as one batched request; vLLM's async engine "
              "is not used (the completions are the same)", file=sys.stderr, flush=True)
    lora = _switch("--vllm_enable_lora", enable_lora)
    if lora:   # accepted so that ms-swift's commands start; said, as the run says it (docs/rlhf.md "Rollout server")
        print("--vllm_enable_lora true: the run sends its merged weights every round, so no LoRA adapter is loaded "
              "(the completions are the same)", file=sys.stderr, flush=True)
    raise typer.Exit(serve(RolloutOptions(
        model=model, host=host, port=port, infer_backend=infer_backend, torch_dtype=dt, seed=seed,
        model_revision=model_revision, vllm_tensor_parallel_size=tp, vllm_gpu_memory_utilization=gpu_mem,
        vllm_max_model_len=max_model_len, vllm_max_num_seqs=max_num_seqs,
        vllm_enable_prefix_caching=_switch("--vllm_enable_prefix_caching", prefix_caching),
        vllm_enforce_eager=_switch("--vllm_enforce_eager", enforce_eager),
        vllm_enable_lora=lora, vllm_data_parallel_size=dp, multi_turn_scheduler=multi_turn_scheduler,
        max_turns=max_turns, external_plugins=plugins, use_gym_env=gym, gym_env=gym_env)))


def _turn_options(name: str | None, max_turns: int | None, plugins: list[str]) -> tuple[str, ...]:
    """The scheduler checked as a run would check it (a built-in, or registered by the plugin files and able
    to run: rlhf/plugin_turns.check_scheduler); the plugin files as absolute paths, which the run loads."""
    from pathlib import Path
    if name is None:
        given = [f for f, v in (("--max_turns", max_turns), ("--external_plugins", plugins)) if v]
        if given:
            raise UserError(f"{given[0]} applies to --multi_turn_scheduler (the scheduler the served runs use): give "
                            "one or drop the flag")
        return ()
    if max_turns is not None and max_turns < 1:
        raise UserError(f"--max_turns {max_turns}: 1 or more")
    from swiftlite.config.multi_turn_options import MULTI_TURN_SCHEDULERS, OTHER_SCHEDULERS
    if name in OTHER_SCHEDULERS:
        raise UserError(f"--multi_turn_scheduler {name}: not available here: it {OTHER_SCHEDULERS[name]}")
    from swiftlite.parallel.base import load_plugins
    load_plugins(plugins)
    if name not in MULTI_TURN_SCHEDULERS:
        from swiftlite.rlhf.plugin_turns import check_scheduler
        check_scheduler(name)
    return tuple(str(Path(p).expanduser().resolve()) for p in plugins)


rollout_cmd.command_settings = {"cls": _RolloutCommand}


def deploy_cmd(
    model: str = typer.Option(..., "--model", help="The teacher: an HF folder or hub id (a built-in preset with "
                                                   "--infer_backend transformers)."),
    host: str = typer.Option("0.0.0.0", "--host", help="Address to listen on (ms-swift's default)."),
    port: int = typer.Option(8000, "--port", help="HTTP port (ms-swift's default); the run's --teacher_model_server."),
    infer_backend: str = typer.Option("transformers", "--infer_backend", "--infer-backend",
                                      help="transformers (ms-swift's default; any device) or vllm (a CUDA GPU)."),
    torch_dtype: str = typer.Option("auto", "--torch_dtype", "--torch-dtype", help="auto, bf16, fp16, fp32."),
    seed: int = typer.Option(42, "--seed", help="Engine seed."),
    model_revision: Optional[str] = _REVISION,
    served_model_name: Optional[str] = typer.Option(None, "--served_model_name", "--served-model-name",
                                                    help="The name /v1/models gives (default: --model)."),
    max_logprobs: int = typer.Option(20, "--max_logprobs", "--max-logprobs",
                                     help="The most prompt_logprobs a request may ask (ms-swift's default 20); a "
                                          "GKD run's --gkd_logits_topk must not exceed it."),
    max_length: Optional[int] = typer.Option(None, "--max_length", "--max-length",
                                             help="The longest prompt served, in tokens (default: the model's)."),
    tp: int = _TP,
    gpu_mem: float = _GPU_MEM,
    max_model_len: Optional[int] = _MAX_MODEL_LEN,
) -> None:
    """Serve a model's prompt log-probabilities for a GKD run's --teacher_model_server (ms-swift's `swift
    deploy`): vLLM's OpenAI /v1/completions with prompt token ids and prompt_logprobs, and /v1/models. The
    same server as `swiftlite rollout` (its GRPO endpoints too)."""
    from swiftlite.rollout.server import RolloutOptions, serve
    if infer_backend not in ("vllm", "transformers", "pt"):
        raise UserError(f"--infer_backend {infer_backend}: transformers or vllm")
    if max_logprobs < 0 or (max_length is not None and max_length < 1):
        raise UserError(f"--max_logprobs {max_logprobs} --max_length {max_length}: >= 0 and >= 1")
    dt = _dtype(torch_dtype)
    raise typer.Exit(serve(RolloutOptions(
        model=model, host=host, port=port, infer_backend="transformers" if infer_backend == "pt" else infer_backend,
        torch_dtype=dt, seed=seed, model_revision=model_revision, vllm_tensor_parallel_size=tp,
        vllm_gpu_memory_utilization=gpu_mem, vllm_max_model_len=max_model_len, max_logprobs=max_logprobs,
        served_model_name=served_model_name, max_length=max_length, command="deploy")))


deploy_cmd.command_settings = {"cls": _RolloutCommand}


def register(app: typer.Typer) -> None:
    """Add `rollout` to an app of your own (swiftlite's app takes it from COMMANDS in cli/main.py)."""
    app.command("rollout", cls=_RolloutCommand)(rollout_cmd)
    app.command("deploy", cls=_RolloutCommand)(deploy_cmd)
