"""Any swiftlite checkpoint -> a Hugging Face folder (16-bit safetensors) that vLLM and LMDeploy load.

    swiftlite export --ckpt RUN_OR_CHECKPOINT --output DIR [--merge-lora] [--dtype bf16] [--verify]

What `--ckpt` may be
    a run folder            its `latest` checkpoint (refused, with the reason, if that one is broken)
    checkpoint-N/           dcp/ (single, ddp, fsdp, fsdp1), ds/ (DeepSpeed ZeRO-1/2/3), adapter/ (LoRA)
    a peft adapter folder   adapter_config.json + adapter_model.safetensors (needs --base-model)
    an HF model folder      config.json + *.safetensors (re-sharded and cast)

Where the weights come from
    full fine-tune, torch   the DCP shards, read offline (no process group) a few tensors at a time
    full fine-tune, ZeRO    the fp32 master partitions of the ZeRO optimizer files (DeepSpeed's
                            zero_to_fp32 helpers; ZeRO-2 partitions are stitched lazily here, ZeRO-3
                            through DeepSpeed's lazy GatheredTensor), memory-mapped
    LoRA / QLoRA            checkpoint-N/adapter/ (else the trainable tensors of dcp/ or ds/) plus the
                            base model named in the run's args.json (or --base-model)

Memory: tensors stream from the checkpoint into `hf_io.write_sharded`, which flushes a shard as soon
as it reaches --max-shard-size; a read batch is at most half a shard, so the export's peak memory is
about 1.5 shards plus the largest tensor, whatever the model size. QLoRA merges hold the 4-bit base
(what the run trained against, quantized the same way) and dequantize it one layer at a time.

Atomicity: everything is written into a hidden `.NAME.export-tmp-PID` folder next to --output, which is
renamed to --output only when complete (and verified, with --verify). An interrupted export leaves only
that hidden folder, which the next export removes.

User mistakes (not a checkpoint, base model missing, adapter/base mismatch, output exists) are
UserErrors: one line, exit 2. A failed --verify is a VerifyError: exit 1 and nothing is published.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from swiftlite import checkpoint as ckpt
from swiftlite import dtypes
from swiftlite.errors import UserError
from swiftlite.hf_io import write_config, write_generation_config, write_tokenizer

OUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RUN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Logit agreement of the export (run in its dtype) with the training-side model (fp32), as
# max |diff| / max |reference logit|: at most this, or twice what the training-side model itself loses
# when cast to the export dtype, whichever is larger (docs/export.md). The e2e models land at 0.5-0.7%
# in bf16.
TOLERANCE = {"bf16": 0.04, "fp16": 0.01}

# Names that must never reach an exported (merged) model.
PEFT_MARKERS = ("base_layer", "lora_", "modules_to_save", "original_module", "lora_magnitude")

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


class VerifyError(Exception):
    """--verify found a problem; the export is not published (exit 1)."""


# --------------------------------------------------------------------------------------------------
# Options and the checkpoint being exported

@dataclass
class ExportOptions:
    ckpt: str
    output: str
    base_model: str | None = None
    merge_lora: bool = False
    dtype: str = "bf16"
    max_shard_size: int = 5 * 10**9
    verify: bool = False
    overwrite: bool = False
    log: Callable[[str], None] = field(default=lambda msg: print(f"export: {msg}", flush=True))


@dataclass
class Source:
    """What --ckpt holds, and where its base model comes from."""
    arg: str
    path: Path                       # checkpoint folder, adapter folder or HF folder
    form: str                        # "checkpoint" | "adapter" | "hf"
    train_type: str = "full"         # full | lora | qlora
    backend: str | None = None
    world_size: int | None = None
    step: int | None = None
    run_dir: Path | None = None
    cfg: Any = None                  # RunConfig of the run (args.json), base possibly overridden
    base_from: str = "args.json"     # where the base model name came from (for messages)
    weights: str = "hf"              # "dcp" | "deepspeed" | "adapter" | "hf"

    @property
    def is_peft(self) -> bool:
        return self.train_type in ("lora", "qlora")

    @property
    def dcp_dir(self) -> Path:
        return self.path / "dcp"

    @property
    def adapter_dir(self) -> Path | None:
        if self.form == "adapter":
            return self.path
        d = self.path / "adapter"
        return d if (d / "adapter_config.json").is_file() else None

    @property
    def hf_dir(self) -> Path | None:
        if self.form == "hf":
            return self.path
        d = self.path / "model"
        return d if (d / "config.json").is_file() else None

    def describe(self) -> str:
        if self.form == "checkpoint":
            return (f"{self.path} (step {self.step}, {self.train_type}, {self.backend} x {self.world_size})")
        return f"{self.path} ({self.form} folder)"


def resolve_checkpoint(arg: str) -> tuple[Path, str]:
    """--ckpt -> (folder, form). A run folder means its `latest` checkpoint."""
    p = Path(arg).expanduser()
    if not p.exists():
        raise UserError(f"--ckpt {arg}: no such folder")
    if not p.is_dir():
        raise UserError(f"--ckpt {arg}: not a checkpoint (a file; pass a run folder or a checkpoint-N folder)")
    p = p.resolve()
    if p.name.startswith(".tmp-" + ckpt.PREFIX):
        raise UserError(f"--ckpt {arg}: an incomplete checkpoint (its save did not finish)")
    if (p / ckpt.MANIFEST).is_file() or (p / "trainer_state.json").is_file():
        why = ckpt.verify_checkpoint(p, deep=False)
        if why:
            raise UserError(f"--ckpt {arg}: not a usable checkpoint ({why})")
        return p, "checkpoint"
    if (p / "adapter_config.json").is_file():
        return p, "adapter"
    latest = p / ckpt.LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        c = p / name
        why = ckpt.verify_checkpoint(c, deep=False) if c.is_dir() else "missing"
        if why:
            raise UserError(f"--ckpt {arg}: its latest checkpoint {name} is not usable ({why}); "
                            "pass an older checkpoint-N folder explicitly")
        return c, "checkpoint"
    found = [c for c in reversed(ckpt.list_checkpoints(p)) if ckpt.verify_checkpoint(c, deep=False) is None]
    if found:
        return found[0], "checkpoint"
    if (p / "config.json").is_file() and (list(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file()):
        return p, "hf"
    raise UserError(f"--ckpt {arg}: not a checkpoint (no {ckpt.MANIFEST}, no `latest`, no checkpoint-N "
                    "folder, no adapter_config.json)")


def inspect_source(arg: str, base_model: str | None, log: Callable[[str], None]) -> Source:
    """Classify --ckpt and attach the run's config (base model, quantization, seed)."""
    from swiftlite.config import build_config, load_args
    path, form = resolve_checkpoint(arg)
    src = Source(arg=arg, path=path, form=form)
    if form == "checkpoint":
        try:
            state = json.loads((path / "trainer_state.json").read_text())
        except (OSError, ValueError):
            raise UserError(f"--ckpt {arg}: {path.name}/trainer_state.json is missing or unreadable") from None
        src.train_type = state.get("train_type", "full")
        src.backend = state.get("backend")
        src.world_size = state.get("world_size")
        src.step = state.get("global_step")
        src.run_dir = path.parent
        if (path / "dcp" / ".metadata").is_file():
            src.weights = "dcp"
        elif (path / "ds").is_dir() or src.backend == "deepspeed":
            src.weights = "deepspeed"
        elif src.adapter_dir is not None:
            src.weights = "adapter"
        else:
            raise UserError(f"--ckpt {arg}: {path.name} holds no model weights (no dcp/, ds/ or adapter/)")
        args_file = path.parent / "args.json"
        if args_file.is_file():
            try:
                src.cfg = load_args(args_file)
            except UserError as e:
                raise UserError(f"--ckpt {arg}: cannot read the run's args.json ({e})") from None
        else:
            # A checkpoint copied away from its run: rebuild what trainer_state.json records.
            values = {"train_type": src.train_type, "model": state.get("model") or "tiny-llama",
                      "torch_dtype": state.get("torch_dtype") or "fp32"}
            src.cfg = build_config(values, source=str(path / "trainer_state.json"))
            if src.is_peft or src.hf_dir is None:
                log(f"warning: no args.json next to {path.name}; assuming default seed/quantization settings "
                    f"for base model {values['model']}")
    elif form == "adapter":
        src.train_type = "lora"
        src.weights = "adapter"
        if base_model is None:
            conf = json.loads((path / "adapter_config.json").read_text())
            base_model = conf.get("base_model_name_or_path")
            if not base_model:
                raise UserError(f"--ckpt {arg}: a bare adapter folder; pass --base-model (its base model)")
            src.base_from = "adapter_config.json"
        src.cfg = build_config({"train_type": "lora", "model": base_model}, source="--base-model")
    else:
        src.weights = "hf"
        src.cfg = build_config({"model": str(path)}, source="--ckpt")
    if base_model is not None and form != "hf":
        src.cfg.model.model = base_model
        if src.base_from != "adapter_config.json":
            src.base_from = "--base-model"
    return src


