"""Adapter for any OpenAI-compatible server (vLLM, SGLang, llama.cpp, another minimill serve).

Each choice streams from the server's /completions or /chat/completions with n=1 and the
choice's own seed. Such servers hand out text, not token ids, so checkpoints carry text and
token counts come from the stream (one token per chunk) corrected by the final usage figure.
A chat choice resumes by sending its partial answer as a final assistant message with vLLM's
`continue_final_message`; a completion resumes by appending the text to the prompt.

The server's API key, if it needs one, comes from the environment: MINIMILL_ENGINE_API_KEY.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from minimill.fleet.builtin_engine import flatten_content
from minimill.fleet.choices import ChoiceJob, resumed_token_count
from minimill.fleet.engines import (
    ChoiceUpdate,
    EngineStartError,
    EngineUnavailableError,
    JobError,
)
from minimill.fleet.rate import TokenRate
from minimill.models.tool_calls import ToolFormat

_DEFAULT_CONTEXT = 1 << 20  # only a marker for "ask with no limit": never sent to the server


class HttpEngineAdapter:
    """Streams each choice from a remote OpenAI-compatible server."""

    def __init__(self, base_url: str, client: httpx.AsyncClient, served: dict[str, str],
                 capacity: int) -> None:
        self._base = base_url.rstrip("/")
        self._client = client
        self._served = served  # our model name -> the server's model id
        self._capacity = capacity
        self._rate = TokenRate()
        self._aborted: set[str] = set()

    @classmethod
    async def start(cls, base_url: str, *, model: str, capacity: int) -> HttpEngineAdapter:
        key = os.environ.get("MINIMILL_ENGINE_API_KEY", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        client = httpx.AsyncClient(headers=headers,
                                   timeout=httpx.Timeout(30.0, read=600.0),
                                   limits=httpx.Limits(max_connections=capacity + 8))
        try:
            resp = await client.get(f"{base_url.rstrip('/')}/models")
            resp.raise_for_status()
            ids = [m.get("id") for m in resp.json().get("data", []) if isinstance(m, dict)]
        except (httpx.HTTPError, ValueError) as exc:
            await client.aclose()
            raise EngineStartError(f"cannot list models at {base_url}: {exc}") from exc
        if model in ids:
            remote = model
        elif len(ids) == 1 and isinstance(ids[0], str):
            remote = ids[0]  # a one-model server: serve it under our name
        else:
            await client.aclose()
            raise EngineStartError(f"{base_url} does not serve {model!r} (it serves {ids})")
        return cls(base_url, client, {model: remote}, capacity)

    @property
    def models(self) -> list[str]:
        return list(self._served)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def default_max_tokens(self) -> int:
        return _DEFAULT_CONTEXT

    @property
    def tool_format(self) -> ToolFormat | None:
        return None  # it sees text only: tools and response_format are refused (choices.py)

    @property
    def guides(self) -> bool:
        return False

    @property
    def embeds(self) -> bool:
        return False

    def _request(self, job: ChoiceJob) -> tuple[str, dict[str, Any]]:
        p = job.params
        body: dict[str, Any] = {
            "model": self._served.get(job.model, job.model), "stream": True, "n": 1,
            "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed,
            "stream_options": {"include_usage": True},
        }
        if p.stop:
            body["stop"] = list(p.stop)
        # Penalties on a resumed request see only what the peer generates from here: the
        # peer cannot be told which of the resumed text's tokens count as outputs.
        if p.frequency_penalty:
            body["frequency_penalty"] = p.frequency_penalty
        if p.presence_penalty:
            body["presence_penalty"] = p.presence_penalty
        if p.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in p.logit_bias}
        done = resumed_token_count(job)
        if job.max_tokens_from_body:
            body["max_tokens"] = max(1, p.max_tokens - done)
        text = job.resume.text if job.resume else ""
        if job.kind == "chat":
            assert job.messages is not None  # choice_jobs sets messages for chat
            messages = flatten_content(job.messages)
            if text:
                messages = [*messages, {"role": "assistant", "content": text}]
                body.update(continue_final_message=True, add_generation_prompt=False)
            body["messages"] = messages
            if p.logprobs:
                body.update(logprobs=True, top_logprobs=p.top_logprobs)
            return "/chat/completions", body
        prompt = job.prompt
        if text and isinstance(prompt, str):
            prompt = prompt + text
        body["prompt"] = prompt
        if p.logprobs:
            body["logprobs"] = p.top_logprobs
        return "/completions", body

    @staticmethod
    def _logprobs(kind: str, raw: Any) -> list[dict[str, Any]] | None:
        if not isinstance(raw, dict):
            return None
        if kind == "chat":
            return [{"token": c.get("token", ""), "logprob": c.get("logprob", 0.0),
                     "top_logprobs": [{"token": t.get("token", ""), "logprob": t.get("logprob")}
                                      for t in c.get("top_logprobs") or []]}
                    for c in raw.get("content") or []]
        tops = raw.get("top_logprobs") or []
        return [{"token": tok, "logprob": lp,
                 "top_logprobs": [{"token": k, "logprob": v}
                                  for k, v in (tops[i] or {}).items()] if i < len(tops) else []}
                for i, (tok, lp) in enumerate(zip(raw.get("tokens") or [],
                                                  raw.get("token_logprobs") or [], strict=False))]

    async def generate(self, job: ChoiceJob) -> AsyncIterator[ChoiceUpdate]:
        path, body = self._request(job)
        self._aborted.discard(job.engine_request_id)
        try:
            async for update in self._stream(job, path, body):
                yield update
                if job.engine_request_id in self._aborted:
                    return
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"{self._base}{path}: {exc}") from exc
        finally:
            self._aborted.discard(job.engine_request_id)

    async def _stream(self, job: ChoiceJob, path: str,
                      body: dict[str, Any]) -> AsyncIterator[ChoiceUpdate]:
        counted = 0
        async with self._client.stream("POST", self._base + path, json=body) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                raise self._error(resp)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or {}
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or "" \
                        if job.kind == "chat" else choice.get("text") or ""
                    n = 1 if text else 0
                    counted += n
                    self._rate.add(n)
                    yield ChoiceUpdate(new_text=text, num_new_tokens=n,
                                       logprobs=self._logprobs(job.kind, choice.get("logprobs")),
                                       finish_reason=choice.get("finish_reason"))
                if usage.get("completion_tokens") is not None:
                    extra = max(0, int(usage["completion_tokens"]) - counted)
                    self._rate.add(extra)
                    details = usage.get("prompt_tokens_details") or {}
                    yield ChoiceUpdate(num_new_tokens=extra,
                                       num_prompt_tokens=int(usage.get("prompt_tokens") or 0),
                                       num_cached_tokens=int(details.get("cached_tokens") or 0))

    def _error(self, resp: httpx.Response) -> Exception:
        if resp.status_code >= 500 or resp.status_code in (401, 403, 404, 429):
            return EngineUnavailableError(f"{resp.request.url}: HTTP {resp.status_code}")
        try:
            err = resp.json().get("error") or {}
        except ValueError:
            err = {}
        message = str(err.get("message") or resp.text[:500])
        code = err.get("code") or ("context_length_exceeded" if "context" in message.lower()
                                   else "invalid_request_error")
        return JobError(str(code), message, err.get("param"))

    def abort(self, engine_request_id: str) -> None:
        # The stream is closed when the generator stops being iterated; the flag ends it early.
        self._aborted.add(engine_request_id)

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Never called: a server that fails may answer again (its errors hand the leases
        back one by one)."""

    def tokens_per_s(self) -> float | None:
        return self._rate.per_s()

    async def close(self) -> None:
        await self._client.aclose()
