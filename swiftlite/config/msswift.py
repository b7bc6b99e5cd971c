"""ms-swift's `sft`/`pt` flags that mean nothing here, and ms-swift values swiftlite refuses: one table,
each entry with the line that tells the user what to use instead.

Every other ms-swift flag is a RunConfig field (config/schema.py) under its ms-swift name or an alias,
and means what it means there (docs/usage.md, "ms-swift flags", lists them all; a test checks each
row). A key of `NO_MEANING` is refused the same way as a flag (`--use_hf false`) and as a config-file
key (`use_hf: false`). A value in `fits` asks for exactly what swiftlite always does (`--use_hf true`):
it is accepted and sets nothing. Import-light (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swiftlite.errors import UserError


@dataclass(frozen=True)
class NoMeaning:
    name: str                     # ms-swift's spelling (underscores)
    why: str                      # what it would do, and what to use instead
    fits: tuple[str, ...] = ()    # values that describe swiftlite's fixed behaviour (accepted)
    switch: bool = False          # may stand alone: --streaming == --streaming true
    many: bool = False            # takes several values: --model_author A B


_MULTIMODAL = "multimodal models are not supported (text causal LMs only)"

NO_MEANING: dict[str, NoMeaning] = {e.name: e for e in [
    NoMeaning("use_hf", "swiftlite downloads from the Hugging Face hub only; for a ModelScope model, download it "
              "(modelscope download --model ID --local_dir DIR) and pass --model DIR", fits=("true",), switch=True),
    NoMeaning("model_type", "swiftlite reads the architecture from the model's config.json (--model); there are no "
              "ms-swift model types: drop the flag"),
    NoMeaning("bf16", "use --torch_dtype bfloat16 (the model trains in that dtype; FSDP can still reduce in fp32 "
              "with --mixed-precision bf16)", switch=True),
    NoMeaning("fp16", "use --torch_dtype float16 (loss scaling needs a DeepSpeed backend: --deepspeed zero2/zero3)",
              switch=True),
    NoMeaning("logging_dir", "TensorBoard events are written to <output-dir>/runs (--report-to tensorboard)"),
    NoMeaning("max_new_tokens", "training never generates; generation length is `swiftlite infer --max-new-tokens`"),
    NoMeaning("tuner_backend", "peft is the only tuner backend (unsloth's current release needs a GPU for its triton "
                               "kernels and transformers <= 5.17)", fits=("peft",)),
    NoMeaning("data_seed", "--seed sets the data order as well as the weights and dropout"),
    NoMeaning("dataset_shuffle", "the training rows are always shuffled (a permutation per epoch seeded by --seed)",
              fits=("true",), switch=True),
    NoMeaning("train_dataloader_shuffle", "the training rows are always shuffled (a permutation per epoch seeded "
              "by --seed)", fits=("true",), switch=True),
    # ms-swift's default, false, is what swiftlite's GRPO does (several of its GRPO scripts spell it out)
    NoMeaning("async_generate", "asynchronous generation (the next round sampled from the previous weights while "
              "training) is not available: swiftlite syncs the weights, then samples each round (docs/rlhf.md "
              "\"Rollout server\")", fits=("false",), switch=True),
    NoMeaning("check_model", "swiftlite does not compare model files with the hub", fits=("false",), switch=True),
    NoMeaning("create_checkpoint_symlink", "the newest good checkpoint is named in <output-dir>/latest",
              fits=("false",), switch=True),
    NoMeaning("save_safetensors", "weights are always written as safetensors", fits=("true",), switch=True),
    NoMeaning("push_to_hub", "upload the exported folder yourself (huggingface-cli upload REPO DIR)",
              fits=("false",), switch=True),
    NoMeaning("hub_model_id", "nothing is uploaded; upload the exported folder (huggingface-cli upload REPO DIR)"),
    NoMeaning("ddp_backend", "the process-group backend is chosen automatically: nccl on GPUs, gloo on CPU"),
    NoMeaning("device_map", "one process per GPU (--nproc-per-node); to spread a model over GPUs use --parallelism "
              "fsdp or zero3"),
    NoMeaning("packing_length", "packs are --max-length tokens long; set --max-length"),
    NoMeaning("padding_side", "batches are padding-free where the model allows it, else right-padded",
              fits=("right",)),
    NoMeaning("strict", "a bad row stops the run by default (ms-swift's --strict true); --skip-bad-rows skips and "
              "counts such rows instead", fits=("true",), switch=True),
    NoMeaning("task_type", "swiftlite trains causal language models only", fits=("causal_lm",)),
    NoMeaning("lora_dtype", "LoRA weights follow peft's default dtype for the base's --torch-dtype"),
    NoMeaning("target_regex", "give module names or all-linear to --target-modules"),
    NoMeaning("freeze_vit", _MULTIMODAL, switch=True),
    NoMeaning("freeze_llm", _MULTIMODAL, switch=True),
    NoMeaning("freeze_aligner", _MULTIMODAL, switch=True),
    NoMeaning("max_pixels", _MULTIMODAL),
    # `false` fits in the sense that it is accepted: logits_to_keep() below makes it --loss-impl plain
    NoMeaning("use_logits_to_keep", "the loss computes logits only at the target tokens (--loss-impl chunked, the "
              "default); false computes every position's (--loss-impl plain)", fits=("true", "none", "false"),
              switch=True),
    NoMeaning("model_kwargs", "put model options into the model folder's config.json"),
]}

#: ms-swift values of swiftlite fields that are refused: (field, value) -> the reason.
_TUNERS = ("swiftlite trains full, lora, qlora (LoRA on a bitsandbytes 4-bit base), longlora (LoRA with S2-Attn), "
           "boft, adalora, bone (peft's MiSS, formerly Bone), llamapro or adapter (Houlsby)")
_QUANT = ("quantizing at load time is bitsandbytes (--quant_method bnb --quant_bits 4|8) or HQQ (--quant_method hqq "
          "--quant_bits 1|2|3|4|8) here; for an already GPTQ/AWQ-quantized model, train a LoRA on a 16-bit copy instead")
_OPTIM = ("not available: --optim takes the optimizers torch and transformers ship (adamw_torch_fused, adamw_torch, "
          "sgd, adagrad, rmsprop, adafactor, muon); the 8-bit/paged (bitsandbytes), GaLore, LOMO, schedule-free, "
          "XLA/NPU and other extra-package optimizers are not; for less optimizer memory use LoRA or --parallelism "
          "zero2/zero3/fsdp")
REFUSED_VALUES: dict[tuple[str, str], str] = {
    # HF's GaLore optimizers are ms-swift's --use_galore with --optim adamw/adafactor (its 8-bit and layer-wise
    # ones stay under _OPTIM: bitsandbytes' 8-bit state, and steps inside backward that skip accumulation)
    **{("optim", o): f"GaLore is --use_galore true with --optim {base} (and --galore_target_modules for HF's "
                     "--optim_target_modules)" for o, base in (("galore_adamw", "adamw_torch"),
                                                                ("galore_adafactor", "adafactor"))},
    **{("train_type", t): _TUNERS for t in ("vera", "fourierft", "lora_llm")},
    # ms-swift builds ReFT with pyreft, whose one release (0.1.0) pins transformers==4.45.1
    ("train_type", "reft"): "ReFT runs on pyreft, whose release (0.1.0) requires transformers 4.45.1, and swiftlite " \
                            "runs on transformers 5; " + _TUNERS,
    **{("quant_method", q): _QUANT for q in ("gptq", "awq", "eetq", "quanto", "fp8", "aqlm")},
    ("rlhf_type", "ppo"): "PPO is not available",
    ("optimizer", "lorap"): "give --lorap_lr_ratio (ms-swift picks its lorap optimizer from it; so does swiftlite)",
    ("optimizer", "multimodal"): "not available (per-module learning rates of multimodal models); --optim takes "
                                 "adamw_torch_fused, adamw_torch, sgd, adagrad, rmsprop, adafactor, muon",
    **{("optim", o): _OPTIM for o in (
        "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_anyprecision", "adamw_torch_4bit", "adamw_torch_8bit",
        "ademamix", "adamw_bnb_8bit", "adamw_8bit", "ademamix_8bit", "lion_8bit", "lion_32bit", "paged_adamw_32bit",
        "paged_adamw_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit", "paged_lion_32bit", "paged_lion_8bit",
        "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit", "galore_adamw_8bit", "galore_adamw_layerwise",
        "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise",
        "lomo", "adalomo", "grokadamw", "schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd",
        "apollo_adamw", "apollo_adamw_layerwise", "stable_adamw")},
}


def canonical_value(value: Any, switch: bool) -> str:
    """A value as the `fits` tuples spell it: for a switch, booleans and true/false words -> true/false."""
    from swiftlite.config.schema import FALSE_WORDS, TRUE_WORDS
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    s = str(value).strip().lower()
    if switch and s in TRUE_WORDS:
        return "true"
    if switch and s in FALSE_WORDS:
        return "false"
    return s


#: ms-swift options that add to another option's list (BaseArguments.__post_init__: `external_plugins +=
#: custom_register_path`): key -> the field they add to.
APPENDS = {"custom_register_path": "external_plugins"}


def appended(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each APPENDS key's list added after its field's own (--custom_register_path F: one
    more plugin file, ms-swift's older name for registration files, which now register datasets too)."""
    out = dict(values)
    for key, target in APPENDS.items():
        if key in out:
            more = out.pop(key)
            more = list(more) if isinstance(more, (list, tuple)) else [more]
            mine = out.get(target) or []
            out[target] = [*(mine if isinstance(mine, (list, tuple)) else [mine]), *more]
    return out