def resolve_base(src: Source) -> Any:
    """The run's base model as a ModelSource; a missing one is a UserError saying where it came from."""
    from swiftlite.models.loading import resolve_model
    name = src.cfg.model.model
    try:
        ms = resolve_model(name)
    except UserError as e:
        msg = str(e)
        if msg.startswith(f"--model {name}: "):
            msg = msg[len(f"--model {name}: "):]
        raise UserError(f"base model {name} (from {src.base_from}) is not available: {msg}; "
                        "pass --base-model PATH") from None
    if ms.kind == "hub":
        ms = _download_hub(ms, src)
    return ms


def _download_hub(ms: Any, src: Source) -> Any:
    """A hub id: the local snapshot (downloaded when online), as a folder source."""
    from swiftlite.models.loading import ModelSource
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(ms.ref, revision=src.cfg.model.model_revision,
                                   allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja",
                                                   "tokenizer*"])
    except Exception as e:  # offline, gated, unknown id
        raise UserError(f"base model {ms.ref} (from {src.base_from}) is not available: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; pass --base-model PATH") from None
    return ModelSource("folder", folder, ms.preset)


# --------------------------------------------------------------------------------------------------
# Tensor readers: shapes up front, tensors a batch at a time

class TensorReader:
    """names() in checkpoint order, shape/dtype per name, read(names) -> {name: tensor}."""
    info: dict[str, tuple[torch.Size, torch.dtype]]

    def names(self) -> list[str]:
        return list(self.info)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _batches(reader: TensorReader, names: list[str], budget: int) -> Iterator[list[str]]:
    """Consecutive names whose source bytes add up to at most `budget` (one name may exceed it)."""
    batch: list[str] = []
    size = 0
    for n in names:
        shape, dtype = reader.info[n]
        b = _nbytes(shape, dtype)
        if batch and size + b > budget:
            yield batch
            batch, size = [], 0
        batch.append(n)
        size += b
    if batch:
        yield batch


