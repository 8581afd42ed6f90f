"""The event loop of minimill's long-running processes (`serve`, `worker`).

uvloop where it is installed: its loop (and the httptools parser uvicorn picks beside it) spends
a fraction of the standard loop's CPU per call, and on a small machine every cycle the control
plane and the worker's bookkeeping spend is one the engine's threads lose. The standard loop
otherwise: behaviour is the same, only the cost differs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the fastest event loop available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
