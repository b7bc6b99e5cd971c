"""`swiftlite infer`: its flags -> `swiftlite.infer.InferOptions` (the work is in swiftlite/infer.py,
imported when the command runs)."""

from __future__ import annotations

from typing import Optional

import typer


def infer_cmd(
    model: str = typer.Option(..., "--model", "--model-id-or-path", "--model_id_or_path", "--ckpt", "--ckpt-dir",
                              "--ckpt_dir",
                              help="Preset name (random init with --seed), HF folder (an export), run folder or "
                                   "checkpoint, or hub id."),
    adapters: Optional[str] = typer.Option(None, "--adapters", help="A peft adapter folder to apply."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "--query",
                                         help="One user message; without it (and --dataset) a chat loop on a "
                                              "terminal, or one prompt per stdin line."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "--max_new_tokens", help="Tokens to generate."),
    dataset: Optional[str] = typer.Option(None, "--dataset", "--val-dataset", "--val_dataset",
                                          help="Score the greedy answers against the last assistant turn of "
                                               "each row (file or file#N); a reward model prints each row's "
                                               "reward (pairs: chosen and rejected, and the accuracy)."),
    limit: Optional[int] = typer.Option(None, "--limit", "--val-dataset-sample", "--val_dataset_sample",
                                        help="With --dataset: score only the first N rows."),
    metric: str = typer.Option("exact_match", "--metric", help="exact_match."),
    batch_size: int = typer.Option(16, "--batch-size", "--batch_size", "--max-batch-size", "--max_batch_size",
                                   help="Rows generated together with --dataset."),
    seed: int = typer.Option(42, "--seed", help="Seed (the random weights of built-in presets)."),
    dtype: str = typer.Option("auto", "--dtype", "--torch-dtype", "--torch_dtype",
                              help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32."),
    show: int = typer.Option(3, "--show", help="With --dataset: print this many predictions to stderr."),
    model_revision: Optional[str] = typer.Option(None, "--model-revision", "--model_revision",
                                                 help="A hub model id's branch, tag or commit."),
    response_prefix: Optional[str] = typer.Option(
        None, "--response-prefix", "--response_prefix",
        help="Text every answer starts with (ms-swift's; \\n is a newline): written after the chat template's "
             "generation prompt, the model continues from it, the answer printed begins with it. Default: a run "
             "folder's own (its args.json), else none."),
) -> None:
    """Greedy generation: one prompt, a chat loop, or exact-match accuracy on a dataset; a reward model
    (rlhf --rlhf_type rm) prints rewards instead."""
    from swiftlite.infer import InferOptions, run
    raise typer.Exit(run(InferOptions(model=model, adapters=adapters, prompt=prompt, system=system,
                                      max_new_tokens=max_new_tokens, dataset=dataset, limit=limit, metric=metric,
                                      batch_size=batch_size, seed=seed, dtype=dtype.lower(), show=show,
                                      model_revision=model_revision, response_prefix=response_prefix)))


def register(app: typer.Typer) -> None:
    """Add `infer` to an app of your own (swiftlite's app takes it from COMMANDS in cli/main.py)."""
    app.command("infer")(infer_cmd)