def stream(reader: TensorReader, names: list[str], budget: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, reading `budget` bytes at a time; nothing is kept after it is yielded."""
    throttle = float(os.environ.get("SWIFTLITE_EXPORT_THROTTLE_S", "0") or 0)  # tests: slow exports down
    for batch in _batches(reader, names, budget):
        got = reader.read(batch)
        for n in batch:
            t = got.pop(n)
            if throttle:
                time.sleep(throttle)
            yield n, t
            del t  # hold nothing while the next batch is read
        del got


class DCPReader(TensorReader):
    """The model entries ("model.<fqn>") of a torch.distributed.checkpoint folder, read offline."""

    def __init__(self, dcp_dir: Path, prefix: str = "model."):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        ckpt.check_dcp_metadata(dcp_dir)  # allow-list unpickler first: DCP reads .metadata with pickle

        class _CachedReader(FileSystemReader):
            _md = None

            def read_metadata(self, *a: Any, **kw: Any) -> Any:  # read (and unpickle) once
                if self._md is None:
                    self._md = super().read_metadata(*a, **kw)
                return self._md

        self.dir = dcp_dir
        self.prefix = prefix
        self.reader = _CachedReader(str(dcp_dir))
        md = self.reader.read_metadata()
        self.info = {}
        for k, v in md.state_dict_metadata.items():
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata):
                self.info[k[len(prefix):]] = (v.size, v.properties.dtype)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        import warnings

        import torch.distributed.checkpoint as dcp
        inner = {n: torch.empty(self.info[n][0], dtype=self.info[n][1]) for n in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": intended
            dcp.load({self.prefix.rstrip("."): inner}, storage_reader=self.reader, no_dist=True)
        return inner


class SafetensorsReader(TensorReader):
    """An HF folder's *.safetensors, tensor by tensor (safe_open reads only what is asked)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            wm = json.loads(index.read_text())["weight_map"]
            files = list(dict.fromkeys(wm.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise UserError(f"{folder}: no *.safetensors weights")
        self.file_of: dict[str, str] = {}
        self.info = {}
        for fn in files:
            with safe_open(str(folder / fn), "pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    self.file_of[k] = fn
                    self.info[k] = (torch.Size(sl.get_shape()), _st_dtype(sl.get_dtype()))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open
        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of[n], []).append(n)
        for fn, ns in by_file.items():
            with safe_open(str(self.folder / fn), "pt") as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
        return out


def _st_dtype(name: str) -> torch.dtype:
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}.get(name, torch.float32)


class ModelReader(TensorReader):
    """Weights of an in-memory model (built-in presets, bitsandbytes-quantized bases).

    A 4-bit layer's weight is dequantized with bitsandbytes.functional.dequantize_4bit when read, an
    8-bit one with int8_vectorwise_dequant: the values the run's forward used."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.tensors: dict[str, tuple[torch.nn.Module, str, torch.Tensor]] = {}
        self.info = {}
        self.quantized = 0
        for mname, mod in model.named_modules():
            own = list(mod.named_parameters(recurse=False))
            non_persistent = getattr(mod, "_non_persistent_buffers_set", set())
            own += [(n, b) for n, b in mod.named_buffers(recurse=False) if n not in non_persistent]
            for n, t in own:
                full = f"{mname}.{n}" if mname else n
                if full in self.tensors:
                    continue
                shape, dtype = torch.Size(t.shape), t.dtype
                qs = getattr(t, "quant_state", None)
                if qs is not None:
                    shape, dtype = torch.Size(qs.shape), qs.dtype
                    self.quantized += 1
                elif getattr(t, "SCB", None) is not None or getattr(mod, "state", None) is not None and \
                        getattr(getattr(mod, "state", None), "SCB", None) is not None and n == "weight":
                    dtype = torch.float16
                    self.quantized += 1
                self.tensors[full] = (mod, n, t)
                self.info[full] = (shape, dtype)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self._value(n) for n in names}

    def _value(self, name: str) -> torch.Tensor:
        mod, n, t = self.tensors[name]
        return tensor_value(mod, n, t)


def tensor_value(mod: torch.nn.Module, n: str, t: torch.Tensor) -> torch.Tensor:
    """A module's parameter as the forward uses it: bitsandbytes 4-bit/8-bit weights dequantized."""
    qs = getattr(t, "quant_state", None)
    if qs is not None:
        import bitsandbytes.functional as bf
        return bf.dequantize_4bit(t.data, qs).reshape(qs.shape).detach().cpu()
    scb = getattr(t, "SCB", None)
    if scb is None and n == "weight":
        scb = getattr(getattr(mod, "state", None), "SCB", None)
    if scb is not None and t.dtype == torch.int8:
        import bitsandbytes.functional as bf
        return bf.int8_vectorwise_dequant(t.data, scb).detach().cpu()
    return t.detach().cpu()


class ZeroReader(TensorReader):
    """fp32 weights of a DeepSpeed ZeRO checkpoint (checkpoint-N/ds/), without a process group.

    DeepSpeed's zero_to_fp32 parses the files (through a weights_only torch.load: no arbitrary
    pickles) and builds ZeRO-3 parameters lazily; ZeRO-1/2 partitions are stitched here one parameter
    at a time instead of DeepSpeed's whole-model torch.cat. Optimizer files are memory-mapped."""

    ALLOWED = ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum",
               "deepspeed.utils.tensor_fragment.fragment_address")

    def __init__(self, ckpt_dir: Path, *, exclude_frozen: bool):
        z = _zero_to_fp32()
        tag_file = ckpt_dir / "latest"
        tag = tag_file.read_text().strip() if tag_file.is_file() else "ds"
        ds_dir = ckpt_dir / tag
        if not ds_dir.is_dir():
            raise UserError(f"{ckpt_dir}: no DeepSpeed checkpoint folder {tag}/")
        sink = io.StringIO()
        try:
            with _safe_torch_load(self.ALLOWED), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                states = z.parse_model_states(z.get_model_state_files(str(ds_dir)))
                stage, world, flat, paddings = z.parse_optim_states(z.get_optim_files(str(ds_dir)), str(ds_dir))
                sd: dict[str, Any] = dict(states[0].buffers)
                if not exclude_frozen and states[0].frozen_param_shapes:
                    if stage <= 2:
                        z._zero2_merge_frozen_params(sd, states)
                    else:
                        z._zero3_merge_frozen_params(sd, world, states)
                if stage <= 2:
                    _zero2_lazy(sd, world, flat, states[0].param_shapes, paddings)
                else:
                    z._zero3_merge_trainable_params(sd, world, flat, states)
                for alias, target in states[0].shared_params:
                    if target in sd:
                        sd[alias] = sd[target]
        except UserError:
            raise
        except (FileNotFoundError, ValueError, KeyError) as e:
            raise UserError(f"{ds_dir}: not a readable ZeRO checkpoint ({str(e).splitlines()[0]})") from None
        except Exception as e:
            if "weights_only" in str(e) or "Unsupported global" in str(e) or "UnpicklingError" in type(e).__name__:
                raise UserError(f"{ds_dir}: refused, the checkpoint holds objects outside the allow-list "
                                f"({str(e).splitlines()[0][:200]})") from None
            raise
        self.stage, self.world = int(getattr(stage, 'value', stage)), int(world)
        self.sd = sd
        self.info = {k: (torch.Size(v.shape), v.dtype) for k, v in sd.items()}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for n in names:
            v = self.sd[n]
            out[n] = v if isinstance(v, torch.Tensor) else v.contiguous()
        return out


class _Zero2Param:
    """One parameter of a ZeRO-1/2 checkpoint: a range of the (virtual) concatenation of every
    rank's fp32 partition of its group."""

    def __init__(self, parts: list[torch.Tensor], starts: list[int], offset: int, shape: torch.Size):
        self.parts, self.starts, self.offset, self.shape = parts, starts, offset, torch.Size(shape)
        self.dtype = parts[0].dtype

    def contiguous(self) -> torch.Tensor:
        n = self.shape.numel()
        lo, hi = self.offset, self.offset + n
        pieces = []
        for part, start in zip(self.parts, self.starts):
            a, b = max(lo, start), min(hi, start + part.numel())
            if a < b:
                pieces.append(part[a - start:b - start])
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return flat.reshape(self.shape).clone()


def _zero2_lazy(sd: dict, world: int, flat_groups: list, param_shapes: list, paddings: list | None) -> None:
    """DeepSpeed's _zero2_merge_trainable_params, without materialising the merged groups."""
    for g, shapes in enumerate(param_shapes):
        parts = [flat_groups[r][g] for r in range(world)]
        starts, pos = [], 0
        for p in parts:
            starts.append(pos)
            pos += p.numel()
        avail = pos
        pad = paddings[g] if paddings is not None else None
        if pad is not None and len(pad) != len(shapes):
            raise ValueError(f"group {g}: {len(pad)} alignment paddings for {len(shapes)} parameters")
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            sd[name] = _Zero2Param(parts, starts, offset, shape)
            offset += math.prod(shape)
            if pad is not None:
                offset += pad[i]
        align = 2 * world
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise ValueError(f"group {g}: consumed {offset} of {avail} elements (layout not understood)")


def _zero_to_fp32() -> Any:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import deepspeed.utils.zero_to_fp32 as z
    except ImportError as e:
        raise UserError(f"this is a DeepSpeed checkpoint: install deepspeed to export it ({e})") from None
    return z


@contextlib.contextmanager
def _safe_torch_load(allowed: tuple[str, ...]) -> Iterator[None]:
    """Make torch.load (as called by zero_to_fp32) weights_only with a small allow-list, memory-mapped."""
    import importlib
    objs = []
    for dotted in allowed:
        mod, _, name = dotted.rpartition(".")
        try:
            objs.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            continue
    orig = torch.load

    def safe_load(f: Any, *a: Any, **kw: Any) -> Any:
        kw["weights_only"] = True
        kw.setdefault("mmap", True)
        with torch.serialization.safe_globals(objs):
            return orig(f, *a, **kw)

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = orig


# --------------------------------------------------------------------------------------------------
# The architecture: what keys and shapes the exported folder must hold

def meta_model(conf: Any, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model of `conf` on the meta device (no memory): the reference for names and shapes."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(conf, trust_remote_code=trust_remote_code)


def expected_tensors(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Persistent state-dict names -> shapes, in the model's own order (tied names included)."""
    return {k: torch.Size(v.shape) for k, v in model.state_dict().items()}


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """{'lm_head.weight': 'model.embed_tokens.weight'} for tied models (transformers' own table)."""
    tied = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, dict):
        return dict(tied)
    conf = getattr(model, "config", None)
    return _tie_candidates(model) if getattr(conf, "tie_word_embeddings", False) else {}


# --------------------------------------------------------------------------------------------------
# LoRA adapters

@dataclass
class Adapter:
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]              # peft's saved names (base_model.model....lora_A.weight)
    origin: str

    def lora_modules(self) -> dict[str, dict[str, torch.Tensor]]:
        """module path (HF names) -> {"A": ..., "B": ..., optional "bias": ...}."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in self.tensors.items():
            m = re.match(r"^(?:base_model\.model\.)?(.+)\.lora_(A|B)\.(weight|bias)$", k)
            if m:
                slot = m.group(2) if m.group(3) == "weight" else f"{m.group(2)}_bias"
                out.setdefault(m.group(1), {})[slot] = v
        return out

    def replacements(self) -> dict[str, torch.Tensor]:
        """modules_to_save tensors: HF name -> full replacement tensor."""
        out = {}
        for k, v in self.tensors.items():
            if ".lora_" in k:
                continue
            name = k[len("base_model.model."):] if k.startswith("base_model.model.") else k
            out[name] = v
        return out

    def scale(self, module: str, r: int) -> float:
        c = self.config
        alpha = c.get("lora_alpha", 8)
        for pat, a in (c.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pat})$", module):
                alpha = a
                break
        return alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r


def peft_name(trainable_name: str) -> str | None:
    """A trainable parameter's name in a live peft model -> its name in an adapter file (None: skip)."""
    k = trainable_name
    if ".original_module." in k or ".base_layer." in k:
        return None
    if ".lora_" in k:
        return re.sub(r"\.lora_(A|B)\.[^.]+\.(weight|bias)$", r".lora_\1.\2", k)
    if ".modules_to_save." in k:
        return re.sub(r"\.modules_to_save\.[^.]+\.", ".", k)
    return None


def load_adapter(src: Source, log: Callable[[str], None]) -> Adapter:
    """The LoRA adapter of a checkpoint: adapter/ if saved, else the trainable tensors of dcp/ or ds/."""
    d = src.adapter_dir
    if d is not None:
        conf = json.loads((d / "adapter_config.json").read_text())
        st = d / "adapter_model.safetensors"
        if st.is_file():
            from safetensors.torch import load_file
            tensors = load_file(str(st))
        elif (d / "adapter_model.bin").is_file():
            tensors = torch.load(d / "adapter_model.bin", map_location="cpu", weights_only=True)
        else:
            raise UserError(f"{d}: adapter_config.json without adapter_model.safetensors")
        origin = str(d)
    else:
        if src.weights == "dcp":
            reader: TensorReader = DCPReader(src.dcp_dir)
        elif src.weights == "deepspeed":
            reader = ZeroReader(src.path, exclude_frozen=True)
        else:
            raise UserError(f"--ckpt {src.arg}: no adapter in {src.path}")
        names = {n: peft_name(n) for n in reader.names()}
        names = {n: p for n, p in names.items() if p is not None}
        got = reader.read(list(names))
        tensors = {names[n]: t for n, t in got.items()}
        lc = src.cfg.lora
        targets = sorted({re.sub(r"\.lora_(A|B)\.(weight|bias)$", "", k).rsplit(".", 1)[-1]
                          for k in tensors if ".lora_" in k})
        conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc.lora_rank, "lora_alpha": lc.lora_alpha,
                "lora_dropout": lc.lora_dropout, "target_modules": targets, "bias": "none",
                "modules_to_save": lc.modules_to_save or None, "fan_in_fan_out": False, "use_rslora": False}
        origin = f"{src.path.name}/{'dcp' if src.weights == 'dcp' else 'ds'} (trainable tensors)"
    if conf.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{origin}: a {conf.get('peft_type')} adapter; only LoRA adapters can be exported")
    if conf.get("use_dora"):
        raise UserError(f"{origin}: DoRA adapters are not supported by export")
    empty = [k for k, v in tensors.items() if v.numel() == 0]
    if not tensors or empty:
        raise UserError(f"{origin}: the adapter holds {'no tensors' if not tensors else 'empty tensors: ' + empty[0]}")
    unknown = [k for k in tensors if ".lora_" not in k and any(m in k for m in ("lora_embedding", "lora_magnitude"))]
    if unknown:
        raise UserError(f"{origin}: unsupported adapter tensor {unknown[0]}")
    return Adapter(conf, tensors, origin)


