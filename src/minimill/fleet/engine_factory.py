"""`minimill worker --engine NAME` to an engine adapter: the builtin engine, an OpenAI-compatible
server, or the fake test double. The adapters import their interface (engines.py); this module,
which imports them, stands beside it."""

from __future__ import annotations

from typing import Any

from minimill.fleet.engines import EngineAdapter, EngineStartError
from minimill.fleet.startup import StartClock


async def open_engine(engine: str, *, model: str, dtype: str, capacity: int,
                      clock: StartClock | None = None,
                      engine_options: dict[str, Any] | None = None) -> EngineAdapter:
    """'builtin' loads `model` into the builtin engine (with `engine_options`, EngineConfig
    fields); an http(s) URL uses that server; 'fake' or 'fake:RATE' is a test double that
    loads nothing and makes up tokens (fake_engine.py)."""
    if engine == "builtin":
        from minimill.fleet.builtin_engine import BuiltinEngineAdapter

        return await BuiltinEngineAdapter.start(model=model, dtype=dtype, clock=clock,
                                                options=engine_options)
    if engine.startswith(("http://", "https://")):
        from minimill.fleet.http_engine import HttpEngineAdapter

        return await HttpEngineAdapter.start(engine, model=model, capacity=capacity)
    if engine == "fake" or engine.startswith("fake:"):
        from minimill.fleet.fake_engine import FakeEngineAdapter

        return FakeEngineAdapter.start(engine, model=model, capacity=capacity)
    raise EngineStartError(
        f"--engine must be 'builtin', an OpenAI-compatible base URL, 'none' or 'fake:RATE', "
        f"got {engine!r}")
