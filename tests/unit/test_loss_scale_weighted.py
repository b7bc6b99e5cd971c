"""ms-swift's weighted loss scales (--loss_scale hermes, react, qwen, agentflan, alpha_umi): the pieces
and weights of an answer against ms-swift's own splitting (written out below from swift/template/utils
.split_str_parts_by and swift/loss_scale/utils.calculate_loss_scale), each token's weight, the weights
through batching and the cache, and the loss: sum of weight x cross-entropy over the targets in every
loss impl that has per-token losses."""

from __future__ import annotations

import json
import re

import pytest
import torch

from swiftlite.config.loss_scale import AGENTFLAN_QUERY, WEIGHTED, _split, parse
from swiftlite.data import pipeline
from swiftlite.data.collate import concat_rows, pack_rows, pad_batch
from swiftlite.data.tokenize import IGNORE, encode_messages


# ---- ms-swift's algorithm, as its source writes it (the reference) ------------------------------------

def _msswift_split_str_parts_by(text, delimiters, regex_mode=False):
    origin = delimiters
    if not regex_mode:
        delimiters = [re.escape(d) for d in delimiters]
    combined = "|".join(f"({p})" for p in delimiters)
    parts = [p for p in re.split(combined, text, flags=re.DOTALL) if p is not None]
    if parts[0] == "":
        parts.pop(0)
    else:
        parts.insert(0, "")
    res = []
    if regex_mode:
        for part in [p for p in parts if p]:
            key = next((o for d, o in zip(delimiters, origin) if re.match(d, part, re.DOTALL)), "")
            res.append({"key": key, "content": part})
    else:
        for key, content in zip(parts[::2], parts[1::2]):
            res.append({"key": key, "content": content})
    return res


def _msswift_calculate_loss_scale(query, response, table, query_table=None):
    if query_table is not None:
        for key, w in query_table.items():
            if key in query:
                return [response], [float(w)]
    delimiters = [k for k, v in table.items() if len(v) == 2]
    if delimiters:
        parts = _msswift_split_str_parts_by(response, delimiters)
    else:
        parts = _msswift_split_str_parts_by(response, [k for k, v in table.items() if len(v) == 1], regex_mode=True)
    weights, content = [], []
    for c in parts:
        if c["key"] in table:
            w = list(table[c["key"]])
            weights += w
            content += [c["content"]] if len(w) == 1 else [c["key"], c["content"]]
        else:
            weights.append(1.0)
            content.append(c["content"])
    return content, weights


def _as_chars(pieces_text, weights):
    """Per-character weights of ms-swift's (texts, weights)."""
    return [w for t, w in zip(pieces_text, weights) for _ in t]


RESPONSES = [
    "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"a\"}\n</tool_call>\n<tool_call>\n{\"name\": \"b\"}\n</tool_call>",
    "no tool here",
    "Thought: I need the weather\nAction: weather\nAction Input: {\"city\": \"Paris\"}\nObservation: sunny\n"
    "Thought: done\nFinal Answer: sunny",
    "Action: x\nAction Input: y\nObservation:",
    "\u273fFUNCTION\u273f: search\n\u273fARGS\u273f: {\"q\": 1}\n\u273fRESULT\u273f: r\n\u273fRETURN\u273f: ok",
    "Name: tool\nArguments: {}\nThought: t\nNext: go",
]


@pytest.mark.parametrize("name", sorted(WEIGHTED))
@pytest.mark.parametrize("response", RESPONSES)
def test_pieces_and_weights_are_msswifts(name, response):
    query = "plain question"
    text, weights = _msswift_calculate_loss_scale(query, response, WEIGHTED[name],
                                                  AGENTFLAN_QUERY if name == "agentflan" else None)
    assert "".join(text) == response
    ours = [0.0] * len(response)
    for a, b, w in _split(name, response, 0, 1.0, query):
        ours[a:b] = [w] * (b - a)
    assert ours == _as_chars(text, weights)


