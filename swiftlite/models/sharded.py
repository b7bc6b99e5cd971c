"""Sharded loading: build the model without its weights, let the backend shard it, then fill each
rank's shards straight from the checkpoint, so that no rank ever holds the whole model.

    model = build_skeleton(cfg, source, dtype, attn)   # parameters on the meta device, buffers real
    ... LoRA, activation checkpointing, compile (models/loading.prepare_model), as for a loaded model
    fully_shard(...)                                    # the backend (parallel/fsdp2.py)
    materialize(model, device)                          # each rank reads only its rows

Why this shape (docs/backends.md, "Loading at size"): `from_pretrained` on every rank followed by
`model.to(device)` before `fully_shard` puts the whole model on every GPU and, while the ranks load,
N copies in host RAM: a bf16 70B model needs 140 GB on one GPU before anything is sharded. Here the
skeleton costs nothing (meta tensors), FSDP2 shards it by dim 0 (as `torch.chunk` does), and each
rank copies its own rows of each tensor out of the safetensors files with `safe_open(...).get_slice`,
one tensor at a time, touching only those bytes of the memory-mapped file.

What is *not* in the checkpoint is kept as the skeleton made it: non-persistent buffers (the rotary
`inv_freq`, trap 4 of docs/design.md: `init_empty_weights(include_buffers=False)` computes them for
real) and parameters created on a real device after the skeleton (the LoRA adapters peft draws from
--seed, exactly as on a loaded model); `materialize` keeps a copy of those across `to_empty` and puts
them back. Tied weights (lm_head = embed_tokens) are one parameter, filled once from whichever name
the checkpoint has.

A built-in preset (random weights from --seed) takes the same path: its weights come from the model
built from its config under the seed (`PresetWeights`), tiny by construction, so that the seeded
initial weights, and every parity test, mean what they did.

When the checkpoint's tensor names are not the model's own (an architecture whose weights
transformers converts while loading, a `.bin`-only folder), `plan_sharded` says why and the caller
loads the model whole instead, saying so in one line: never a silent fallback.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

#: safetensors index file (HF's name for a checkpoint split into several files)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class FolderWeights:
    """The tensors of a safetensors checkpoint folder (one file or an index of shards), read by name
    and row range. One file is open at a time: a `safe_open` handle maps its whole file, and the
    pages a rank touched stay in its resident set until the handle is closed, so switching files
    closes the previous one (a rank never keeps more than one shard file's touched pages)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            self.files = {name: self.folder / fname for name, fname in weight_map.items()}
        else:
            from safetensors import safe_open
            single = self.folder / SINGLE_FILE
            with safe_open(str(single), framework="pt") as f:
                self.files = {name: single for name in f.keys()}
        self._open: tuple[Path, Any, Any] | None = None

    def names(self) -> set[str]:
        return set(self.files)

    def largest_file_bytes(self) -> int:
        return max((p.stat().st_size for p in set(self.files.values())), default=0)

    def _handle(self, path: Path) -> Any:
        if self._open is not None and self._open[0] == path:
            return self._open[2]
        self.close()
        from safetensors import safe_open
        ctx = safe_open(str(path), framework="pt")
        self._open = (path, ctx, ctx.__enter__())
        return self._open[2]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> "torch.Tensor":
        """The tensor `name`, or only its rows [start, stop) along dim 0."""
        f = self._handle(self.files[name])
        if rows is None:
            return f.get_tensor(name)
        return f.get_slice(name)[rows[0]:rows[1]]

    def release(self) -> None:
        """Unmap the open file (it is opened again when next read)."""
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
            self._open = None

    close = release


class PresetWeights:
    """A built-in preset's seeded weights, as a source like a checkpoint folder's."""

    def __init__(self, state: dict[str, "torch.Tensor"]):
        self.state = state

    def names(self) -> set[str]:
        return set(self.state)

    def largest_file_bytes(self) -> int:
        return 0

    def read(self, name: str, rows: tuple[int, int] | None = None) -> "torch.Tensor":
        t = self.state[name]
        return t if rows is None else t[rows[0]:rows[1]]

    def release(self) -> None:
        """Nothing is mapped: the weights are tensors in memory, freed by `close`."""

    def close(self) -> None:
        self.state = {}


@dataclass
class Deferred:
    """A skeleton's pending weights: where they come from and which checkpoint name fills which
    parameter (keyed by the module object and attribute, which survive peft's wrapping and
    fully_shard, where the parameter objects do not)."""
    source: Any                                        # FolderWeights | PresetWeights
    names: dict[tuple[int, str], list[str]] = field(default_factory=dict)
    modules: "weakref.WeakValueDictionary" = field(default_factory=weakref.WeakValueDictionary)
    ties: dict[tuple[int, str], list[tuple[int, str]]] = field(default_factory=dict)   # one parameter, many places
    #: 4-bit layers' weights: quantized as they arrive (`_Quantized`), keyed like `names`
    quantized: dict[tuple[int, str], "_Quantized"] = field(default_factory=dict)
    dtype: Any = None                                  # the run's dtype: checkpoint tensors are cast to it


@dataclass(frozen=True)
class _Quantized:
    """How one bitsandbytes 4-bit layer quantizes its weight (Params4bit's settings)."""
    blocksize: int
    compress_statistics: bool
    quant_type: str
    quant_storage: Any
    shape: tuple[int, ...]                             # the 16/32-bit weight's shape in the checkpoint


_DEFERRED: "weakref.WeakKeyDictionary[Any, Deferred]" = weakref.WeakKeyDictionary()


def deferred(model: Any) -> Deferred | None:
    """The pending weights of a skeleton (looked up through peft's wrapper), or None for a model
    that holds its weights already."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _DEFERRED.get(base)


def safetensors_folder(folder: Path) -> str | None:
    """None when `folder` holds a safetensors checkpoint sharded loading can read, else why not."""
    if (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file():
        return None
    return "the checkpoint has no safetensors files (pytorch_model.bin is read whole)"


@contextlib.contextmanager
def _empty_weights() -> Iterator[None]:
    """Parameters on the meta device, buffers real (accelerate's context, the one transformers uses)."""
    from accelerate import init_empty_weights
    with init_empty_weights(include_buffers=False):
        yield


def _empty_model(conf: Any, dtype: "torch.dtype", attn: dict[str, Any]) -> Any:
    """The causal LM of `conf` with meta parameters and its tied weights tied (accelerate's
    init_empty_weights unties them: its parameter hook registers a copy where tying assigns one)."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        # fork_rng: building consumes no randomness a later step (LoRA init, dropout) would miss
        with _empty_weights():
            model = AutoModelForCausalLM.from_config(conf, dtype=dtype, **attn)
        # outside the context: inside it, assigning a parameter registers a new meta copy of it
        model.tie_weights()
    return model


def build_skeleton(conf: Any, dtype: "torch.dtype", source: Any, attn: dict[str, Any],
                   quantization: Any = None) -> Any:
    """The causal LM of `conf` with its parameters on the meta device and its pending weights
    registered (the caller checked with `missing_names` that the checkpoint has them all).

    `quantization` (transformers' BitsAndBytesConfig, 4-bit): the linear layers transformers would
    quantize become bitsandbytes Linear4bit layers, chosen by transformers' own rules
    (`get_keys_to_not_convert`: not lm_head), each with a meta weight already of the packed shape and
    dtype (`bnb_4bit_quant_storage`), so that the backend shards the packed bytes; `materialize`
    (FSDP2) or `unit_initializer` (FSDP1) quantizes each weight when it arrives, one at a time."""
    model = _empty_model(conf, dtype, attn)
    model.config.use_cache = False
    plan = Deferred(source, dtype=dtype)
    if quantization is not None:
        _swap_in_4bit(model, quantization, plan)
    places: dict[int, list[tuple[int, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            plan.names.setdefault((id(module), attr), []).append(full)
            plan.modules[id(module)] = module
            places.setdefault(id(p), []).append((id(module), attr))
        for attr in module._buffers:
            if attr in module._non_persistent_buffers_set:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            plan.names.setdefault((id(module), attr), []).append(full)
            plan.modules[id(module)] = module
    for keys in places.values():
        unique = list(dict.fromkeys(keys))
        if len(unique) > 1:
            names = [n for k in unique for n in plan.names[k]]
            for k in unique:
                plan.ties[k] = [o for o in unique if o != k]
                plan.names[k] = list(dict.fromkeys(names))
    _DEFERRED[model] = plan
    return model


def _swap_in_4bit(model: Any, quantization: Any, plan: Deferred) -> None:
    """Replace the linear layers by meta Linear4bit layers holding packed-shape meta weights."""
    import torch
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert
    shapes = {name: tuple(m.weight.shape) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    skip = list(set(get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])))
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=quantization)
    for name, m in model.named_modules():
        if type(m).__name__ != "Linear4bit":
            continue
        w = m.weight
        spec = _Quantized(w.blocksize, w.compress_statistics, w.quant_type, w.quant_storage, shapes[name])
        numel = 1
        for d in spec.shape:
            numel *= d
        per_element = torch.tensor([], dtype=spec.quant_storage).element_size() * 2   # 4-bit values per element
        w.data = torch.empty(((numel + 1) // per_element, 1), dtype=spec.quant_storage, device="meta")
        w.bnb_quantized = True   # packed: a later .to(device) must not quantize it again
        plan.quantized[(id(m), "weight")] = spec


def _quantize(module: Any, spec: _Quantized, value: "torch.Tensor", device: Any) -> "torch.Tensor":
    """bitsandbytes' 4-bit quantization of one whole weight, as Params4bit does it when transformers
    loads a layer; the module keeps the quantization state (scales), the packed bytes are returned."""
    import bitsandbytes as bnb
    packed, state = bnb.functional.quantize_4bit(
        value.contiguous().to(device), blocksize=spec.blocksize, compress_statistics=spec.compress_statistics,
        quant_type=spec.quant_type, quant_storage=spec.quant_storage)
    module.quant_state = state
    return packed


def _as_params4bit(module: Any, spec: _Quantized, packed: "torch.Tensor") -> Any:
    """A weight that stays whole (not an FSDP2 shard) becomes a Params4bit carrying its state, as
    after transformers' loading (`to_empty` made it a plain Parameter): without it bitsandbytes
    replaces the parameter at every forward, which ZeRO-3's parameter tracking cannot follow."""
    import bitsandbytes as bnb
    module.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=module.quant_state,
                                      blocksize=spec.blocksize, compress_statistics=spec.compress_statistics,
                                      quant_type=spec.quant_type, quant_storage=spec.quant_storage,
                                      module=module, bnb_quantized=True)
    return module.weight


def missing_names(conf: Any, dtype: "torch.dtype", source: Any, attn: dict[str, Any]) -> list[str]:
    """The model's parameters the checkpoint has under none of their names (tied ones count once)."""
    model = _empty_model(conf, dtype, attn)
    have = source.names()
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(names[0] for names in groups.values() if not any(n in have for n in names))


def materialize(model: Any, device: "torch.device | str") -> None:
    """After the backend sharded the skeleton: give every parameter real (local-shard) storage on
    `device`, then copy each rank's rows out of the checkpoint. Tensors that were real before (LoRA
    adapters, non-persistent buffers) keep their values. Closes the source."""
    import torch
    plan = deferred(model)
    if plan is None:
        return
    _follow_copies(model, plan)
    kept = _keep_real_tensors(model)
    kept_keys = {(id(m), a) for (m, a), _ in kept}
    model.to_empty(device=device)
    with torch.no_grad():
        seen: set[int] = set()
        for (module, attr), value in kept:
            t = _tensor_of(module, attr)
            _local(t).copy_(value)
            seen.add(id(t))
        for (mid, attr), names in plan.names.items():
            module = plan.modules.get(mid)
            if module is None:
                continue
            t = _tensor_of(module, attr)
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            name = next((n for n in names if n in plan.source.names()), None)
            if name is None:
                if (mid, attr) in kept_keys:   # a buffer the skeleton computed, not a checkpoint tensor
                    continue
                raise RuntimeError(f"sharded loading: no tensor {names[0]} in the checkpoint")
            seen.add(id(_fill(t, plan, name, module, attr, device)))
    plan.source.close()
    # Every tensor must have been filled or kept: one left as to_empty made it would train on
    # uninitialised memory without a word.
    empty = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if id(t) not in seen]
    if empty:
        raise RuntimeError(f"sharded loading: {len(empty)} tensors got no value (e.g. {empty[0]})")
    _DEFERRED.pop(model.get_base_model() if hasattr(model, "get_base_model") else model, None)


def unit_initializer(model: Any, device: "torch.device | str") -> Any:
    """FSDP1's `param_init_fn` for a skeleton, or None for a loaded model: FSDP1 calls it on each
    module that still has meta tensors as it wraps each unit (one decoder layer, then the root), before
    flattening and sharding that unit. It gives the module real storage on `device`, keeps what was
    real (buffers, adapters), fills every checkpoint tensor whole and re-points tied places at the one
    new parameter. A unit is thus whole for a moment, never the model."""
    import torch
    plan = deferred(model)
    if plan is None:
        return None
    _follow_copies(model, plan)
    names = plan.source.names()

    def init(module: Any) -> None:
        kept = {a: t.detach().clone() for a, t in list(module._parameters.items()) + list(module._buffers.items())
                if t is not None and t.device.type != "meta"}
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            for attr, value in kept.items():
                _tensor_of(module, attr).copy_(value)
            for attr in list(module._parameters) + list(module._buffers):
                if attr in kept or _tensor_of(module, attr) is None:
                    continue
                key = (id(module), attr)
                name = next((n for n in plan.names.get(key, []) if n in names), None)
                if name is None:
                    raise RuntimeError(f"sharded loading: no checkpoint tensor for {type(module).__name__}.{attr}")
                _fill(_tensor_of(module, attr), plan, name, module, attr, device)   # (4-bit: a new Params4bit)
                for mid, other_attr in plan.ties.get(key, []):   # tied: every place gets this parameter
                    other = plan.modules.get(mid)
                    if other is not None and attr in module._parameters:
                        other._parameters[other_attr] = module._parameters[attr]
        # The unit's tensors were read whole: unmap the file so its touched pages leave this rank's
        # resident set now, not when the last unit is done.
        plan.source.release()
    return init


def finish(model: Any) -> None:
    """After FSDP1 wrapped a skeleton: nothing may be left on the meta device; close the source."""
    plan = deferred(model)
    if plan is None:
        return
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"sharded loading: {len(left)} tensors got no value (e.g. {left[0]})")
    plan.source.close()
    _DEFERRED.pop(model.get_base_model() if hasattr(model, "get_base_model") else model, None)


