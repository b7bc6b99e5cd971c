"""peft adapters: read one (a peft folder, or a LoRA checkpoint's trainable tensors), check it fits a
base, and merge it (LoRA here; BOFT, AdaLoRA and MiSS/Bone by peft's layers, export/tuner_merge.py)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from swiftlite.checkpoint.readers import TensorReader
from swiftlite.config.tuner_options import moves_base
from swiftlite.errors import UserError
from swiftlite.export.source import Source
from swiftlite.hf_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_WEIGHTS_BIN


@dataclass
class Adapter:
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]              # peft's saved names (base_model.model....lora_A.weight)
    origin: str

    def lora_modules(self) -> dict[str, dict[str, torch.Tensor]]:
        """module path (HF names) -> {"A": ..., "B": ..., optional "B_bias", optional "m" (DoRA's
        magnitude vector)}."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in self.tensors.items():
            m = re.match(r"^(?:base_model\.model\.)?(.+)\.lora_(A|B)\.(weight|bias)$", k)
            if m:
                slot = m.group(2) if m.group(3) == "weight" else f"{m.group(2)}_bias"
                out.setdefault(m.group(1), {})[slot] = v
            m = re.match(r"^(?:base_model\.model\.)?(.+)\.lora_magnitude_vector(?:\.weight)?$", k)
            if m:
                out.setdefault(m.group(1), {})["m"] = v
        return out

    @property
    def peft_type(self) -> str:
        return self.config.get("peft_type", "LORA")

    def tuner_modules(self) -> dict[str, dict[str, torch.Tensor]]:
        """BOFT / AdaLoRA / MiSS adapters: module path -> its tensors (export/tuner_merge.py); {} for LoRA."""
        from swiftlite.export.tuner_merge import tuner_modules
        return tuner_modules(self.peft_type, self.tensors)

    def replacements(self) -> dict[str, torch.Tensor]:
        """modules_to_save tensors and --lora_bias all's biases: HF name -> full replacement tensor
        (an adapted layer's bias is peft's `<layer>.base_layer.bias`)."""
        out = {}
        for k, v in self.tensors.items():
            if ".lora_" in k or ".boft_" in k or ".miss_" in k:
                continue
            name = k[len("base_model.model."):] if k.startswith("base_model.model.") else k
            out[name.replace(".base_layer.", ".")] = v
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
    if ".lora_magnitude_vector." in k:
        return re.sub(r"\.lora_magnitude_vector\.[^.]+\.weight$", ".lora_magnitude_vector", k)
    if ".lora_" in k:
        return re.sub(r"\.lora_(A|B)\.[^.]+\.(weight|bias)$", r".lora_\1.\2", k)
    if ".modules_to_save." in k:
        return re.sub(r"\.modules_to_save\.[^.]+\.", ".", k)
    return None