def check_adapter_fits(adapter: Adapter, expected: dict[str, torch.Size], base_desc: str) -> None:
    """Every adapted module exists in the base with matching shapes (else UserError)."""
    fan = bool(adapter.config.get("fan_in_fan_out"))
    mods = adapter.lora_modules()
    for mod, parts in mods.items():
        if "A" not in parts or "B" not in parts:
            raise UserError(f"{adapter.origin}: {mod} has lora_A or lora_B missing")
        wname = f"{mod}.weight"
        if wname not in expected:
            raise UserError(f"adapter/base architecture mismatch: the adapter adapts {mod}, which base model "
                            f"{base_desc} does not have")
        out_f, in_f = expected[wname][0], expected[wname][1] if len(expected[wname]) > 1 else 1
        if fan:
            out_f, in_f = in_f, out_f
        a, b = parts["A"].shape, parts["B"].shape
        if a[1] != in_f or b[0] != out_f or a[0] != b[1]:
            raise UserError(f"adapter/base architecture mismatch: {mod}: the adapter expects a "
                            f"[{b[0]}, {a[1]}] weight, base model {base_desc} has {list(expected[wname])}")
    for name, t in adapter.replacements().items():
        if name not in expected:
            raise UserError(f"adapter/base architecture mismatch: the adapter replaces {name}, which base model "
                            f"{base_desc} does not have")
        if t.shape != expected[name]:
            raise UserError(f"adapter/base architecture mismatch: {name}: adapter {list(t.shape)}, base model "
                            f"{base_desc} {list(expected[name])}")


def merge_lora(w: torch.Tensor, parts: dict[str, torch.Tensor], scale: float, fan_in_fan_out: bool) -> torch.Tensor:
    """W + scale * B @ A, computed in fp32."""
    delta = (parts["B"].float() @ parts["A"].float()) * scale
    if fan_in_fan_out:
        delta = delta.T
    return w.float() + delta


# --------------------------------------------------------------------------------------------------
# Writing the folder

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


# --------------------------------------------------------------------------------------------------
# The export

@dataclass
class ExportResult:
    output: Path
    kind: str                      # "model" | "adapter"
    files: list[str]
    tensors: int
    bytes: int
    base_desc: str | None = None
    verify: dict[str, Any] | None = None


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


