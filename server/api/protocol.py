"""OpenAI request models (``/v1/completions``, ``/v1/chat/completions``) and response builders.

Requests are validated strictly (no string-to-number coercion; unknown fields are refused by name) so a bad type is
a 400 naming the field. Responses are plain dicts in OpenAI's shapes; ``return_token_ids`` (vLLM's extension) adds
``prompt_token_ids`` and ``token_ids`` to each choice.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints: vLLM's sampling names plus OpenAI's ``n``, ``stream`` and ``user``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (a one-element batch is unwrapped)."""

    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is OpenAI's newer name for ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


class ResponseBuilder:
    """Builds the response objects and stream chunks of one request (completion or chat)."""

    def __init__(self, request_id: str, model: str, chat: bool, return_token_ids: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.return_token_ids = return_token_ids
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}  # fmt: skip

    def full(self, text: str, finish_reason: str, prompt_token_ids: list[int], token_ids: list[int]) -> dict:
        """The non-streaming response."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason)
        if self.return_token_ids:
            choice.update(prompt_token_ids=prompt_token_ids, token_ids=token_ids)
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, [choice], usage=usage(len(prompt_token_ids), len(token_ids)))

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None,
              prompt_token_ids: list[int] | None, first: bool, include_usage: bool) -> dict:  # fmt: skip
        """One streamed chunk. The chat stream's first chunk carries ``role``; with ``return_token_ids`` the first
        chunk also carries ``prompt_token_ids`` and each chunk the ``token_ids`` it adds."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason)
        if self.return_token_ids:
            if first:
                choice["prompt_token_ids"] = prompt_token_ids
            choice["token_ids"] = token_ids or []
        extra = {"usage": None} if include_usage else {}
        return self._envelope(self._chunk_object, [choice], **extra)

    def usage_chunk(self, num_prompt_tokens: int, num_output_tokens: int) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return self._envelope(self._chunk_object, [], usage=usage(num_prompt_tokens, num_output_tokens))

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"
