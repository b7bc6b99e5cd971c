"""ms-swift's request and response types (swift/infer_engine/protocol.py) as plugins use them: a
`RequestConfig` for an engine's sampling, the chat-completion response whose choices carry the
generated message. Only the fields a plugin reads or sets; an engine here honours those listed in
engine.TransformersEngine's docstring."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4


@dataclass
class RequestConfig:
    """ms-swift's defaults: None takes the model's generation_config (engine.generation_config)."""

    max_tokens: int | None = None          # None: the model's max length minus the prompt's
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    num_beams: int = 1
    stop: list[str] | None = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    length_penalty: float = 1.0
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []


@dataclass
class ChatMessage:
    role: str
    content: str


@dataclass
class ChatCompletionResponseChoice:
    index: int
    message: ChatMessage
    finish_reason: str | None = None       # "stop" (EOS) or "length"
    token_ids: list[int] | None = None
    #: with the request config's `logprobs`: {"content": [{"token", "logprob"}, ...]}, one per token id
    logprobs: dict[str, Any] | None = None


@dataclass
class ChatCompletionResponse:
    model: str
    choices: list[ChatCompletionResponseChoice]
    id: str = ""
    object: str = "chat.completion"


@dataclass
class RolloutInferRequest:
    """A request as ms-swift's rollout passes it: the conversation, the row's other columns and the
    trajectory's id (ms-swift's `uuid`, which a gym scheduler keys its environments by)."""

    messages: list[dict[str, Any]]
    data_dict: dict[str, Any] = field(default_factory=dict)
    uuid: str = field(default_factory=lambda: uuid4().hex)


InferRequest = RolloutInferRequest


@dataclass
class RolloutOutput:
    """What a scheduler's `run` returns for a trajectory (ms-swift's RolloutOutput): the last response, the
    whole conversation (the prompt's messages, then every turn), each turn's token ids and loss mask (one list
    per turn; none: the assistant messages' text is encoded), and JSON-able infos (`total_reward`: the
    trajectory's --use_gym_env reward)."""

    response: ChatCompletionResponse
    messages: list[dict[str, Any]] | None = None
    response_token_ids: list[list[int]] = field(default_factory=list)
    response_loss_mask: list[list[int]] = field(default_factory=list)
    rollout_infos: dict[str, Any] = field(default_factory=dict)
    rollout_logprobs: list[list[float]] = field(default_factory=list)

__all__ = ["ChatCompletionResponse", "ChatCompletionResponseChoice", "ChatMessage", "InferRequest", "RequestConfig",
           "RolloutInferRequest", "RolloutOutput"]
