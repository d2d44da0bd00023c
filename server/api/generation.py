"""One completion or chat request end to end: validate against the limits, add it to the engine, then answer in
full or as an SSE stream. A client disconnect cancels the request in the engine (its slot is freed)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from server.api.errors import APIError, engine_error, error_body
from server.api.protocol import ChatCompletionRequest, CompletionRequest, ResponseBuilder, SamplingFields
from server.api.state import ServingState
from server.async_engine import EngineDeadError, EngineOverloadedError, RequestHandle
from server.engine_api import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def completion_prompt(req: CompletionRequest, state: ServingState) -> list[int]:
    """Token ids of ``prompt`` (a string or token ids; a one-element batch is unwrapped)."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: batches of {len(prompt)} prompts are not supported; send one per request",
                           param="prompt", code="invalid_value")  # fmt: skip
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
        return _encode(lambda: state.tokenizer.encode(prompt), "prompt")
    if not prompt:
        raise APIError(400, "prompt: the token id list must not be empty", param="prompt", code="invalid_value")
    bad = [t for t in prompt if t < 0]
    if bad:
        raise APIError(400, f"prompt: token ids must be >= 0, got {bad[0]}", param="prompt", code="invalid_value")
    return list(prompt)


def chat_prompt(req: ChatCompletionRequest, state: ServingState) -> list[int]:
    """Token ids of ``messages`` after the tokenizer's chat template."""
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    return _encode(lambda: state.tokenizer.apply_chat_template(messages), "messages")


def _encode(tokenize: Callable[[], list[int]], param: str) -> list[int]:
    """``tokenize()``; text JSON can carry but UTF-8 cannot (a lone surrogate such as ``"\\ud800"``) is a 400."""
    try:
        return tokenize()
    except UnicodeError as e:
        raise APIError(400, f"{param}: not encodable as UTF-8 ({e.reason}, e.g. a lone surrogate escape)",
                       param=param, code="invalid_value") from None  # fmt: skip


def sampling_params(req: SamplingFields, requested: int | None, num_prompt_tokens: int, default: int | None,
                    state: ServingState, prompt_param: str) -> SamplingParams:  # fmt: skip
    """Check the prompt length and ``max_tokens`` against ``max_model_len`` / ``max_tokens_limit``; build the
    engine's sampling params. ``default`` None means "the rest of the context"."""
    max_model_len, limit = state.max_model_len, state.config.max_tokens_limit
    max_prompt_tokens = state.config.max_prompt_tokens
    if max_prompt_tokens is not None and num_prompt_tokens > max_prompt_tokens:
        raise APIError(400, f"{prompt_param}: {num_prompt_tokens} prompt tokens are over this server's limit of "
                       f"{max_prompt_tokens} (max-prompt-tokens)", param=prompt_param,
                       code="context_length_exceeded")  # fmt: skip
    remaining = max_model_len - num_prompt_tokens
    if remaining < 1:
        raise APIError(400, f"{prompt_param}: {num_prompt_tokens} prompt tokens leave no room for output: this "
                       f"model's maximum context length is {max_model_len} tokens", param=prompt_param,
                       code="context_length_exceeded")  # fmt: skip
    if requested is None:
        max_tokens = min(remaining, default or remaining, limit or remaining)
    elif limit is not None and requested > limit:
        raise APIError(400, f"max_tokens: {requested} is over this server's limit of {limit}",
                       param="max_tokens", code="invalid_value")  # fmt: skip
    elif requested > remaining:
        raise APIError(400, f"max_tokens: {num_prompt_tokens} prompt tokens + {requested} max_tokens exceed this "
                       f"model's maximum context length of {max_model_len} tokens", param="max_tokens",
                       code="context_length_exceeded")  # fmt: skip
    else:
        max_tokens = requested
    stops = [req.stop] if isinstance(req.stop, str) else req.stop
    if stops and any(not s for s in stops):
        raise APIError(400, "stop: stop strings must not be empty", param="stop", code="invalid_value")
    if req.stop_token_ids and any(t < 0 for t in req.stop_token_ids):
        raise APIError(400, "stop_token_ids: token ids must be >= 0", param="stop_token_ids", code="invalid_value")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed, stop=stops, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos)  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None


async def serve(http: Request, req: SamplingFields, prompt_ids: list[int], params: SamplingParams,
                state: ServingState, chat: bool, arrival: float) -> Response:  # fmt: skip
    """Add the request to the engine and answer it (streamed when ``req.stream``)."""
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        handle = await state.engine.add_request(request_id, prompt_ids, params, arrival)
    except (EngineOverloadedError, EngineDeadError, ValueError, TypeError) as e:
        raise engine_error(e) from None
    builder = ResponseBuilder(request_id, state.model_name, chat, req.return_token_ids)
    if req.stream:
        holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        body = _sse(state, handle, builder, prompt_ids, holdback, req.include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(state.engine.abort, request_id))  # fmt: skip
    return await _until_disconnect(http, _collect(state, handle, builder, prompt_ids))


async def _collect(state: ServingState, handle: RequestHandle, builder: ResponseBuilder,
                   prompt_ids: list[int]) -> Response:  # fmt: skip
    token_ids: list[int] = []
    last = None
    try:
        async for batch in state.engine.stream(handle):
            for delta in batch:
                token_ids += delta.new_token_ids
            last = batch[-1]
    except EngineDeadError as e:
        raise engine_error(e) from None
    assert last is not None and last.finish_reason is not None
    if last.finish_reason == "error":
        raise APIError(500, f"generation failed: {last.error}", code="generation_error")
    return JSONResponse(builder.full(last.text, last.finish_reason, prompt_ids, token_ids))


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _stable_len(text: str, holdback: int) -> int:
    """How much of a running request's text is final: not a possible stop-string prefix, not a partial char."""
    n = len(text) - holdback
    while n > 0 and text[n - 1] == "\ufffd":
        n -= 1
    return max(n, 0)


async def _sse(state: ServingState, handle: RequestHandle, builder: ResponseBuilder, prompt_ids: list[int],
               holdback: int, include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
    sent, first, num_output_tokens = 0, True, 0
    try:
        async for batch in state.engine.stream(handle):
            new_ids = [t for delta in batch for t in delta.new_token_ids]
            num_output_tokens += len(new_ids)
            last = batch[-1]
            if last.finish_reason == "error":
                yield _data(error_body(500, f"generation failed: {last.error}", code="generation_error"))
                break
            stable = len(last.text) if last.finish_reason else _stable_len(last.text, holdback)
            piece = last.text[sent:stable]
            sent = max(sent, stable)
            if piece or new_ids or last.finish_reason or first:
                yield _data(builder.chunk(piece, last.finish_reason, new_ids, prompt_ids, first, include_usage))
                first = False
        else:
            if include_usage:
                yield _data(builder.usage_chunk(len(prompt_ids), num_output_tokens))
    except EngineDeadError as e:
        yield _data(error_body(503, str(e), code="engine_unavailable"))
    yield "data: [DONE]\n\n"


async def _until_disconnect(http: Request, handler: Awaitable[Response]) -> Response:
    """Run ``handler`` while watching for the client's ``http.disconnect`` (the body is already read, so the next
    ASGI message is the disconnect); on disconnect cancel it, which aborts its engine request."""

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)  # nobody reads it: the client is gone
    return task.result()


def now() -> float:
    return time.monotonic()