def test_agentflan_query_rule_weights_the_whole_answer():
    q = "What is the value of x?"
    text, weights = _msswift_calculate_loss_scale(q, "Action: go", WEIGHTED["agentflan"], AGENTFLAN_QUERY)
    assert weights == [3.0]
    assert _split("agentflan", "Action: go", 5, 1.0, q) == [(5, 15, 3.0)]


# ---- each token's weight --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


CALL = "<tool_call>\n{\"name\": \"w\"}\n</tool_call>"
CONV = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Let me check.\n" + CALL},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]


def _runs(tok, enc):
    """(weight, text) runs of consecutive tokens with the same weight."""
    out, cur, buf = [], None, []
    for i, w in zip(enc.input_ids, enc.weights):
        if w != cur and buf:
            out.append((cur, tok.decode(buf)))
            buf = []
        cur = w
        buf.append(i)
    out.append((cur, tok.decode(buf)))
    return out


def test_hermes_weighs_the_tool_call_two(tokenizer):
    enc = encode_messages(tokenizer, CONV, 512, loss_scale=parse("hermes"))
    assert _runs(tokenizer, enc) == [
        (0.0, "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n"),
        (1.0, "Let me check.\n"), (2.0, CALL), (1.0, "<|im_end|>\n"),   # the end of turn: weight 1, as ms-swift's suffix
        (0.0, "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"),
        (1.0, "It is sunny.<|im_end|>\n")]
    # the targets are those of the binary default scale: weights move the loss, not the labels
    plain = encode_messages(tokenizer, CONV, 512)
    assert enc.labels == plain.labels and enc.input_ids == plain.input_ids
    assert all((w > 0) == (lab != IGNORE) for w, lab in zip(enc.weights, enc.labels))


def test_a_weight_of_zero_is_no_target_and_strategies_and_rules_combine(tokenizer):
    conv = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>\n\n</think>\n\nAction: s\nObservation: result text"}]
    enc = encode_messages(tokenizer, conv, 512, loss_scale=parse("react+ignore_empty_think"))
    runs = [r for r in _runs(tokenizer, enc) if r[0] > 0]
    assert runs == [(2.0, "Action: s\nObservation:"), (1.0, "<|im_end|>\n")]
    labelled = tokenizer.decode([i for i, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE])
    assert "result text" not in labelled and "<think>" not in labelled
    # last_round: the first answer is no target at all
    enc = encode_messages(tokenizer, CONV, 512, loss_scale=parse("last_round+hermes"))
    assert [r for r in _runs(tokenizer, enc) if r[0] > 0] == [(1.0, "It is sunny.<|im_end|>\n")]


def test_truncation_cuts_the_weights_with_the_tokens(tokenizer):
    full = encode_messages(tokenizer, CONV, 512, loss_scale=parse("hermes"))
    left = encode_messages(tokenizer, CONV, 20, truncation="left", loss_scale=parse("hermes"))
    assert left.truncated and left.weights == full.weights[-20:] and len(left.input_ids) == 20


# ---- through batches and the cache ----------------------------------------------------------------------

