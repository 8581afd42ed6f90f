"""What the engine asks of the machine: huge pages for its large tensors, and freed memory
kept for the next step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# A fresh interpreter: torch reads its switch once, at the process's first large tensor.
PROBE = """
import json, os
import minimill.engine
import torch
t = torch.ones(64 << 20, dtype=torch.uint8)
huge_kb = 0
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("AnonHugePages:"):
        huge_kb = int(line.split()[1])
print(json.dumps({"switch": os.environ.get("THP_MEM_ALLOC_ENABLE"), "huge_kb": huge_kb}))
"""


def probe(env_extra: dict[str, str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env_extra
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_engine_asks_for_huge_pages_where_the_kernel_gives_them() -> None:
    mode = THP_MODE.read_text() if THP_MODE.exists() else "[never]"
    on_request = "[always]" in mode or "[madvise]" in mode
    report = probe({})
    assert report["switch"] == ("1" if on_request else None)
    if on_request:
        assert int(report["huge_kb"]) >= 2048  # the 64 MiB tensor got huge pages
    if "[madvise]" in mode:
        # Without the switch a tensor gets no huge page in madvise mode, so any here are ours.
        assert probe({"THP_MEM_ALLOC_ENABLE": "0"})["huge_kb"] == 0


def test_an_explicit_choice_is_kept() -> None:
    assert probe({"THP_MEM_ALLOC_ENABLE": "0"})["switch"] == "0"


# Allocates 200 blocks of 1 MiB through the C library, touches and frees them all, and prints
# how much of it the process still holds.
KEEP_PROBE = """
import ctypes, sys
from minimill.engine.memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = rss_mb()
blocks = [libc.malloc(1 << 20) for _ in range(200)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
for b in blocks:
    libc.free(b)
print(kept, round(rss_mb() - before))
"""


def test_freed_memory_is_kept_for_the_next_step() -> None:
    def run(mode: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", KEEP_PROBE, mode], capture_output=True,
                             text=True, check=True, timeout=60)
        return out.stdout.split()

    kept, held_mb = run("keep")
    assert kept == "True"  # glibc, as on every Linux machine this project runs on
    assert int(held_mb) >= 150  # freed, still mapped: the next allocation faults nothing in
    default_kept, default_held_mb = run("default")
    assert default_kept == "None" and int(default_held_mb) < 50  # glibc hands it back
