"""Greedy generation from any model swiftlite knows: a preset (random init, --seed), an HF folder
(an export), a run folder or checkpoint (the training-side model), a hub id, plus --adapters.

    swiftlite infer --model DIR --prompt "reverse: abc"
    swiftlite infer --model tiny-llama --seed 42 --dataset val.jsonl --metric exact_match   # "before"
    swiftlite infer --model output/run --dataset val.jsonl --metric exact_match            # "after"
    swiftlite infer --model DIR                                                             # chat (TTY)

The prompt is rendered with the tokenizer's chat template exactly as training rendered the prompt
part of a conversation (`data.tokenize.prompt_ids`), so a model is scored on what it was taught.
Exact match compares the stripped greedy answer with the last assistant turn of each row.

A reward model (`rlhf --rlhf_type rm`, its checkpoint or export: one-output sequence classification)
is not generated from: infer prints the reward of each input instead, a --dataset of pairs as
`chosen rejected` per row plus the preference accuracy, other rows (or --prompt / stdin lines, each a
user turn) one reward each.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from swiftlite import dtypes
from swiftlite.errors import UserError

METRICS = ("exact_match",)


@dataclass
class InferOptions:
    model: str
    adapters: str | None = None
    prompt: str | None = None
    system: str | None = None
    max_new_tokens: int = 64
    dataset: str | None = None
    limit: int | None = None
    metric: str = "exact_match"
    batch_size: int = 16
    seed: int = 42
    dtype: str = "auto"
    show: int = 3
    model_revision: str | None = None   # a hub model id's branch, tag or commit (ms-swift's --model_revision)
    #: ms-swift's --response_prefix (None: a run folder's own, from its args.json; else none)
    response_prefix: str | None = None


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    desc: str
    #: written after the generation prompt; every answer starts with it (ms-swift's response_prefix)
    response_prefix: str = ""


def _dtype(name: str) -> Any:
    import torch
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if name not in dtypes.NAMES:
        raise UserError(f"--dtype {name}: choose auto, bf16, fp16 or fp32")
    return dtypes.torch_dtype(name)


def load(opts: InferOptions, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> Loaded:
    """The model and tokenizer --model (+ --adapters) name, on the GPU when there is one."""
    import torch
    from transformers import AutoTokenizer

    from swiftlite.config import build_config
    from swiftlite.hf_io import ADAPTER_CONFIG
    from swiftlite.models.loading import load_model, load_tokenizer, resolve_model
    import warnings

    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    dtype = _dtype(opts.dtype)
    dtype_name = dtypes.from_torch(dtype)
    arg = opts.model
    p = Path(arg).expanduser()
    tokenizer = None
    run_prefix = None   # a run folder's --response_prefix (its args.json)
    rev = opts.model_revision
    try:
        ms = resolve_model(arg)   # preset, HF folder or hub id: the precedence every command uses
    except UserError:
        if not p.is_dir():
            raise
        ms = None   # a folder without config.json: infer's own cases, an adapter folder or a run folder
    if rev and (ms is None or ms.kind != "hub"):
        raise UserError(f"--model_revision {rev}: applies to a hub model id; --model {arg} is a "
                        f"{'local folder' if ms is None or ms.kind == 'folder' else 'built-in preset'}")
    if ms is None and (p / ADAPTER_CONFIG).is_file() and opts.adapters is None:
        raise UserError(f"--model {arg}: an adapter folder; pass --model BASE --adapters {arg}")
    elif ms is None:
        from swiftlite.export.reference import load_reference
        ref = load_reference(arg, log)
        model, tokenizer, desc, src = ref.model, ref.tokenizer, ref.desc, ref.source
        run_prefix = src.cfg.data.response_prefix if src.cfg is not None else None
        model = model.to(dtype) if not (src.cfg and src.cfg.quant.quant_bits) else model
    elif ms.kind == "preset":
        cfg = build_config({"model": arg, "seed": opts.seed, "torch_dtype": dtype_name}, source="--model")
        model = load_model(cfg, ms)
        tokenizer = load_tokenizer(cfg, ms)
        desc = f"{arg} (built-in, random init with seed {opts.seed})"
    else:
        ms.check_folder()   # weights, no code of its own, not pre-quantized by another method
        from swiftlite.export.base_model import auto_class   # a reward model's folder: its score head
        try:
            model = auto_class(ms.config(revision=rev)).from_pretrained(ms.ref, dtype=dtype, revision=rev)
            tokenizer = AutoTokenizer.from_pretrained(ms.tokenizer_ref, revision=rev)
        except (OSError, ValueError) as e:
            raise UserError(f"--model {arg}: cannot load ({str(e).splitlines()[0]})") from None
        desc = f"{p} (HF folder)" if ms.kind == "folder" else ms.ref if ms.preset is None else f"{arg} ({ms.ref})"
    if opts.adapters:
        model, tokenizer, desc = _with_adapter(model, tokenizer, desc, opts.adapters)
    if tokenizer is None:
        raise UserError(f"--model {arg}: no tokenizer found")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if torch.cuda.is_available():
        model = model.to("cuda")
    from swiftlite.models.quant import disable_cpu_repack
    disable_cpu_repack(model)
    model.eval()
    if hasattr(model, "config"):
        model.config.use_cache = True
    prefix = opts.response_prefix if opts.response_prefix is not None else run_prefix
    return Loaded(model, tokenizer, desc, (prefix or "").replace("\\n", "\n"))


def _with_adapter(model: Any, tokenizer: Any, desc: str, adapters: str) -> tuple[Any, Any, str]:
    from swiftlite.checkpoint.layout import ADAPTER_DIR
    from swiftlite.hf_io import ADAPTER_CONFIG
    d = Path(adapters).expanduser()
    if not (d / ADAPTER_CONFIG).is_file():
        if (d / ADAPTER_DIR / ADAPTER_CONFIG).is_file():  # a checkpoint folder
            d = d / ADAPTER_DIR
        else:
            raise UserError(f"--adapters {adapters}: not a peft adapter folder (no {ADAPTER_CONFIG})")
    from swiftlite.models.quant import peft_without_bnb
    quantized = any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules())
    from transformers import AutoTokenizer
    try:
        import json

        from swiftlite.models.tuners import boft_layers
        factor = json.loads((d / ADAPTER_CONFIG).read_text()).get("boft_n_butterfly_factor") or 1
        with peft_without_bnb(quantized), boft_layers(factor, "the adapter's boft_n_butterfly_factor"):
            from peft import PeftModel
            model = PeftModel.from_pretrained(model, str(d))
    except (RuntimeError, ValueError, KeyError) as e:
        raise UserError(f"--adapters {adapters}: does not fit the model ({str(e).splitlines()[0][:200]})") from None
    if (d / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(d))
    return model, tokenizer, f"{desc} + adapter {d}"


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for v in (getattr(gen, "eos_token_id", None), getattr(getattr(model, "config", None), "eos_token_id", None),
              tokenizer.eos_token_id):
        for i in (v if isinstance(v, list) else [v]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def prompt_ids(tokenizer: Any, messages: list[dict], response_prefix: str = "") -> list[int]:
    """Chat-rendered prompt (as in training), then `response_prefix`; raw text when the tokenizer has no
    template."""
    if getattr(tokenizer, "chat_template", None):
        from swiftlite.data.tokenize import prompt_ids as chat_prompt_ids
        return chat_prompt_ids(tokenizer, messages, response_prefix)
    text = "\n".join(m["content"] for m in messages) + response_prefix
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate(loaded: Loaded, prompts: list[list[dict]], max_new_tokens: int) -> list[str]:
    """Greedy answers for a batch of conversations (left-padded), each starting with the response prefix."""
    import torch
    tok, model = loaded.tokenizer, loaded.model
    encoded = [prompt_ids(tok, m, loaded.response_prefix) for m in prompts]
    width = max(len(e) for e in encoded)
    pad = tok.pad_token_id
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
        mask[i, width - len(e):] = 1
    device = next(model.parameters()).device
    from swiftlite.models.quant import disable_cpu_repack
    disable_cpu_repack(model)  # trap 1: never let bitsandbytes repack 4-bit weights on an eval forward
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_ids(model, tok), pad_token_id=pad,
                             num_beams=1, temperature=None, top_p=None, top_k=None)
    # ms-swift's decode puts the prefix in front of the answer's first token
    return [(loaded.response_prefix + tok.decode(row[width:], skip_special_tokens=True)).strip() for row in out.cpu()]


@dataclass
class EvalResult:
    correct: int
    total: int
    examples: list[tuple[str, str, str]]  # (prompt, expected, got)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def evaluate(loaded: Loaded, spec: str, *, max_new_tokens: int, batch_size: int,
             system: str | None = None, limit: int | None = None) -> EvalResult:
    """Exact match of the greedy answer with each row's last assistant turn (the first `limit` rows)."""
    from swiftlite.data.formats import to_messages
    from swiftlite.data.sources import load_rows
    rows = load_rows(spec)
    if limit is not None:
        rows.rows, rows.where = rows.rows[:limit], rows.where[:limit]
    items: list[tuple[list[dict], str]] = []
    for row, where in zip(rows.rows, rows.where):
        msgs = to_messages(row, where)
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        prompt = msgs[:last]
        if system and not any(m["role"] == "system" for m in prompt):
            prompt = [{"role": "system", "content": system}] + prompt
        items.append((prompt, msgs[last]["content"]))
    if not items:
        raise UserError(f"--dataset {spec}: no rows")
    correct, examples = 0, []
    for b in range(0, len(items), batch_size):
        chunk = items[b:b + batch_size]
        answers = generate(loaded, [p for p, _ in chunk], max_new_tokens)
        for (prompt, expected), got in zip(chunk, answers):
            ok = got.strip() == expected.strip()
            correct += ok
            examples.append((prompt[-1]["content"] if prompt else "", expected, got))
    return EvalResult(correct, len(items), examples)


