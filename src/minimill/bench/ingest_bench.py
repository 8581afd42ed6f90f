"""`minimill bench ingest`: a 50,000-line, ~200 MB batch through a control plane process, whose
memory and heartbeat service are measured in the same run.

A `serve --no-local-worker` process is the control plane (SQLite under a temporary home). A
worker-protocol client in its own process holds a realtime lease for the whole run and
heartbeats it every HEARTBEAT_INTERVAL_S with a one-token checkpoint, recording the gap between
consecutive answered heartbeats; another thread of it leases the batch's lines and completes
them with ~1 KB answers. Meanwhile this process uploads the file, creates the batch, waits for
ingest and then for the output file, and downloads it, while sampling the control plane's RSS.
It prints the peak RSS over the idle RSS measured before the upload (target: at most
TARGET_PEAK_OVER_IDLE_MB), both of the control plane's whole process tree (it ingests and
finalizes in a worker process), and the longest heartbeat gap beside the interval (target: at
most twice the interval), also per phase of the run.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx

from minimill.bench.batch_wait import wait_for_batch
from minimill.bench.proc_tree import process_tree

NUM_LINES = 50_000
LINE_BYTES = 4_000  # ~200 MB in all, under the default 200 MiB file limit
MODEL = "smollm2-135m"
HEARTBEAT_INTERVAL_S = 0.5
ANSWER_CHARS = 1_000
TARGET_PEAK_OVER_IDLE_MB = 300.0
TARGET_GAP_FACTOR = 2.0
RSS_SAMPLE_S = 0.02
_WORDS = ("token factory mill site lease epoch checkpoint batch ingest stream heartbeat "
          "worker chip price queue deadline tenant file output error line model").split()


def write_batch_file(path: Path, num_lines: int = NUM_LINES,
                     line_bytes: int = LINE_BYTES) -> int:
    """A batch input file of `num_lines` chat lines of about `line_bytes` each; its size."""
    rng = random.Random(7)
    with path.open("w") as f:
        for i in range(num_lines):
            head = json.dumps({"custom_id": f"ing-{i:05d}", "method": "POST",
                               "url": "/v1/chat/completions",
                               "body": {"model": MODEL, "max_tokens": 16, "messages": [
                                   {"role": "user", "content": ""}]}})
            words: list[str] = []
            room = line_bytes - len(head) - 1
            while room > 0:
                word = rng.choice(_WORDS)
                words.append(word)
                room -= len(word) + 1
            f.write(head.replace('"content": ""', f'"content": "{" ".join(words)}"') + "\n")
    return path.stat().st_size


def _rss_kb(pid: int, field: str = "VmRSS", members: list[int] | None = None) -> int:
    """`field` of /proc/PID/status summed over the process and its descendants (for VmHWM,
    the sum of each one's own peak: at least the tree's peak)."""
    total = 0
    for member in members if members is not None else process_tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
    if not total:
        raise RuntimeError(f"no {field} for process {pid}")
    return total


class RssSampler:
    """Samples a process tree's RSS every RSS_SAMPLE_S; `peak_kb` since start."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kb = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        members, listed_at = process_tree(self.pid), time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - listed_at > 1.0:  # listing /proc is the costly part
                members, listed_at = process_tree(self.pid), time.monotonic()
            with contextlib.suppress(OSError, RuntimeError):
                self.peak_kb = max(self.peak_kb, _rss_kb(self.pid, members=members))
            time.sleep(RSS_SAMPLE_S)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---- the worker-protocol client (runs in a process of its own) ---------------------------------
