"""DeepSpeed JSON configs: presets, "auto" filling, and the checks DeepSpeed does not do itself.

    ds = resolve_ds_config(cfg, world_size, hidden_size, "zero3")   # load + fill_auto + validate
    ds = load_ds_config("zero3")  /  load_ds_config("my_ds.json")
    ds = fill_auto(ds, cfg, world_size, hidden_size)
    validate_ds_config(ds, world_size)

Presets live in ``swiftlite/ds_configs/*.json`` (shipped with the package; the top-level
``ds_configs/`` folder of the repository is a symlink to it). They follow ms-swift's presets:
every value that depends on the run is "auto" and is filled here the way the Hugging Face
Trainer integration fills it:

    train_micro_batch_size_per_gpu      --per-device-train-batch-size
    gradient_accumulation_steps         --gradient-accumulation-steps
    train_batch_size                    micro * accumulation * world size
    gradient_clipping                   --max-grad-norm
    bf16.enabled / fp16.enabled         --torch-dtype bf16 / fp16
    bf16.bf16_master_weights_and_grads  --pure-bf16 (DeepSpeed's own switch: bf16 master weights,
    bf16.bf16_optimizer_states          gradients and AdamW moments; ZeRO 1-3, no optimizer offload)
    reduce_bucket_size                  hidden_size * hidden_size
    stage3_prefetch_bucket_size         int(0.9 * hidden_size * hidden_size)
    stage3_param_persistence_threshold  10 * hidden_size
    zero_hpz_partition_size             --nproc-per-node (ZeRO++ hpZ: one node's processes; in a rank
                                        started without the flag, the launcher's LOCAL_WORLD_SIZE);
                                        1 (hpZ off) when one node holds the whole world
    zero_quantized_weights / _gradients --zero-quantized-weights / --zero-quantized-gradients (ZeRO++
                                        qwZ/qgZ; refused on CPU runs, deepspeed.py check_config)
    nvme_path                           --offload-dir (required when a preset says "auto")
    optimizer / scheduler blocks        dropped: swiftlite always builds AdamW + its schedule from the
                                        flags (explicit values there must agree with the flags)

An explicit value (not "auto") that contradicts a flag is a UserError naming both, never silently
overridden. Rejected outright: offload_param with ZeRO stage < 3 (DeepSpeed ignores it silently),
train_batch_size != micro * accumulation * world, fp16 and bf16 both enabled, an "auto" that
swiftlite cannot fill, nvme offload without a path, and ZeRO++ settings below stage 3 (ignored by
DeepSpeed) or an hpZ group size that does not divide the world.

This module is import-light (no torch, no deepspeed) so the CLI can check a config before launch.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.config import RunConfig

AUTO = "auto"
PRESET_DIR = Path(__file__).resolve().parent.parent / "ds_configs"


def preset_names() -> list[str]:
    """The shipped presets (file stems of swiftlite/ds_configs/*.json)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def preset_path(name: str) -> Path | None:
    stem = name[:-5] if name.endswith(".json") else name
    p = PRESET_DIR / f"{stem}.json"
    return p if "/" not in name and p.is_file() else None


def load_ds_config(source: str) -> dict[str, Any]:
    """Read a DeepSpeed config: an existing JSON file, else a preset name (zero2, zero3, ...)."""
    if not source or not str(source).strip():
        raise UserError(f"--deepspeed: empty DeepSpeed config name (presets: {', '.join(preset_names())})")
    path = Path(source).expanduser()
    if not path.is_file():
        pre = preset_path(str(source))
        if pre is None:
            if str(source).endswith(".json") or "/" in str(source):
                raise UserError(f"--deepspeed: file not found: {source} (or use a preset: "
                                f"{', '.join(preset_names())})")
            raise UserError(f"--deepspeed: unknown DeepSpeed preset {source!r} (presets: "
                            f"{', '.join(preset_names())}; or a path to a .json file)")
        path = pre
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise UserError(f"{source}: a DeepSpeed config must be a JSON object, got {type(data).__name__}")
    return data


def ds_stage(ds: dict[str, Any]) -> int:
    """ZeRO stage of a config (0 when there is no zero_optimization block)."""
    zo = ds.get("zero_optimization") or {}
    try:
        return int(zo.get("stage", 0))
    except (TypeError, ValueError):
        raise UserError(f"DeepSpeed config: zero_optimization.stage must be 0-3, got {zo.get('stage')!r}") from None


def _offload_device(ds: dict[str, Any], key: str) -> str:
    block = (ds.get("zero_optimization") or {}).get(key) or {}
    dev = block.get("device", "none") if isinstance(block, dict) else "none"
    return str(dev or "none").lower()


def offload_devices(ds: dict[str, Any]) -> tuple[str, str]:
    """(optimizer, param) offload devices: each "none", "cpu" or "nvme"."""
    return _offload_device(ds, "offload_optimizer"), _offload_device(ds, "offload_param")


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.strip().lower() == AUTO


def _num(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UserError(f"DeepSpeed config: {key} must be a number or \"auto\", got {v!r}")
    return v


def _fill(block: dict, key: str, value: Any, *, label: str, flag: str | None, flag_value: Any = None) -> None:
    """block[key]: "auto" -> value; an explicit value must equal `value` when it comes from a flag."""
    if key not in block:
        return
    cur = block[key]
    if _is_auto(cur):
        block[key] = value
    elif flag is not None:
        n = _num(cur, label)
        if n != value:
            shown = flag_value if flag_value is not None else value
            raise UserError(f"DeepSpeed config {label}={cur} contradicts {flag} {shown}: "
                            f"set it to \"auto\" or make them agree")


def fill_auto(ds: dict[str, Any], cfg: "RunConfig", world_size: int, hidden_size: int | None) -> dict[str, Any]:
    """A copy of `ds` with every "auto" filled from the run (see the module docstring).

    `hidden_size` is the model's hidden size (for the bucket sizes); None drops those "auto" keys so
    DeepSpeed uses its own defaults."""
    ds = copy.deepcopy(ds)
    t, o = cfg.train, cfg.optim
    micro, gas = t.per_device_train_batch_size, t.gradient_accumulation_steps
    _fill(ds, "train_micro_batch_size_per_gpu", micro, label="train_micro_batch_size_per_gpu",
          flag="--per-device-train-batch-size")
    _fill(ds, "gradient_accumulation_steps", gas, label="gradient_accumulation_steps",
          flag="--gradient-accumulation-steps")
    _fill(ds, "train_batch_size", micro * gas * world_size, label="train_batch_size", flag=None)
    _fill(ds, "gradient_clipping", o.max_grad_norm, label="gradient_clipping", flag="--max-grad-norm")
    # The flags are the source of truth: a config that leaves a batch key out gets it from the flags.
    ds.setdefault("train_micro_batch_size_per_gpu", micro)
    ds.setdefault("gradient_accumulation_steps", gas)
    ds.setdefault("gradient_clipping", o.max_grad_norm)

    dtype = cfg.model.torch_dtype
    for prec in ("bf16", "fp16"):
        want = dtype == prec
        block = ds.get(prec)
        if block is None:
            if want:
                ds[prec] = {"enabled": True}
            continue
        if not isinstance(block, dict):
            raise UserError(f"DeepSpeed config: {prec} must be an object like {{\"enabled\": \"auto\"}}")
        en = block.get("enabled", False)
        if _is_auto(en):
            block["enabled"] = want
        elif bool(en) != want:
            raise UserError(f"DeepSpeed config {prec}.enabled={str(bool(en)).lower()} contradicts "
                            f"--torch-dtype {dtype}: set it to \"auto\" or make them agree")

    _fill_pure_bf16(ds, cfg)

    zo = ds.get("zero_optimization")
    if isinstance(zo, dict):
        sizes = {"reduce_bucket_size": lambda h: h * h,
                 "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                 "stage3_param_persistence_threshold": lambda h: 10 * h}
        for key, fn in sizes.items():
            if _is_auto(zo.get(key)):
                if hidden_size:
                    zo[key] = fn(int(hidden_size))
                else:
                    del zo[key]
        if _is_auto(zo.get("zero_hpz_partition_size")):
            # ZeRO++ hpZ: the secondary weight partition spans one node's processes. On one node that
            # group is the whole world, and DeepSpeed would still build the secondary partition (the
            # same size as the primary: measured, twice the parameter bytes) for no traffic saved: 1 (off).
            per_node = procs_per_node(cfg, world_size)
            zo["zero_hpz_partition_size"] = per_node if per_node < world_size else 1
        _fill_quantized(zo, cfg)
        offload_dir = cfg.parallel.offload_dir
        for key in ("offload_optimizer", "offload_param"):
            block = zo.get(key)
            if not isinstance(block, dict) or "nvme_path" not in block:
                continue
            if _is_auto(block["nvme_path"]):
                if str(block.get("device", "none")).lower() != "nvme":
                    block.pop("nvme_path")
                    continue
                if not offload_dir:
                    raise UserError(f"DeepSpeed config zero_optimization.{key}.nvme_path is \"auto\": "
                                    "give the NVMe folder with --offload-dir")
                block["nvme_path"] = offload_dir
            elif offload_dir and str(Path(block["nvme_path"])) != str(Path(offload_dir)):
                raise UserError(f"DeepSpeed config zero_optimization.{key}.nvme_path={block['nvme_path']} "
                                f"contradicts --offload-dir {offload_dir}: set it to \"auto\" or make them agree")

    _drop_optimizer_and_scheduler(ds, cfg)
    return ds


def procs_per_node(cfg: "RunConfig", world_size: int) -> int:
    """--nproc-per-node; inside a rank started without it (torchrun by hand), the launcher's
    LOCAL_WORLD_SIZE; else the whole world (one node)."""
    from swiftlite import env as envvars
    if cfg.parallel.nproc_per_node:
        return int(cfg.parallel.nproc_per_node)
    v = envvars.world_vars()
    return v.local_world_size if v.has_local_world_size else world_size


#: ZeRO++'s quantized communication switches (zero_optimization block) and the flag that sets each.
#: zero_quantized_nontrainable_weights has no flag (a user JSON may set it; the same device check).
QUANTIZED_KEYS = {"zero_quantized_weights": "--zero-quantized-weights",
                  "zero_quantized_gradients": "--zero-quantized-gradients",
                  "zero_quantized_nontrainable_weights": None}


def _fill_quantized(zo: dict[str, Any], cfg: "RunConfig") -> None:
    """qwZ/qgZ: "auto" takes the flag (false without it), so does a config that leaves the key out
    when the flag is given; an explicit value that the flag contradicts is an error."""
    for key, flag in QUANTIZED_KEYS.items():
        if flag is None:
            continue
        want = bool(getattr(cfg.parallel, key, False))
        cur = zo.get(key)
        if _is_auto(cur) or (cur is None and want):
            zo[key] = want
        elif want and cur is not True:
            raise UserError(f"DeepSpeed config zero_optimization.{key}={str(cur).lower()} contradicts {flag}: "
                            "set it to \"auto\" or make them agree")


def quantized_settings(ds: dict[str, Any]) -> list[str]:
    """The ZeRO++ quantized-communication keys a filled config turns on."""
    zo = ds.get("zero_optimization") or {}
    return [k for k in QUANTIZED_KEYS if zo.get(k) is True]


#: DeepSpeed's pure-bf16 switches (bf16 block), set together by --pure-bf16.
PURE_BF16_KEYS = ("bf16_master_weights_and_grads", "bf16_optimizer_states")


def _fill_pure_bf16(ds: dict[str, Any], cfg: "RunConfig") -> None:
    """--pure-bf16 -> bf16.bf16_master_weights_and_grads + bf16.bf16_optimizer_states (DeepSpeed then
    keeps its "master" partition, gradients and AdamW moments in bf16); without the flag they are
    false (fp32 master weights, DeepSpeed's default). An explicit value must agree with the flag."""
    pure = bool(getattr(cfg.parallel, "pure_bf16", False))
    block = ds.get("bf16")
    if not isinstance(block, dict):
        return  # no bf16 block: not a bf16 run (--pure-bf16 needs bf16: optim.precision_problem)
    for key in PURE_BF16_KEYS:
        cur = block.get(key)
        if cur is None or _is_auto(cur):
            if pure or cur is not None:
                block[key] = pure
        elif bool(cur) != pure:
            raise UserError(f"DeepSpeed config bf16.{key}={str(bool(cur)).lower()} contradicts "
                            f"{'--pure-bf16' if pure else 'the run (fp32 master weights; --pure-bf16 not given)'}: "
                            "set it to \"auto\" or make them agree")


_OPT_FLAGS = {"lr": "--learning-rate", "eps": "--adam-epsilon", "weight_decay": "--weight-decay"}


def _drop_optimizer_and_scheduler(ds: dict[str, Any], cfg: "RunConfig") -> None:
    """swiftlite always passes its own AdamW and schedule (so every backend has the same numerics):
    a DeepSpeed optimizer/scheduler block may stay for compatibility with HF configs only if it
    says the same thing as the flags (or "auto")."""
    opt = ds.pop("optimizer", None)
    if opt is not None:
        if not isinstance(opt, dict):
            raise UserError("DeepSpeed config: optimizer must be an object")
        kind = str(opt.get("type", "AdamW"))
        if kind.lower() not in ("adam", "adamw"):
            raise UserError(f"DeepSpeed config optimizer.type={kind}: swiftlite trains with AdamW "
                            "(set by --learning-rate, --adam-beta1/2, --adam-epsilon, --weight-decay); "
                            "remove the optimizer block")
        params = opt.get("params") or {}
        o = cfg.optim
        wanted = {"lr": cfg.learning_rate, "eps": o.adam_epsilon, "weight_decay": o.weight_decay}
        for k, v in params.items():
            if _is_auto(v):
                continue
            if k in wanted:
                if _num(v, f"optimizer.params.{k}") != wanted[k]:
                    raise UserError(f"DeepSpeed config optimizer.params.{k}={v} contradicts "
                                    f"{_OPT_FLAGS[k]} {wanted[k]}: set it to \"auto\" or make them agree")
            elif k == "betas":
                if not isinstance(v, (list, tuple)) or [float(b) for b in v] != [o.adam_beta1, o.adam_beta2]:
                    raise UserError(f"DeepSpeed config optimizer.params.betas={v} contradicts --adam-beta1 "
                                    f"{o.adam_beta1} / --adam-beta2 {o.adam_beta2}: set it to \"auto\"")
            elif k in ("torch_adam", "adam_w_mode", "fused"):
                continue
            else:
                raise UserError(f"DeepSpeed config optimizer.params.{k}: not supported by swiftlite's AdamW; "
                                "remove it")
    sch = ds.pop("scheduler", None)
    if sch is not None:
        params = (sch.get("params") or {}) if isinstance(sch, dict) else {}
        explicit = [k for k, v in params.items() if not _is_auto(v)]
        if explicit:
            raise UserError(f"DeepSpeed config scheduler.params.{explicit[0]} is set: swiftlite schedules the "
                            "learning rate itself (--lr-scheduler, --warmup-steps, --warmup-ratio); "
                            "remove the scheduler block or set its params to \"auto\"")


def _find_auto(obj: Any, prefix: str = "") -> list[str]:
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _find_auto(v, f"{prefix}.{k}" if prefix else str(k))
    elif _is_auto(obj):
        out.append(prefix)
    return out


def validate_ds_config(ds: dict[str, Any], world_size: int) -> None:
    """Reject what DeepSpeed would accept silently or fail on obscurely (call after fill_auto)."""
    left = _find_auto(ds)
    if left:
        raise UserError(f"DeepSpeed config {left[0]} is \"auto\" but swiftlite has no value for it: "
                        "set it explicitly")
    stage = ds_stage(ds)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"DeepSpeed config: zero_optimization.stage must be 0-3, got {stage}")
    opt_dev, par_dev = offload_devices(ds)
    for key, dev in (("offload_optimizer", opt_dev), ("offload_param", par_dev)):
        if dev not in ("none", "cpu", "nvme"):
            raise UserError(f"DeepSpeed config zero_optimization.{key}.device={dev!r}: use none, cpu or nvme")
    if par_dev != "none" and stage < 3:
        raise UserError(f"DeepSpeed config: offload_param (device {par_dev}) needs ZeRO stage 3, got stage "
                        f"{stage} (DeepSpeed would silently ignore it): use zero3_offload, or drop offload_param")
    if opt_dev != "none" and stage < 1:
        raise UserError("DeepSpeed config: offload_optimizer needs ZeRO stage 1-3, got stage 0")
    for key, dev in (("offload_optimizer", opt_dev), ("offload_param", par_dev)):
        if dev == "nvme":
            block = ds["zero_optimization"][key]
            if not block.get("nvme_path"):
                raise UserError(f"DeepSpeed config zero_optimization.{key}: device nvme needs nvme_path "
                                "(or \"auto\" with --offload-dir)")
    _validate_zeropp(ds, stage, world_size)
    bf16 = bool((ds.get("bf16") or {}).get("enabled", False))
    fp16 = bool((ds.get("fp16") or {}).get("enabled", False))
    if bf16 and fp16:
        raise UserError("DeepSpeed config: bf16.enabled and fp16.enabled are both true: pick one")
    if any((ds.get("bf16") or {}).get(k) is True for k in PURE_BF16_KEYS):
        if stage < 1:
            raise UserError("DeepSpeed config: bf16 master weights and optimizer state (--pure-bf16) need ZeRO "
                            "stage 1-3, got stage 0")
        if opt_dev != "none":
            raise UserError(f"--pure-bf16 with optimizer offload (device {opt_dev}): DeepSpeed keeps bf16 optimizer "
                            "state on the CPU only with its own CPU Adam, and swiftlite runs torch AdamW; use zero2 "
                            "or zero3, or drop --pure-bf16")
    micro = ds.get("train_micro_batch_size_per_gpu")
    gas = ds.get("gradient_accumulation_steps")
    tbs = ds.get("train_batch_size")
    for k, v in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", gas),
                 ("train_batch_size", tbs)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            if not (isinstance(v, float) and v.is_integer() and v > 0):
                raise UserError(f"DeepSpeed config {k} must be a positive integer, got {v!r}")
    if tbs is not None and micro is not None and gas is not None and int(tbs) != int(micro) * int(gas) * world_size:
        raise UserError(f"DeepSpeed config train_batch_size={tbs} != train_micro_batch_size_per_gpu {micro} x "
                        f"gradient_accumulation_steps {gas} x world size {world_size} = "
                        f"{int(micro) * int(gas) * world_size}: set it to \"auto\"")


def _validate_zeropp(ds: dict[str, Any], stage: int, world_size: int) -> None:
    """ZeRO++ settings DeepSpeed reads only at stage 3 (ignored silently below), and an hpZ group
    size that must divide the world (DeepSpeed asserts it deep in its group setup)."""
    zo = ds.get("zero_optimization") or {}
    hpz = zo.get("zero_hpz_partition_size", 1)
    if isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 0:
        raise UserError(f"DeepSpeed config zero_optimization.zero_hpz_partition_size must be a whole number of "
                        f"processes, got {hpz!r}")
    if hpz > 1:
        if stage != 3:
            raise UserError(f"DeepSpeed config: zero_hpz_partition_size {hpz} (ZeRO++ hpZ) needs ZeRO stage 3, got "
                            f"stage {stage} (DeepSpeed would silently ignore it)")
        if hpz > world_size or world_size % hpz:
            raise UserError(f"DeepSpeed config: zero_hpz_partition_size {hpz} (ZeRO++ hpZ: processes per node) must "
                            f"divide the {world_size} processes")
    for key in quantized_settings(ds):
        if stage != 3:
            raise UserError(f"DeepSpeed config: {key} (ZeRO++) needs ZeRO stage 3, got stage {stage} "
                            "(DeepSpeed would silently ignore it)")


def resolve_ds_config(cfg: "RunConfig", world_size: int, hidden_size: int | None,
                      source: str | None) -> dict[str, Any]:
    """The run's DeepSpeed config, filled and validated (what the engine passes to DeepSpeed)."""
    src = source
    if not src:
        raise UserError("--parallelism: no DeepSpeed config (use zero2, zero3, ... or --deepspeed FILE)")
    ds = fill_auto(load_ds_config(src), cfg, world_size, hidden_size)
    validate_ds_config(ds, world_size)
    return ds


def ds_config_family(ds: dict[str, Any]) -> str:
    """The memory family of a DeepSpeed config, from its stage and its offload blocks: parameter
    offload (stage 3) -> zero3_offload; optimizer offload only -> zero2_offload /
    zero3_offload_optimizer; stage 3 with hpZ (`zero_hpz_partition_size` "auto" or > 1) -> zero3pp."""
    optimizer, param = offload_devices(ds)
    if ds_stage(ds) == 3:
        if param != "none":
            return "zero3_offload"
        if optimizer != "none":
            return "zero3_offload_optimizer"
        hpz = (ds.get("zero_optimization") or {}).get("zero_hpz_partition_size")
        return "zero3pp" if hpz == "auto" or (isinstance(hpz, int) and not isinstance(hpz, bool) and hpz > 1) \
            else "zero3"
    return "zero2_offload" if optimizer != "none" else "zero2"


def quantized_comm_problem(ds: dict[str, Any], cfg: "RunConfig", *, cuda: bool | None = None) -> str | None:
    """ZeRO++ qwZ/qgZ run DeepSpeed's quantizer op (QuantizerBuilder: CUDA kernels). On the CPU
    accelerator that op is a NotImplementedBuilder whose load() raises "This op had not been
    implemented on CPU backend" at the first all-gather (deepspeed/ops/op_builder/cpu/no_impl.py):
    refused before launch instead, whether a flag or the JSON asks for it."""
    keys = quantized_settings(ds)
    if not keys:
        return None
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    if cuda:
        return None
    key = keys[0]
    flag = QUANTIZED_KEYS.get(key)
    what = flag if flag and getattr(cfg.parallel, key, False) else f"DeepSpeed config zero_optimization.{key}=true"
    return (f"{what} (ZeRO++ quantized communication) needs DeepSpeed's CUDA quantizer kernels, which its CPU "
            "accelerator lacks (\"This op had not been implemented on CPU backend\"); this run has no GPU: drop it "
            "(hpZ, zero_hpz_partition_size, runs on CPU)")


