"""Watch.changed: a waiter reads its row when woken, looks whether its client left between
wake-ups, and reads anyway once `reread_s` passed without one."""

from __future__ import annotations

import asyncio

import pytest

from minimill.api import progress
from minimill.api.progress import Watch


@pytest.fixture(autouse=True)
def quick_client_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "CLIENT_CHECK_S", 0.01)


async def _waits_for_its_wakeup() -> tuple[bool, bool]:
    watch = Watch("req_1")
    looks = 0
    looked_often = asyncio.Event()

    async def gone() -> bool:
        nonlocal looks
        looks += 1
        if looks >= 5:
            looked_often.set()
        return False

    waiter = asyncio.create_task(watch.changed(gone, reread_s=3600.0))
    await looked_often.wait()
    returned_unwoken = waiter.done()
    watch.event.set()
    return returned_unwoken, await waiter


def test_a_waiter_looks_at_its_client_but_returns_only_when_woken() -> None:
    returned_unwoken, changed = asyncio.run(_waits_for_its_wakeup())
    assert not returned_unwoken  # five looks at the client, no read of the row
    assert changed


async def _unwoken(client_left: bool, reread_s: float) -> bool:
    """What `changed` says of a watch nobody wakes."""
    async def gone() -> bool:
        return client_left

    return await Watch("req_1").changed(gone, reread_s=reread_s)


def test_a_waiter_whose_client_left_returns_false() -> None:
    assert asyncio.run(_unwoken(client_left=True, reread_s=3600.0)) is False


def test_a_waiter_never_woken_reads_its_row_after_reread_s() -> None:
    assert asyncio.run(_unwoken(client_left=False, reread_s=0.05)) is True
