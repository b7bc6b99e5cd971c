"""--stop_words (rlhf/stop_words.py): a completion is cut after the token that completes its first stop word
(kept), found with the shipped byte-level tokenizer, whatever the token boundaries; the tensors past the cut
are reset; a completion without one is left whole."""

from __future__ import annotations

import math

import torch
from transformers import AutoTokenizer

from swiftlite.models.presets import TINY_TOKENIZER
from swiftlite.rlhf.stop_words import cut, ended, stop_length

TOK = AutoTokenizer.from_pretrained(TINY_TOKENIZER)


def _ids(text):
    return TOK.encode(text, add_special_tokens=False)


def test_stop_length_is_the_first_token_completing_a_stop_word():
    ids = _ids("Thought: go\nAction: x\nObservation: y\nObservation:")
    k = stop_length(TOK, ids, ["Observation:"])
    assert TOK.decode(ids[:k]) == "Thought: go\nAction: x\nObservation:"
    assert stop_length(TOK, ids, ["Action:", "Observation:"]) == len(_ids("Thought: go\nAction:"))   # the first
    assert stop_length(TOK, ids, ["nowhere"]) is None and stop_length(TOK, [], ["x"]) is None
    assert ended(TOK, ids[:k], ["Observation:"]) and not ended(TOK, ids[:k - 1], ["Observation:"])
    assert not ended(TOK, ids, [])


def test_cut_resets_the_tensors_past_the_stop_and_keeps_the_others():
    a, b = _ids("abc STOP def"), _ids("no stop here")
    n = max(len(a), len(b))
    t = {"completion_ids": torch.full((2, n), 259), "completion_mask": torch.zeros(2, n, dtype=torch.long),
         "rollout_logps": torch.full((2, n), float("nan"))}
    for j, ids in enumerate((a, b)):
        t["completion_ids"][j, :len(ids)] = torch.tensor(ids)
        t["completion_mask"][j, :len(ids)] = 1
        t["rollout_logps"][j, :len(ids)] = -1.0
    before = t["completion_ids"][1].clone()
    cut(t, TOK, ["STOP"], 259)
    k = len(_ids("abc STOP"))
    assert t["completion_mask"][0].tolist() == [1] * k + [0] * (n - k)
    assert TOK.decode(t["completion_ids"][0, :k].tolist()) == "abc STOP"
    assert (t["completion_ids"][0, k:] == 259).all() and all(math.isnan(v) for v in t["rollout_logps"][0, k:].tolist())
    assert torch.equal(t["completion_ids"][1], before) and int(t["completion_mask"][1].sum()) == len(b)


def test_a_multi_turn_completion_is_cut_at_the_limit_by_its_last_turn_only():
    """ms-swift's finish_reason of the last turn: a stop word or EOS at its end finishes it, whatever earlier
    turns held; a completion ending in a scheduler's insertion ended its last turn before; a last turn that
    ends in another sampled token was cut at the limit (before: one stop word in an earlier turn made a
    completion ending with another count as cut)."""
    from swiftlite.rlhf.stop_words import at_limit
    EOS = TOK.eos_token_id
    words = ["Observation:"]
    turn1 = TOK.encode("Action: calc\nObservation:", add_special_tokens=False)
    answer = TOK.encode(" 5", add_special_tokens=False)
    turn2 = TOK.encode(" more\nObservation:", add_special_tokens=False)
    ids, loss = turn1 + answer + turn2, [1] * len(turn1) + [0] * len(answer) + [1] * len(turn2)
    assert not at_limit(TOK, ids, loss, {EOS}, words)              # the last turn ends at its own stop word
    assert at_limit(TOK, ids, None, {EOS}, words)                   # one turn's rule: the first stop word is earlier
    cut = ids[:-2]
    assert at_limit(TOK, cut, loss[:-2], {EOS}, words)             # the last turn ran out of tokens
    assert not at_limit(TOK, turn1 + answer, loss[:len(turn1 + answer)], {EOS}, words)   # ends in an insertion
    assert not at_limit(TOK, ids + [EOS], loss + [1], {EOS}, [])    # EOS
    assert at_limit(TOK, [], [], {EOS}, words)                       # nothing sampled


def test_generate_stops_once_every_row_completed_a_stop_word_and_the_cut_is_unchanged():
    """--stop_words end generation (generate.sample, stop_words.stopping): the cut completions are the ones sampled to
    --max_completion_length and cut afterwards, token for token, while generation ends early (the completions'
    width: the longest row's stop, not the limit)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftlite.models.presets import get_preset
    from swiftlite.rlhf.generate import sample
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**get_preset("tiny-llama-2l").config)).eval()
    words = list("aeiou")                                       # random bytes: one token in a few completes one
    prompts = [_ids("reverse: abcd"), _ids("hello"), _ids("x")]
    kw = dict(pad_id=TOK.pad_token_id, eos_id=TOK.eos_token_id, max_new_tokens=64, temperature=1.0, top_p=1.0,
              top_k=0, device="cpu")
    full = sample(model, prompts, [1, 2, 3], **kw)
    early = sample(model, prompts, [1, 2, 3], stop_words=words, tokenizer=TOK, **kw)
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    a = cut(dict(zip(keys, full)), TOK, words, TOK.pad_token_id)
    b = cut(dict(zip(keys, early)), TOK, words, TOK.pad_token_id)
    n = int(a["completion_mask"].sum(-1).max())
    assert 0 < n < 64 and early[2].shape[1] < full[2].shape[1] == 64        # every row stopped well before 64
    assert torch.equal(a["completion_mask"][:, :n], b["completion_mask"][:, :n])
    assert torch.equal(a["completion_ids"][:, :n], b["completion_ids"][:, :n])
