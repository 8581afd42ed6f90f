"""The `ctx` of a harness, and the journal behind it.

Every effect has a key naming its place in the run: the context's prefix (the root's is "",
subagent i of the m-th `map` of a context is "<prefix>m<m>.<i>/") plus the effect's kind and
its count in that context. A harness that awaits its effects in order (concurrency only
through `ctx.map`) gives every effect the same key on every run, so a runner that takes the
agent over answers the effects already journaled from the journal and runs only the rest.
An effect is journaled before its result is used: what a harness saw, a replay sees.

A run that is handed back (its runner stops) starts no new effect: the harness parks at its
next one, and the effects already in flight run to their journal append (`Run.in_flight`
counts them). The runner then cancels the parked run and releases the agent; the next runner
replays the journal and performs that parked effect for the first time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
DEFAULT_MAX_TOKENS = 256
STDERR_TAIL_CHARS = 500
# The journal kind of ctx.box.keep() (control/agents.py reads it when the agent ends).
KEEP_BOX_EFFECT = "keep_box"


class Answer(str):
    """What ctx.chat returns: the message's text (a str, as before tools), with the tool calls
    it made (OpenAI's chat `tool_calls`: id, type, function {name, arguments}) and why it
    stopped ("stop", "length" or "tool_calls")."""

    tool_calls: list[dict[str, Any]]
    finish_reason: str | None

    def __new__(cls, text: str, tool_calls: list[dict[str, Any]] | None = None,
                finish_reason: str | None = None) -> Answer:
        answer = super().__new__(cls, text)
        answer.tool_calls = list(tool_calls or [])
        answer.finish_reason = finish_reason
        return answer


class BudgetExceeded(RuntimeError):
    """The agent spent its token budget; ctx.chat refuses further calls."""


class EffectFailed(RuntimeError):
    """The API answered an effect with an error (shown to the harness as this exception)."""


class ExecFailed(RuntimeError):
    """`ctx.box.exec` ran a command that failed (non-zero exit, or a limit it hit); the
    message ends with the tail of its stderr."""

    def __init__(self, command: str | list[str], result: dict[str, Any]) -> None:
        self.exit_code = result.get("exit_code")
        self.stdout = str(result.get("stdout") or "")
        self.stderr = str(result.get("stderr") or "")
        shown = command if isinstance(command, str) else " ".join(command)
        why = f": {result['error']}" if result.get("error") else ""
        tail = self.stderr.strip()[-STDERR_TAIL_CHARS:]
        super().__init__(f"box exec {shown!r} exited {self.exit_code}{why}"
                         + (f"; stderr: {tail}" if tail else ""))


async def _const(value: Any) -> Any:
    return value


class Suspend(BaseException):
    """Raised by ctx.sleep_until: the runner parks the agent until `wake_at`."""

    def __init__(self, wake_at: float) -> None:
        super().__init__(wake_at)
        self.wake_at = wake_at


@dataclass
class Budget:
    """Tokens (prompt + completion) the agent may spend, and what it spent, replays included."""

    limit_tokens: int | None = None
    spent_tokens: int = 0
    spent_usd: float = 0.0

    @property
    def remaining_tokens(self) -> int | None:
        if self.limit_tokens is None:
            return None
        return max(self.limit_tokens - self.spent_tokens, 0)

    def charge(self, usage: dict[str, Any]) -> None:
        self.spent_tokens += int(usage.get("total_tokens") or 0)
        self.spent_usd += float(usage.get("cost_usd") or 0.0)

    @classmethod
    def from_journal(cls, limit_tokens: int | None,
                     entries: Sequence[tuple[str, Any]]) -> Budget:
        """What the agent spent in its earlier runs: the usage of every journaled call
        (`entries`: each journal entry's kind and value)."""
        budget = cls(limit_tokens=limit_tokens)
        for kind, value in entries:
            if kind == "chat" and isinstance(value, dict):
                budget.charge(value.get("usage") or {})
        return budget


class Effects:
    """What a run does to the world, performed by the runner (harness_child.PipeEffects asks
    it over a pipe). Each call performs the effect and returns a JSON-able value."""

    async def chat(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        raise NotImplementedError

    async def box_create(self) -> str:
        raise NotImplementedError

    async def box_call(self, box_id: str, op: str, args: dict[str, Any], key: str) -> Any:
        """`key`: the effect's journal key, so that the call can be made idempotent."""
        raise NotImplementedError

    async def journal(self, key: str, kind: str, value: Any) -> None:
        """Append an effect's result to the agent's journal (with the count of effects
        answered from the journal since the last append, `Run.take_replayed`)."""
        raise NotImplementedError


@dataclass
class Run:
    """One run of an agent on one runner: the journal so far and the effects."""

    effects: Effects
    journal: dict[str, Any]
    model: str
    budget: Budget
    replayed: int = 0
    performed: int = 0
    box_id: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    handing_back: bool = False
    # Effects (and subagent results) performing or being journaled right now.
    in_flight: int = 0
    # Called once the run is quiet (handed back, nothing in flight).
    on_quiet: Callable[[], None] | None = None

    def take_replayed(self) -> int:
        """The effects answered from the journal since the last call (they are reported with
        the next journal append)."""
        replayed, self.replayed = self.replayed, 0
        return replayed

    def hand_back(self) -> None:
        """Start no new effect from now on; `on_quiet` says when the ones in flight are
        journaled."""
        self.handing_back = True
        self._tell_quiet()

    def _tell_quiet(self) -> None:
        if self.quiet and self.on_quiet is not None:
            self.on_quiet()

    async def begin_effect(self) -> None:
        """Called before an effect starts: it parks for good (until the runner cancels the
        run) once the run is handed back, so that nothing new happens that the next runner
        would not know of."""
        if self.handing_back:
            await asyncio.get_running_loop().create_future()
        self.in_flight += 1

    def end_effect(self) -> None:
        self.in_flight -= 1
        self._tell_quiet()

    @property
    def quiet(self) -> bool:
        """Handed back and nothing in flight: every effect it did is journaled."""
        return self.handing_back and self.in_flight == 0


class Ctx:
    def __init__(self, run: Run, prefix: str = "") -> None:
        self._run = run
        self._prefix = prefix
        self._counts: dict[str, int] = {}
        self.box = AgentBox(self)

    @property
    def budget(self) -> Budget:
        return self._run.budget

    def _key(self, kind: str) -> str:
        n = self._counts.get(kind, 0)
        self._counts[kind] = n + 1
        return f"{self._prefix}{kind}{n}"

    async def effect(self, kind: str, perform: Callable[[str], Awaitable[Any]]) -> Any:
        """Run `perform(key)` once in the agent's life: a journaled effect is answered from
        the journal."""
        key = self._key(kind)
        run = self._run
        if key in run.journal:
            run.replayed += 1
            return run.journal[key]
        await run.begin_effect()
        try:
            value = await perform(key)
            await run.effects.journal(key, kind, value)
        finally:
            run.end_effect()
        run.journal[key] = value
        run.performed += 1
        return value

    async def chat(self, messages: str | list[dict[str, Any]], *, max_tokens: int =
                   DEFAULT_MAX_TOKENS, model: str | None = None, temperature: float = 0.0,
                   realtime: bool = False, tools: list[dict[str, Any]] | None = None,
                   tool_choice: str | dict[str, Any] | None = None,
                   parallel_tool_calls: bool | None = None,
                   response_format: dict[str, Any] | None = None, **extra: Any) -> Answer:
        """A chat completion through the token factory (background tier unless `realtime`);
        returns the text, carrying the message's `tool_calls` and `finish_reason`. `tools`,
        `tool_choice`, `parallel_tool_calls` and `response_format` are chat completions'
        own (enforced by the engine). Usage is charged to ctx.budget."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        budget = self._run.budget
        if budget.remaining_tokens == 0:
            raise BudgetExceeded(f"the agent spent its budget of {budget.limit_tokens} tokens")
        body = {"model": model or self._run.model, "messages": messages,
                "max_tokens": max_tokens, "temperature": temperature, **extra}
        for name, value in (("tools", tools), ("tool_choice", tool_choice),
                            ("parallel_tool_calls", parallel_tool_calls),
                            ("response_format", response_format)):
            if value is not None:
                body[name] = value
        if not realtime:
            body["service_tier"] = "flex"

        async def perform(key: str) -> dict[str, Any]:
            done = await self._run.effects.chat(body, key)
            budget.charge(done.get("usage") or {})  # a replayed call was charged already
            return done

        answer = await self.effect("chat", perform)
        calls = answer.get("tool_calls")
        return Answer(str(answer.get("text") or ""),
                      calls if isinstance(calls, list) else None, answer.get("finish_reason"))

    async def map(self, subagent: Callable[[Ctx, Any], Awaitable[T]], items: Sequence[Any],
                  concurrency: int = 8) -> list[T]:
        """Run `subagent(sub_ctx, item)` for every item, at most `concurrency` at once; a
        finished subagent's result is journaled and never run again."""
        m = self._counts.get("map", 0)
        self._counts["map"] = m + 1
        limit = asyncio.Semaphore(max(concurrency, 1))
        run = self._run

        async def one(i: int, item: Any) -> Any:
            key = f"{self._prefix}m{m}.{i}"
            if key in run.journal:
                run.replayed += 1
                return run.journal[key]
            async with limit:
                value = await subagent(Ctx(run, f"{key}/"), item)
            await run.begin_effect()
            try:
                await run.effects.journal(key, "subagent", value)
            finally:
                run.end_effect()
            run.journal[key] = value
            run.performed += 1
            return value

        return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(items))))

    async def log(self, message: str) -> None:
        """Record progress (minimill agent logs ID)."""
        async def perform(_key: str) -> str:
            return str(message)

        await self.effect("log", perform)

    async def sleep_until(self, when: float) -> None:
        """Wait until Unix time `when` holding nothing: the agent leaves its runner and is
        taken up again (on any runner) when the time comes."""
        async def perform(_key: str) -> float:
            return float(when)

        target = await self.effect("sleep", perform)
        if time.time() < target:
            raise Suspend(target)