def _umask() -> int:
    cur = os.umask(0)
    os.umask(cur)
    return cur


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished temp folder to the output (replacing an old one only now)."""
    mode = 0o666 & ~_umask()
    for p in tmp.iterdir():
        if p.is_file():
            os.chmod(p, mode)  # safetensors writes 0600; servers often run as another user
    os.chmod(tmp, 0o777 & ~_umask())
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.export-old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    ckpt.fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export(opts: ExportOptions) -> ExportResult:
    """Run one export (see the module docstring); returns what was written."""
    from transformers.utils import logging as hf_logging

    from swiftlite.hf_io import parse_size
    hf_logging.disable_progress_bar()  # the export logs its own lines; no per-load bars
    log = opts.log
    if opts.dtype not in OUT_DTYPES:
        raise UserError(f"--dtype {opts.dtype}: choose bf16 or fp16")
    max_shard = parse_size(opts.max_shard_size)
    src = inspect_source(opts.ckpt, opts.base_model, log)
    if opts.merge_lora and not src.is_peft:
        log(f"note: --merge-lora ignored, {src.path.name} is a full fine-tune")
    out, tmp = prepare_output(opts.output, opts.overwrite, src)
    log(f"source {src.describe()}")
    t0 = time.perf_counter()
    try:
        if src.is_peft and not opts.merge_lora:
            result = _export_adapter(src, opts, tmp, out)
        else:
            result = _export_model(src, opts, tmp, out, max_shard)
        if opts.verify:
            report = verify_export(tmp, src, opts, result)
            result.verify = report
            append_readme(tmp, "## Verification\n\n" + "\n".join(f"- {k}: {v}" for k, v in report.items()) + "\n")
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.output = out
    log(f"wrote {out} ({len(result.files)} files, {result.tensors} tensors, {result.bytes / 1e6:.1f} MB) "
        f"in {time.perf_counter() - t0:.1f} s")
    return result


def _load_base_for_lora(src: Source, ms: Any, log: Callable[[str], None]) -> tuple[TensorReader, str]:
    """The base weights the run trained against, as a reader, and a sentence saying which they are."""
    from swiftlite.models.loading import load_model
    cfg = src.cfg
    run_dtype = cfg.model.torch_dtype
    q = cfg.quant.quant_bits
    name = ms.ref if ms.kind != "preset" else f"{cfg.model.model} (built-in, random init with seed {cfg.train.seed})"
    if q:
        model = load_model(cfg, ms)
        from swiftlite.models.quant import disable_cpu_repack
        disable_cpu_repack(model)
        reader: TensorReader = ModelReader(model)
        if q == 4:
            how = (f"{cfg.quant.bnb_4bit_quant_type} 4-bit"
                   f"{' + double quant' if cfg.quant.bnb_4bit_use_double_quant else ''}, compute {run_dtype}")
            desc = (f"{name}, quantized {how} exactly as in training, then dequantized with "
                    f"bitsandbytes.functional.dequantize_4bit ({reader.quantized} layers); LoRA merged into the "
                    "dequantized weights (what was trained against), not into the original weights")
        else:
            desc = (f"{name}, quantized to 8-bit as in training and dequantized ({reader.quantized} layers); "
                    "LoRA merged into the dequantized weights")
        return reader, desc
    if ms.kind == "preset":
        return ModelReader(load_model(cfg, ms)), f"{name}, {run_dtype}"
    folder = Path(ms.ref)
    try:
        return SafetensorsReader(folder), f"{folder} (safetensors, as {run_dtype}, as in training)"
    except UserError:
        return ModelReader(load_model(cfg, ms)), f"{folder} (loaded with transformers, {run_dtype})"


def _model_config_for(src: Source, ms: Any) -> Any:
    from swiftlite.models.loading import model_config
    return model_config(src.cfg, ms)


def _export_model(src: Source, opts: ExportOptions, tmp: Path, out: Path, max_shard: int) -> ExportResult:
    """Full weights (full fine-tune, or LoRA merged into its base) -> shards + config + tokenizer."""
    from transformers import AutoConfig

    from swiftlite.hf_io import write_sharded
    log = opts.log
    dtype = OUT_DTYPES[opts.dtype]
    budget = max(1, min(max_shard // 2, 1 << 30))
    trust = bool(src.cfg.model.trust_remote_code) if src.cfg is not None else False
    ms = None
    base_folder: Path | None = None
    if src.hf_dir is not None and not src.is_peft and (src.base_from != "--base-model"):
        conf = AutoConfig.from_pretrained(str(src.hf_dir), trust_remote_code=trust)
        conf_from = str(src.hf_dir)
        base_folder = src.hf_dir
    else:
        ms = resolve_base(src)
        conf = _model_config_for(src, ms)
        conf_from = f"base model {src.cfg.model.model}"
        base_folder = Path(ms.ref) if ms.kind == "folder" else None
    model = meta_model(conf, trust)
    arch = type(model).__name__
    expected = expected_tensors(model)
    tied = tied_names(model) if getattr(conf, "tie_word_embeddings", False) else {}
    info: dict[str, Any] = {"kind": "model", "dtype": opts.dtype, "output_name": out.name, "final_path": str(out)}
    replace: dict[str, torch.Tensor] = {}
    loras: dict[str, dict[str, torch.Tensor]] = {}
    adapter = None

    if src.is_peft:
        adapter = load_adapter(src, log)
        base_desc_short = src.cfg.model.model
        check_adapter_fits(adapter, expected, base_desc_short)
        reader, base_desc = _load_base_for_lora(src, ms, log)
        info["base_desc"] = base_desc
        info["base_ref"] = _base_ref(src, ms)
        info["hub_base"] = _hub_id(src, ms)
        info["weights_from"] = f"{base_desc_short} + adapter {adapter.origin}"
        info["what"] = f"LoRA merged into the base ({len(adapter.lora_modules())} modules)"
        log(f"base: {base_desc}")
        loras = adapter.lora_modules()
        replace = adapter.replacements()
        run_dtype = RUN_DTYPES[src.cfg.model.torch_dtype]
    else:
        if src.weights == "dcp":
            reader = DCPReader(src.dcp_dir)
            info["weights_from"] = f"{src.path.name}/dcp (torch.distributed.checkpoint, {len(reader.info)} tensors)"
        elif src.weights == "deepspeed":
            reader = ZeroReader(src.path, exclude_frozen=False)
            info["weights_from"] = (f"{src.path.name}/ds (ZeRO-{reader.stage} fp32 master weights of "
                                    f"{reader.world} ranks)")
        elif src.weights == "hf":
            reader = SafetensorsReader(src.path)
            info["weights_from"] = f"{src.path} (safetensors)"
        else:
            raise UserError(f"--ckpt {src.arg}: no full weights to export")
        info["what"] = "full weights"
        info["base_desc"] = conf_from
        run_dtype = None
        log(f"weights: {info['weights_from']}; architecture from {conf_from}")

    # Names to write: the architecture's, minus tied copies; every one must be in the source.
    have = reader.info
    tie = bool(tied)
    if tie:
        extra_touch = set(replace) | {f"{m}.weight" for m in loras}
        if any(k in extra_touch for pair in tied.items() for k in pair):
            tie = False  # the adapter changes one side of the tie: write both
            log("note: the adapter changes a tied embedding; writing lm_head separately (tie_word_embeddings=false)")
        else:
            for dst, srcname in tied.items():
                if dst in have and srcname in have:
                    got = reader.read([dst, srcname])
                    if not torch.equal(got[dst], got[srcname]):
                        tie = False
                        log(f"note: {dst} differs from {srcname} in the checkpoint; writing both "
                            "(tie_word_embeddings=false)")
    else:
        # An untied architecture whose checkpoint holds no lm_head: it was trained tied.
        cand = _tie_candidates(model)
        if cand and all(k not in have and k not in replace and v in have for k, v in cand.items()):
            conf.tie_word_embeddings = True
            model = meta_model(conf, trust)
            tied, tie = tied_names(model) or cand, True
            expected = expected_tensors(model)
            log("note: the checkpoint holds no lm_head.weight: writing a tied model (tie_word_embeddings=true)")
    skip = set(tied) if tie else set()
    names = [k for k in expected if k not in skip]
    missing = [k for k in names if k not in have and k not in replace]
    if missing:
        raise UserError(f"--ckpt {src.arg}: the weights do not match the architecture of {conf_from}: "
                        f"{len(missing)} tensors missing (e.g. {missing[0]})")
    for k in names:
        if k in have and tuple(have[k][0]) != tuple(expected[k]):
            raise UserError(f"--ckpt {src.arg}: the weights do not match the architecture of {conf_from}: "
                            f"{k} is {list(have[k][0])} in the checkpoint, {list(expected[k])} in the model")
    unexpected = [k for k in have if k not in expected and not src.is_peft and not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise UserError(f"--ckpt {src.arg}: the checkpoint holds tensors that {conf_from} does not have "
                        f"(e.g. {unexpected[0]}); pass the right --base-model")
    fan = bool(adapter.config.get("fan_in_fan_out")) if adapter else False
    read_names = [k for k in names if k not in replace]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        it = stream(reader, read_names, budget)
        for k in names:
            if k in replace:
                t = replace[k]
            else:
                rk, t = next(it)
                if rk != k:
                    raise RuntimeError(f"export: read {rk}, expected {k}")
                if run_dtype is not None and t.is_floating_point():
                    t = t.to(run_dtype)  # the base as the run loaded it
                if k.endswith(".weight") and k[:-7] in loras:
                    parts = loras[k[:-7]]
                    t = merge_lora(t, parts, adapter.scale(k[:-7], parts["A"].shape[0]), fan)
                elif k.endswith(".bias") and "B_bias" in loras.get(k[:-5], {}):
                    parts = loras[k[:-5]]
                    t = t.float() + parts["B_bias"].float() * adapter.scale(k[:-5], parts["A"].shape[0])
            out_t = cast_checked(k, t, dtype)
            del t
            yield k, out_t
            del out_t

    probe = MemProbe()
    weight_map = write_sharded(tensors(), tmp, dtype=opts.dtype, max_shard_size=max_shard)
    probe.stop()
    reader.close()
    conf_dict = write_config(conf, arch, tmp, dtype, tie)
    tokenizer = _tokenizer_for(src, ms)
    gen = write_generation_config(tmp, conf_dict, tokenizer, base_folder)
    has_template = write_tokenizer(tokenizer, tmp) if tokenizer is not None else False
    if not has_template:
        log("warning: the tokenizer has no chat template (chat serving needs one: re-export with a run "
            "that used --template)")
    shards = sorted(set(weight_map.values()))
    info["files"] = f"{len(shards)} safetensors shard(s), {len(weight_map)} tensors"
    if "base_ref" not in info and ms is not None:
        info["base_ref"] = _base_ref(src, ms)
        info["hub_base"] = _hub_id(src, ms)
    write_readme(tmp, src, info)
    total = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
    log(f"{len(weight_map)} tensors in {len(shards)} shard(s), {opts.dtype}, tie_word_embeddings={tie}, "
        f"eos {gen.get('eos_token_id')}")
    return ExportResult(out, "model", sorted(p.name for p in tmp.iterdir()), len(weight_map), total,
                        info.get("base_desc"))


def _base_ref(src: Source, ms: Any) -> str:
    """How a model card / adapter_config names the base: preset name, hub id or absolute folder."""
    name = src.cfg.model.model
    if ms.kind == "preset":
        return name
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name


class MemProbe:
    """Diagnostics (scripts/bench_export_memory.py, the memory test): with SWIFTLITE_EXPORT_MEMLOG=FILE,
    record RSS when weight streaming starts and the peak RSS during it (VmHWM reset through
    /proc/self/clear_refs; a 5 ms sampler where that is not allowed) into FILE as JSON."""

    def __init__(self) -> None:
        self.path = os.environ.get("SWIFTLITE_EXPORT_MEMLOG")
        if not self.path:
            return
        import threading
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.start_rss = _proc_kb("VmRSS")
        self.sampled = self.start_rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.sampled = max(self.sampled, _proc_kb("VmRSS"))

    def stop(self) -> None:
        if not self.path:
            return
        self._stop.set()
        self._thread.join()
        peak = _proc_kb("VmHWM") if self.hwm_reset else self.sampled
        Path(self.path).write_text(json.dumps({"start_rss": self.start_rss, "peak_rss": max(peak, self.sampled),
                                               "end_rss": _proc_kb("VmRSS"), "hwm_reset": self.hwm_reset}))


def _proc_kb(field_name: str) -> int:
    """A /proc/self/status memory field in bytes (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _hub_id(src: Source, ms: Any) -> str | None:
    """The base's hub id, when it has one (model cards name only hub models as base_model)."""
    if ms is None or ms.kind == "preset":
        return None
    name = src.cfg.model.model
    from swiftlite.models.presets import get_preset
    pr = get_preset(name)
    if pr is not None and pr.hub_id:
        return pr.hub_id
    return name if not Path(name).expanduser().exists() and name.count("/") == 1 else None


def _tie_candidates(model: torch.nn.Module) -> dict[str, str]:
    """For an untied model: {output embedding weight name: input embedding weight name}."""
    try:
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return {}
    if out_emb is None or in_emb is None:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    o, i = names.get(id(out_emb)), names.get(id(in_emb))
    return {f"{o}.weight": f"{i}.weight"} if o is not None and i is not None else {}


def _tokenizer_for(src: Source, ms: Any) -> Any:
    """The tokenizer the run trained with (checkpoint model/ copy, else the base's with --template)."""
    from transformers import AutoTokenizer
    if src.hf_dir is not None and ((src.hf_dir / "tokenizer.json").is_file()
                                   or (src.hf_dir / "tokenizer_config.json").is_file()):
        return AutoTokenizer.from_pretrained(str(src.hf_dir))
    if src.form == "checkpoint" and src.cfg is not None:
        from swiftlite.models.loading import load_tokenizer
        try:
            return load_tokenizer(src.cfg, ms)
        except UserError:
            if src.cfg.task == "sft":
                raise
    if ms is not None:
        try:
            return AutoTokenizer.from_pretrained(ms.tokenizer_ref)
        except (OSError, ValueError):
            return None
    return None


def _export_adapter(src: Source, opts: ExportOptions, tmp: Path, out: Path) -> ExportResult:
    """A LoRA run without --merge-lora: the adapter alone (peft format) + tokenizer + README."""
    from safetensors.torch import save_file
    log = opts.log
    dtype = OUT_DTYPES[opts.dtype]
    adapter = load_adapter(src, log)
    ms = resolve_base(src)
    conf = _model_config_for(src, ms)
    trust = bool(src.cfg.model.trust_remote_code)
    expected = expected_tensors(meta_model(conf, trust))
    check_adapter_fits(adapter, expected, src.cfg.model.model)
    c = dict(adapter.config)
    c["base_model_name_or_path"] = _base_ref(src, ms)
    c["inference_mode"] = True
    (tmp / "adapter_config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    tensors = {k: cast_checked(k, v, dtype).contiguous() for k, v in adapter.tensors.items()}
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    tokenizer = _tokenizer_for(src, ms)
    if tokenizer is not None:
        write_tokenizer(tokenizer, tmp)
    base_desc = (f"{src.cfg.model.model} (built-in, random init with seed {src.cfg.train.seed})"
                 if ms.kind == "preset" else ms.ref)
    if src.cfg.quant.quant_bits:
        base_desc += (f"; trained against its {src.cfg.quant.quant_bits}-bit quantized form "
                      f"({src.cfg.quant.bnb_4bit_quant_type if src.cfg.quant.quant_bits == 4 else 'int8'})")
    infer_base = src.cfg.model.model + (f" --seed {src.cfg.train.seed}" if ms.kind == "preset" else "")
    info = {"kind": "adapter", "dtype": opts.dtype, "output_name": out.name, "base_desc": base_desc,
            "final_path": str(out), "base_is_builtin": ms.kind == "preset", "hub_base": _hub_id(src, ms),
            "base_ref": _base_ref(src, ms), "infer_base": infer_base,
            "weights_from": adapter.origin, "what": "LoRA adapter only (peft format, not merged)",
            "files": f"adapter_model.safetensors ({len(tensors)} tensors)"}
    write_readme(tmp, src, info)
    log(f"adapter only (no --merge-lora): {len(tensors)} tensors for base {base_desc}")
    total = (tmp / "adapter_model.safetensors").stat().st_size
    return ExportResult(out, "adapter", sorted(p.name for p in tmp.iterdir()), len(tensors), total, base_desc)


# --------------------------------------------------------------------------------------------------
# Verification

FIXED_PROMPT = [{"role": "user", "content": "reverse: abcdefgh"}]
FIXED_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789"


def prompt_for(tokenizer: Any) -> torch.Tensor:
    """The fixed verification prompt as input ids (chat-rendered when a template exists)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(FIXED_PROMPT, tokenize=False, add_generation_prompt=True)
        text += "hgfedcba"
    else:
        text = FIXED_TEXT
    if tokenizer is None:
        return torch.arange(1, 33).unsqueeze(0)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids])


def reference_model(src: Source) -> tuple[torch.nn.Module, str]:
    """The training-side model, rebuilt from the checkpoint (not from the export): the checkpoint's
    own HF folder (full), else its fp32 weights; LoRA: the base exactly as trained (quantized for
    QLoRA) + the checkpoint's adapter, through peft."""
    from transformers import AutoModelForCausalLM
    if not src.is_peft:
        if src.hf_dir is not None:
            m = AutoModelForCausalLM.from_pretrained(str(src.hf_dir), dtype=torch.float32)
            return m.eval(), f"{src.hf_dir} (the checkpoint's own HF folder), fp32"
        ms = resolve_base(src) if src.form != "hf" else None
        conf = _model_config_for(src, ms) if ms is not None else None
        if conf is None:
            from transformers import AutoConfig
            conf = AutoConfig.from_pretrained(str(src.path))
        m = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
        reader = (DCPReader(src.dcp_dir) if src.weights == "dcp" else
                  ZeroReader(src.path, exclude_frozen=False) if src.weights == "deepspeed" else
                  SafetensorsReader(src.path))
        sd = {k: v.float() if v.is_floating_point() else v for k, v in reader.read(reader.names()).items()}
        missing, unexpected = m.load_state_dict(sd, strict=False)
        if unexpected or [k for k in missing if k not in tied_names(m)]:
            raise VerifyError(f"reference model: cannot load the checkpoint weights ({missing[:2]}, {unexpected[:2]})")
        return m.eval(), f"{src.weights} weights of {src.path.name}, fp32"
    from peft import PeftModel

    from swiftlite.models.loading import load_model
    ms = resolve_base(src)
    base = load_model(src.cfg, ms)
    from swiftlite.models.quant import disable_cpu_repack
    disable_cpu_repack(base)
    adir = src.adapter_dir
    tmpdir = None
    if adir is None:
        import tempfile
        adapter = load_adapter(src, lambda _m: None)
        tmpdir = tempfile.mkdtemp(prefix="swiftlite-ref-adapter-")
        adir = Path(tmpdir)
        (adir / "adapter_config.json").write_text(json.dumps(adapter.config))
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in adapter.tensors.items()}, str(adir / "adapter_model.safetensors"))
    try:
        m = PeftModel.from_pretrained(base, str(adir))
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    q = src.cfg.quant.quant_bits
    return m.eval(), (f"base {src.cfg.model.model}{f' ({q}-bit, as trained)' if q else ''} + adapter from "
                      f"{src.path.name}, {src.cfg.model.torch_dtype}")


