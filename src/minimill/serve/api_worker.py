"""One more API process of `serve --workers K` (api_workers.py): the control plane's app
served by uvicorn on the listening socket serve passed down, on serve's store (MINIMILL_DB)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Any

import uvicorn

from minimill import event_loop
from minimill.lifetime import die_with_parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m " + __spec__.name)
    parser.add_argument("--fd", type=int, required=True, help="the listening socket's fd")
    parser.add_argument("--model", required=True)
    parser.add_argument("--webhook-allow-private", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s serve[{os.getpid()}] %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    die_with_parent()
    from minimill.api.app import create_app
    from minimill.api.settings import Settings

    chosen: dict[str, Any] = {"webhook_allow_private": True} if args.webhook_allow_private else {}
    settings = Settings(models=[args.model], **chosen)
    if not settings.db:
        parser.error("MINIMILL_DB names no store")
    app = create_app(settings)
    sock = socket.socket(fileno=args.fd)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=5))
    event_loop.run(server.serve(sockets=[sock]))


if __name__ == "__main__":
    main()
