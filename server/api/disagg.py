"""Prefill/decode disaggregation in the HTTP layer: a request's bootstrap fields (SGLang's ``bootstrap_host``,
``bootstrap_port``, ``bootstrap_room``) become its samples' :class:`~server.engine_api.KVTransferParams`, and
``GET /disaggregation`` tells ``python -m server.router`` an instance's role and bootstrap address."""

from __future__ import annotations

from fastapi import APIRouter

from server.api.errors import APIError
from server.api.protocol import SamplingFields
from server.api.responses import Sample
from server.api.state import ServingState
from server.engine_api import KVTransferParams

_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def transfer_params(req: SamplingFields, mode: str, samples: list[Sample]) -> list[KVTransferParams | None]:
    """One per sample: its bootstrap room (``bootstrap_room``, suffixed ``-index`` when the request has several
    choices), or None for a colocated server; a 400 naming the field when they do not fit ``mode``."""
    given = [name for name in _FIELDS if getattr(req, name) is not None]
    if mode == "none":
        if given:
            raise APIError(
                400,
                f"{given[0]}: this server runs colocated (no --disaggregation-mode); send requests "
                "without bootstrap fields",
                param=given[0],
                code="invalid_value",
            )
        return [None] * len(samples)
    missing = [name for name in _FIELDS if name not in given]
    if missing:
        raise APIError(
            400,
            f"{missing[0]}: a {mode} instance (--disaggregation-mode {mode}) needs bootstrap_host, "
            "bootstrap_port and bootstrap_room; send requests through python -m server.router",
            param=missing[0],
            code="invalid_value",
        )
    assert req.bootstrap_host is not None and req.bootstrap_port is not None
    room = str(req.bootstrap_room)
    single = len(samples) == 1
    return [
        KVTransferParams(req.bootstrap_host, req.bootstrap_port, room if single else f"{room}-{s.index}")
        for s in samples
    ]


def make_disagg_router(state: ServingState) -> APIRouter:
    """``GET /disaggregation`` (open, as ``/health``): ``{"mode": "none" | "prefill" | "decode", ...}`` (a
    prefill instance adds ``bootstrap_host`` and ``bootstrap_port``)."""
    router = APIRouter()

    @router.get("/disaggregation")
    async def disaggregation() -> dict:
        return state.engine.engine.disaggregation_info() or {"mode": "none"}

    return router
