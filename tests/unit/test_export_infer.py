"""swiftlite.infer without training: prompts, the chat loop, exact match, option checks."""

from __future__ import annotations

import io
import json

import pytest

from swiftlite import infer
from swiftlite.errors import UserError


@pytest.fixture(scope="module")
def tiny():
    return infer.load(infer.InferOptions(model="tiny-llama-2l", seed=42), log=lambda m: None)


def test_preset_is_seeded_and_greedy(tiny):
    again = infer.load(infer.InferOptions(model="tiny-llama-2l", seed=42), log=lambda m: None)
    other = infer.load(infer.InferOptions(model="tiny-llama-2l", seed=7), log=lambda m: None)
    msgs = [[{"role": "user", "content": "reverse: abc"}]]
    a = infer.generate(tiny, msgs, 6)
    assert a == infer.generate(again, msgs, 6) == infer.generate(tiny, msgs, 6)
    assert a != infer.generate(other, msgs, 6)
    assert "seed 42" in tiny.desc


def test_batched_generation_matches_one_by_one(tiny):
    prompts = [[{"role": "user", "content": p}] for p in ("reverse: a", "reverse: abcdefgh", "x")]
    together = infer.generate(tiny, prompts, 5)
    assert together == [infer.generate(tiny, [p], 5)[0] for p in prompts]  # left padding is masked


def test_response_prefix_starts_and_conditions_every_answer(tiny):
    """--response_prefix (ms-swift's): written after the generation prompt, so the model goes on from it
    and the answer shown begins with it (`\\n` in the flag's text is a newline, as ms-swift's)."""
    pre = infer.load(infer.InferOptions(model="tiny-llama-2l", seed=42, response_prefix="Final Answer:\\n"),
                     log=lambda m: None)
    assert pre.response_prefix == "Final Answer:\n" and tiny.response_prefix == ""
    msgs = [{"role": "user", "content": "reverse: abc"}]
    tok = tiny.tokenizer
    plain, prefixed = infer.prompt_ids(tok, msgs), infer.prompt_ids(tok, msgs, pre.response_prefix)
    assert prefixed[:len(plain)] == plain and tok.decode(prefixed[len(plain):]) == "Final Answer:\n"
    got = infer.generate(pre, [msgs], 6)[0]
    assert got.startswith("Final Answer:")
    # the continuation is the greedy one from the prompt with the prefix, not from the bare prompt
    import torch
    with torch.no_grad():
        out = tiny.model.generate(input_ids=torch.tensor([prefixed]), do_sample=False, max_new_tokens=6,
                                  eos_token_id=infer.eos_ids(tiny.model, tok), pad_token_id=tok.pad_token_id,
                                  num_beams=1, temperature=None, top_p=None, top_k=None)
    assert got == ("Final Answer:\n" + tok.decode(out[0, len(prefixed):], skip_special_tokens=True)).strip()


def test_exact_match_scores_last_assistant_turn(tiny, tmp_path):
    msgs = [{"role": "user", "content": "reverse: ab"}]
    pred = infer.generate(tiny, [msgs], 4)[0]
    rows = [{"messages": msgs + [{"role": "assistant", "content": pred}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"},
                          {"role": "user", "content": "reverse: ab"},
                          {"role": "assistant", "content": "certainly not this " + pred}]}]
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = infer.evaluate(tiny, str(data), max_new_tokens=4, batch_size=2)
    assert (res.correct, res.total) == (1, 2) and res.accuracy == 0.5
    assert infer.evaluate(tiny, str(data), max_new_tokens=4, batch_size=1, limit=1).total == 1


def test_chat_loop_keeps_history_and_quits(tiny):
    stdin = io.StringIO("hello\n/clear\nreverse: ab\n/exit\nnever read\n")
    stdout = io.StringIO()
    infer.chat_loop(tiny, infer.InferOptions(model="x", max_new_tokens=3), stdin=stdin, stdout=stdout)
    text = stdout.getvalue()
    assert text.count(">>> ") == 4 and "never read" not in text


def test_bad_options_are_user_errors():
    for opts, msg in ((infer.InferOptions(model="tiny-llama-2l", metric="bleu"), "--metric"),
                      (infer.InferOptions(model="tiny-llama-2l", max_new_tokens=0), "--max-new-tokens"),
                      (infer.InferOptions(model="tiny-llama-2l", limit=0, dataset="x"), "--limit")):
        with pytest.raises(UserError, match=msg):
            infer.run(opts)
    with pytest.raises(UserError, match="--model"):
        infer.load(infer.InferOptions(model="/no/such/folder"))
