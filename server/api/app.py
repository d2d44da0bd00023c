"""``create_app(config, engine)``: the FastAPI app over one engine (no module-level app, no globals)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.disagg import make_disagg_router
from server.api.errors import error_body, install_error_handlers
from server.api.generation import generation_defaults
from server.api.routes import make_router
from server.api.state import ServingState
from server.async_engine import AsyncEngine
from server.chat_template import serving_template
from server.config import ServerConfig
from server.engine_api import EngineCore
from server.metrics import Metrics
from server.structured.compiler import GrammarCache

logger = logging.getLogger("server.api")


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413 (by ``Content-Length``, and while reading the body)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await self._refuse(send)
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body is over the limit of {self.max_bytes} bytes (max-request-bytes)"

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(error_body(413, self._message(), code="request_too_large")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deep_ep_npu")
    except PackageNotFoundError:
        return "unknown"


def create_app(config: ServerConfig, engine: EngineCore, *, capacity: int | None = None) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (a started :class:`EngineCore`).

    The app owns the engine from here on: its lifespan starts the engine thread and, at exit, shuts the engine
    down. ``capacity`` is how many requests the engine runs at once (default ``max_num_seqs * ep_size``).
    """
    metrics = Metrics(config.model_name)
    chat, refusal = serving_template(config.chat_template, engine.tokenizer)
    logger.info("chat template: %s", chat.origin if chat is not None else f"none ({refusal})")
    defaults = generation_defaults(config.model, config.generation_config)
    if defaults:
        logger.info(
            "sampling defaults from the model's generation_config.json (a request's own values win): %s", defaults
        )
    capacity = capacity or engine.max_num_seqs * config.ep_size
    async_engine = AsyncEngine(engine, capacity=capacity, max_queue_len=config.max_queue_len, metrics=metrics)
    grammars = GrammarCache(engine.tokenizer, engine.vocab_size or 0)
    state = ServingState(
        config=config,
        engine=async_engine,
        tokenizer=engine.tokenizer,
        metrics=metrics,
        grammars=grammars,
        model_name=config.model_name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        chat=chat,
        chat_refusal=refusal,
        generation_defaults=defaults,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()

    # /openapi.json and /docs are the router's own routes (behind the API key); FastAPI's are off
    app = FastAPI(
        title="deep_ep_npu server",
        version=_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.serving = state
    install_error_handlers(app)
    app.include_router(make_router(state))
    app.include_router(make_disagg_router(state))
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    return app
