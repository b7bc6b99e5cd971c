"""LISA layer sampling (--lisa_activated_layers N, --lisa_step_interval K), around the backend's engine.

A full fine-tune in which only N of the model's decoder layers train at a time (ms-swift's LISACallback):
every other decoder layer is frozen, the parameters outside the layers (embeddings, final norm, lm_head)
train throughout, and the N layers are drawn again at the start of the optimizer step that begins with
`global_step` steps done whenever global_step % K == 0, and at global_step 1 (ms-swift's rule: so the
first window is the first step alone, the second steps 2..K, then every K steps).

How a frozen layer is kept unchanged: the optimizer is built over every parameter before anything is
frozen, and a frozen layer's parameters get `requires_grad = False`, so their `.grad` stays None (the
torch engines clear gradients with `zero_grad(set_to_none=True)` after each update, before the next
window is drawn). torch's optimizers skip a parameter whose gradient is None: no update, no weight decay,
and no movement from the momentum it kept from an earlier window. A layer's optimizer state, once made,
stays (AdamW moments carry over to its next window), as a parameter without a gradient keeps it in torch.

Where this differs from ms-swift, on purpose:

* the draw is a function of --seed and the window's first step (numpy's SeedSequence), not of numpy's
  global random state, so a resumed run trains the same layers, and ends with the same weights, as an
  uninterrupted one;
* ms-swift's optimizer is built by HF Trainer after the callback froze the layers, and HF keeps only the
  parameters that require grad then: there, only the first draw's layers are in the optimizer. Here every
  layer a window draws is updated.

The draw happens inside `step()`, right after the previous update and the clearing of the gradients
(nothing between two optimizer steps reads which parameters require grad), and for the first step when
the engine is made. Only `--parallelism single` runs it (`lisa_problem`): the wrapping of the other
backends fixes at wrap time which parameters they reduce and update.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

#: Mixed into the seed so that LISA's draws are not the stream of any other use of --seed.
_STREAM = 0x4C495341


def lisa_on(cfg: Any) -> bool:
    return cfg.lora.lisa_activated_layers > 0


def lisa_problem(cfg: Any, choice: Any = None) -> str | None:
    """Why LISA cannot run on the chosen backend (a parallel.base.BackendChoice), or None."""
    if not lisa_on(cfg) or choice is None:
        return None
    rec = choice.record
    if choice.is_deepspeed or any(rec.shards) or rec.max_processes != 1:
        return (f"--lisa_activated_layers with --parallelism {choice.name}: LISA freezes and thaws decoder layers "
                "between optimizer steps, and this backend fixes at wrap time which parameters it reduces and "
                "updates (DDP's reducer, FSDP's sharded groups, ZeRO's flat partitions); run it on one process "
                "(--parallelism single or auto)")
    return None


def check_layers(cfg: Any, source: Any) -> None:
    """Preflight: more active layers than the model has is refused (a hub id's config is read later)."""
    from swiftlite.errors import UserError
    if not lisa_on(cfg):
        return
    conf = source.config_dict() or {}
    n = conf.get("num_hidden_layers", (conf.get("text_config") or {}).get("num_hidden_layers"))
    if isinstance(n, int) and cfg.lora.lisa_activated_layers > n:
        raise UserError(f"--lisa_activated_layers {cfg.lora.lisa_activated_layers}: the model has {n} decoder "
                        "layers; give at most that many")


def window_start(done: int, interval: int) -> int:
    """The step count at which the layers the next step trains were drawn (`done`: optimizer steps done)."""
    if done <= 1 or done % interval == 0:
        return done
    last = done - done % interval
    return last if last > 0 else 1


def sample(seed: int, start: int, n_layers: int, n_active: int) -> list[int]:
    """The decoder layers (sorted indices) the window drawn at step count `start` trains: a function of
    --seed and `start` alone."""
    import numpy as np
    rng = np.random.default_rng([_STREAM, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, start])
    return sorted(int(i) for i in rng.choice(n_layers, size=n_active, replace=False))


class LisaLayers:
    """The model's decoder layers and which of them train."""

    def __init__(self, model: "torch.nn.Module", cfg: Any):
        from swiftlite.errors import UserError
        from swiftlite.models.loading import decoder_layers
        self.layers = decoder_layers(model)
        self.n_active = cfg.lora.lisa_activated_layers
        self.interval = cfg.lora.lisa_step_interval
        self.seed = cfg.train.seed
        if self.n_active > len(self.layers):
            raise UserError(f"--lisa_activated_layers {self.n_active}: the model has {len(self.layers)} decoder "
                            "layers; give at most that many")
        self.active: list[int] = []

    def activate(self, done: int) -> bool:
        """Train the layers of the window the step after `done` steps belongs to; True when newly drawn."""
        start = window_start(done, self.interval)
        if start != done and self.active:
            return False
        self.active = sample(self.seed, start, len(self.layers), self.n_active)
        keep = set(self.active)
        for i, layer in enumerate(self.layers):
            for p in layer.parameters():
                p.requires_grad_(i in keep)
        return True


class LisaEngine:
    """The backend's engine with LISA's draw after each `step()`; everything else is the engine's."""

    def __init__(self, engine: Any, layers: LisaLayers, start_step: int, total_steps: int, log: Any = print):
        self._engine = engine
        self.layers = layers
        self.global_step = start_step
        self._total = total_steps
        self._log = log
        self._draw()

    def __getattr__(self, name: str) -> Any:   # the Engine surface: the wrapped engine's
        return getattr(self._engine, name)

    def _draw(self) -> None:
        if self.layers.activate(self.global_step) and self.global_step < self._total:
            self._log(f"lisa: from step {self.global_step + 1}, training decoder layers "
                      f"{', '.join(map(str, self.layers.active))} of {len(self.layers.layers)} "
                      "(and every parameter outside the layers)")

    def step(self) -> float:
        norm = self._engine.step()   # the update, then the gradients cleared (set to None)
        self.global_step += 1
        self._draw()
        return norm


def with_lisa(engine: Any, model: Any, cfg: Any, start_step: int, total_steps: int, log: Any = print) -> Any:
    """The engine the loop drives: `engine` itself, or with --lisa_activated_layers an LisaEngine."""
    if not lisa_on(cfg):
        return engine
    return LisaEngine(engine, LisaLayers(model, cfg), start_step, total_steps, log)


@contextlib.contextmanager
def resume_scope(model: Any, cfg: Any, path: Path | None) -> Iterator[None]:
    """Around the load of a full fine-tune's checkpoint: only the parameters that have optimizer state in
    it require grad.

    A fresh optimizer has no state; torch's state-dict API makes one for every parameter that requires
    grad before loading into it (a zero-gradient step), and DCP then wants each of those in the
    checkpoint. A LISA checkpoint holds state for the layers drawn so far only, so the others are frozen
    for the load: the resumed optimizer holds exactly the checkpoint's state, as the uninterrupted one
    did (and a full run without LISA can go on from such a checkpoint, --ignore-data-skip). A checkpoint
    of a full run without LISA has state for every parameter: nothing changes. The flags are restored
    afterwards; `with_lisa` then freezes the next window's layers."""
    names = _optimizer_state_names(path) if cfg.train.train_type == "full" and path is not None else None
    if not names:
        yield
        return
    with_state: dict[int, bool] = {}
    for name, p in model.named_parameters(remove_duplicate=False):   # a tied weight: under any of its names
        with_state[id(p)] = with_state.get(id(p), False) or _clean(name) in names
    trainable = [p for p in model.parameters() if p.requires_grad]
    if all(with_state[id(p)] for p in trainable) or not any(with_state[id(p)] for p in trainable):
        # every parameter has its state (a checkpoint without LISA: nothing to do), or none matches (names
        # this check cannot read): the load goes on as for any full run, which reports a real mismatch
        yield
        return
    before = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(with_state[id(p)] and before[id(p)])
    try:
        yield
    finally:
        for p in model.parameters():
            p.requires_grad_(before[id(p)])


#: Module names wrappers insert into a parameter's name that checkpoints (torch's state-dict API) leave
#: out: FSDP1's and activation checkpointing's wrappers, torch.compile's.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _optimizer_state_names(path: Path) -> set[str]:
    """Parameter names with optimizer state in a checkpoint's DCP folder (empty: none, or no DCP folder)."""
    from swiftlite.checkpoint.layout import DCP_DIR, DCP_METADATA
    from swiftlite.checkpoint.safety import load_dcp_metadata
    folder = Path(path) / DCP_DIR
    if not (folder / DCP_METADATA).is_file():
        return set()
    keys = load_dcp_metadata(folder).state_dict_metadata
    prefix = "optim.state."
    # optim.state.<parameter name>.<state entry>: entries are leaves (exp_avg, exp_avg_sq, step, ...)
    return {k[len(prefix):].rsplit(".", 1)[0] for k in keys if k.startswith(prefix)}