def check_files(folder: Path, kind: str, dtype: torch.dtype) -> list[str]:
    """Structural checks on the written files; returns problems."""
    from safetensors import safe_open
    problems: list[str] = []
    if kind == "adapter":
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            if not (folder / f).is_file():
                problems.append(f"missing {f}")
        files = [folder / "adapter_model.safetensors"]
    else:
        for f in ("config.json", "generation_config.json", "README.md"):
            if not (folder / f).is_file():
                problems.append(f"missing {f}")
        stray = [f for f in ADAPTER_FILES if (folder / f).exists()]
        if stray:
            problems.append(f"stray adapter files: {stray}")
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            wm = json.loads(index.read_text())["weight_map"]
            files = [folder / f for f in sorted(set(wm.values()))]
            for f in files:
                if not f.is_file():
                    problems.append(f"index names missing shard {f.name}")
            files = [f for f in files if f.is_file()]
            listed = set(wm)
        else:
            files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []
            if not files:
                problems.append("no model.safetensors and no index")
            listed = None
        others = [p.name for p in folder.glob("*.safetensors") if p not in files]
        if others:
            problems.append(f"safetensors files not in the index: {others}")
    seen: set[str] = set()
    for f in files:
        if not f.is_file():
            continue
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                shape, dt = sl.get_shape(), _st_dtype(sl.get_dtype())
                seen.add(k)
                if math.prod(shape) == 0:
                    problems.append(f"zero-size tensor {k} {shape}")
                if kind != "adapter" and any(m in k for m in PEFT_MARKERS):
                    problems.append(f"peft name in a merged model: {k}")
                if dt.is_floating_point and dt != dtype:
                    problems.append(f"{k} is {dt}, expected {dtype}")
    if kind != "adapter" and files and listed is not None and listed != seen:
        problems.append(f"index and shards disagree on {len(listed ^ seen)} tensor names")
    return problems


