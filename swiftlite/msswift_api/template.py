"""ms-swift's `Template` as a reward-model plugin uses it (swift/template): `encode` one request's
conversation into token ids with the model's own chat template, `data_collator` a list of those into
one padded batch. ms-swift's templates are Python classes per model family; here the conversation is
rendered with the tokenizer's chat template (the model folder's, as every run here renders).

`encode` renders the conversation as given when it ends with an assistant turn (a completion to
score) and adds the generation prompt otherwise (a request for an engine to answer), as ms-swift's
template does in its training and inference modes. Only `role` and `content` of each message are
rendered (the reward-model scorer here always did so: rlhf/reward_model.py). No truncation: a
conversation longer than the model holds fails in the model, as with ms-swift's default
(truncation_strategy delete raises)."""

from __future__ import annotations

from typing import Any


def _messages(request: Any) -> list[dict[str, str]]:
    msgs = request["messages"] if isinstance(request, dict) else request.messages
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


class Template:
    """A tokenizer's chat template with ms-swift's Template methods that plugins call."""

    def __init__(self, tokenizer: Any, max_length: int | None = None):
        self.tokenizer = tokenizer
        self.processor = tokenizer
        self.max_length = max_length
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id

    def encode(self, inputs: Any, return_length: bool = False) -> dict[str, Any]:
        """{"input_ids": [...], "length": n} of one request (a dict with `messages`, or an object with
        `.messages`)."""
        msgs = _messages(inputs)
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                  add_generation_prompt=msgs[-1]["role"] != "assistant")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ids, "length": len(ids)}

    def data_collator(self, batch: list[dict[str, Any]], *, padding_to: int | None = None,
                      padding_side: str = "right") -> dict[str, Any]:
        """input_ids and attention_mask tensors of the encoded rows, padded (right by default: a
        sequence classifier pools at the last token that is not padding)."""
        import torch
        n = max([len(b["input_ids"]) for b in batch] + [padding_to or 0])
        ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for j, b in enumerate(batch):
            x = torch.tensor(b["input_ids"], dtype=torch.long)
            sl = slice(n - len(x), n) if padding_side == "left" else slice(0, len(x))
            ids[j, sl] = x
            mask[j, sl] = 1
        return {"input_ids": ids, "attention_mask": mask}


__all__ = ["Template"]
