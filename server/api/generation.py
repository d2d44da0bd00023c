"""One completion or chat request end to end: validate against the limits, add one engine request per choice
(prompt x sample), then answer in full or as an SSE stream (:mod:`server.api.sse`). A client disconnect cancels the
request's engine requests (their slots are freed)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from server.api import sse
from server.api.disagg import transfer_params
from server.api.errors import APIError, engine_error
from server.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest
from server.api.responses import ResponseBuilder, Sample, SampleOutput
from server.api.state import ServingState
from server.api.tools import template_tools
from server.async_engine import EngineDeadError, EngineOverloadedError
from server.chat_template import ChatTemplateError
from server.engine_api import SamplingParamError, SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
# generation_config.json field -> sampling parameter, and the transformers defaults that vLLM does not apply
GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
HF_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def completion_prompts(req: CompletionRequest, state: ServingState) -> list[tuple[list[int], str]]:
    """Per prompt of ``prompt`` (a string, token ids, or a batch of either): its token ids and, with ``echo``, its
    text."""
    prompt: Any = req.prompt
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    out = []
    for i, one in enumerate(batch):
        param = "prompt" if len(batch) == 1 and batch[0] is prompt else f"prompt.{i}"
        if isinstance(one, str):
            if not one:
                raise APIError(400, f"{param}: must not be empty", param=param, code="invalid_value")
            tokenize = functools.partial(state.tokenizer.encode, one, add_special_tokens=True)
            out.append((encode(tokenize, param), one))
            continue
        if not one:
            raise APIError(400, f"{param}: the token id list must not be empty", param=param, code="invalid_value")
        bad = [t for t in one if t < 0]
        if bad:
            raise APIError(400, f"{param}: token ids must be >= 0, got {bad[0]}", param=param, code="invalid_value")
        out.append((list(one), _decode(one, state, param) if req.echo else ""))
    return out


def _decode(token_ids: list[int], state: ServingState, param: str) -> str:
    if state.vocab_size is not None and any(t >= state.vocab_size for t in token_ids):
        bad = next(t for t in token_ids if t >= state.vocab_size)
        raise APIError(
            400,
            f"{param}: token id {bad} is not in [0, {state.vocab_size}) (vocab_size)",
            param=param,
            code="invalid_value",
        )
    return state.tokenizer.decode(token_ids)


def chat_prompt(
    req: ChatCompletionRequest | TokenizeRequest, state: ServingState, add_special_tokens: bool
) -> list[int]:
    """The token ids of ``req.messages`` rendered by the chat template (a 400 naming ``chat_template`` without one).
    A BOS the template writes twice, or once more than ``add_special_tokens`` adds, is kept once."""
    if state.chat is None:
        raise APIError(400, state.chat_refusal, param="chat_template", code="chat_template_missing")
    tokenizer = state.tokenizer
    messages = [m.for_template() for m in req.messages or ()]
    tools = template_tools(req) if isinstance(req, ChatCompletionRequest) else None
    try:
        text = state.chat.render(
            messages,
            tokenizer.special_tokens,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            tools,
        )
    except ChatTemplateError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    ids = encode(functools.partial(tokenizer.encode, text, add_special_tokens=add_special_tokens), "messages")
    bos = tokenizer.bos_token_id
    return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids


def generation_defaults(model_path: str | None, mode: str) -> dict[str, Any]:
    """Sampling defaults from ``generation_config.json`` as vLLM's ``--generation-config auto`` takes them: only
    ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as
    ``max_tokens``), and only values that differ from transformers' defaults; none with ``mode`` ``vllm``. A value
    that is not a valid sampling parameter stops start-up."""
    path = os.path.join(model_path or "", "generation_config.json")
    if model_path is None or mode == "vllm" or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        gen = json.load(f)
    defaults = {
        ours: gen[theirs]
        for theirs, ours in GENERATION_FIELDS.items()
        if gen.get(theirs) is not None and gen[theirs] != HF_GENERATION_DEFAULTS.get(theirs)
    }
    try:
        SamplingParams(**defaults)
    except (SamplingParamError, TypeError) as e:
        raise ValueError(f"{path}: {e} (start with --generation-config vllm to ignore the file)") from None
    return defaults


def encode(tokenize: Callable[[], list[int]], param: str) -> list[int]:
    """``tokenize()``; text JSON can carry but UTF-8 cannot (a lone surrogate such as ``"\\ud800"``) is a 400."""
    try:
        return tokenize()
    except UnicodeEncodeError as e:
        raise APIError(
            400,
            f"{param}: not encodable as UTF-8 ({e.reason}, e.g. a lone surrogate escape)",
            param=param,
            code="invalid_value",
        ) from None


def check_supported(req: SamplingFields) -> None:
    """A known field set to a value this server does not support is a 400 naming it."""
    refused = req.unsupported()
    if refused is not None:
        field, why = refused
        raise APIError(400, f"{field}: {why}", param=field, code="unsupported_value")


def sampling_params(
    req: SamplingFields,
    requested: int | None,
    num_prompt_tokens: int,
    default: int | None,
    state: ServingState,
    prompt_param: str,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Check the prompt length and ``max_tokens`` against ``max_model_len`` / ``max_tokens_limit``; build the
    engine's sampling params (``n`` of them: the caller adds ``for_sample(i)``). ``default`` None means "the rest
    of the context". Fields the request leaves unset take the model's generation defaults, then OpenAI's."""
    model = state.generation_defaults
    default = model.get("max_tokens", default)
    max_model_len, limit = state.max_model_len, state.config.max_tokens_limit
    max_prompt_tokens = state.config.max_prompt_tokens
    if max_prompt_tokens is not None and num_prompt_tokens > max_prompt_tokens:
        raise APIError(
            400,
            f"{prompt_param}: {num_prompt_tokens} prompt tokens are over this server's limit of "
            f"{max_prompt_tokens} (max-prompt-tokens)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    remaining = max_model_len - num_prompt_tokens
    if remaining < 1:
        raise APIError(
            400,
            f"{prompt_param}: {num_prompt_tokens} prompt tokens leave no room for output: this "
            f"model's maximum context length is {max_model_len} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        max_tokens = min(remaining, default or remaining, limit or remaining)
    elif limit is not None and requested > limit:
        raise APIError(
            400,
            f"max_tokens: {requested} is over this server's limit of {limit}",
            param="max_tokens",
            code="invalid_value",
        )
    elif requested > remaining:
        raise APIError(
            400,
            f"max_tokens: {num_prompt_tokens} prompt tokens + {requested} max_tokens exceed this "
            f"model's maximum context length of {max_model_len} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    else:
        max_tokens = requested
    stops = [req.stop] if isinstance(req.stop, str) else req.stop
    if stops and any(not s for s in stops):
        raise APIError(400, "stop: stop strings must not be empty", param="stop", code="invalid_value")
    if req.stop_token_ids and any(t < 0 for t in req.stop_token_ids):
        raise APIError(400, "stop_token_ids: token ids must be >= 0", param="stop_token_ids", code="invalid_value")
    try:
        bias = None if req.logit_bias is None else {_token_key(k): float(v) for k, v in req.logit_bias.items()}
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(req.temperature, model.get("temperature", 1.0)),
            top_p=_or(req.top_p, model.get("top_p", 1.0)),
            top_k=_or(req.top_k, model.get("top_k", -1)),
            min_p=_or(req.min_p, model.get("min_p", 0.0)),
            seed=req.seed,
            stop=stops,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            n=req.num_samples,
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, model.get("repetition_penalty", 1.0)),
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except SamplingParamError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _token_key(key: str) -> int:
    """A ``logit_bias`` key: a token id written as a string (JSON keys are strings)."""
    if not key.isdigit() or not key.isascii():
        raise SamplingParamError("logit_bias", f'keys must be token ids (e.g. "50256"), got {key!r}')
    return int(key)


def make_samples(
    prompts: list[tuple[list[int], str]], params: list[SamplingParams], chat: bool, echo: bool = False
) -> tuple[str, list[Sample]]:
    """The request id and one :class:`Sample` per prompt x sample (``index = prompt_index * n + sample_index``).
    A sample's engine request id is the request id, suffixed by ``-index`` when there are several choices."""
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    single = len(prompts) == 1 and params[0].n == 1
    samples = []
    for p, ((ids, text), sp) in enumerate(zip(prompts, params, strict=True)):
        for i in range(sp.n):
            index = p * sp.n + i
            engine_id = request_id if single else f"{request_id}-{index}"
            samples.append(Sample(index, engine_id, ids, sp.for_sample(i), text if echo else "", i == 0))
    return request_id, samples


async def serve(
    http: Request,
    req: SamplingFields,
    samples: list[Sample],
    builder: ResponseBuilder,
    state: ServingState,
    arrival: float,
) -> Response:
    """Add every sample to the engine and answer (streamed when ``req.stream``)."""
    handles = []
    transfers = transfer_params(req, state.config.disaggregation_mode, samples)
    try:
        for s, transfer in zip(samples, transfers, strict=True):
            handles.append(await state.engine.add_request(s.request_id, s.prompt_ids, s.params, arrival, transfer))
    except (EngineOverloadedError, EngineDeadError, ValueError, TypeError) as e:
        for s in samples[: len(handles)]:
            state.engine.abort(s.request_id)
        raise engine_error(e) from None
    except BaseException:
        for s in samples[: len(handles)]:
            state.engine.abort(s.request_id)
        raise
    if req.stream:
        body = sse.stream(state, samples, handles, builder, req.include_usage)

        def abort_all() -> None:
            for s in samples:
                state.engine.abort(s.request_id)

        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(abort_all),
        )
    return await _until_disconnect(http, _collect(state, samples, handles, builder))


async def _collect(state: ServingState, samples: list[Sample], handles: list, builder: ResponseBuilder) -> Response:
    async def one(handle: Any) -> SampleOutput:
        out = SampleOutput()
        async for batch in state.engine.stream(handle):
            sse.apply(out, batch)
        if out.finish_reason == "error":
            raise APIError(500, f"generation failed: {out.error}", code="generation_error")
        return out

    tasks = [asyncio.ensure_future(one(h)) for h in handles]
    try:
        outputs = await asyncio.gather(*tasks)
    except EngineDeadError as e:
        raise engine_error(e) from None
    finally:
        for task in tasks:
            task.cancel()
    return JSONResponse(builder.full(samples, list(outputs)))


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
