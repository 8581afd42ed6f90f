"""The two ways an operator command reaches the fleet, and which one it took: the running
server over HTTP with an operator key (`--operator-key` or MINIMILL_OPERATOR_KEY, at
`--server` or the base URL clients use), else the store itself (`--db`, else MINIMILL_HOME's).
Each command says on stderr which server or store it used, and a command that only reads
refuses a store that does not exist instead of creating an empty one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import typer

from minimill.cli_options import error_line, open_store_or_exit
from minimill.client_env import BASE_URL_VARS, DEFAULT_BASE_URL, OPERATOR_KEY_VAR, server_root

if TYPE_CHECKING:
    from minimill.control.store import Store

OperatorKeyOption = typer.Option(
    None, "--operator-key", envvar=OPERATOR_KEY_VAR, show_envvar=True,
    help="Ask the running server with this operator key (minimill keys create --operator) "
    "instead of opening the store.")
ServerOption = typer.Option(DEFAULT_BASE_URL, "--server", envvar=list(BASE_URL_VARS),
                            show_envvar=True, help="The server --operator-key is sent to.")
TIMEOUT_S = 30.0


def _say(text: str) -> None:
    typer.echo(text, err=True)


def call(server: str, key: str, method: str, path: str, **kwargs: Any) -> Any:
    """One operator request (`path` under the server's root, e.g. /v1/sites); its errors end
    the command with one line."""
    root = server_root(server)
    _say(f"server: {root}")
    try:
        resp = httpx.request(method, root + path, headers={"Authorization": f"Bearer {key}"},
                             timeout=TIMEOUT_S, **kwargs)
    except httpx.TransportError as exc:
        raise SystemExit(f"error: cannot reach {root} ({exc}); is `minimill serve` "
                         "running there?") from None
    if resp.status_code >= 400:
        # Operator routes answer a key that is not an operator's as an unknown URL.
        hint = ("; is the key an operator key?" if resp.status_code in (401, 404)
                else "")
        line = error_line(_message(resp), resp.status_code, None,
                          resp.headers.get("x-request-id"))
        raise SystemExit(f"error: {line}{hint}")
    return resp.json()


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def _sqlite_path(url: str) -> Path | None:
    prefix = "sqlite:///"
    return Path(url[len(prefix):]) if url.startswith(prefix) else None


def store_url(db: str | None) -> str:
    """The store a command would open: `db`, else the SQLite file under MINIMILL_HOME (its
    path only: nothing is created)."""
    if db:
        return db
    from minimill.control.store import minimill_home

    return f"sqlite:///{minimill_home() / 'data' / 'minimill.db'}"


@contextlib.contextmanager
def fleet_store(db: str | None, reading: bool) -> Iterator[Store]:
    """The store, said on stderr; when `reading`, an SQLite store that does not exist is an
    error (a read must not leave an empty store behind)."""
    url = store_url(db)
    path = _sqlite_path(url)
    if reading and path is not None and not path.exists():
        raise SystemExit(f"error: no store at {path} (MINIMILL_HOME is where `minimill serve` "
                         "keeps it); give --db URL or MINIMILL_HOME, or ask the running server "
                         "with --operator-key")
    from sqlalchemy import make_url

    _say(f"store: {make_url(url).render_as_string(hide_password=True)}")
    with open_store_or_exit(url) as store:
        yield store