def _follow_copies(model: Any, plan: Deferred) -> None:
    """peft's --modules-to-save copies (ModulesToSaveWrapper) start as copies of the module they
    wrap: fill each copy from the checkpoint names of its original."""
    for m in model.modules():
        original, copies = getattr(m, "original_module", None), getattr(m, "modules_to_save", None)
        if original is None or copies is None:
            continue
        for copy in copies.values():
            for (_, src), (_, dst) in zip(original.named_modules(), copy.named_modules()):
                for attr in list(dst._parameters) + list(dst._buffers):
                    names = plan.names.get((id(src), attr))
                    if names:
                        plan.names[(id(dst), attr)] = names
                        plan.modules[id(dst)] = dst


@contextlib.contextmanager
def adapters_stay_real() -> Iterator[None]:
    """peft moves each new adapter to its base layer's device; on a skeleton that is the meta
    device, and the adapter weights peft just drew from --seed would be lost. Inside this block no
    real tensor moves to the meta device (a `.to(meta, dtype)` keeps only the dtype cast), so the
    adapter is exactly the one peft builds on a loaded model, on the CPU, and `materialize` keeps it.
    Done as a torch function mode, not by patching peft: it holds whichever of peft's code paths
    (layer update, module replacement) does the move."""
    import torch
    from torch.overrides import TorchFunctionMode

    class _NoMoveToMeta(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) \
                    and args[0].device.type != "meta":
                device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
                if device is not None and torch.device(device).type == "meta":
                    return args[0].to(dtype=dtype) if dtype is not None else args[0]
            return func(*args, **kwargs)

    with _NoMoveToMeta():
        yield


