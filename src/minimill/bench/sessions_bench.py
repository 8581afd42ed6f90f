"""`minimill bench sessions`: agent sessions through `serve` and the official openai client,
with prefix reuse and KV tiers on, then off, in the same run.

Each of N sessions runs T turns; every turn appends a few hundred tokens of "tool output" (a
slice of the shipped public-domain text) to its conversation and asks for a short answer
(greedy, `prompt_cache_key` = the session). All sessions run at once against a device KV pool
far smaller than their contexts, so blocks are evicted while a session waits for its next
turn. Figures, each run measured here:

- prefill_tokens_on / _off: prompt tokens the engine computed (prompt tokens less the
  `cached_tokens` the answers report), seconds_on / _off: wall time of all turns;
- restore_s_per_1k vs recompute_s_per_1k: the engine alone, in this process, before any
  serve: loading 1k tokens of KV back from flash (a fresh engine over the files, as after a
  restart) or from host RAM, against computing them;
- restart: the "on" configuration again, with serve (and its worker) stopped after turn
  `restart_after` and started afresh over the same flash directory: what turn
  restart_after + 1 finds cached came from flash.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from minimill.bench.stages import stage

TEXT = Path(__file__).parent / "data" / "kjv-genesis-exodus.txt"
TARGETS = {"prefill_ratio": 3.0, "speedup": 2.0}
SYSTEM = ("You are a research agent. You read tool output (passages of an old text), keep "
          "notes, and answer in one short sentence naming the next passage to look up. "
          "Never repeat the passage. Be terse.")


@dataclass(frozen=True, slots=True)
class SessionsBenchOptions:
    json_out: bool = False
    model: str = "smollm2-135m"
    dtype: str = "auto"
    sessions: int = 64
    turns: int = 8
    tool_tokens: int = 300  # about this many tokens of tool output per turn
    max_tokens: int = 16  # answer length per turn
    # The device pool; None: a quarter of what all sessions hold at their last turn (at
    # least three sessions' worth), so that it must evict.
    kv_cache_gb: float | None = None
    kv_host_gb: float = 0.5
    kv_flash_gb: float = 8.0
    restart_after: int = 4  # turns before the restart of the restart variant (0: skip it)
    probe_tokens: int = 1024  # prompt length of the restore vs recompute probe


@dataclass(slots=True)
class RunTotals:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    answers: dict[tuple[int, int], str] = field(default_factory=dict)  # (session, turn)
    cached_by_turn: dict[int, int] = field(default_factory=dict)
    prompt_by_turn: dict[int, int] = field(default_factory=dict)

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def _words() -> list[str]:
    return TEXT.read_text().split()


def tool_output(words: list[str], session: int, turn: int, num_tokens: int) -> str:
    """A deterministic passage of about `num_tokens` tokens for this session and turn."""
    n = max(1, num_tokens * 3 // 4)  # about 4/3 tokens a word in this text
    seed = hashlib.blake2b(f"{session}/{turn}".encode(), digest_size=8).digest()
    start = int.from_bytes(seed, "little") % max(1, len(words) - n)
    return " ".join(words[start:start + n])


class Conversations:
    """Every session's messages so far (the client's side of the conversation)."""

    def __init__(self, options: SessionsBenchOptions) -> None:
        self.options = options
        self.words = _words()
        self.messages = [[{"role": "system", "content": SYSTEM}]
                         for _ in range(options.sessions)]

    async def run_turns(self, client: Any, turns: range, totals: RunTotals) -> None:
        started = time.perf_counter()
        await asyncio.gather(*(self._session(client, s, turns, totals)
                               for s in range(self.options.sessions)))
        totals.seconds += time.perf_counter() - started

    async def _session(self, client: Any, session: int, turns: range,
                       totals: RunTotals) -> None:
        o = self.options
        messages = self.messages[session]
        for turn in turns:
            passage = tool_output(self.words, session, turn, o.tool_tokens)
            messages.append({"role": "user", "content": f"Tool output {turn + 1}:\n{passage}"})
            answer = await client.chat.completions.create(
                model=o.model, messages=messages, max_tokens=o.max_tokens, temperature=0,
                prompt_cache_key=f"session-{session}")
            text = answer.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            usage = answer.usage
            details = usage.prompt_tokens_details
            cached = int(details.cached_tokens or 0) if details is not None else 0
            totals.prompt_tokens += usage.prompt_tokens
            totals.cached_tokens += cached
            totals.completion_tokens += usage.completion_tokens
            totals.answers[(session, turn)] = text
            totals.cached_by_turn[turn] = totals.cached_by_turn.get(turn, 0) + cached
            totals.prompt_by_turn[turn] = totals.prompt_by_turn.get(turn, 0) + usage.prompt_tokens


def _serve_args(options: SessionsBenchOptions, tiers: bool, flash_dir: Path | None) -> list[str]:
    args = ["--kv-cache-gb", str(options.kv_cache_gb)]
    if not tiers:
        return [*args, "--no-prefix-caching"]
    args += ["--kv-host-gb", str(options.kv_host_gb)]
    if flash_dir is not None:
        args += ["--kv-flash-dir", str(flash_dir), "--kv-flash-gb", str(options.kv_flash_gb)]
    return args


def _start(options: SessionsBenchOptions, dtype: str, serve_args: list[str],
           home: Path) -> Any:
    from minimill.bench.local_fleet import LocalFleet

    fleet = LocalFleet(options.model, dtype, serve_args=tuple(serve_args), home=home)
    try:
        fleet.start()
    except BaseException:
        fleet.close()
        raise
    return fleet


async def _turns(fleet: Any, conversations: Conversations, turns: range,
                 totals: RunTotals) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=fleet.base_url, api_key=fleet.key, timeout=3600,
                         max_retries=0)
    try:
        await conversations.run_turns(client, turns, totals)
    finally:
        await client.close()


def _served_run(options: SessionsBenchOptions, dtype: str, tiers: bool, flash_dir: Path | None,
                restart_after: int = 0) -> RunTotals:
    """All sessions, all turns, against one serve (two, with a restart after a turn)."""
    conversations = Conversations(options)
    totals = RunTotals()
    splits = [range(0, options.turns)]
    if restart_after:
        splits = [range(0, restart_after), range(restart_after, options.turns)]
    # A restart keeps the home (the store: the same tenant, whose prefix-cache salt finds its
    # blocks on flash again), as restarting a real serve does.
    home = Path(tempfile.mkdtemp(prefix="minimill-bench-"))
    try:
        for part in splits:
            fleet = _start(options, dtype, _serve_args(options, tiers, flash_dir), home)
            try:
                asyncio.run(_turns(fleet, conversations, part, totals))
            finally:
                fleet.close()  # SIGTERM: the worker finishes its flash writes before it exits
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return totals


def _probe(options: SessionsBenchOptions, flash_dir: Path) -> dict[str, Any]:
    """Restore vs recompute of one prompt's KV, the engine alone in this process."""
    from minimill.engine.llm import LLM
    from minimill.engine.loading import load_with_config
    from minimill.engine.params import SamplingParams

    loaded, config = load_with_config(options.model, {"dtype": options.dtype}, auto_pull=True)
    ids = loaded.tokenizer.encode(" ".join(_words()[:options.probe_tokens]),
                                  add_special_tokens=False)[:options.probe_tokens]
    one = SamplingParams(max_tokens=1, temperature=0)
    # Room for two such prompts: a few others push the first one's blocks out.
    common = {"dtype": config.dtype, "num_kv_blocks": 2 * (len(ids) // 16 + 1) + 8,
              "max_model_len": len(ids) + 64, "max_num_batched_tokens": len(ids) + 64}
    tiers = {"kv_host_bytes": 1 << 30, "kv_flash_dir": str(flash_dir),
             "kv_flash_bytes": 4 << 30}
    cold = LLM(loaded, enable_prefix_caching=False, **common)
    cold.generate([ids[:64]], one)  # warm-up
    started = time.perf_counter()
    expected = cold.generate([ids], one)[0].output_token_ids
    recompute_s = time.perf_counter() - started
    del cold
    writer = LLM(loaded, **tiers, **common)
    writer.generate([ids], one)
    for shift in (1, 2, 3):  # other prompts push its blocks out of the pool, down the tiers
        writer.generate([[*ids[shift:], ids[0]]], one)
    assert writer.engine.tiers is not None
    host = writer.engine.tiers.stats
    before = (host.restore_s, host.restored_blocks)
    again = writer.generate([ids], one)[0]
    host_s = host.restore_s - before[0]
    host_tokens = (host.restored_blocks - before[1]) * config.block_size
    writer.close()
    del writer
    reader = LLM(loaded, **{**tiers, "kv_host_bytes": 0}, **common)  # as after a restart
    restored = reader.generate([ids], one)[0]
    assert reader.engine.tiers is not None
    flash = reader.engine.tiers.stats
    flash_tokens = flash.restored_blocks * config.block_size
    reader.close()
    del reader
    result = {
        "probe_tokens": len(ids),
        "recompute_s_per_1k": round(recompute_s / len(ids) * 1000, 5),
        "restore_s_per_1k": round(flash.restore_s / max(1, flash_tokens) * 1000, 5),
        "restore_host_s_per_1k": round(host_s / max(1, host_tokens) * 1000, 5),
        "restored_tokens_flash": flash_tokens, "restored_tokens_host": host_tokens,
        "restore_same_tokens": (again.output_token_ids == expected
                                and restored.output_token_ids == expected),
        "dtype": config.dtype,
        "kv_bytes_per_token": config.kv_bytes_per_token(loaded.config),
    }
    del loaded
    gc.collect()
    return result


def _pool_gb(options: SessionsBenchOptions, bytes_per_token: float) -> float:
    """A quarter of what all sessions hold at their last turn, at least three sessions."""
    longest = 96 + options.turns * (options.tool_tokens + options.max_tokens + 16)
    tokens = max(3 * longest, options.sessions * longest // 4)
    return round(tokens * bytes_per_token / (1 << 30), 4)


def run_sessions_bench(options: SessionsBenchOptions) -> None:
    from rich.console import Console

    from minimill.bench.local_fleet import BenchError
    from minimill.engine.params import EngineError
    from minimill.models.types import ModelError

    err = Console(stderr=True)
    try:
        report = _bench(options, err)
    except (BenchError, ModelError, EngineError, OSError, ValueError, TimeoutError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise SystemExit(1) from exc
    if options.json_out:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:>28}: {value}", file=sys.stdout)


def _bench(options: SessionsBenchOptions, err: Any) -> dict[str, Any]:
    from minimill.engine.hardware import cpu_report

    if options.sessions < 1 or options.turns < 1:
        raise ValueError("--sessions and --turns must be at least 1")
    if not 0 <= options.restart_after < options.turns:
        raise ValueError("--restart-after must be 0 (no restart run) or below --turns")

    root = Path(tempfile.mkdtemp(prefix="minimill-sessions-"))
    try:
        with stage(err, "restore vs recompute, engine alone ..."):
            probe = _probe(options, root / "probe-flash")
        dtype = probe.pop("dtype")
        if options.kv_cache_gb is None:
            options = replace(options, kv_cache_gb=_pool_gb(options, probe["kv_bytes_per_token"]))
        label = f"{options.sessions} sessions x {options.turns} turns"
        with stage(err, f"{label}, prefix reuse and KV tiers on ..."):
            on = _served_run(options, dtype, True, root / "flash-on")
        with stage(err, f"{label}, prefix reuse and KV tiers off ..."):
            off = _served_run(options, dtype, False, None)
        restart: dict[str, Any] | None = None
        if options.restart_after:
            with stage(err, f"{label}, restarting serve after turn {options.restart_after} ..."):
                again = _served_run(options, dtype, True, root / "flash-restart",
                                    options.restart_after)
            after = options.restart_after
            restart = {
                "restart_after_turn": after, "seconds": round(again.seconds, 3),
                "prefill_tokens": again.prefill_tokens,
                "cached_tokens_reported": again.cached_tokens,
                "turn_after_restart_prompt_tokens": again.prompt_by_turn.get(after, 0),
                "turn_after_restart_cached_tokens": again.cached_by_turn.get(after, 0),
                "prefill_ratio_vs_off": round(off.prefill_tokens
                                              / max(1, again.prefill_tokens), 3),
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    same = sum(on.answers[k] == off.answers.get(k) for k in on.answers)
    prefill_ratio = off.prefill_tokens / max(1, on.prefill_tokens)
    speedup = off.seconds / max(on.seconds, 1e-9)
    return {
        "model": options.model, "dtype": dtype,
        "cpu": cpu_report(),
        "sessions": options.sessions, "turns": options.turns,
        "tool_tokens": options.tool_tokens, "max_tokens": options.max_tokens,
        "kv_cache_gb": options.kv_cache_gb, "kv_host_gb": options.kv_host_gb,
        "kv_flash_gb": options.kv_flash_gb,
        "prompt_tokens": on.prompt_tokens,
        "prefill_tokens_on": on.prefill_tokens, "prefill_tokens_off": off.prefill_tokens,
        "prefill_ratio": round(prefill_ratio, 3),
        "seconds_on": round(on.seconds, 3), "seconds_off": round(off.seconds, 3),
        "speedup": round(speedup, 3),
        "cached_tokens_reported": on.cached_tokens,
        "cached_tokens_reported_off": off.cached_tokens,
        **probe,
        "answers_same_on_off": round(same / max(1, len(on.answers)), 4),
        "restart": restart,
        "targets": TARGETS,
        "meets_targets": (prefill_ratio >= TARGETS["prefill_ratio"]
                          and speedup >= TARGETS["speedup"]),
        "note": "prefill tokens = prompt tokens less the cached_tokens the answers report; "
                "seconds = wall time of all turns of all sessions as the client sees it "
                "(serve start-up excluded); restore_s_per_1k reads flash files in a fresh "
                "engine (as after a restart), restore_host_s_per_1k host RAM",
    }
