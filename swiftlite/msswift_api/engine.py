"""ms-swift's `TransformersEngine` (swift/infer_engine) as a generative judge in a plugin uses it:
`TransformersEngine(model, template=..., max_batch_size=0).infer(requests, RequestConfig(...))` returns
one ChatCompletionResponse per request.

It runs transformers' `generate` on the loaded model, with ms-swift's rules for the request's settings
(swift/infer_engine/utils.prepare_generation_config): temperature, top_k, top_p and repetition_penalty
left None take the model's generation_config; temperature 0, or None on a model whose generation_config
does not sample, is greedy decoding; `max_tokens` None is the model's max length (config
max_position_embeddings, 8192 when it has none) minus the longest prompt of the batch; `n` answers per
request; `stop` strings end an answer (transformers' stop_strings). Requests are batched
`max_batch_size` at a time (0: all), left-padded.

Sampling is seeded: by the request's `seed`, else by a hash of the batch's token ids, in a forked
random state. So a judge gives the same answers to the same batch (a resumed run scores as the
uninterrupted one) and does not move the run's own random stream (dropout). ms-swift samples from the
global stream; the distribution of each answer is the same.

Not here: streaming, logprobs, a model given by name (pass the loaded model: a plugin's `self.model`).
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

from swiftlite.msswift_api.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage,
                                            InferRequest, RequestConfig, RolloutInferRequest)
from swiftlite.msswift_api.template import Template

#: ms-swift's max_model_len when the model's config has none
DEFAULT_MAX_MODEL_LEN = 8192


class TransformersEngine:
    def __init__(self, model: Any, template: Template | None = None, max_batch_size: int = 0, **kwargs: Any):
        if isinstance(model, str):
            raise TypeError("TransformersEngine here takes a loaded model (a reward-model plugin's self.model), "
                            f"not a name ({model!r})")
        if template is None:
            from transformers import AutoTokenizer
            template = Template(AutoTokenizer.from_pretrained(model.name_or_path))
        self.model, self.template, self.max_batch_size = model, template, max_batch_size
        self.tokenizer = template.tokenizer
        self.generation_config = getattr(model, "generation_config", None)
        self.max_model_len = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN

    def infer(self, infer_requests: list[Any], request_config: RequestConfig | None = None, metrics: Any = None, *,
              use_tqdm: bool | None = None, **kwargs: Any) -> list[ChatCompletionResponse]:
        rc = request_config or RequestConfig()
        encoded = [self.template.encode(r) for r in infer_requests]
        size = self.max_batch_size or len(encoded) or 1
        out: list[ChatCompletionResponse] = []
        for i in range(0, len(encoded), size):
            out += self._batch(encoded[i:i + size], rc)
        return out

    def _generation_config(self, rc: RequestConfig, num_tokens: int) -> Any:
        from transformers import GenerationConfig
        base = self.generation_config
        max_tokens = self.max_model_len - num_tokens
        if max_tokens <= 0:
            raise ValueError(f"a judge prompt of {num_tokens} tokens leaves no room to answer in the model's "
                             f"{self.max_model_len}")
        kw: dict[str, Any] = {"max_new_tokens": max_tokens if rc.max_tokens is None else min(rc.max_tokens, max_tokens),
                              "num_beams": rc.num_beams, "length_penalty": rc.length_penalty,
                              "num_return_sequences": rc.n}
        for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
            v = getattr(rc, key)
            kw[key] = getattr(base, key, None) if v is None else v
        if kw["top_k"] is not None and kw["top_k"] <= 0:
            kw["top_k"] = None
        if not getattr(base, "do_sample", False) and rc.temperature in (0, None):
            kw["temperature"] = 0
        if kw["temperature"] == 0:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kw["do_sample"] = True
        gc = GenerationConfig(**{k: v for k, v in kw.items() if v is not None})
        eos = getattr(base, "eos_token_id", None)
        gc.eos_token_id = eos if eos is not None else self.tokenizer.eos_token_id
        gc.pad_token_id = self.template.pad_id
        if rc.stop:
            gc.stop_strings = list(rc.stop)
        return gc

    def _batch(self, encoded: list[dict], rc: RequestConfig) -> list[ChatCompletionResponse]:
        import torch
        batch = self.template.data_collator(encoded, padding_side="left")
        n_prompt = batch["input_ids"].shape[1]
        gc = self._generation_config(rc, n_prompt)
        device = next(self.model.parameters()).device
        seed = rc.seed if rc.seed is not None else zlib.crc32(batch["input_ids"].numpy().tobytes())
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            gen = self.model.generate(input_ids=batch["input_ids"].to(device),
                                      attention_mask=batch["attention_mask"].to(device), generation_config=gc,
                                      **({"tokenizer": self.tokenizer} if rc.stop else {}))
        new = gen[:, n_prompt:].tolist()
        eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
        out = []
        for r in range(len(encoded)):
            choices = []
            for k in range(rc.n):
                ids = new[r * rc.n + k]
                end = next((j for j, t in enumerate(ids) if t in eos), None)
                if end is not None:
                    ids = ids[:end]
                else:   # a stop string ended it: the batch's padding follows
                    while ids and ids[-1] == gc.pad_token_id:
                        ids = ids[:-1]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                done = end is not None or len(ids) < gc.max_new_tokens
                choices.append(ChatCompletionResponseChoice(k, ChatMessage("assistant", text),
                                                            "stop" if done else "length", ids))
            out.append(ChatCompletionResponse(getattr(self.model, "name_or_path", ""), choices))
        return out


__all__ = ["ChatCompletionResponse", "ChatCompletionResponseChoice", "ChatMessage", "InferRequest", "RequestConfig",
           "RolloutInferRequest", "TransformersEngine"]
