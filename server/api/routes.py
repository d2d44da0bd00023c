"""The endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models[/{id}]``, vLLM's ``/tokenize`` and
``/detokenize``, ``/openapi.json`` and ``/docs`` (unless ``disable-docs``), all behind the API key when one is
configured; ``/health``, ``/metrics`` and ``/version`` (open unless ``api-key-health`` / ``api-key-metrics``)."""

from __future__ import annotations

import hmac
import time

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.api import generation, structured
from server.api.errors import APIError, error_body
from server.api.logprobs import LogprobFormatter
from server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from server.api.responses import ResponseBuilder
from server.api.state import ServingState
from server.api.tools import tool_calling


def make_router(state: ServingState) -> APIRouter:
    api_key = state.config.api_key.encode() if state.config.api_key else None
    created = int(time.time())

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key):
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_model(req: SamplingFields | TokenizeRequest | DetokenizeRequest) -> None:
        if req.model is not None and req.model != state.model_name:
            raise APIError(
                404,
                f"model: {req.model!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )

    config = state.config
    router = APIRouter()
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    keyed = APIRouter(dependencies=[Depends(check_api_key)])
    formatter = LogprobFormatter(state.tokenizer)
    health_auth = [Depends(check_api_key)] if config.api_key_health else []
    metrics_auth = [Depends(check_api_key)] if config.api_key_metrics else []

    def check_request(req: SamplingFields) -> None:
        check_model(req)
        state.warn_unknown_fields(req)
        generation.check_supported(req)

    @v1.post("/completions")
    async def completions(req: CompletionRequest, http: Request) -> Response:
        arrival = generation.now()
        check_request(req)
        prompts = generation.completion_prompts(req, state)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else req.prompt_logprobs
        params = [
            generation.sampling_params(
                req,
                req.max_tokens,
                len(ids),
                generation.COMPLETION_DEFAULT_MAX_TOKENS,
                state,
                "prompt",
                req.logprobs,
                prompt_logprobs,
            )
            for ids, _ in prompts
        ]
        params = await structured.constrain(params, structured.single_spec(structured.requested_specs(req)), state)
        request_id, samples = generation.make_samples(prompts, params, chat=False, echo=req.echo)
        builder = ResponseBuilder(
            request_id,
            state.model_name,
            False,
            req.return_token_ids,
            formatter,
            logprobs=req.logprobs is not None,
            echo=req.echo,
            prompt_logprobs=req.prompt_logprobs is not None,
        )
        return await generation.serve(http, req, samples, builder, state, arrival)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request) -> Response:
        arrival = generation.now()
        check_request(req)
        tools = tool_calling(req, state)
        specs = structured.requested_specs(req)
        tool_grammar = None if tools is None else tools.grammar()
        spec = structured.single_spec(specs + ([tool_grammar] if tool_grammar is not None else []))
        prompt_ids = generation.chat_prompt(req, state, req.add_special_tokens)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = generation.sampling_params(
            req, requested, len(prompt_ids), None, state, "messages", logprobs, req.prompt_logprobs
        )
        params = (await structured.constrain([params], spec, state))[0]
        request_id, samples = generation.make_samples([(prompt_ids, "")], [params], chat=True)
        builder = ResponseBuilder(
            request_id,
            state.model_name,
            True,
            req.return_token_ids,
            formatter,
            logprobs=bool(req.logprobs),
            prompt_logprobs=req.prompt_logprobs is not None,
            tools=tools,
        )
        return await generation.serve(http, req, samples, builder, state, arrival)

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": created,
            "owned_by": "deep_ep_npu",
            "root": state.config.model or state.model_name,
            "max_model_len": state.max_model_len,
        }

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != state.model_name:
            raise APIError(
                404,
                f"model: {model_id!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return model_card()

    @keyed.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        check_model(req)
        state.warn_unknown_fields(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", param="prompt", code="invalid_value")
        if req.chat_template is not None:
            raise APIError(
                400,
                "chat_template: a per-request chat template is not accepted; start the server with --chat-template",
                param="chat_template",
                code="unsupported_value",
            )
        if req.messages is not None:
            ids = generation.chat_prompt(req, state, bool(req.add_special_tokens))
        else:
            text, add = req.prompt or "", req.add_special_tokens is not False
            ids = generation.encode(lambda: state.tokenizer.encode(text, add_special_tokens=add), "prompt")
        strs = [formatter.text(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

    @keyed.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req)
        state.warn_unknown_fields(req)
        vocab = state.vocab_size
        bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise APIError(
                400,
                f"tokens: token id {bad[0]} is not in [0, {vocab}) (vocab_size)",
                param="tokens",
                code="invalid_value",
            )
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @router.get("/health", dependencies=health_auth)
    async def health() -> Response:
        if state.engine.is_healthy():
            return Response(status_code=200)
        return JSONResponse(error_body(503, "the engine is down", code="engine_unavailable"), 503)

    @router.get("/metrics", dependencies=metrics_auth)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/version", dependencies=metrics_auth)
    async def version() -> dict:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("deep_ep_npu")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    if not config.disable_docs:

        @keyed.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request) -> JSONResponse:
            return JSONResponse(request.app.openapi())

        @keyed.get("/docs", include_in_schema=False)
        async def docs() -> Response:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="deep_ep_npu server")

    router.include_router(v1)
    router.include_router(keyed)
    return router