def logits_to_keep(values: dict[str, Any]) -> dict[str, Any]:
    """ms-swift's --use_logits_to_keep false (the logits of every position, not only of the targets)
    is --loss-impl plain here: the model's own forward and full logits. The same loss and gradients as
    the default (chunked: logits at the target positions only), with the memory ms-swift's false costs."""
    v = values.get("use_logits_to_keep")
    if v is None or canonical_value(v, True) != "false":
        return values
    impl = values.get("loss_impl")
    if impl is not None and str(impl) != "plain":
        raise UserError(f"--use_logits_to_keep false computes every position's logits (--loss-impl plain), and "
                        f"--loss-impl {impl} computes the target positions' only: give one of them")
    out = {k: x for k, x in values.items() if k != "use_logits_to_keep"}
    out["loss_impl"] = "plain"
    return out


def check_no_meaning(name: str, value: Any, source: str) -> None:
    """Accept a NO_MEANING key whose value fits swiftlite's behaviour (nothing to set); refuse any other
    value with its reason, naming the flag as the user wrote it (--name) or the file and key."""
    entry = NO_MEANING[name]
    if canonical_value(value, entry.switch) in entry.fits:
        return
    from swiftlite.config.schema import SECRET_KEY
    secret = SECRET_KEY.search(name) is not None  # never echo a secret
    shown = "" if value is True or secret else \
        f" {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}"
    where = f"--{name}{shown}" if source == "flags" else f"{source}: {name}" + ("" if secret else f": {value!r}")
    raise UserError(f"{where}: {entry.why}")


def check_value(key: str, value: Any, source: str) -> None:
    """Refuse an ms-swift value that swiftlite does not implement (--train_type adalora)."""
    why = REFUSED_VALUES.get((key, str(value).strip().lower()))
    if why is not None:
        if key == "rlhf_type":  # what it takes, as the schema says now
            from swiftlite.config.schema import RLHF_TYPES
            why += f"; --rlhf_type takes {', '.join(RLHF_TYPES)}"
        where = f"--{key} {value}" if source == "flags" else f"{source}: {key}: {value!r}"
        raise UserError(f"{where}: {why}")
