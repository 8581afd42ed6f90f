"""Asynchronous front ends: callers on an asyncio loop submit requests and iterate their
TokenDeltas, never blocking the loop; the step loop runs elsewhere.

- `AsyncEngine`: the step loop in a thread of this process (tests, embedding).
- `ProcessEngine` (engine_process.py): the step loop in a child process, so that the
  caller's own Python work (HTTP, checkpoints, JSON) never competes with it for the GIL.

Both share `StreamFrontend` (frontend.py): per-request streams, results handed to each
stream's event loop with one `call_soon_threadsafe` per step and loop. A failure while
processing one request ends only that request (its iterator raises); the loop keeps serving
the others.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from typing import Any

from minimill.engine.config import EngineConfig
from minimill.engine.core import EngineCore
from minimill.engine.frontend import AddRequest, Outcome, StreamFrontend
from minimill.engine.loading import load_with_config
from minimill.engine.params import EngineDied, EngineError
from minimill.engine.step_loop import apply_command, step_into
from minimill.models.types import LoadedModel

_IDLE_WAIT_S = 0.5


class AsyncEngine(StreamFrontend):
    """The builtin engine with its step loop in a thread of this process."""

    def __init__(self, model: str | LoadedModel, **config_overrides: Any) -> None:
        loaded, config = load_with_config(model, config_overrides)
        self._core = EngineCore(loaded, config)
        self.config: EngineConfig = config
        super().__init__(loaded.tokenizer, self._core.limits)
        self._inbox: deque[AddRequest | str] = deque()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minimill-engine", daemon=True)
        self._thread.start()

    def _submit(self, command: AddRequest | str) -> None:
        self._inbox.append(command)
        self._wake.set()

    def close(self) -> None:
        """Stop the step loop; unfinished requests' streams raise EngineError."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.fail_streams(EngineError("the engine was closed"))

    def _run(self) -> None:
        core = self._core
        while not self._closed:
            with self._lock:
                commands, self._inbox = self._inbox, deque()
            out: dict[str, list[Outcome]] = defaultdict(list)
            for command in commands:
                apply_command(core, command, out)
            if not core.has_unfinished:
                self.deliver(out)
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                step_into(core, out)
            except EngineDied as exc:
                self.deliver(out)
                self.died(str(exc))
                break
            self._tok_s = core.recent_output_tok_s()
            self.step_counts = (core.num_steps, core.num_step_seqs)
            self.deliver(out)
        core.close()
