"""`serve` and `worker` run on uvloop (a project dependency on Linux); a coroutine's result and
its exceptions come back as from asyncio.run."""

from __future__ import annotations

import asyncio

import pytest

from minimill import event_loop


def test_runs_a_coroutine_on_uvloop() -> None:
    async def loop_module() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(loop_module()).startswith("uvloop")


def test_an_exception_comes_back_as_raised() -> None:
    async def fails() -> None:
        raise ValueError("from the coroutine")

    with pytest.raises(ValueError, match="from the coroutine"):
        event_loop.run(fails())
