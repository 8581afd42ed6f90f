"""Errors a caller's request causes, shared by every layer that checks a request: the engine
(a bad sampling parameter, a prompt past the context) and the control plane (a malformed body,
an unknown object). The API turns each into an OpenAI error object with its HTTP status."""

from __future__ import annotations


class RequestError(Exception):
    """Base class: `message`, OpenAI `type`, optional `param` and `code`, and an HTTP status."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(RequestError, ValueError):
    """The request is malformed or asks for something unsupported (400): an empty prompt,
    max_tokens <= 0, a prompt longer than the context, a bad parameter."""
