"""A big CPU step split across cores: each core runs the whole model for its own sequences.

Sequences are independent within a step (each reads and writes only its own KV blocks), so a
step's batch can be cut into groups, one per core, each run start to finish on one thread with
single-threaded kernels. Compared with every kernel spread over all cores:
- no barrier after each of the ~250 kernels of a step, and no thread spinning while Python
  prepares the next call;
- phases overlap: while one core streams KV through attention (bound by memory bandwidth),
  the other is in a GEMM (bound by its FMA units), instead of both waiting on memory together.
The price is that every core reads every weight once per step: worth it only when a group's
rows make the GEMMs compute-bound, hence `MIN_ROWS_PER_GROUP`.

Results do not depend on the split: oneDNN's GEMMs and minimill's kernels give the same
numbers on one thread or many (tests/engine/test_core_split.py holds it), so a request
computes the same tokens whichever group it lands in.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# Below this many rows per core, reading every weight once per core costs more than the
# barriers saved: at ~30 rows a 135M model's GEMMs stop being bound by memory on a 2-core VM.
MIN_ROWS_PER_GROUP = 32
# A split is used only if its busiest group has at most this share over an even split of the
# step's cost (one long prompt chunk cannot be shared, and would leave the other cores idle).
MAX_IMBALANCE = 1.25


def plan_groups(costs: Sequence[float], rows: Sequence[int], num_groups: int
                ) -> list[list[int]] | None:
    """Indices of the step's sequences per group (each in step order), or None when the step
    is better run whole: too few rows per group, or no split balanced within MAX_IMBALANCE.

    Longest-processing-time first: the costliest sequence goes to the least loaded group."""
    if num_groups < 2 or len(costs) < num_groups:
        return None
    if sum(rows) < num_groups * MIN_ROWS_PER_GROUP:
        return None
    loads = [0.0] * num_groups
    group_rows = [0] * num_groups
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        g = min(range(num_groups), key=loads.__getitem__)
        loads[g] += costs[i]
        group_rows[g] += rows[i]
        members[g].append(i)
    total = sum(loads)
    if total <= 0 or max(loads) > MAX_IMBALANCE * total / num_groups:
        return None
    if min(group_rows) < MIN_ROWS_PER_GROUP:
        return None
    return [sorted(m) for m in members]


class CoreWorkers:
    """One thread per CPU, each pinned to its CPU (when asked) with one intra-op thread."""

    def __init__(self, cpus: Sequence[int], pin: bool,
                 init_thread: Callable[[], None] = lambda: None) -> None:
        """`init_thread` runs first on each worker: a kernel library's first parallel call on
        a thread sets that thread's count to the process default, so each library must make
        that call before the worker sets its count to one."""
        self.cpus = list(cpus)
        threads = torch.get_num_threads()  # this thread's count, before any worker sets its own
        self._inboxes: list[queue.SimpleQueue[Any]] = []
        ready = threading.Barrier(len(self.cpus) + 1)
        for cpu in self.cpus:
            inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
            self._inboxes.append(inbox)
            threading.Thread(target=self._serve, args=(inbox, cpu if pin else None, ready,
                                                       init_thread),
                             name=f"minimill-core-{cpu}", daemon=True).start()
        ready.wait()
        # torch.set_num_threads in a worker also set the default for threads started later;
        # put back what the rest of the process runs with (each thread keeps its own count).
        torch.set_num_threads(threads)

    @staticmethod
    def _serve(inbox: queue.SimpleQueue[Any], cpu: int | None, ready: threading.Barrier,
               init_thread: Callable[[], None]) -> None:
        if cpu is not None and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, {cpu})  # 0: this thread
            except OSError:
                pass
        # A thread takes the process default on its first parallel call (once per library
        # that parallelises: torch's, then minimill's kernels), so those come before setting
        # this thread's own count.
        torch.get_num_threads()
        init_thread()
        torch.set_num_threads(1)
        ready.wait()
        while True:
            fn, report = inbox.get()
            try:
                with torch.inference_mode():
                    result = fn()
            except BaseException as exc:  # handed to the caller, which re-raises it
                report(False, exc)
            else:
                report(True, result)
            # An idle core holds nothing of its last job. These threads outlive every engine
            # of the process, and a step's closure holds its engine's runner: an engine
            # dropped after its last split step kept its weights and KV pool alive (a
            # float32 mixture of experts' 10.6 GiB, beside the copy a baseline loaded next).
            fn = report = result = None

    def map(self, fns: Sequence[Callable[[], T]]) -> list[T]:
        """Run fns[i] on core i (at most one per core), all at once; their results in order.
        The first exception any of them raised is raised here, after all have finished."""
        assert len(fns) <= len(self._inboxes)
        done = threading.Semaphore(0)
        slots: list[list[tuple[bool, Any]]] = [[] for _ in fns]
        for fn, inbox, slot in zip(fns, self._inboxes, slots, strict=False):
            def report(ok: bool, value: Any, slot: list[tuple[bool, Any]] = slot) -> None:
                slot.append((ok, value))
                done.release()
            inbox.put((fn, report))
        for _ in fns:
            done.acquire()
        results: list[T] = []
        for slot in slots:
            ok, value = slot[0]
            if not ok:
                raise value
            results.append(value)
        return results


    def submit(self, core: int, fn: Callable[[], Any],
               report: Callable[[bool, Any], None]) -> None:
        """Run fn on core `core` and return at once; the core calls report(True, result), or
        report(False, exception), when it is done (engine lanes: core.py)."""
        self._inboxes[core].put((fn, report))


_workers: dict[tuple[tuple[int, ...], bool], CoreWorkers] = {}
_workers_lock = threading.Lock()


def core_workers(cpus: Sequence[int], pin: bool,
                 init_thread: Callable[[], None] = lambda: None) -> CoreWorkers:
    """The process's workers for these CPUs (cores are a per-process resource, like the
    intra-op thread pool, so every engine in the process shares them)."""
    key = (tuple(cpus), pin)
    with _workers_lock:
        if key not in _workers:
            _workers[key] = CoreWorkers(cpus, pin, init_thread)
        return _workers[key]
