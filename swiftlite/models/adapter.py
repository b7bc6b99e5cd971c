"""Houlsby adapters (`--train_type adapter`, arXiv 1902.00751), as ms-swift builds them
(swift/tuners/adapter.py, chosen in swift/pipelines/train/tuner.py): one AdapterModule per decoder
layer, on the layer's `mlp` module; the MLP's output x becomes x + linear2(act(linear1(x))), with
linear1: hidden -> --adapter_length and linear2: --adapter_length -> hidden, both with bias, and act
transformers' ACT2CLS[--adapter_act]. The sum is computed in the adapter's dtype and returned in x's
(ms-swift's forward). Where the MLP returns a tuple (MoE blocks with router logits) the adapter
applies to its first element (ms-swift's hidden_pos=0). Only the adapters train.

Initialisation is ms-swift's: xavier_uniform_ weights and normal(std=1e-6) biases. The adapter is not
an identity at step 0: linear2's xavier weights make its output as large as any layer's, so the model
computes something else than the base from the first step on (ms-swift's does too).

How it is attached: the AdapterModule is a submodule of the MLP named `adapter_default` (ms-swift's
attribute name, so the state-dict keys are ms-swift's: `model.layers.0.mlp.adapter_default.linear1.weight`),
and a forward hook on the MLP adds it. A hook, not a wrapper: the base's parameter names stay the
model's own (sharded loading, DCP checkpoints and the model's other hooks see the usual module tree),
and FSDP2's fully_shard per decoder layer shards the adapter with its layer, so it is gathered and
resharded with the layer's other weights (ZeRO-3 gathers it as a submodule of the layer, by its own
hooks); activation checkpointing of the layer recomputes it too.

The adapter's weights are drawn under --seed (fork_rng), so every rank and every run (a resume, a
checkpoint rebuilt by infer) draws the same values before any are loaded over them.

No transformers architecture has this module and it cannot be merged into the base (a non-linear
function of the MLP's output), so a checkpoint keeps it in its sharded state only: dcp/ holds the
adapters alone (the frozen base is the base model's, read again at resume, as for LoRA), ds/ everything
DeepSpeed saves; no HF model folder is written that would claim to be the plain model. `swiftlite export`
refuses it (ms-swift cannot merge it either); infer rebuilds the model (export/reference.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swiftlite.errors import UserError

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig

#: The attribute of each MLP that holds its adapter (ms-swift's f"adapter_{adapter_name}").
ATTR = "adapter_default"
#: The module of each decoder layer the adapter follows (ms-swift's model_arch.mlp of the text LLMs).
MLP = "mlp"
#: The backends the adapter runs on (engine keys; "deepspeed": every ZeRO record). Under the FSDP2 ones the
#: base is a skeleton (models/sharded.py): the adapters are created real next to its meta tensors, sharded
#: with their layer, and kept while each rank fills its rows of the base; under ZeRO-3 the base is
#: partitioned as it loads (zero.Init) and the adapters, created whole after it, are partitioned by
#: deepspeed.initialize with the rest.
BACKENDS = ("single", "ddp", "fsdp", "hsdp", "deepspeed")


def _module_class() -> type:
    import torch

    class AdapterModule(torch.nn.Module):
        """ms-swift's AdapterModule: x + linear2(act(linear1(x))) in the adapter's dtype, returned in x's."""

        def __init__(self, dim: int, length: int, act: str):
            super().__init__()
            from transformers.activations import ACT2CLS
            self.linear1 = torch.nn.Linear(dim, length)
            self.act = ACT2CLS[act]()
            self.linear2 = torch.nn.Linear(length, dim)
            for lin in (self.linear1, self.linear2):
                torch.nn.init.xavier_uniform_(lin.weight)
                torch.nn.init.normal_(lin.bias, std=1e-6)

        def forward(self, x: "torch.Tensor") -> "torch.Tensor":
            x_dtype = x.dtype
            h = x.to(self.linear1.weight.dtype)
            return (h + self.linear2(self.act(self.linear1(h)))).to(x_dtype)

    return AdapterModule


_CLASS: Any = None


