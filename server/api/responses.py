"""Response objects and stream chunks in OpenAI's shapes, for one request of one or more choices.

A choice is one sample of one prompt (:class:`Sample`); its ``index`` is ``prompt_index * n + sample_index``.
``return_token_ids`` (vLLM's extension) adds ``prompt_token_ids`` and ``token_ids`` to each choice; completions'
``echo`` puts the prompt before the text (and its log-probabilities before the output's).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from server.api.logprobs import LogprobFormatter
from server.api.tools import ToolCalling
from server.engine_api import SamplingParams, TokenLogprob


@dataclasses.dataclass
class Sample:
    """One choice to generate: engine request ``request_id`` for ``prompt_ids``; ``echo_text`` is the prompt text
    to echo ('' without echo); ``counts_prompt`` is set on one sample per prompt (usage counts a prompt once)."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    echo_text: str = ""
    counts_prompt: bool = True


@dataclasses.dataclass
class SampleOutput:
    """What a sample produced so far."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


class ResponseBuilder:
    """Builds the response and the stream chunks of one completion or chat request.

    ``logprobs``: the request asked for the output's log-probabilities; ``prompt_logprobs``: for vLLM's
    ``prompt_logprobs`` field (echoed completions put them into ``logprobs`` instead); ``tools``: how a chat
    output becomes tool calls (:mod:`server.api.tools`).
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        return_token_ids: bool,
        formatter: LogprobFormatter,
        logprobs: bool = False,
        echo: bool = False,
        prompt_logprobs: bool = False,
        tools: ToolCalling | None = None,
    ) -> None:
        self.tools = tools
        self.request_id, self.model, self.chat = request_id, model, chat
        self.return_token_ids, self.formatter = return_token_ids, formatter
        self.logprobs, self.echo, self.prompt_logprobs = logprobs, echo, prompt_logprobs
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def full(self, samples: list[Sample], outputs: list[SampleOutput]) -> dict:
        """The non-streaming response (choices in ``index`` order)."""
        choices = []
        for s, out in sorted(zip(samples, outputs, strict=True), key=lambda pair: pair[0].index):
            finish_reason = out.finish_reason
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": out.text}
                if self.tools is not None:
                    content, calls = self.tools.message(out.text, out.token_ids, out.finish_reason)
                    message.update(content=content, tool_calls=[c.to_dict() for c in calls])
                    finish_reason = "tool_calls" if calls else finish_reason
                choice: dict[str, Any] = {"index": s.index, "message": message}
            else:
                choice = {"index": s.index, "text": s.echo_text + out.text}
            choice.update(
                logprobs=self._logprobs(s, out, out.token_ids, out.logprobs, 0, True), finish_reason=finish_reason
            )
            self._extras(choice, s, out, out.token_ids, True)
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, usage=self.usage(samples, outputs))

    def chunk(
        self,
        s: Sample,
        out: SampleOutput,
        piece: str | None,
        new_ids: list[int],
        new_logprobs: list[TokenLogprob],
        offset: int,
        first: bool,
        include_usage: bool,
        tool_calls: list[dict] | None = None,
        finish_reason: str | None = None,
    ) -> dict:
        """One streamed chunk of choice ``s``: ``piece`` of text, ``new_ids`` and their log-probabilities (text
        offsets from ``offset``), chat ``tool_calls`` deltas. A choice's first chunk carries the chat ``role``, the
        echoed prompt and, with ``return_token_ids``, ``prompt_token_ids``. ``finish_reason``: the output's unless
        given."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": piece} if first else {"content": piece}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": s.index, "delta": delta}
        else:
            choice = {"index": s.index, "text": (s.echo_text if first else "") + (piece or "")}
        choice.update(
            logprobs=self._logprobs(s, out, new_ids, new_logprobs, offset, first),
            finish_reason=finish_reason or out.finish_reason,
        )
        self._extras(choice, s, out, new_ids, first)
        extra = {"usage": None} if include_usage else {}
        return self._envelope(self._chunk_object, [choice], **extra)

    def _logprobs(
        self, s: Sample, out: SampleOutput, ids: list[int], entries: list[TokenLogprob], offset: int, with_prompt: bool
    ) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": self.formatter.chat(entries)}
        all_ids: list[int] = list(ids)
        all_entries: list[TokenLogprob | None] = list(entries)
        if self.echo and with_prompt:
            all_ids = s.prompt_ids + all_ids
            all_entries = list(out.prompt_logprobs or [None] * len(s.prompt_ids)) + all_entries
        return self.formatter.completion(all_entries, all_ids, offset)

    def _extras(self, choice: dict, s: Sample, out: SampleOutput, ids: list[int], first: bool) -> None:
        if self.prompt_logprobs and first:
            choice["prompt_logprobs"] = self.formatter.prompt(out.prompt_logprobs or [])
        if self.return_token_ids:
            if first:
                choice["prompt_token_ids"] = s.prompt_ids
            choice["token_ids"] = ids

    def usage(self, samples: list[Sample], outputs: list[SampleOutput]) -> dict[str, int]:
        """Each prompt counted once, every choice's output tokens."""
        return usage(sum(len(s.prompt_ids) for s in samples if s.counts_prompt), sum(len(o.token_ids) for o in outputs))

    def usage_chunk(self, samples: list[Sample], outputs: list[SampleOutput]) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return self._envelope(self._chunk_object, [], usage=self.usage(samples, outputs))

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"
