"""A box host process for tests: `minimill worker --engine none --boxes N` with its own site
token and workspace directory."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from api_harness import ApiEnv
from serve_process import Proc, minimill_cmd

from minimill.control.records import SiteScope
from minimill.control.sites import create_site


class BoxHostProc(Proc):
    """A box host site: its own token and its own workspace directory."""

    def __init__(self, env: ApiEnv, root: Path, slots: int = 4,
                 snapshot_interval_s: float = 30.0, agents: int = 0) -> None:
        self.site = f"boxhost-{uuid.uuid4().hex[:6]}"
        serves = {SiteScope.BOXES, SiteScope.AGENTS} if agents else {SiteScope.BOXES}
        self.token = create_site(env.store, self.site, 0.1, "cpu", serves=frozenset(serves))
        self.box_dir = root / self.site
        args = minimill_cmd("worker", "--server", env.base_url, "--site", self.site,
                            "--engine", "none", "--boxes", str(slots),
                            "--box-dir", str(self.box_dir),
                            "--box-snapshot-interval-s", str(snapshot_interval_s),
                            *(("--agents", str(agents)) if agents else ()))
        super().__init__(args, {**os.environ, "MINIMILL_SITE_TOKEN": self.token,
                                "MINIMILL_LOG_LEVEL": "INFO"},
                         root / f"{self.site}.log")

    def start_and_wait(self) -> BoxHostProc:
        self.start()
        self.wait_for_log("worker for site .* ready: no engine", timeout=60)
        return self