def adapter_class() -> type:
    """The AdapterModule class (built once: torch is imported on first use, not with this module)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _module_class()
    return _CLASS


def _add_adapter(module: "torch.nn.Module", _args: Any, output: Any) -> Any:
    """The MLP's forward hook: its output through the adapter (a tuple's first element)."""
    adapter = getattr(module, ATTR)
    if isinstance(output, tuple):
        return (adapter(output[0]), *output[1:])
    return adapter(output)


def _layers(model: "torch.nn.Module") -> Any:
    """The decoder layers: the first `layers` ModuleList of the causal LM."""
    import torch
    for m in model.modules():
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
            return m.layers
    raise UserError(f"--train_type adapter: cannot find the decoder layers of {type(model).__name__} "
                    "(no `layers` list)")


def _hidden(conf: Any) -> int:
    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    return int(text.hidden_size)


def architecture_problem(model: "torch.nn.Module") -> str | None:
    """Why this model's decoder layers cannot take an adapter (a layer without an `mlp` module), or None.
    Works on a meta-device model (preflight)."""
    import torch
    for i, layer in enumerate(_layers(model)):
        if not isinstance(getattr(layer, MLP, None), torch.nn.Module):
            return (f"--train_type adapter: decoder layer {i} ({type(layer).__name__}) has no `{MLP}` module, which "
                    "the Houlsby adapter follows; use --train_type lora or full")
    return None


def attach(model: "torch.nn.Module", cfg: "RunConfig") -> "torch.nn.Module":
    """Add an adapter after every decoder layer's MLP of `model` (a causal LM, weights loaded or about to
    be loaded over it) and leave only the adapters trainable. Returns the same model."""
    import torch
    why = architecture_problem(model)
    if why:
        raise UserError(why)
    cls = adapter_class()
    dim, length, act = _hidden(model.config), cfg.lora.adapter_length, cfg.lora.adapter_act
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        for layer in _layers(model):
            mlp = getattr(layer, MLP)
            if hasattr(mlp, ATTR):
                raise UserError(f"--train_type adapter: {type(mlp).__name__} already has an adapter")
            ref = next(mlp.parameters(), None)
            adapter = cls(dim, length, act)
            if ref is not None:   # the base's dtype; its device, or the host for a skeleton's meta base
                device = ref.device if ref.device.type != "meta" else None
                adapter = adapter.to(device=device, dtype=ref.dtype if ref.is_floating_point() else None)
            setattr(mlp, ATTR, adapter)
            mlp.register_forward_hook(_add_adapter)
    return model


def adapter_params(n_layers: int, hidden: int, length: int) -> int:
    """Parameters the adapters train: per layer linear1 (hidden x length + length) and linear2
    (length x hidden + hidden)."""
    return n_layers * (2 * hidden * length + length + hidden)


def describe(cfg: "RunConfig", model: "torch.nn.Module") -> str:
    """One line for the run's log: where the adapters went and what trains."""
    n = len(_layers(model))
    hidden, length = _hidden(model.config), cfg.lora.adapter_length
    return (f"adapter: Houlsby adapters after the MLP of each of {n} decoder layers ({hidden} -> {length} -> "
            f"{hidden}, {cfg.lora.adapter_act}), {adapter_params(n, hidden, length):,} trained parameters; the "
            "rest frozen")


def backend_problem(cfg: "RunConfig", choice: Any = None) -> str | None:
    """Why --train_type adapter cannot run on the chosen backend (a parallel.base.BackendChoice), or None.
    fsdp1 flattens each unit into one tensor of one dtype, and the adapters' fp32 master weights sit next
    to a 16-bit frozen base (and a backend of a plugin is not known to keep the hooks): refused before
    launch. Under DeepSpeed a --save_only_model checkpoint holds its weights as the HF copy alone, which an
    adapter run does not write: refused too."""
    if cfg.train.train_type != "adapter" or choice is None:
        return None
    if choice.key not in BACKENDS:
        return (f"--train_type adapter with --parallelism {choice.name}: swiftlite trains Houlsby adapters on "
                "single, ddp, fsdp (FSDP2), hsdp and the DeepSpeed ZeRO stages; use --parallelism fsdp (or zero2)")
    if choice.key == "deepspeed" and cfg.checkpoint.save_only_model:
        return (f"--save_only_model with --train_type adapter under --parallelism {choice.name}: a DeepSpeed "
                "--save_only_model checkpoint holds its weights only as an HF folder, and no HF folder holds "
                "Houlsby adapters; drop --save_only_model, or use --parallelism fsdp")


def check_model(cfg: "RunConfig", source: Any) -> None:
    """Before launch: every decoder layer has an `mlp` (a meta-device model: no weights read). A hub model
    not downloaded yet is checked in the rank."""
    if cfg.train.train_type != "adapter" or source.kind == "hub":
        return
    import torch

    from swiftlite.models.sharded import _empty_model
    conf = source.config(cfg.model.trust_remote_code, cfg.model.model_revision)
    why = architecture_problem(_empty_model(conf, torch.float32, {}))
    if why:
        raise UserError(why)


def refuse_export(flag: str, arg: str) -> None:
    """`swiftlite export` of an adapter checkpoint: refused in one line (no faithful HF form exists)."""
    raise UserError(f"{flag} {arg}: a --train_type adapter checkpoint cannot be exported: a Houlsby adapter is a "
                    "non-linear function of each MLP's output, which no merge into the base weights reproduces and "
                    "no transformers architecture has (ms-swift cannot merge it either); use it with `swiftlite "
                    "infer --model RUN_OR_CHECKPOINT` or resume it")
