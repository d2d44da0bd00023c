"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the right HTTP status."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.async_engine import EngineDeadError, EngineOverloadedError

logger = logging.getLogger("server.api")
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client. ``param`` names the offending request field, if any."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), err.status, headers=err.headers)


def engine_error(e: BaseException, retry_after_s: int = 1) -> APIError:
    """Map the async engine's errors: overloaded and dead are 503 (overloaded with ``Retry-After``)."""
    if isinstance(e, EngineOverloadedError):
        return APIError(503, str(e), code="engine_overloaded", headers={"Retry-After": str(retry_after_s)})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable")
    if isinstance(e, (ValueError, TypeError)):
        return APIError(400, str(e), param=getattr(e, "param", None), code="invalid_value")
    raise e


def field_path(loc: tuple) -> str | None:
    """A request field's path (``messages.0.role``) from a pydantic error location: drops ``body`` and the tags
    pydantic adds for union members and validators (``str``, ``list[int]``, ``function-after[...]``, class names)."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or _is_field_name(p)] if loc[:1] == ("body",) else []
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json", "literal", "any"}


def _is_field_name(part: object) -> bool:
    if not isinstance(part, str):
        return False
    return part.isdigit() or (part.isidentifier() and part.islower() and part not in _TYPE_TAGS)  # digits: dict keys


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":  # its location is a character offset, not a field
        return APIError(400, f"request body is not valid JSON ({first.get('msg', '')})", code="invalid_json")
    param = field_path(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}"
    else:
        given = f" (got {first['input']!r})" if "input" in first and param else ""
        message = f"{param or 'body'}: {first['msg']}{given}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 413: "request_too_large"}.get(exc.status_code)
        headers = dict(exc.headers) if exc.headers else None
        return error_response(APIError(exc.status_code, str(exc.detail), code=code, headers=headers))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error while handling a request", exc_info=exc)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    handlers: dict[type[Exception], Any] = {
        APIError: on_api_error,
        Exception: on_unexpected,
        RequestValidationError: on_validation,
        StarletteHTTPException: on_http,
    }
    for exc_type, handler in handlers.items():
        app.add_exception_handler(exc_type, handler)
