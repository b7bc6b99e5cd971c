"""The output folder: a hidden temp folder next to --output, the model card, values checked against
the export dtype, and the atomic move into place."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from swiftlite.checkpoint.store import replace_dir
from swiftlite.errors import UserError
from swiftlite.export.source import Source
from swiftlite.hf_io import make_readable


@dataclass
class ExportResult:
    output: Path
    kind: str                      # "model" | "adapter"
    files: list[str]
    tensors: int
    bytes: int
    base_desc: str | None = None
    verify: dict[str, Any] | None = None


def cast_checked(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast floating tensors to the export dtype; values that overflow it are an error, not infs."""
    if not t.is_floating_point() or t.dtype == dtype:
        return t
    out = t.to(dtype)
    if dtype == torch.float16 and not bool(torch.isfinite(out).all()) and bool(torch.isfinite(t).all()):
        raise UserError(f"{name}: values exceed the fp16 range (max |x| = {float(t.abs().max()):.3g}); "
                        "export with --dtype bf16")
    return out


def write_readme(out: Path, src: Source, info: dict[str, Any]) -> None:
    """A model card: what was exported from what, how to serve it, and the run's training config."""
    lines = ["---", "library_name: " + ("peft" if info["kind"] == "adapter" else "transformers"),
             "tags: [swiftlite]"]
    if info.get("hub_base"):
        lines.append(f"base_model: {info['hub_base']}")
    lines += ["---", "", f"# {info['output_name']}", "",
              "Exported by `swiftlite export`.", "",
              "| | |", "|---|---|",
              f"| source | `{src.path}` |",
              f"| step | {src.step if src.step is not None else '-'} |",
              f"| training | {src.train_type}, backend {src.backend or '-'} x {src.world_size or '-'} |",
              f"| weights read from | {info['weights_from']} |",
              f"| base model | {info.get('base_desc', '-')} |",
              f"| export | {info['what']} |",
              f"| dtype | {info['dtype']} |",
              f"| files | {info['files']} |",
              f"| exported | {time.strftime('%Y-%m-%d %H:%M:%S')} |", ""]
    d = info["final_path"]
    if info["kind"] == "adapter":
        lines += ["## Use", "", "A peft LoRA adapter (not merged). With its base model:", "", "```bash",
                  f"swiftlite infer --model {info.get('infer_base', 'BASE')} --adapters {d} --prompt '...'"]
        if info.get("base_is_builtin"):
            lines += ["```", "", "The base is a swiftlite built-in model (random weights from the seed): to serve "
                      "with vLLM or LMDeploy, export with `--merge-lora` instead.", ""]
        else:
            lines += [f"vllm serve {info.get('base_ref') or 'BASE'} --enable-lora --lora-modules adapter={d}",
                      "```", "", f"or merge it into the base: `swiftlite export --ckpt {src.path} --merge-lora "
                      "--output DIR`.", ""]
    else:
        lines += ["## Use", "", "```bash", f"vllm serve {d}", f"lmdeploy serve api_server {d}",
                  f"swiftlite infer --model {d} --prompt '...'", "```", ""]
    if src.cfg is not None and src.form == "checkpoint":
        lines += ["## Training config (args.json)", "", "```json",
                  json.dumps(src.cfg.to_dict(), indent=2), "```", ""]
    (out / "README.md").write_text("\n".join(lines))


def append_readme(out: Path, text: str) -> None:
    with (out / "README.md").open("a") as fh:
        fh.write(text)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare_output(output: str, overwrite: bool, src: Source) -> tuple[Path, Path]:
    """(final folder, temp folder next to it); refuses an existing output unless --overwrite."""
    out = Path(output).expanduser().resolve()
    if out.exists():
        if not overwrite:
            raise UserError(f"--output {output}: already exists; pass --overwrite to replace it")
        if not out.is_dir():
            raise UserError(f"--output {output}: exists and is a file")
        for protected in (src.path, src.run_dir):
            if protected is not None and (protected == out or out in protected.parents):
                raise UserError(f"--output {output}: holds the checkpoint being exported; choose another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.export-tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not _pid_alive(int(pid)) or int(pid) == os.getpid():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    tmp.mkdir()
    return out, tmp


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished temp folder to the output (replacing an old one only now), through the
    same rename-and-fsync as checkpoints (`checkpoint.store.replace_dir`)."""
    for p in tmp.iterdir():
        if p.is_file():
            make_readable(p)  # safetensors writes 0600; servers often run as another user
    make_readable(tmp)
    replace_dir(tmp, out, out.parent / f".{out.name}.export-old-{os.getpid()}")


@contextlib.contextmanager
def replacing(tmp: Path) -> Iterator[Path]:
    """A sibling folder to write the quantized form into; on success it replaces `tmp` (the export's
    hidden work folder), on any failure it is removed and `tmp` is left as it was."""
    qdir = tmp.with_name(tmp.name + "-q")
    shutil.rmtree(qdir, ignore_errors=True)
    try:
        yield qdir
        shutil.rmtree(tmp, ignore_errors=True)
        qdir.rename(tmp)
    except BaseException:
        shutil.rmtree(qdir, ignore_errors=True)
        raise


def copy_other_files(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """The files of `src` the quantized save did not write (tokenizer, chat template, README, ...):
    every file but the weights, those `dst` already has, and `skip`."""
    for p in src.iterdir():
        if p.is_file() and not (dst / p.name).exists() and p.name not in skip and not _is_weight(p.name):
            shutil.copy2(p, dst / p.name)


def _is_weight(name: str) -> bool:
    return name.endswith(".safetensors") or name == "model.safetensors.index.json"