class AgentBox:
    """The agent's box (one per agent, shared by its subagents), created on first use; every
    exec and file write is a journaled effect."""

    def __init__(self, ctx: Ctx) -> None:
        self._ctx = ctx

    async def _box_id(self) -> str:
        run = self._ctx._run
        async with run.lock:
            if run.box_id is None:
                root = Ctx(run, "")  # the box belongs to the agent, whoever uses it first
                run.box_id = str(await root.effect(
                    "box", lambda _key: run.effects.box_create()))
        return run.box_id

    async def exec(self, command: str | list[str], *, stdin: str = "",
                   timeout_s: float | None = None, check: bool = True) -> dict[str, Any]:
        """Run a command in the box (argv, or a string for /bin/sh -c): {exit_code, stdout,
        stderr, ...}. Like `subprocess.run(check=True)`, a non-zero exit raises ExecFailed
        (after the result is journaled) unless `check=False`."""
        box_id = await self._box_id()
        args = {"command": command, "stdin": stdin, "timeout_s": timeout_s}
        result: dict[str, Any] = await self._ctx.effect(
            "exec", lambda key: self._ctx._run.effects.box_call(box_id, "exec", args, key))
        if check and (result.get("exit_code") != 0 or result.get("error")):
            raise ExecFailed(command, result)
        return result

    async def keep(self) -> None:
        """Keep the box when the agent ends (by default an ending agent's box is deleted):
        the tenant deletes it later (minimill box rm)."""
        box_id = await self._box_id()
        await self._ctx.effect(KEEP_BOX_EFFECT, lambda _key: _const(box_id))

    async def write(self, path: str, content: str) -> None:
        box_id = await self._box_id()
        await self._ctx.effect("write", lambda key: self._ctx._run.effects.box_call(
            box_id, "write", {"path": path, "content": content}, key))

    async def read(self, path: str) -> str:
        box_id = await self._box_id()
        return str(await self._ctx.effect("read", lambda key: self._ctx._run.effects.box_call(
            box_id, "read", {"path": path}, key)))


def load_main(code: str, filename: str) -> Callable[[Ctx, Any], Awaitable[Any]]:
    """The harness's `main` from its source."""
    namespace: dict[str, Any] = {"__name__": "minimill_harness", "__file__": filename}
    exec(compile(code, filename, "exec"), namespace)
    main = namespace.get("main")
    if not callable(main):
        raise ValueError(f"{filename} defines no `async def main(ctx, task)`")
    return main
