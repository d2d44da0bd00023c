"""The SSE stream of one request: every choice's chunks as they come (``data: {...}``), then ``data: [DONE]``.

Text that could still become part of a stop string, or is a partial UTF-8 character, is held back until it is final.
Each chunk carries the token ids and log-probabilities it adds. An engine failure ends the stream with an error
event; a client that goes away closes the generator, which cancels every choice's engine request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from server.api.errors import error_body
from server.api.responses import ResponseBuilder, Sample, SampleOutput
from server.api.state import ServingState
from server.api.tools import ToolStream
from server.async_engine import EngineDeadError, RequestHandle
from server.engine_api import RequestDelta, TokenLogprob


def apply(out: SampleOutput, batch: list[RequestDelta]) -> tuple[list[int], list[TokenLogprob]]:
    """Fold a batch of one sample's deltas into ``out``; returns the new token ids and their log-probabilities."""
    new_ids: list[int] = []
    new_logprobs: list[TokenLogprob] = []
    for delta in batch:
        new_ids += delta.new_token_ids
        new_logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
    last = batch[-1]
    out.token_ids += new_ids
    out.logprobs += new_logprobs
    out.text, out.finish_reason, out.error = last.text, last.finish_reason, last.error
    return new_ids, new_logprobs


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _stable_len(text: str, holdback: int) -> int:
    """How much of a running request's text is final: not a possible stop-string prefix, not a partial char."""
    n = len(text) - holdback
    while n > 0 and text[n - 1] == "\ufffd":
        n -= 1
    return max(n, 0)


async def _choice(
    state: ServingState,
    s: Sample,
    handle: RequestHandle,
    out: SampleOutput,
    builder: ResponseBuilder,
    include_usage: bool,
    queue: asyncio.Queue,
) -> None:
    """Put choice ``s``'s chunks (as SSE text) on ``queue``; an error event ends the choice."""
    holdback = max((len(stop) for stop in s.params.stop_strings), default=1) - 1
    sent, offset, first = 0, 0, True
    tools = None if builder.tools is None else ToolStream(builder.tools)
    async for batch in state.engine.stream(handle):
        new_ids, new_logprobs = apply(out, batch)
        if out.finish_reason == "error":
            await queue.put(_data(error_body(500, f"generation failed: {out.error}", code="generation_error")))
            return
        stable = len(out.text) if out.finish_reason else _stable_len(out.text, holdback)
        piece: str | None = out.text[sent:stable]
        sent = max(sent, stable)
        calls, finish = None, None
        if tools is not None:
            piece, calls = tools.feed(piece or "", out.text, out.token_ids, out.finish_reason)
            finish = tools.finish_reason(out.finish_reason)
        if piece or calls or new_ids or out.finish_reason or first:
            chunk = builder.chunk(s, out, piece, new_ids, new_logprobs, offset, first, include_usage, calls, finish)
            logprobs = chunk["choices"][0]["logprobs"]
            if logprobs is not None and "text_offset" in logprobs:
                offset += sum(len(t) for t in logprobs["tokens"])
            await queue.put(_data(chunk))
            first = False


async def stream(
    state: ServingState,
    samples: list[Sample],
    handles: list[RequestHandle],
    builder: ResponseBuilder,
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE body: the choices' chunks interleaved as they come, the usage chunk if asked for, ``[DONE]``."""
    queue: asyncio.Queue = asyncio.Queue()
    outputs = [SampleOutput() for _ in samples]
    tasks = [
        asyncio.ensure_future(_choice(state, s, h, out, builder, include_usage, queue))
        for s, h, out in zip(samples, handles, outputs, strict=True)
    ]
    pending = set(tasks)
    failed = False
    try:
        while pending or not queue.empty():
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, *pending}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
            else:
                getter.cancel()
            for task in done - {getter}:
                pending.discard(task)
                if isinstance(task.exception(), EngineDeadError):
                    failed = True
                    yield _data(error_body(503, str(task.exception()), code="engine_unavailable"))
                    break
                elif task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if failed:
                break
        if include_usage and not failed and all(o.finish_reason not in (None, "error") for o in outputs):
            yield _data(builder.usage_chunk(samples, outputs))
    finally:
        for task in tasks:
            task.cancel()
    yield "data: [DONE]\n\n"