def is_reward_model(model: Any) -> bool:
    """A sequence-classification model with one output (`rlhf --rlhf_type rm` and its export)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__.endswith("ForSequenceClassification") and base.config.num_labels == 1


def rewards(loaded: Loaded, conversations: list[list[dict]], batch_size: int) -> list[float]:
    """The reward model's score of each whole conversation, tokenized as training tokenized it
    (rlhf/data.encode_side: the chat template, the answer included), right-padded; the model reads
    the score at the last token that is not the pad token."""
    import torch

    from swiftlite.rlhf.data import encode_side
    tok, model = loaded.tokenizer, loaded.model
    model.config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None \
        else tok.pad_token_id
    device = next(model.parameters()).device
    out: list[float] = []
    for b in range(0, len(conversations), batch_size):
        enc = []
        for msgs in conversations[b:b + batch_size]:
            last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs))
            enc.append(encode_side(tok, msgs[:last], msgs[last:])[0] if last < len(msgs) else
                       prompt_ids(tok, msgs))
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), model.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, :len(e)], mask[i, :len(e)] = torch.tensor(e, dtype=torch.long), 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        out += [float(x) for x in logits.float().reshape(len(enc), -1)[:, 0].cpu()]
    return out


def reward_dataset(loaded: Loaded, spec: str, *, batch_size: int, limit: int | None = None) -> int:
    """Print the reward of each row: pairs (rlhf/data.py's formats) as `chosen rejected`, then the
    share of pairs whose chosen answer scores higher; other rows (any sft chat format) as one reward."""
    from swiftlite.data.formats import to_messages
    from swiftlite.data.sources import load_rows
    from swiftlite.rlhf.data import to_pair
    rows = load_rows(spec)
    items = list(zip(rows.rows, rows.where))[:limit]
    if not items:
        raise UserError(f"--dataset {spec}: no rows")
    paired = any(k in items[0][0] for k in ("chosen", "rejected", "rejected_response"))
    convs = []
    for row, where in items:
        if paired:
            p = to_pair(row, where)
            convs += [p.prompt + p.chosen, p.prompt + p.rejected]
        else:
            convs.append(to_messages(row, where))
    scores = rewards(loaded, convs, batch_size)
    if not paired:
        for s in scores:
            print(f"{s:.6f}")
        return 0
    right = 0
    for c, r in zip(scores[0::2], scores[1::2]):
        right += c > r
        print(f"{c:.6f} {r:.6f}")
    n = len(items)
    print(f"preference accuracy: {right / n:.4f} ({right}/{n}) {loaded.desc} on {spec}")
    return 0


def chat_loop(loaded: Loaded, opts: InferOptions, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
    """Interactive chat: history kept across turns; /clear resets, /exit (or Ctrl-D) quits."""
    history: list[dict] = [{"role": "system", "content": opts.system}] if opts.system else []
    print(f"swiftlite infer: {loaded.desc}. /clear resets the conversation, /exit quits.", file=stdout)
    while True:
        try:
            stdout.write(">>> ")
            stdout.flush()
            line = stdin.readline()
        except KeyboardInterrupt:
            print(file=stdout)
            return
        if not line:
            print(file=stdout)
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/clear":
            history = history[:1] if opts.system else []
            continue
        history.append({"role": "user", "content": text})
        answer = generate(loaded, [history], opts.max_new_tokens)[0]
        history.append({"role": "assistant", "content": answer})
        print(answer, file=stdout, flush=True)


def run(opts: InferOptions) -> int:
    """`swiftlite infer`: one prompt, a dataset score, stdin lines, or a chat loop on a TTY."""
    import torch
    if opts.metric not in METRICS:
        raise UserError(f"--metric {opts.metric}: choose {', '.join(METRICS)}")
    if opts.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be > 0, got {opts.max_new_tokens}")
    if opts.limit is not None and opts.limit <= 0:
        raise UserError(f"--limit must be > 0, got {opts.limit}")
    if opts.batch_size <= 0:
        raise UserError(f"--batch-size must be > 0, got {opts.batch_size}")
    torch.manual_seed(opts.seed)
    loaded = load(opts)
    if is_reward_model(loaded.model):   # a reward model prints rewards, it does not generate
        if opts.dataset is not None:
            return reward_dataset(loaded, opts.dataset, batch_size=opts.batch_size, limit=opts.limit)
        lines = [opts.prompt] if opts.prompt is not None else \
            [ln.strip() for ln in sys.stdin.read().splitlines() if ln.strip()]
        if not lines:
            raise UserError("a reward model scores --dataset rows, --prompt or stdin lines (a user turn each)")
        sysmsg = [{"role": "system", "content": opts.system}] if opts.system else []
        for s in rewards(loaded, [sysmsg + [{"role": "user", "content": ln}] for ln in lines], opts.batch_size):
            print(f"{s:.6f}")
        return 0
    if opts.dataset is not None:
        res = evaluate(loaded, opts.dataset, max_new_tokens=opts.max_new_tokens, batch_size=opts.batch_size,
                       system=opts.system, limit=opts.limit)
        for prompt, expected, got in res.examples[:opts.show]:
            print(f"  {prompt!r} -> {got!r} (expected {expected!r})", file=sys.stderr)
        print(f"{opts.metric}: {res.accuracy:.4f} ({res.correct}/{res.total}) {loaded.desc} on {opts.dataset}")
        if opts.prompt is None:
            return 0
    if opts.prompt is not None:
        msgs = ([{"role": "system", "content": opts.system}] if opts.system else [])
        print(generate(loaded, [msgs + [{"role": "user", "content": opts.prompt}]], opts.max_new_tokens)[0])
        return 0
    if sys.stdin.isatty():
        chat_loop(loaded, opts)
        return 0
    lines = [ln.strip() for ln in sys.stdin.read().splitlines() if ln.strip()]
    if not lines:
        raise UserError("--prompt or --dataset is required (stdin is empty and not a terminal)")
    msgs = ([{"role": "system", "content": opts.system}] if opts.system else [])
    for b in range(0, len(lines), opts.batch_size):
        for ans in generate(loaded, [msgs + [{"role": "user", "content": ln}] for ln in lines[b:b + opts.batch_size]],
                            opts.max_new_tokens):
            print(ans)
    return 0