def test_batches_and_packs_carry_the_weights():
    a = {"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3], "loss_scale": [0.0, 2.0, 1.0]}
    b = {"input_ids": [4, 5], "labels": [IGNORE, 5], "loss_scale": [0.0, 3.0]}
    padded = pad_batch([a, b], 0)
    assert padded["loss_scale"].tolist() == [[0.0, 2.0, 1.0], [0.0, 3.0, 0.0]]
    flat = concat_rows([a, b])
    assert flat["loss_scale"].tolist() == [[0.0, 2.0, 1.0, 0.0, 3.0]]
    pack = pack_rows([a, b], 8)[0]
    assert pack["loss_scale"] == [0.0, 2.0, 1.0, 0.0, 3.0] and concat_rows([pack])["loss_scale"].tolist() == \
        flat["loss_scale"].tolist()
    # rows of a binary scale carry none
    assert "loss_scale" not in pad_batch([{"input_ids": [1], "labels": [1]}], 0)


def test_the_cache_keeps_float_weights(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Action: s\nObservation: r"}]
    data.write_text(json.dumps({"messages": conv}) + "\n" + json.dumps({"messages": CONV}) + "\n")

    def tok():
        return pipeline.tokenize_specs([str(data)], tokenizer, task="sft", max_length=512, packing=False,
                                       skip_bad_rows=False, load_from_cache_file=True, loss_scale=parse("react"))
    first, again = tok(), tok()
    assert [r["loss_scale"] for r in again.rows] == [r["loss_scale"] for r in first.rows]
    assert 2.0 in first.rows[0]["loss_scale"] and isinstance(again.rows[0]["loss_scale"][0], float)


# ---- the loss -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(conf).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :6] = IGNORE
    labels[1, 15:] = IGNORE
    weights = torch.where(labels != IGNORE, torch.randint(1, 4, labels.shape, generator=g).float(), 0.0)
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), "loss_scale": weights}


def _reference(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1),
                                           ignore_index=IGNORE, reduction="none")
    return (ce * batch["loss_scale"][:, 1:].reshape(-1)).sum()


@pytest.mark.parametrize("impl", ["chunked", "plain"])
def test_the_loss_is_the_weighted_sum(model, impl):
    from swiftlite.parallel.loss import LossOptions, token_loss_sum
    batch = _batch()
    model.zero_grad()
    ref = _reference(model, batch)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = token_loss_sum(model, batch, LossOptions(impl=impl, chunk_tokens=5))
    loss.backward()
    assert torch.allclose(loss, ref, rtol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6), n
    # and it is not the unweighted sum: the weights act
    unweighted = token_loss_sum(model, {k: v for k, v in batch.items() if k != "loss_scale"},
                                LossOptions(impl=impl))
    assert abs(float(unweighted) - float(loss.detach())) > 0.1 * float(unweighted)


def test_weights_and_dft_multiply(model):
    from swiftlite.parallel.loss import LossOptions, token_loss_sum
    batch = _batch()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                               batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE,
                                               reduction="none")
        ref = (ce * torch.exp(-ce) * batch["loss_scale"][:, 1:].reshape(-1)).sum()
        for impl in ("chunked", "plain"):
            got = token_loss_sum(model, batch, LossOptions(impl=impl, dft=True))
            assert torch.allclose(got, ref, rtol=1e-5), impl


# ---- the messages' own "loss" and "loss_scale" (ms-swift's data fields) ---------------------------------

FIELDS = [{"role": "user", "content": "hello!"},
          {"role": "assistant", "content": "hi!", "loss_scale": 2.0},
          {"role": "user", "content": "1+1=?"},
          {"role": "assistant", "content": "<think>\n\n</think>\n\n2", "loss": False},
          {"role": "user", "content": "bye"},
          {"role": "assistant", "content": "<think>\n\n</think>\n\nbye", "loss_scale": 0.5}]


def _targets(tok, enc):
    return [r for r in _runs(tok, enc) if r[0] > 0]


