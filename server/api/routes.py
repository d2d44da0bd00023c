"""The endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (API key checked when configured),
``/health``, ``/metrics`` and ``/version`` (open unless ``api-key-health`` / ``api-key-metrics``)."""

from __future__ import annotations

import hmac
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.api import generation
from server.api.errors import APIError, error_body
from server.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.api.state import ServingState


def make_router(state: ServingState) -> APIRouter:
    api_key = state.config.api_key.encode() if state.config.api_key else None
    created = int(time.time())

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip

    def check_model(req: SamplingFields) -> None:
        if req.model is not None and req.model != state.model_name:
            raise APIError(404, f"model: {req.model!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    config = state.config
    router = APIRouter()
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    health_auth = [Depends(check_api_key)] if config.api_key_health else []
    metrics_auth = [Depends(check_api_key)] if config.api_key_metrics else []

    @v1.post("/completions")
    async def completions(req: CompletionRequest, http: Request) -> Response:
        arrival = generation.now()
        check_model(req)
        prompt_ids = generation.completion_prompt(req, state)
        params = generation.sampling_params(req, req.max_tokens, len(prompt_ids),
                                            generation.COMPLETION_DEFAULT_MAX_TOKENS, state, "prompt")  # fmt: skip
        return await generation.serve(http, req, prompt_ids, params, state, chat=False, arrival=arrival)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request) -> Response:
        arrival = generation.now()
        check_model(req)
        prompt_ids = generation.chat_prompt(req, state)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = generation.sampling_params(req, requested, len(prompt_ids), None, state, "messages")
        return await generation.serve(http, req, prompt_ids, params, state, chat=True, arrival=arrival)

    @v1.get("/models")
    async def models() -> dict:
        card = {"id": state.model_name, "object": "model", "created": created, "owned_by": "deep_ep_npu",
                "root": state.config.model or state.model_name, "max_model_len": state.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

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

    router.include_router(v1)
    return router