def load_adapter(src: Source, log: Callable[[str], None]) -> Adapter:
    """The LoRA adapter of a checkpoint: adapter/ if saved, else the trainable tensors of dcp/ or ds/."""
    d = src.adapter_dir
    if d is not None:
        conf = json.loads((d / ADAPTER_CONFIG).read_text())
        st = d / ADAPTER_WEIGHTS
        if st.is_file():
            from safetensors.torch import load_file
            tensors = load_file(str(st))
        elif (d / ADAPTER_WEIGHTS_BIN).is_file():
            tensors = torch.load(d / ADAPTER_WEIGHTS_BIN, map_location="cpu", weights_only=True)
        else:
            raise UserError(f"{d}: {ADAPTER_CONFIG} without {ADAPTER_WEIGHTS}")
        origin = str(d)
    else:
        lc = src.cfg.lora
        if not src.cfg.is_lora:
            raise UserError(f"--ckpt {src.arg}: a --train_type {src.cfg.train.train_type} checkpoint without adapter/: "
                            "its adapter config (BOFT blocks, AdaLoRA rank pattern, Bone's rank) is written there only; export a "
                            "checkpoint written with --save-hf-model true")
        if moves_base(lc.init_weights):
            raise UserError(f"--ckpt {src.arg}: a --init_weights {lc.init_weights} run's checkpoint without adapter/: "
                            "its tensors are relative to the base PiSSA/OLoRA/LoRA-GA rewrote; export a checkpoint "
                            "written "
                            "with --save-hf-model true (its adapter/ is converted to a plain LoRA of the base)")
        reader: TensorReader | None = src.sharded_reader(exclude_frozen=True)
        if reader is None:
            raise UserError(f"--ckpt {src.arg}: no adapter in {src.path}")
        names = {n: peft_name(n) for n in reader.names()}
        if lc.lora_bias == "all":   # every bias trained: peft's adapter file names them as the model does
            names.update({n: n.replace(".base_layer.", ".") for n in reader.names()
                          if n.endswith(".bias") and ".lora_" not in n})
        names = {n: p for n, p in names.items() if p is not None}
        got = reader.read(list(names))
        tensors = {names[n]: t for n, t in got.items()}
        targets = sorted({re.sub(r"\.lora_(A|B)\.(weight|bias)$", "", k).rsplit(".", 1)[-1]
                          for k in tensors if ".lora_A." in k or ".lora_B." in k})
        conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc.lora_rank, "lora_alpha": lc.lora_alpha,
                "lora_dropout": lc.lora_dropout, "target_modules": targets, "bias": lc.lora_bias,
                "modules_to_save": lc.modules_to_save or None, "fan_in_fan_out": False,
                "use_rslora": lc.use_rslora, "use_dora": lc.use_dora}
        origin = f"{src.path.name}/{src.weights.folder} (trainable tensors)"
    if conf.get("peft_type", "LORA") not in ("LORA", "BOFT", "ADALORA", "MISS"):
        raise UserError(f"{origin}: a {conf.get('peft_type')} adapter; LoRA, BOFT, AdaLoRA and MiSS (Bone) adapters "
                        "can be exported")
    from swiftlite.hf_io import pruned_layers
    pruned = pruned_layers(conf)   # AdaLoRA layers at rank 0: empty in peft's file, nothing to merge
    empty = [k for k, v in tensors.items()
             if v.numel() == 0 and re.sub(r"\.lora_[ABE]$", "", k.removeprefix("base_model.model.")) not in pruned]
    if not tensors or empty:
        raise UserError(f"{origin}: the adapter holds {'no tensors' if not tensors else 'empty tensors: ' + empty[0]}")
    unknown = [k for k in tensors if "lora_embedding" in k]
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
    for mod, parts in adapter.tuner_modules().items():
        wname = f"{mod}.weight"
        if wname not in expected or len(expected[wname]) != 2:
            raise UserError(f"adapter/base architecture mismatch: the {adapter.peft_type} adapter adapts {mod}, which "
                            f"base model {base_desc} does not have as a Linear layer")
    for name, t in adapter.replacements().items():
        if name not in expected:
            raise UserError(f"adapter/base architecture mismatch: the adapter replaces {name}, which base model "
                            f"{base_desc} does not have")
        if t.shape != expected[name]:
            raise UserError(f"adapter/base architecture mismatch: {name}: adapter {list(t.shape)}, base model "
                            f"{base_desc} {list(expected[name])}")


def merge_lora(w: torch.Tensor, parts: dict[str, torch.Tensor], scale: float, fan_in_fan_out: bool) -> torch.Tensor:
    """W + scale * B @ A, computed in fp32. DoRA (a magnitude vector "m"): m / ||W + dW|| x (W + dW),
    the norm over each output row, as peft's DoRA merge (tuners/lora/dora.py, `dora_factor`)."""
    delta = (parts["B"].float() @ parts["A"].float()) * scale
    if fan_in_fan_out:
        delta = delta.T
    merged = w.float() + delta
    if "m" in parts:
        rows = merged.T if fan_in_fan_out else merged          # [out, in]
        rows = rows * (parts["m"].float() / torch.linalg.norm(rows, dim=1)).view(-1, 1)
        merged = rows.T if fan_in_fan_out else rows
    return merged