def test_loss_false_and_true_override_the_strategy(tokenizer):
    from swiftlite.data.formats import to_messages
    msgs = to_messages({"messages": FIELDS}, "x")
    assert msgs[3]["loss"] is False and msgs[1]["loss_scale"] == 2.0
    enc = encode_messages(tokenizer, msgs, 512, loss_scale=parse(None, binary=False))
    # loss false: no target; loss_scale: the message's weight, its end of turn 1; no rule applies to it
    assert _targets(tokenizer, enc) == [(2.0, "hi!"), (1.0, "<|im_end|>\n"),
                                        (0.5, "<think>\n\n</think>\n\nbye"), (1.0, "<|im_end|>\n")]
    # binary (the default without a weighted scale): the weights become labels only, as in ms-swift
    binary = encode_messages(tokenizer, msgs, 512, loss_scale=parse("ignore_empty_think"))
    assert binary.weights is None and binary.labels == enc.labels
    # "loss": true trains an answer last_round would not
    first = [dict(FIELDS[0]), {"role": "assistant", "content": "hi!", "loss": True}, *FIELDS[2:3],
             {"role": "assistant", "content": "2"}]
    enc = encode_messages(tokenizer, to_messages({"messages": first}, "x"), 512, loss_scale=parse("last_round"))
    labelled = tokenizer.decode([i for i, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE])
    assert labelled == "hi!<|im_end|>\n2<|im_end|>\n"
    # a weight of 0 is no target
    zero = [FIELDS[0], {"role": "assistant", "content": "hi!", "loss_scale": 0}]
    enc = encode_messages(tokenizer, to_messages({"messages": zero}, "x"), 512)
    assert all(lab == IGNORE for lab in enc.labels)


@pytest.mark.parametrize("message,error", [
    ({"role": "user", "content": "q", "loss": True}, "messages[0].loss: only an assistant turn"),
    ({"role": "assistant", "content": "a", "loss": "yes"}, "messages[0].loss must be true, false or null"),
    ({"role": "assistant", "content": "a", "loss_scale": -1}, "messages[0].loss_scale must be a number >= 0"),
])
def test_bad_message_fields_are_refused_with_their_place(message, error):
    from swiftlite.data.formats import to_messages
    from swiftlite.errors import UserError
    with pytest.raises(UserError, match=re.escape(error)):
        to_messages({"messages": [message, {"role": "assistant", "content": "b"}]}, "d.jsonl:3")
    # null is absent (HF datasets give every message every key)
    ok = to_messages({"messages": [{"role": "user", "content": "q", "loss": None, "loss_scale": None},
                                   {"role": "assistant", "content": "a"}]}, "x")
    assert "loss" not in ok[0]


def test_tool_calls_keep_the_first_calls_fields(tokenizer):
    from swiftlite.data.agent import Agent, render_turns
    from swiftlite.data.formats import to_messages
    row = {"tools": [json.dumps({"name": "f", "description": "d", "parameters": {}})], "messages": [
        {"role": "user", "content": "q"},
        {"role": "tool_call", "content": json.dumps({"name": "f", "arguments": {}}), "loss": False},
        {"role": "tool_call", "content": json.dumps({"name": "f", "arguments": {"x": 1}}), "loss": True},
        {"role": "tool_response", "content": "r"}, {"role": "assistant", "content": "done"}]}
    msgs = render_turns(row, to_messages(row, "x", agent_roles=True), Agent("hermes"), None, "x")
    calls = [m for m in msgs if m["role"] == "assistant" and "<tool_call>" in m["content"]]
    assert len(calls) == 1 and calls[0]["loss"] is False
    enc = encode_messages(tokenizer, msgs, 1024)
    labelled = tokenizer.decode([i for i, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE])
    assert labelled == "done<|im_end|>\n"


@pytest.mark.parametrize("task,argv,message", [
    ("pt", ["--is_binary_loss_scale", "false"], "--is-binary-loss-scale false: loss weights are for sft's chat rows"),
    ("sft", ["--is_binary_loss_scale", "false", "--loss_impl", "cce"],
     "--is-binary-loss-scale false with --loss-impl cce: the fused kernel"),
    ("sft", ["--loss_scale", "all+react"], "'react' weights parts of the answers, and `all`"),
    ("sft", ["--loss_scale", "hermes", "--is_binary_loss_scale", "true"], None),
])
def test_rules(task, argv, message):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.errors import UserError
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", *argv])
    if message is None:
        cfg = load_config(config_file, values, validate_paths=False, task=task)
        assert cfg.data.is_binary_loss_scale is True and parse(cfg.data.loss_scale, binary=True).is_binary
        return
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(config_file, values, validate_paths=False, task=task)