@dataclass
class _ClientStats:
    beats: int = 0
    completed: int = 0
    errors: int = 0
    # (when answered, Unix seconds; seconds since the previous answer)
    gaps: list[tuple[float, float]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


def _client_main(server: str, token: str, interval_s: float, stop: EventType,
                 ready: EventType, out: Any) -> None:
    """Hold one realtime lease and heartbeat it; lease and complete every batch line."""
    fleet = f"{server}/v1/fleet"
    headers = {"Authorization": f"Bearer {token}"}
    held: dict[str, Any] = {}
    stats = _ClientStats()
    lock = threading.Lock()

    def work() -> None:
        with httpx.Client(base_url=fleet, headers=headers, timeout=120) as http:
            answer = "ok " * (ANSWER_CHARS // 3)
            while not stop.is_set():
                try:
                    leases = http.post("/lease", json={"capacity": 256, "models": [MODEL]}
                                       ).json()["leases"]
                except (httpx.HTTPError, ValueError, KeyError):
                    stats.errors += 1
                    time.sleep(0.2)
                    continue
                results = []
                for lease in leases:
                    if lease["body"]["messages"][0]["content"] == "hold":
                        with lock:
                            held[lease["request_id"]] = {"epoch": lease["epoch"], "tokens": 0}
                        ready.set()
                        continue
                    results.append({"request_id": lease["request_id"], "epoch": lease["epoch"],
                                    "outcome": "succeeded", "choices": [
                                        {"index": 0, "text": answer, "finish_reason": "stop"}]})
                for start in range(0, len(results), 128):
                    with contextlib.suppress(httpx.HTTPError):
                        done = http.post("/complete", json={"results": results[start:start + 128]})
                        stats.completed += len(done.json()["accepted"])
                if not leases:
                    time.sleep(0.2)
            with lock:
                final = [{"request_id": rid, "epoch": h["epoch"], "outcome": "succeeded",
                          "choices": [{"index": 0, "text": "done", "finish_reason": "stop"}]}
                         for rid, h in held.items()]
            if final:
                http.post("/complete", json={"results": final})

    def beat() -> None:
        with httpx.Client(base_url=fleet, headers=headers, timeout=120) as http:
            last_answer: float | None = None
            while not stop.is_set():
                started = time.monotonic()
                with lock:
                    items = [{"request_id": rid, "epoch": h["epoch"], "delta": {"choices": [
                        {"index": 0, "base_tokens": h["tokens"], "base_chars": h["tokens"],
                         "token_ids": [1], "text": "x"}]}} for rid, h in held.items()]
                try:
                    answer = http.post("/heartbeat", json={"leases": items}).json()
                except (httpx.HTTPError, ValueError):
                    stats.errors += 1
                    answer = {}
                now = time.monotonic()
                with lock:
                    for rid in answer.get("extended", {}):
                        if rid in held and rid not in answer.get("resync", []):
                            held[rid]["tokens"] += 1
                stats.latencies.append(now - started)
                if last_answer is not None and ready.is_set():
                    stats.gaps.append((time.time(), now - last_answer))
                last_answer = now
                stats.beats += 1
                time.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    threads = [threading.Thread(target=f, daemon=True) for f in (work, beat)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put({"beats": stats.beats, "completed": stats.completed, "errors": stats.errors,
             "gaps": stats.gaps,
             "longest_latency_s": max(stats.latencies, default=0.0)})


# ---- the driver ------------------------------------------------------------------------------
def _start_control_plane(home: Path) -> tuple[Any, str, str, int]:
    from minimill.bench.local_fleet import LocalProcess, free_port

    port = free_port()
    env = {**os.environ, "MINIMILL_HOME": str(home), "MINIMILL_LOG_LEVEL": "WARNING"}
    proc = LocalProcess([sys.executable, "-m", "minimill.cli", "serve", "--port", str(port),
                         "--no-local-worker", "--model", MODEL], env, home / "serve.log")
    proc.start()
    server = f"http://127.0.0.1:{port}"
    key = proc.wait_for_serve(server, timeout=120)
    if proc.popen is None:
        raise RuntimeError("the control plane did not start")
    return proc, server, key, proc.popen.pid


def _warm_up(client: Any, tmp: Path) -> None:
    """One tiny batch end to end, so that idle RSS counts every module the run uses."""
    path = tmp / "warm.jsonl"
    write_batch_file(path, num_lines=3, line_bytes=300)
    batch = client.batches.create(input_file_id=client.files.create(
        file=path.open("rb"), purpose="batch").id, endpoint="/v1/chat/completions",
        completion_window="24h")
    wait_for_batch(client, batch.id, lambda b: b.status == "completed", 120)


def run(tmp: Path, interval_s: float = HEARTBEAT_INTERVAL_S,
        num_lines: int = NUM_LINES) -> dict[str, Any]:
    from openai import OpenAI

    path = tmp / "batch.jsonl"
    file_bytes = write_batch_file(path, num_lines)
    home = tmp / "home"
    home.mkdir()
    proc, server, key, pid = _start_control_plane(home)
    ctx = multiprocessing.get_context("spawn")
    stop, ready, out = ctx.Event(), ctx.Event(), ctx.Queue()
    token = _site_token(home)
    worker = ctx.Process(target=_client_main, args=(server, token, interval_s, stop, ready, out),
                         daemon=True)
    client = OpenAI(base_url=server + "/v1", api_key=key, timeout=3600, max_retries=0)
    def hold() -> None:
        """The realtime request the client holds (and heartbeats) for the whole run."""
        with contextlib.suppress(Exception):  # it may end with the control plane
            client.chat.completions.create(model=MODEL,
                                           messages=[{"role": "user", "content": "hold"}])

    holder = threading.Thread(target=hold, daemon=True)
    try:
        worker.start()
        _warm_up(client, tmp)
        holder.start()
        if not ready.wait(60):
            raise TimeoutError("the heartbeating client got no realtime lease")
        idle_kb = 0
        for _ in range(20):  # a second of samples with the lease held and heartbeated
            idle_kb = max(idle_kb, _rss_kb(pid))
            time.sleep(0.05)
        phases: dict[str, float] = {}
        marks: list[tuple[str, float]] = []  # (phase, when it began)
        with RssSampler(pid) as sampler:
            marks.append(("upload", time.time()))
            started = time.perf_counter()
            uploaded = client.files.create(file=path.open("rb"), purpose="batch")
            phases["upload_s"] = time.perf_counter() - started
            marks.append(("ingest", time.time()))
            started = time.perf_counter()
            batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                          endpoint="/v1/chat/completions")
            queued = wait_for_batch(client, batch.id, lambda b: b.status != "validating", 3600)
            phases["ingest_s"] = time.perf_counter() - started
            if queued.status == "failed":
                raise RuntimeError(f"the batch failed validation: {queued.errors}")
            ingest_peak_kb = sampler.peak_kb
            marks.append(("serve_and_finalize", time.time()))
            started = time.perf_counter()
            done = wait_for_batch(client, batch.id, lambda b: b.status in (
                "completed", "failed", "expired", "cancelled"), 3600)
            phases["serve_and_finalize_s"] = time.perf_counter() - started
            marks.append(("download", time.time()))
            started = time.perf_counter()
            output_bytes = output_lines = 0
            with client.files.with_streaming_response.content(done.output_file_id) as resp:
                for part in resp.iter_bytes():
                    output_bytes += len(part)
                    output_lines += part.count(b"\n")
            phases["download_s"] = time.perf_counter() - started
            marks.append(("after", time.time()))
            peak_kb = max(sampler.peak_kb, _rss_kb(pid, "VmHWM"))
        stop.set()
        client_stats = out.get(timeout=120)
        worker.join(timeout=60)
    finally:
        stop.set()
        if worker.is_alive():
            worker.terminate()
        proc.stop()
    over_idle_mb = (peak_kb - idle_kb) / 1024
    gap_target = TARGET_GAP_FACTOR * interval_s
    by_phase = _longest_gaps(client_stats["gaps"], marks)
    longest_gap = max(by_phase.values(), default=0.0)
    return {
        "lines": num_lines, "file_bytes": file_bytes, "output_lines": output_lines,
        "output_bytes": output_bytes, "batch_status": done.status,
        **{k: round(v, 2) for k, v in phases.items()},
        "ingest_lines_s": round(num_lines / phases["ingest_s"], 1),
        "idle_rss_mb": round(idle_kb / 1024, 1),
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "ingest_peak_rss_mb": round(ingest_peak_kb / 1024, 1),
        "peak_over_idle_mb": round(over_idle_mb, 1),
        "peak_over_idle_target_mb": TARGET_PEAK_OVER_IDLE_MB,
        "heartbeat_interval_s": interval_s,
        "longest_heartbeat_gap_s": round(longest_gap, 3),
        "longest_heartbeat_gap_target_s": gap_target,
        "longest_heartbeat_gap_by_phase_s": {k: round(v, 3) for k, v in by_phase.items()},
        "longest_heartbeat_latency_s": round(client_stats["longest_latency_s"], 3),
        "heartbeats": client_stats["beats"], "client_errors": client_stats["errors"],
        "meets_targets": (over_idle_mb <= TARGET_PEAK_OVER_IDLE_MB
                          and longest_gap <= gap_target
                          and done.status == "completed" and output_lines == num_lines),
        "note": "RSS of the control plane's process tree; peak is the highest sampled sum, or "
                "the sum of each process's own peak if higher, from upload to download; gaps "
                "are between answered heartbeats of a held lease",
    }


def _longest_gaps(gaps: list[tuple[float, float]],
                  marks: list[tuple[str, float]]) -> dict[str, float]:
    """The longest heartbeat gap that overlapped each phase (before the first: "idle"). A gap
    counts for every phase it overlaps: a phase shorter than the heartbeat interval (a small
    batch's ingest) still gets the gap it happened in."""
    bounds = [("idle", float("-inf")), *marks]
    out: dict[str, float] = {}
    for at, gap in gaps:
        start = at - gap
        for i, (name, began) in enumerate(bounds):
            ended = bounds[i + 1][1] if i + 1 < len(bounds) else float("inf")
            if start < ended and at >= began:
                out[name] = max(out.get(name, 0.0), gap)
    return out


def _site_token(home: Path) -> str:
    from minimill.control.sites import create_site
    from minimill.control.store import open_store

    store = open_store(f"sqlite:///{home / 'data' / 'minimill.db'}")
    try:
        return create_site(store, "bench-client", 0.1, "cpu", replace=True)
    finally:
        store.close()


def run_ingest_bench(interval_s: float = HEARTBEAT_INTERVAL_S,
                     num_lines: int = NUM_LINES) -> dict[str, Any]:
    """The report of one run, in a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="minimill-ingest-") as tmp:
        return run(Path(tmp), interval_s, num_lines)
