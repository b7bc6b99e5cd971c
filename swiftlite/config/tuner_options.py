"""The options of the tuners besides LoRA: BOFT (`--train_type boft`), AdaLoRA (`--train_type adalora`),
Bone (`--train_type bone`: peft's MiSS, formerly Bone), LLaMA-Pro (`--train_type llamapro`, block
expansion: models/llamapro.py) and Houlsby adapters (`--train_type adapter`: models/adapter.py), and of
LoRA-GA's initialisation (`--init_weights lora-ga`), with ms-swift's
names and defaults (swift/arguments/tuner_args.py: the dataclass values, not its docstring's); and LISA's
layer sampling of a full fine-tune (`--lisa_activated_layers`, ms-swift's swift/trainers/arguments.py, run
by train/lisa.py). A base of schema.LoraConfig, kept here so that schema.py stays short; the shared adapter
options (--target_modules, --modules_to_save, --lora_alpha, --lora_dropout, --lora_bias, --init_weights)
live in LoraConfig, and
config/rules_tuners.py says which option applies to which tuner.
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt

#: --train_type values that are a peft adapter on a frozen base (cfg.is_peft).
PEFT_TYPES = ("lora", "qlora", "longlora", "boft", "adalora", "bone")
#: --train_type values whose adapter is peft's LoRA (cfg.is_lora): the LoRA variants apply to these.
LORA_TYPES = ("lora", "qlora", "longlora")
#: Options that only mean something for an adapter (config/rules.py refuses them on a full run,
#: rules_tuners.py on a llamapro one).
LORA_ONLY = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save", "use_dora", "use_rslora",
             "init_weights", "lorap_lr_ratio", "lora_bias")
#: LoRA-GA's choices (peft LoraGAConfig): how the gradient's singular vectors go to A and B, and B's scale.
LORA_GA_DIRECTIONS = ("ArBr", "A2rBr", "ArB2r", "random")
LORA_GA_SCALES = ("stable", "weight_svd", "gd_scale", "unit")


def moves_base(init_weights: str) -> bool:
    """--init_weights values with which peft starts the adapter non-zero and subtracts it from the base
    (PiSSA, OLoRA: the principal part; LoRA-GA: s B0 A0 of the gradient's singular vectors), so that
    the base in memory is no longer the model folder's and saved adapters are converted."""
    return init_weights.startswith("pissa") or init_weights in ("olora", "lora-ga")


@dataclass(kw_only=True)
class TunerOptions(Section):
    """`boft_*`, `adalora_*`, `reft_rank`, `llamapro_*` and `adapter_*`: read only by their own --train_type;
    `lora_ga_*` by --init_weights lora-ga; `lisa_*` by --train_type full."""
    boft_block_size: int = opt(4, "BOFT (peft boft_block_size): size of each orthogonal block; each adapted "
                               "layer's input width must be a multiple of it. Give it or --boft_block_num, "
                               "not both (0 = unset).")
    boft_block_num: int = opt(0, "BOFT (peft boft_block_num): number of orthogonal blocks per layer instead of "
                              "their size (then --boft_block_size 0).")
    boft_n_butterfly_factor: int = opt(1, "BOFT butterfly factors (peft boft_n_butterfly_factor): 1 is OFT "
                                       "(block-diagonal); more needs peft's fbd_cuda CUDA extension (refused "
                                       "where it does not load: peft would silently train 1).")
    boft_dropout: float = opt(0.0, "BOFT multiplicative dropout (peft boft_dropout).")
    adalora_target_r: int = opt(8, "AdaLoRA (peft target_r): average rank per layer the budget ends with.")
    adalora_init_r: int = opt(12, "AdaLoRA (peft init_r): rank each adapted layer starts with.")
    adalora_tinit: int = opt(0, "AdaLoRA (peft tinit): optimizer steps of warm-up before ranks are pruned.")
    adalora_tfinal: int = opt(0, "AdaLoRA (peft tfinal): last optimizer steps trained with the final ranks.")
    adalora_deltaT: int = opt(1, "AdaLoRA (peft deltaT): optimizer steps between two rank allocations.")
    adalora_beta1: float = opt(0.85, "AdaLoRA (peft beta1): EMA factor of the importance (sensitivity).")
    adalora_beta2: float = opt(0.85, "AdaLoRA (peft beta2): EMA factor of its uncertainty.")
    lora_ga_batch_size: int = opt(2, "LoRA-GA (--init_weights lora-ga): rows per gradient-estimation batch.")
    lora_ga_iters: int = opt(2, "LoRA-GA: batches the gradient is averaged over before training (the first "
                             "batch_size x iters training rows).")
    lora_ga_max_length: int = opt(1024, "LoRA-GA: tokens of each row the gradient estimation reads.")
    lora_ga_direction: str = opt("ArB2r", "LoRA-GA (peft direction): which of the gradient's top 2r singular "
                                 "vectors initialise A and B.", choices=LORA_GA_DIRECTIONS)
    lora_ga_scale: str = opt("stable", "LoRA-GA (peft scale): how B is scaled.", choices=LORA_GA_SCALES)
    lora_ga_stable_gamma: int = opt(16, "LoRA-GA: gamma of the stable scale, out_features^0.25 / sqrt(gamma).")
    adalora_orth_reg_weight: float = opt(0.5, "AdaLoRA (peft orth_reg_weight): weight of the orthogonality "
                                         "penalty on A and B, added to each optimizer step's loss.")
    llamapro_num_new_blocks: int = opt(4, "LLaMA-Pro (--train_type llamapro): new decoder blocks; the model's "
                                       "layer count must be divisible by it. Each is a copy of the layer before "
                                       "it with o_proj/down_proj zeroed (the output is unchanged at step 0); only "
                                       "the new blocks train.")
    llamapro_num_groups: int | None = opt(None, "LLaMA-Pro groups: one new block after every "
                                          "num_hidden_layers/groups layers, so groups blocks in all (ms-swift "
                                          "inserts one per group); must divide the layer count. Default: "
                                          "--llamapro_num_new_blocks.")
    adapter_length: int = opt(128, "Houlsby adapter (--train_type adapter): width of each adapter's bottleneck. "
                              "After every decoder layer's MLP, output x becomes x + linear2(act(linear1(x))), "
                              "linear1 hidden -> adapter_length, linear2 back, both with bias; only the adapters "
                              "train, 2 x hidden x adapter_length + adapter_length + hidden parameters per layer. "
                              "Default 128, ms-swift's.")
    adapter_act: str = opt("gelu", "Houlsby adapter: the activation between its two linears, a name of "
                           "transformers' ACT2CLS (gelu, relu, silu, tanh, gelu_new, ...). Default gelu, ms-swift's.")
    # ms-swift builds Bone with r=args.reft_rank (swift/pipelines/train/tuner.py): its ReFT rank's name and
    # default serve as Bone's rank; ReFT itself (--train_type reft) is not available here.
    reft_rank: int = opt(4, "Bone (peft's MiSS, formerly Bone; peft r): rows of the trained block per adapted "
                         "layer, r x out_features parameters; ms-swift's name (its ReFT rank, which it also "
                         "gives Bone). Must be at most each adapted layer's input width; with --init_weights "
                         "bat both widths must be multiples of it.")
    lisa_activated_layers: int = opt(0, "LISA (full fine-tune only): train this many decoder layers at a time, "
                                     "drawn at random, the others frozen; embeddings, final norm and lm_head "
                                     "always train. 0: off. The draw is a function of --seed and the window's "
                                     "first step (ms-swift: numpy's global state), so a resumed run trains the "
                                     "same layers. --parallelism single only (docs/lora.md, LISA).")
    lisa_step_interval: int = opt(20, "LISA: draw the layers again every this many optimizer steps (at the start "
                                  "of each step whose count of finished steps is a multiple of it, and of step 2).")
