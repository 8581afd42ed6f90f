"""A fork bomb and a memory bomb in one box while a neighbour box on the same host runs an
exec: the bombs end at the box's limits (its processes, its memory; its own host uid, so
its processes count against nobody else's limit) and the neighbour's exec runs and
answers."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess

from box_harness import BoxHostProc
from security_harness import assert_healthy

from minimill.boxes.uids import BOX_UID_FIRST
from minimill.client.boxes import Boxes

FORK_BOMB = ("import os, time\nn = 0\ntry:\n    while n < 100000:\n"
             "        if os.fork() == 0:\n            time.sleep(20); os._exit(0)\n"
             "        n += 1\nexcept OSError as e:\n    print('stopped at', n, e.errno)\n")
# Every process it may have, each taking memory until it may take no more.
MEMORY_BOMB = ("import os\nfor _ in range(7):\n    if os.fork() == 0:\n        break\n"
               "hoard = []\ntry:\n    while True:\n        hoard.append(bytearray(8 << 20))\n"
               "except MemoryError:\n    print('held', len(hoard) * 8, 'MiB')\n")
NEIGHBOUR = ("i=0; while [ $i -lt 200 ]; do i=$((i+1)); echo line $i > f; done; "
             "python3 -c 'print(sum(range(10**6)))'; cat f")


def test_bombs_beside_a_healthy_neighbour(boxes: Boxes, box_host: BoxHostProc) -> None:
    bomb_box = boxes.create(limits={"max_processes": 8, "memory_mb": 96, "timeout_s": 60})
    neighbour = boxes.create(limits={"max_processes": 8})
    assert_healthy(bomb_box, neighbour)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        forks = pool.submit(bomb_box.exec, ["python3", "-c", FORK_BOMB], timeout_s=30)
        memory = pool.submit(bomb_box.exec, ["python3", "-c", MEMORY_BOMB], timeout_s=30)
        beside = pool.submit(neighbour.exec, NEIGHBOUR, timeout_s=60)
        done = beside.result(timeout=300)
        fork_result, memory_result = forks.result(timeout=300), memory.result(timeout=300)
    # The neighbour ran whole, with a limit of 8 processes of its own while the bomb held
    # all of its 8.
    assert (done.exit_code, done.stdout) == (0, "499999500000\nline 200\n"), done
    assert fork_result.stdout.startswith("stopped at"), fork_result
    assert int(fork_result.stdout.split()[2]) < 8
    assert "held" in memory_result.stdout or memory_result.exit_code != 0, memory_result
    held = [int(line.split()[1]) for line in memory_result.stdout.splitlines()
            if line.startswith("held")]
    assert all(mib <= 96 for mib in held), held
    assert_healthy(neighbour, bomb_box)
    assert _stray_processes() == 0
    bomb_box.delete()
    neighbour.delete()


def _stray_processes() -> int:
    """Bomb processes left on the host under any box's uid."""
    if os.geteuid() != 0:
        return 0
    out = subprocess.run(["ps", "-e", "-o", "uid=,args="], capture_output=True,
                         text=True).stdout
    return sum(1 for line in out.splitlines()
               if int(line.split()[0]) >= BOX_UID_FIRST
               and ("os.fork()" in line or "hoard" in line))
