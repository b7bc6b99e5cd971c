"""What `--ckpt` is (a run folder, a checkpoint, a peft adapter folder, an HF folder), what the run
was (args.json / trainer_state.json), and where its base model comes from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from swiftlite import checkpoint as ckpt
from swiftlite.checkpoint import layout
from swiftlite.errors import UserError
from swiftlite.hf_io import ADAPTER_CONFIG


@dataclass
class ExportOptions:
    ckpt: str
    output: str | None = None        # None: default_output() (ms-swift's <checkpoint>-merged when merging)
    base_model: str | None = None
    merge_lora: bool = False
    dtype: str = "bf16"
    max_shard_size: int = 5 * 10**9
    verify: bool = False
    overwrite: bool = False
    log: Callable[[str], None] = field(default=lambda msg: print(f"export: {msg}", flush=True))
    ckpt_flag: str = "--ckpt"        # how the user named the checkpoint (--ckpt or --adapters), for messages
    quant: Any = None                # export/quantize.BnbExport: --quant_method bnb (None: 16-bit)
    ollama: bool = False             # --to_ollama: a Modelfile next to the weights (export/ollama.py)
    model_only: bool = False         # `--model M` without a checkpoint (ms-swift's `swift export --model M`)


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
    base_from: str = layout.ARGS     # where the base model name came from (for messages)
    #: The checkpoint's sharded state that holds the weights (checkpoint/layout.CheckpointFormat, the one
    #: vocabulary of records, trainer_state.json and export); None when the weights are a folder of
    #: their own: an HF folder, a peft adapter, or a checkpoint's model/ or adapter/ alone (a DeepSpeed
    #: --save_only_model checkpoint, or one whose dcp/ was removed). `form` says what `path` is.
    weights: "layout.CheckpointFormat | None" = None

    @property
    def is_peft(self) -> bool:
        from swiftlite.config.tuner_options import PEFT_TYPES
        return self.train_type in PEFT_TYPES

    @property
    def dcp_dir(self) -> Path:
        return self.path / layout.DCP_DIR

    @property
    def adapter_dir(self) -> Path | None:
        if self.form == "adapter":
            return self.path
        d = self.path / layout.ADAPTER_DIR
        return d if (d / ADAPTER_CONFIG).is_file() else None

    @property
    def hf_dir(self) -> Path | None:
        if self.form == "hf":
            return self.path
        d = self.path / layout.MODEL_DIR
        return d if (d / "config.json").is_file() else None

    def sharded_reader(self, exclude_frozen: bool) -> Any:
        """A reader of the checkpoint's sharded state (dcp/ or ds/; `exclude_frozen`: ZeRO's trainable tensors
        only), or None when the weights are a folder of their own (`weights` is None)."""
        from swiftlite.checkpoint.readers import DCPReader, ZeroReader
        if self.weights is layout.CheckpointFormat.DCP:
            return DCPReader(self.dcp_dir)
        if self.weights is layout.CheckpointFormat.DS:
            return ZeroReader(self.path, exclude_frozen=exclude_frozen)
        return None

    def describe(self) -> str:
        if self.form == "checkpoint":
            return (f"{self.path} (step {self.step}, {self.train_type}, {self.backend} x {self.world_size})")
        return f"{self.path} ({self.form} folder)"


def _is_checkpoint(p: Path) -> bool:
    return (p / layout.MANIFEST).is_file() or (p / layout.TRAINER_STATE).is_file()


def resolve_checkpoint(arg: str, flag: str = "--ckpt") -> tuple[Path, str]:
    """--ckpt / --adapters -> (folder, form). A run folder means its `latest` checkpoint; the
    adapter/ folder inside a checkpoint means that checkpoint (its run's base model and seed)."""
    p = Path(arg).expanduser()
    if not p.exists():
        raise UserError(f"{flag} {arg}: no such folder")
    if not p.is_dir():
        raise UserError(f"{flag} {arg}: not a checkpoint (a file; pass a run folder or a checkpoint-N folder)")
    p = p.resolve()
    if (p.name == layout.ADAPTER_DIR and (p / ADAPTER_CONFIG).is_file() and not _is_checkpoint(p)
            and _is_checkpoint(p.parent)):
        p = p.parent
    if p.name.startswith(layout.TMP_PREFIX + layout.PREFIX):
        raise UserError(f"{flag} {arg}: an incomplete checkpoint (its save did not finish)")
    if _is_checkpoint(p):
        why = ckpt.verify_checkpoint(p, deep=False)
        if why:
            raise UserError(f"{flag} {arg}: not a usable checkpoint ({why})")
        return p, "checkpoint"
    if (p / ADAPTER_CONFIG).is_file():
        return p, "adapter"
    latest = p / layout.LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        c = p / name
        why = ckpt.verify_checkpoint(c, deep=False) if c.is_dir() else "missing"
        if why:
            raise UserError(f"{flag} {arg}: its latest checkpoint {name} is not usable ({why}); "
                            "pass an older checkpoint-N folder explicitly")
        return c, "checkpoint"
    found = [c for c in reversed(ckpt.list_checkpoints(p)) if ckpt.verify_checkpoint(c, deep=False) is None]
    if found:
        return found[0], "checkpoint"
    if (p / "config.json").is_file() and (list(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file()):
        return p, "hf"
    raise UserError(f"{flag} {arg}: not a checkpoint (no {layout.MANIFEST}, no `{layout.LATEST}`, no checkpoint-N "
                    f"folder, no {ADAPTER_CONFIG})")


def inspect_source(arg: str, base_model: str | None, log: Callable[[str], None], flag: str = "--ckpt") -> Source:
    """Classify --ckpt and attach the run's config (base model, quantization, seed)."""
    from swiftlite.config import build_config, load_args
    path, form = resolve_checkpoint(arg, flag)
    src = Source(arg=arg, path=path, form=form)
    if form == "checkpoint":
        try:
            state = json.loads((path / layout.TRAINER_STATE).read_text())
        except (OSError, ValueError):
            raise UserError(f"{flag} {arg}: {path.name}/{layout.TRAINER_STATE} is missing or unreadable") from None
        src.train_type = state.get("train_type", "full")
        src.backend = state.get("backend")
        src.world_size = state.get("world_size")
        src.step = state.get("global_step")
        src.run_dir = path.parent
        if (path / layout.DCP_DIR / layout.DCP_METADATA).is_file():
            src.weights = layout.CheckpointFormat.DCP
        elif (path / layout.DS_TAG).is_dir():
            src.weights = layout.CheckpointFormat.DS
        elif src.adapter_dir is None and (src.is_peft or src.hf_dir is None):
            raise UserError(f"{flag} {arg}: {path.name} holds no model weights (no dcp/, ds/, "
                            f"{layout.ADAPTER_DIR if src.is_peft else layout.MODEL_DIR}/)")
        # else: the weights are its model/ or adapter/ folder alone (--save_only_model under DeepSpeed)
        args_file = path.parent / layout.ARGS
        if args_file.is_file():
            try:
                src.cfg = load_args(args_file)
            except UserError as e:
                raise UserError(f"{flag} {arg}: cannot read the run's args.json ({e})") from None
        else:
            # A checkpoint copied away from its run: rebuild what trainer_state.json records.
            values = {"train_type": src.train_type, "model": state.get("model") or "tiny-llama",
                      "torch_dtype": state.get("torch_dtype") or "fp32"}
            src.cfg = build_config(values, source=str(path / layout.TRAINER_STATE))
            if src.is_peft or src.hf_dir is None:
                log(f"warning: no args.json next to {path.name}; assuming default seed/quantization settings "
                    f"for base model {values['model']}")
    elif form == "adapter":
        src.train_type = "lora"
        if base_model is None:
            conf = json.loads((path / ADAPTER_CONFIG).read_text())
            base_model = conf.get("base_model_name_or_path")
            if not base_model:
                raise UserError(f"{flag} {arg}: a bare adapter folder; pass --base-model (its base model)")
            src.base_from = ADAPTER_CONFIG
        src.cfg = build_config({"train_type": "lora", "model": base_model}, source="--base-model")
    else:
        src.cfg = build_config({"model": str(path)}, source="--ckpt")
    if base_model is not None and form != "hf":
        src.cfg = src.cfg.with_values(model=base_model)   # the run's config, on another base
        if src.base_from != ADAPTER_CONFIG:
            src.base_from = "--base-model"
    return src


def default_output(src: Source, merge: bool, quant: Any = None) -> Path:
    """The output when none is given: `<checkpoint>-bnb-int4` for a quantized export and
    `<checkpoint>-merged` when merging (ms-swift's defaults), else `<checkpoint>-export`, next to the
    checkpoint (or adapter/HF folder). None is a `checkpoint-N` name, so a run folder's checkpoint
    listing ignores it."""
    tail = quant.suffix() if quant is not None else "merged" if merge else "export"
    return src.path.parent / f"{src.path.name}-{tail}"


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
        ms = local_snapshot(ms, src.cfg.model.model_revision,
                            f"base model {ms.ref} (from {src.base_from})", "; pass --base-model PATH")
    return ms


#: The files of a hub model an export reads: config, weights, tokenizer.
SNAPSHOT_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*")


def local_snapshot(ms: Any, revision: str | None, what: str, hint: str = "") -> Any:
    """A hub ModelSource's local snapshot (downloaded when online) as a folder source; offline, gated or
    unknown: a UserError naming `what`, then `hint`."""
    try:
        return ms.snapshot(revision, SNAPSHOT_FILES)
    except Exception as e:  # offline, gated, unknown id
        raise UserError(f"{what} is not available: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        f"{hint}") from None


def model_config_for(src: Source, ms: Any) -> Any:
    """The base model's transformers config, as the run built it (model_config of its RunConfig; a
    llamapro run's with its inserted layers)."""
    from swiftlite.config.tasks import reward_model
    from swiftlite.models.loading import load_tokenizer, model_config
    conf = model_config(src.cfg, ms)
    if src.cfg.train.train_type == "llamapro":   # the run trained the expanded model (models/llamapro.py)
        from swiftlite.models.llamapro import expanded_config
        conf = expanded_config(conf, src.cfg)
    if reward_model(src.cfg):   # the run built the base's config with a one-output score head
        from transformers import AutoModelForSequenceClassification
        import torch
        conf.num_labels = 1
        conf.pad_token_id = load_tokenizer(src.cfg, ms).pad_token_id
        with torch.device("meta"):
            conf.architectures = [type(AutoModelForSequenceClassification.from_config(conf)).__name__]
    return conf
