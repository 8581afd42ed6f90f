"""A real HTTP webhook receiver for tests: it checks every delivery's signature with the official
openai client (`client.webhooks.unwrap`, the Standard Webhooks scheme) and records it.

Several endpoints share one receiver, told apart by path, each with its own secret. With
`refuse_first`, the first delivery of each event id is answered 503, as a receiver that fails
after processing would, so the sender must deliver it again (at least once).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
from openai import OpenAI

_verifier = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


@dataclass(frozen=True)
class Delivery:
    path: str
    webhook_id: str
    headers: dict[str, str]
    body: bytes
    event_type: str
    data_id: str


def verify(body: bytes, headers: dict[str, str], secret: str) -> Any:
    """The event, if the signature is valid; raises openai.InvalidWebhookSignatureError."""
    return _verifier.webhooks.unwrap(body, headers, secret=secret)


class WebhookReceiver:
    def __init__(self, port: int, secrets: dict[str, str], refuse_first: bool = False) -> None:
        self.port = port
        self.secrets = secrets
        self.refuse_first = refuse_first
        self.deliveries: list[Delivery] = []
        self.bad_signatures: list[bytes] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> WebhookReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                self.send_response(receiver._receive(self.path, headers, body))
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def _receive(self, path: str, headers: dict[str, str], body: bytes) -> int:
        secret = self.secrets.get(path)
        if secret is None:
            return 404
        try:
            event = verify(body, headers, secret)
        except openai.InvalidWebhookSignatureError:
            with self._lock:
                self.bad_signatures.append(body)
            return 400
        with self._lock:
            first = not any(d.webhook_id == headers["webhook-id"] for d in self.deliveries
                            if d.path == path)
            self.deliveries.append(Delivery(path, headers["webhook-id"], headers, body,
                                            event.type, event.data.id))
        return 503 if self.refuse_first and first else 200

    def events(self, path: str) -> set[tuple[str, str]]:
        """(type, object id) of every event received at `path`, duplicates dropped."""
        with self._lock:
            return {(d.event_type, d.data_id) for d in self.deliveries if d.path == path}

    def by_id(self, path: str) -> dict[str, list[Delivery]]:
        with self._lock:
            out: dict[str, list[Delivery]] = {}
            for d in self.deliveries:
                if d.path == path:
                    out.setdefault(d.webhook_id, []).append(d)
            return out

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