def _tensor_of(module: Any, attr: str) -> Any:
    if attr in module._parameters:
        return module._parameters[attr]
    return module._buffers.get(attr)


def _local(t: Any) -> "torch.Tensor":
    """The storage this rank holds for `t` (a DTensor's local shard, else the tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _keep_real_tensors(model: Any) -> list[tuple[tuple[Any, str], "torch.Tensor"]]:
    """Copies of every parameter and buffer that is not on the meta device (their local shards)."""
    kept = []
    for module in model.modules():
        for attr, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is None:
                continue
            local = _local(t)
            if local.device.type != "meta":
                kept.append(((module, attr), local.detach().clone()))
    return kept


def _fill(t: Any, plan: Deferred, name: str, module: Any, attr: str, device: Any) -> Any:
    """Copy this rank's part of checkpoint tensor `name` into `t` (dim-0 rows of a DTensor shard).
    A 4-bit layer's weight is read whole (its scales are per block of the whole weight), cast to the
    run's dtype as from_pretrained does, quantized, and this rank keeps its rows of the packed bytes."""
    source = plan.source
    local = _local(t)
    spec = plan.quantized.get((id(module), attr))
    if spec is not None:
        packed = _quantize(module, spec, source.read(name).to(plan.dtype), device)
        if not hasattr(t, "device_mesh"):
            return _as_params4bit(module, spec, packed)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local.copy_(packed[offset[0]:offset[0] + shape[0]])
        return t
    if local.numel() == 0:
        return t
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if any(o != 0 for o in offset[1:]) or tuple(shape[1:]) != tuple(t.shape[1:]):
            raise RuntimeError(f"sharded loading: {name} is sharded on a dimension other than 0")
        value = source.read(name, (offset[0], offset[0] + shape[0]))
    else:
        value = source.read(name)
    if tuple(value.shape) != tuple(local.shape):
        raise RuntimeError(f"sharded loading: {name} has shape {tuple(value.shape)} in the checkpoint, "
                           f"{tuple(local.shape)} on this rank")
    local.copy_(value)
    return t
