"""Typed domain errors; the API turns each into an OpenAI error object with its HTTP status.
Their base and the 400 are minimill/errors.py's, which the engine raises too."""

from __future__ import annotations

import math

from minimill.errors import InvalidRequestError as InvalidRequestError
from minimill.errors import RequestError as ControlError


class NotFoundError(ControlError):
    """No such object for this tenant (404); other tenants' objects are not found either."""

    status_code = 404


class ConflictError(ControlError):
    """The object is in a state that does not allow the operation (409)."""

    status_code = 409


class PayloadTooLargeError(ControlError):
    """An upload over the configured size limit (413)."""

    status_code = 413


class AuthenticationError(ControlError):
    """A missing or unknown API key or site token (401)."""

    status_code = 401


class PermissionDeniedError(ControlError):
    """A valid key of a role the route is not for (403): an operator key on a tenant route."""

    status_code = 403
    error_type = "permission_error"


class RequestTimeoutError(ControlError):
    """A realtime request that no worker finished before its deadline (504)."""

    status_code = 504
    error_type = "timeout"


class OverloadedError(ControlError):
    """The control plane cannot take the call now (503); the caller asks again after
    `retry_after_s` (its Retry-After header), with whatever it asked for unchanged."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, code="overloaded")
        self.headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
