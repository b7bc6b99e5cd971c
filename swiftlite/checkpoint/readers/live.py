"""The weights of an in-memory model, as its forward uses them (bitsandbytes and HQQ layers dequantized)."""

from __future__ import annotations

import torch

from swiftlite.checkpoint.readers.base import TensorReader


class ModelReader(TensorReader):
    """Weights of an in-memory model (built-in presets, bitsandbytes-quantized bases).

    A 4-bit layer's weight is dequantized with bitsandbytes.functional.dequantize_4bit when read, an
    8-bit one with int8_vectorwise_dequant, an HQQ layer's (packed `W_q` and its metadata) with
    HQQLinear.dequantize, under the name `weight` the 16-bit model has: the values the run's forward used."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.tensors: dict[str, tuple[torch.nn.Module, str, torch.Tensor]] = {}
        self.info = {}
        self.quantized = 0
        from swiftlite.models.hqq import is_hqq_layer
        for mname, mod in model.named_modules():
            if is_hqq_layer(mod):
                full = f"{mname}.weight"
                self.tensors[full] = (mod, "weight", None)
                self.info[full] = (torch.Size((mod.out_features, mod.in_features)), mod.compute_dtype)
                self.quantized += 1
                if mod.bias is not None:
                    self.tensors[f"{mname}.bias"] = (mod, "bias", mod.bias)
                    self.info[f"{mname}.bias"] = (torch.Size(mod.bias.shape), mod.bias.dtype)
                continue
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
    """A module's parameter as the forward uses it: bitsandbytes 4-bit/8-bit and HQQ weights dequantized."""
    from swiftlite.models.hqq import dequantized_weight, is_hqq_layer
    if is_hqq_layer(mod) and n == "weight":   # packed W_q and its metadata: no tensor of that name exists
        return dequantized_weight(mod)
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
