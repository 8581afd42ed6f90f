"""Every error the API returns is an OpenAI error object: {"error": {message, type, param, code}}.

Domain errors carry their own status; FastAPI's validation errors become 400
invalid_request_error naming the parameter; HTTP errors from routing (404, 405) keep their
status, except that an operator route answers 404 to a wrong method as to a caller who is not
an operator (a 405 would tell that the URL exists); anything unexpected is a 500 server_error
whose traceback goes to the log only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minimill.control.body_rules import describe_errors
from minimill.control.errors import ControlError, NotFoundError

log = logging.getLogger("minimill.api")

_TYPE_BY_STATUS = {401: "invalid_request_error", 403: "permission_error",
                   404: "invalid_request_error", 429: "rate_limit_error", 504: "timeout"}
UNKNOWN_URL = "Unknown URL or object."


def unknown_url() -> NotFoundError:
    """What a URL that does not exist answers; operator routes answer it to non-operators."""
    return NotFoundError(UNKNOWN_URL, code="unknown_url")


def error_response(status: int, message: str, *, type_: str | None = None,
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    if type_ is None:
        type_ = "server_error" if status >= 500 else _TYPE_BY_STATUS.get(
            status, "invalid_request_error")
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": type_, "param": param, "code": code}})


async def _control_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ControlError)
    return control_error_response(exc)


def control_error_response(exc: ControlError) -> JSONResponse:
    """A domain error's answer, whichever path raised it (a route, or lean_fleet.py)."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    if isinstance(getattr(exc, "headers", None), dict):  # a 429's x-ratelimit-*, retry-after
        headers = {**(headers or {}), **exc.headers}  # type: ignore[attr-defined]
    return error_response(exc.status_code, exc.message, type_=exc.error_type, param=exc.param,
                          code=exc.code, headers=headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    # A caller whose credential the route checks with its own store work (deps.SiteCall) is
    # answered 401 or 403 before a word about its body, as one checked by a dependency is.
    deferred_auth: Callable[[], object] | None = getattr(request.state, "deferred_auth", None)
    if deferred_auth is not None:
        try:
            await anyio.to_thread.run_sync(deferred_auth)
        except ControlError as refused:
            return await _control_error(request, refused)
    errors: list[Any] = list(exc.errors())
    if errors and errors[0].get("type") == "json_invalid":
        detail = (errors[0].get("ctx") or {}).get("error", "invalid JSON")
        return error_response(400, "We could not parse the JSON body of your request "
                              f"({detail}). Send a valid JSON object.")
    # loc[0] is where the value came from: body, query, path or header.
    message, param = describe_errors(errors, skip=1)
    # A check of the body as a whole (a validator's "param: ..." message) says what is wrong;
    # any other error at the body itself means it is not an object at all.
    if errors and tuple(errors[0].get("loc", ())) == ("body",) \
            and errors[0].get("type") != "value_error":
        message = ("The body must be a JSON object (Content-Type: application/json)"
                   if errors[0].get("type") != "missing" else "A request body is required.")
    return error_response(400, message, param=param)


def _operator_path(request: Request) -> bool:
    paths = getattr(request.app.state, "operator_paths", ())
    return any(p.match(request.url.path) for p in paths)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405 and _operator_path(request):
        return await _control_error(request, unknown_url())
    messages = {404: UNKNOWN_URL, 405: "Method not allowed for this URL."}
    detail = exc.detail if isinstance(exc.detail, str) else None
    if exc.status_code in messages and detail in (None, "Not Found", "Method Not Allowed"):
        detail = messages[exc.status_code]
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, detail or "HTTP error", code=code,
                          headers=getattr(exc, "headers", None))


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", exc_info=exc)
    return error_response(500, "The server had an error while processing your request.")


def install(app: FastAPI) -> None:
    app.add_exception_handler(ControlError, _control_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the error statuses a route may return."""
    return {s: {"description": "OpenAI error object",
                "content": {"application/json": {"schema": ERROR_SCHEMA}}} for s in statuses}
