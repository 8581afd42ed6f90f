"""A FIFO (and a device) read through the file API, and one tenant's 40 slow operations:
neither blocks a host thread for good or freezes the other boxes of the host."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from box_harness import BoxHostProc
from security_harness import assert_healthy

from minimill.client.boxes import BoxError, Boxes


def test_reading_a_fifo_is_refused_at_once(boxes: Boxes, box_host: BoxHostProc) -> None:
    box = boxes.create()
    assert box.exec("mkfifo pipe && ln -s /dev/zero zero").exit_code == 0
    for call in (lambda: box.read("pipe"), lambda: box.write("pipe", "x")):
        with pytest.raises(BoxError) as err:
            call()
        assert (err.value.status, err.value.code) == (400, "not_a_file"), err.value
    with pytest.raises(BoxError) as err:
        box.read("zero")
    assert err.value.code == "symlink"
    # Many of them at once: every one answers, none holds a thread.
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda _: _code_of(lambda: box.read("pipe")), range(48)))
    assert outcomes == ["not_a_file"] * 48
    assert_healthy(box)
    box.delete()


def _code_of(call: object) -> str | None:
    try:
        call()  # type: ignore[operator]
    except BoxError as exc:
        return exc.code
    return None


def test_one_boxs_slow_operations_leave_the_others_answering(
        boxes: Boxes, box_host: BoxHostProc) -> None:
    flooded, neighbour = boxes.create(), boxes.create()
    assert_healthy(flooded, neighbour)
    pool = concurrent.futures.ThreadPoolExecutor(40)
    try:
        command = "touch started-$(cat /proc/sys/kernel/random/uuid); sleep 600"
        slow = [pool.submit(flooded.exec, command, timeout_s=600) for _ in range(40)]
        # Wait until the flooded box runs as many as it may at once.
        deadline = time.monotonic() + 120
        workspace = box_host.box_dir / flooded.id
        while len(list(workspace.glob("started-*"))) < 4:
            assert time.monotonic() < deadline, "the flooded box never started its execs"
            time.sleep(0.2)
        # Its 40 execs run (or wait in its own queue) for ten minutes; its neighbour answers
        # meanwhile, and so does a new box.
        assert_healthy(neighbour, boxes.create())
        assert not any(f.done() for f in slow)
    finally:
        flooded.delete()  # its execs end with the box
        pool.shutdown(wait=True, cancel_futures=True)
    assert_healthy(neighbour)

