"""The router's app: ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not) through a prefill and a
decode instance, ``/v1/models`` (a decode instance's), ``/health`` (200 while a prefill and a decode instance are
up) and ``/metrics`` (the router's own counters).

A request's body goes to both halves with the bootstrap fields added (the prefill half not streamed); the client
gets the decode half's answer. The decode instance fails a request whose prefill instance dies with an error naming
it; the router also watches the prefill half: if it fails first (refused, or its instance unreachable), the decode
half is cancelled (which frees what it held) and the client gets that error. A decode instance that breaks off a
stream ends it with an error event naming it. Instances that fail at the connection level are marked down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from server.api.errors import error_body

from .pool import Instance, NoInstance, Pool

PROBE_INTERVAL_S = 1.0


class _Failed(Exception):
    """A half of a request failed: ``status`` and the OpenAI-style error body for the client."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body


def _error(status: int, message: str, code: str) -> _Failed:
    return _Failed(status, error_body(status, message, code=code))


def _event(failed: _Failed) -> bytes:
    return f"data: {json.dumps(failed.body)}\n\ndata: [DONE]\n\n".encode()


def create_router_app(
    prefill: Pool, decode: Pool, startup_timeout_s: float = 300.0, request_timeout_s: float = 600.0
) -> FastAPI:
    """The router over ``prefill`` and ``decode``; at start-up it waits for every instance (``startup_timeout_s``)."""
    registry = CollectorRegistry()
    routed = Counter(
        "deep_ep_npu:router_requests",
        "Requests routed, by prefill and decode instance.",
        ["prefill", "decode"],
        registry=registry,
    )
    failures = Counter(
        "deep_ep_npu:router_failures",
        "Requests that failed, by the instance that failed them.",
        ["instance"],
        registry=registry,
    )
    up = Gauge(
        "deep_ep_npu:router_instance_up", "1 while an instance takes requests.", ["instance", "kind"], registry=registry
    )
    client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0))

    def refresh_gauges() -> None:
        for instance in prefill.instances + decode.instances:
            up.labels(instance.url, instance.kind).set(int(instance.down is None))

    async def probe_forever() -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await prefill.probe(client)
            await decode.probe(client)
            refresh_gauges()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await prefill.connect(client, startup_timeout_s)
        await decode.connect(client, startup_timeout_s)
        refresh_gauges()
        prober = asyncio.ensure_future(probe_forever())
        try:
            yield
        finally:
            prober.cancel()
            await client.aclose()

    app = FastAPI(title="deep_ep_npu router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def lost(pool: Pool, instance: Instance, e: Exception) -> _Failed:
        pool.mark_down(instance, repr(e))
        failures.labels(instance.url).inc()
        refresh_gauges()
        return _error(502, f"{pool.kind} instance {instance.url} failed: {e!r}", f"{pool.kind}_unavailable")

    async def answer(pool: Pool, instance: Instance, response: httpx.Response) -> _Failed | None:
        """None for a 200, else the instance's error for the client."""
        if response.status_code == 200:
            return None
        failures.labels(instance.url).inc()
        try:
            body = json.loads(await response.aread())
            body["error"]["message"] = f"{pool.kind} instance {instance.url}: {body['error']['message']}"
        except (ValueError, KeyError, TypeError):
            body = error_body(
                response.status_code,
                f"{pool.kind} instance {instance.url} answered HTTP {response.status_code}",
                code=f"{pool.kind}_error",
            )
        return _Failed(response.status_code, body)

    async def prefill_half(p: Instance, path: str, body: dict, headers: dict) -> _Failed | None:
        p.inflight += 1
        try:
            return await answer(prefill, p, await client.post(p.url + path, json=body, headers=headers))
        except httpx.HTTPError as e:
            return lost(prefill, p, e)
        finally:
            p.inflight -= 1

    async def route(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(error_body(400, "the body is not valid JSON", code="invalid_json"), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body(400, "the body must be a JSON object", code="invalid_json"), 400)
        try:
            p, d = prefill.pick(), decode.pick()
        except NoInstance as e:
            return JSONResponse(error_body(503, str(e), code="no_instance"), 503)
        routed.labels(p.url, d.url).inc()
        extra = {
            "bootstrap_host": p.bootstrap_host,
            "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": secrets.randbits(63),
        }
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        p_body = {k: v for k, v in body.items() if k != "stream_options"} | extra | {"stream": False}
        p_task = asyncio.ensure_future(prefill_half(p, path, p_body, headers))
        d.inflight += 1
        d_req = client.build_request("POST", d.url + path, json=body | extra, headers=headers)
        d_task = asyncio.ensure_future(client.send(d_req, stream=True))
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task.done() and (failed := p_task.result()) is not None:
                raise failed
            try:
                response = await d_task
            except httpx.HTTPError as e:
                raise lost(decode, d, e) from None
            if (failed := await answer(decode, d, response)) is not None:
                await response.aclose()
                await prefill.check(client, p)
                raise failed
        except _Failed as failed:
            d_task.cancel()  # (a decode half still waiting for its prefill: closing it frees what it holds)
            d.inflight -= 1
            return JSONResponse(failed.body, failed.status)
        if not body.get("stream"):
            try:
                content = await response.aread()
            except httpx.HTTPError as e:
                d.inflight -= 1
                broken = lost(decode, d, e)
                return JSONResponse(broken.body, broken.status)
            await response.aclose()
            d.inflight -= 1
            return Response(content, 200, media_type="application/json")
        return StreamingResponse(
            relay(response, d, p, p_task), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def relay(response: httpx.Response, d: Instance, p: Instance, p_task: asyncio.Future) -> AsyncIterator[bytes]:
        """The decode half's SSE lines; an error event if it breaks off or the prefill half fails first (the prefill
        instance ``p`` is checked before an error event of the decode half is passed on)."""
        lines = response.aiter_lines()
        line_task: asyncio.Future | None = None
        try:
            while True:
                if line_task is None:
                    line_task = asyncio.ensure_future(anext(lines))
                watched = {line_task} if p_task.done() else {line_task, p_task}
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                if p_task.done() and (failed := p_task.result()) is not None:
                    yield _event(failed)
                    return
                if not line_task.done():
                    continue
                task, line_task = line_task, None
                try:
                    line = task.result()
                except StopAsyncIteration:
                    return
                except httpx.HTTPError as e:
                    yield _event(lost(decode, d, e))
                    return
                if line.startswith("data: {") and '"error"' in line:
                    await prefill.check(client, p)
                yield (line + "\n").encode()
        finally:
            if line_task is not None:
                line_task.cancel()
            d.inflight -= 1
            await response.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            d = decode.pick()
            r = await client.get(d.url + "/v1/models", headers=headers)
        except NoInstance as e:
            return JSONResponse(error_body(503, str(e), code="no_instance"), 503)
        except httpx.HTTPError as e:
            failed = lost(decode, d, e)
            return JSONResponse(failed.body, failed.status)
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        missing = [p.kind for p in (prefill, decode) if all(i.down is not None for i in p.instances)]
        if missing:
            return JSONResponse(error_body(503, f"no {missing[0]} instance is up", code="no_instance"), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
