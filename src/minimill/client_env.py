"""Where a client finds the server, one rule for every client command and SDK: the base URL
from MINIMILL_BASE_URL, else OPENAI_BASE_URL (what `minimill serve` prints both of), else
the local default; the key from MINIMILL_API_KEY, else OPENAI_API_KEY. Operator commands that
act on a running fleet take an operator key from MINIMILL_OPERATOR_KEY."""

from __future__ import annotations

import os

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
BASE_URL_VARS = ("MINIMILL_BASE_URL", "OPENAI_BASE_URL")
API_KEY_VARS = ("MINIMILL_API_KEY", "OPENAI_API_KEY")
OPERATOR_KEY_VAR = "MINIMILL_OPERATOR_KEY"


def _first(names: tuple[str, ...]) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def base_url() -> str:
    """The API's base URL (ending in /v1) from the environment."""
    return _first(BASE_URL_VARS) or DEFAULT_BASE_URL


def api_key() -> str:
    """The tenant's API key from the environment ("" when none is set)."""
    return _first(API_KEY_VARS) or ""


def server_root(url: str) -> str:
    """The server's root for operator routes, from a base URL with or without /v1."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")