def verify_export(folder: Path, src: Source, opts: ExportOptions, result: ExportResult) -> dict[str, Any]:
    """Load the written folder with transformers, check every key, compare logits with the training-side
    model. Raises VerifyError listing every problem; returns a summary for the log and README."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    log = opts.log
    dtype = OUT_DTYPES[opts.dtype]
    problems = check_files(folder, result.kind, dtype)
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - reported as a verification failure
        if result.kind == "model":
            problems.append(f"tokenizer does not load: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if result.kind == "model":
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None) and src.cfg is not None \
                and src.cfg.task == "sft":
            problems.append("tokenizer has no chat template")
        exported, loading = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
        for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            got = loading.get(what) or []
            if got:
                problems.append(f"{what.replace('_', ' ')} when loading with transformers: {sorted(map(str, got))[:5]}")
        conf = json.loads((folder / "config.json").read_text())
        if conf.get("dtype") != dtypes.hf_name(dtypes.from_torch(dtype)):
            problems.append(f"config.json dtype {conf.get('dtype')}, expected {dtypes.hf_name(dtypes.from_torch(dtype))}")
        emb, head = exported.get_input_embeddings(), exported.get_output_embeddings()
        if head is not None and emb is not None:
            shared = head.weight.data_ptr() == emb.weight.data_ptr()
            if shared != bool(conf.get("tie_word_embeddings")):
                problems.append(f"tie_word_embeddings={conf.get('tie_word_embeddings')} but the loaded model "
                                f"{'shares' if shared else 'does not share'} lm_head and embeddings")
        bad = [n for n, p in exported.named_parameters() if p.is_floating_point() and p.dtype != dtype]
        if bad:
            problems.append(f"parameters not in {opts.dtype} after loading: {bad[:3]}")
    else:
        from peft import PeftModel

        from swiftlite.models.loading import load_model
        ms = resolve_base(src)
        cfg = copy.deepcopy(src.cfg)
        base = load_model(cfg, ms)
        from swiftlite.models.quant import disable_cpu_repack
        disable_cpu_repack(base)
        exported = PeftModel.from_pretrained(base, str(folder))
    exported.eval()
    ref, ref_desc = reference_model(src)
    report: dict[str, Any] = {"reference": ref_desc}

    # 1. Weights: each exported tensor against the training-side one cast to the export dtype.
    #    Full fine-tunes must match exactly; LoRA merges within rounding (peft's get_delta_weight on the
    #    base as trained: dequantized for QLoRA).
    if result.kind == "model":
        want = reference_weights(ref)
        got = exported.state_dict()
        # DeepSpeed keeps fp32 masters next to 16-bit module weights (the reference): exporting them
        # to another 16-bit dtype rounds once where the reference rounded twice.
        run_dtype = src.cfg.model.torch_dtype if src.cfg is not None else "fp32"
        double = src.weights == "deepspeed" and run_dtype not in ("fp32", opts.dtype)
        exact = not src.is_peft and not double
        rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
        if double:
            rtol = max(rtol, {"bf16": 2**-7, "fp16": 2**-10}[run_dtype])
        worst, bad_names = 0.0, []
        for k, a in got.items():
            if k not in want:
                bad_names.append(f"{k} (not in the training-side model)")
                continue
            w = want[k]
            if not a.is_floating_point():
                ok = torch.equal(a, w)
            elif exact:
                ok = torch.equal(a, w.to(dtype))
            else:
                err = (a.float() - w.float()).abs() / (w.float().abs() + 1e-8)
                worst = max(worst, float(err.max()) if err.numel() else 0.0)
                ok = bool(torch.isclose(a.float(), w.float(), rtol=rtol, atol=1e-8).all())
            if not ok:
                bad_names.append(k)
        if bad_names:
            problems.append(f"{len(bad_names)} exported tensors differ from the training-side model "
                            f"{'cast to ' + opts.dtype if exact else 'beyond rounding'}: {bad_names[:3]}")
        report["weights"] = (f"{len(got)} tensors {'equal to the training-side ones cast to ' + opts.dtype if exact else f'within {rtol:.2g} relative (rounding) of the merged training-side ones, worst {worst:.2g}'}"
                             if not bad_names else f"{len(bad_names)} of {len(got)} differ")
    else:
        adapter = load_adapter(src, lambda _m: None)
        from safetensors.torch import load_file
        got = load_file(str(folder / "adapter_model.safetensors"))
        bad_names = [k for k, v in adapter.tensors.items() if k not in got or not torch.equal(got[k], v.to(dtype))]
        if bad_names or set(got) != set(adapter.tensors):
            problems.append(f"adapter tensors differ from the checkpoint's: {bad_names[:3]}")
        report["weights"] = f"{len(got)} adapter tensors equal to the checkpoint's cast to {opts.dtype}"

    # 2. Logits on a fixed prompt: the export (in its dtype, as a server runs it) against the
    #    training-side model in fp32. Tolerance: 4% of the logit scale, or twice the error the
    #    training-side model itself makes when cast to the export dtype, whichever is larger.
    needs_base = src.form != "hf" and (src.is_peft or src.hf_dir is None)
    ref_tok = _tokenizer_for(src, resolve_base(src) if needs_base else None)
    ids = prompt_for(ref_tok or tokenizer)
    if tokenizer is not None and ref_tok is not None and getattr(ref_tok, "chat_template", None):
        ids_export = prompt_for(tokenizer)
        if not torch.equal(ids_export, ids):
            problems.append("the exported tokenizer renders the fixed prompt differently from the training one")
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits.float()
        exp_logits = exported(input_ids=ids).logits.float()
    scale = max(float(ref_logits.abs().max()), 1e-6)
    diff = float((exp_logits - ref_logits).abs().max())
    rel = diff / scale
    cal = None
    if not any(getattr(p, "quant_state", None) is not None or p.dtype == torch.int8 for p in ref.parameters()):
        ref.to(dtype)  # the training-side model itself at the export dtype: what rounding alone costs
        with torch.no_grad():
            cal = float((ref(input_ids=ids).logits.float() - ref_logits).abs().max()) / scale
    tol = max(TOLERANCE[opts.dtype], 2 * cal) if cal is not None else TOLERANCE[opts.dtype]
    top1 = float((exp_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    if not math.isfinite(rel) or rel > tol:
        problems.append(f"logits differ from the training-side model: max |diff| {diff:.4g} = {rel:.2%} of the "
                        f"logit scale {scale:.3g} (tolerance {tol:.1%})")
    report.update({"prompt tokens": int(ids.shape[1]), "max abs logit diff": f"{diff:.4g}",
                   "logit scale (max |ref|)": f"{scale:.4g}",
                   "relative diff": f"{rel:.3%} (tolerance {tol:.1%})",
                   "training-side model cast to " + opts.dtype: ("-" if cal is None else f"{cal:.3%}"),
                   "top-1 agreement": f"{top1:.1%}",
                   "checks": "passed" if not problems else "FAILED"})
    for k, v in report.items():
        log(f"verify: {k}: {v}")
    if problems:
        raise VerifyError("; ".join(problems))
    return report


def reference_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named weights of the training-side model; for a peft model the merged values computed by
    peft itself (base weight, dequantized for 4/8-bit, + get_delta_weight; modules_to_save copies)."""
    from peft import PeftModel
    if not isinstance(model, PeftModel):
        reader = ModelReader(model)
        return reader.read(reader.names())
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper
    inner = model.get_base_model()
    name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    out: dict[str, torch.Tensor] = {}
    done: list[str] = []
    for mname, mod in inner.named_modules():
        if any(mname.startswith(p) for p in done):
            continue
        if isinstance(mod, LoraLayer):
            base = mod.get_base_layer()
            w = tensor_value(base, "weight", base.weight).float()
            out[f"{mname}.weight"] = w + mod.get_delta_weight(name).float().reshape(w.shape)
            if getattr(base, "bias", None) is not None:
                out[f"{mname}.bias"] = base.bias.detach().float()
            done.append(mname + ".")
        elif isinstance(mod, ModulesToSaveWrapper):
            for n, t in mod.modules_to_save[name].state_dict().items():
                out[f"{mname}.{n}"] = t.detach()
            done.append(mname + ".")
        else:
            non_persistent = getattr(mod, "_non_persistent_buffers_set", set())
            own = list(mod.named_parameters(recurse=False))
            own += [(n, b) for n, b in mod.named_buffers(recurse=False) if n not in non_persistent]
            for n, t in own:
                out[f"{mname}.{n}" if mname else n] = tensor_value(mod, n, t)
    return out
