"""OpenAI response shapes built from stored results: the same bodies for realtime responses,
stream chunks and batch output lines. Pure functions of plain data.

Workers report per-token logprobs as `{"token", "logprob", "top_logprobs": [{"token",
"logprob"}]}` (protocol.ChoiceProgress.logprobs); chat responses carry them as OpenAI's
`logprobs.content`, completions as `tokens`/`token_logprobs`/`top_logprobs`/`text_offset`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from minimill.control.records import Kind, Tier
from minimill.models.tool_calls import FORMATS, parse_message

SYSTEM_FINGERPRINT = "minimill"


def request_hex(request_id: str) -> str:
    return request_id.removeprefix("req_")


def response_id(kind: Kind, request_id: str) -> str:
    prefix = "chatcmpl-" if kind == Kind.CHAT else "cmpl-"
    return prefix + request_hex(request_id)


def usage_dict(prompt_tokens: int, completion_tokens: int, billed_usd: float,
               cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage plus `cost_usd`: what the tenant is billed for the request (the operator's
    price list; prices.py), never what the tokens cost the factory. `cached_tokens`: prompt
    tokens served from the engine's KV cache (billed at the cached-input price)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}, "cost_usd": billed_usd}


def service_tier(tier: Tier | str) -> str:
    return "flex" if tier == Tier.BACKGROUND else "default"


def _logprob(lp: dict[str, Any]) -> float:
    value = lp.get("logprob")
    return float(value) if isinstance(value, int | float) else 0.0


def _tops(lp: dict[str, Any]) -> list[dict[str, Any]]:
    # Workers are trusted but not infallible: odd shapes render as "no alternatives".
    tops = lp.get("top_logprobs")
    return [t for t in tops if isinstance(t, dict)] if isinstance(tops, list) else []


def _token_entry(lp: dict[str, Any]) -> dict[str, Any]:
    token = str(lp.get("token", ""))
    return {"token": token, "logprob": _logprob(lp),
            "bytes": list(token.encode("utf-8", "replace"))}


def chat_logprobs(items: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if items is None:
        return None
    content = [{**_token_entry(lp), "top_logprobs": [_token_entry(t) for t in _tops(lp)]}
               for lp in items]
    return {"content": content, "refusal": None}


def completion_logprobs(items: list[dict[str, Any]] | None,
                        text_offset: int = 0) -> dict[str, Any] | None:
    if items is None:
        return None
    tokens, offsets, offset = [], [], text_offset
    for lp in items:
        token = str(lp.get("token", ""))
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [_logprob(lp) for lp in items],
            "top_logprobs": [{str(t.get("token", "")): _logprob(t) for t in _tops(lp)}
                             for lp in items],
            "text_offset": offsets}


def tool_call_id(request_id: str, choice_index: int, call_index: int) -> str:
    """The id of a call: the same in a stream, its final message and a later retrieval."""
    digest = hashlib.blake2b(f"{request_id}:{choice_index}:{call_index}".encode(),
                             digest_size=12).hexdigest()
    return f"call_{digest}"


def assistant_message(request_id: str, choice: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A chat choice's message and finish reason: a request with tools has its calls parsed
    out of the text (the worker says in which syntax); "tool_calls" when it made any."""
    finish = choice.get("finish_reason") or "stop"
    text = str(choice.get("text", ""))
    fmt = FORMATS.get(str(choice.get("tool_format")))
    if fmt is None:
        return {"role": "assistant", "content": text, "refusal": None}, finish
    parsed = parse_message(fmt, text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
    if parsed.calls:
        index = int(choice.get("index", 0))
        message["tool_calls"] = [
            {"id": tool_call_id(request_id, index, i), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for i, call in enumerate(parsed.calls)]
        if finish == "stop":
            finish = "tool_calls"
    return message, finish


def render_choice(kind: Kind, choice: dict[str, Any], request_id: str = "") -> dict[str, Any]:
    finish = choice.get("finish_reason") or "stop"
    text = choice.get("text", "")
    if kind == Kind.CHAT:
        message, finish = assistant_message(request_id, choice)
        return {"index": choice.get("index", 0), "message": message,
                "logprobs": chat_logprobs(choice.get("logprobs")), "finish_reason": finish}
    return {"index": choice.get("index", 0), "text": text,
            "logprobs": completion_logprobs(choice.get("logprobs")), "finish_reason": finish}


def render_response(kind: Kind, request_id: str, model: str, created: float, tier: Tier | str,
                    choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    """A `chat.completion` or `text_completion` object."""
    ordered = sorted(choices, key=lambda c: int(c.get("index", 0)))
    return {"id": response_id(kind, request_id),
            "object": "chat.completion" if kind == Kind.CHAT else "text_completion",
            "created": int(created), "model": model,
            "choices": [render_choice(kind, c, request_id) for c in ordered],
            "usage": usage, "service_tier": service_tier(tier),
            "system_fingerprint": SYSTEM_FINGERPRINT}


def render_chunk(kind: Kind, request_id: str, model: str, created: float, tier: Tier | str,
                 choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 with_usage_field: bool = False) -> dict[str, Any]:
    """One streaming chunk; `choices` are already in chunk shape (delta or text)."""
    chunk: dict[str, Any] = {
        "id": response_id(kind, request_id),
        "object": "chat.completion.chunk" if kind == Kind.CHAT else "text_completion",
        "created": int(created), "model": model, "choices": choices,
        "service_tier": service_tier(tier), "system_fingerprint": SYSTEM_FINGERPRINT}
    if with_usage_field or usage is not None:
        chunk["usage"] = usage
    return chunk


def error_body(error: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error object from a stored error {"code", "message", "param"}."""
    return {"error": {"message": error.get("message", "request failed"),
                      "type": error.get("type") or "invalid_request_error",
                      "param": error.get("param"), "code": error.get("code")}}


def batch_line_id(request_id: str) -> str:
    return "batch_req_" + request_hex(request_id)


def batch_output_line(request_id: str, custom_id: str | None,
                      response: dict[str, Any]) -> dict[str, Any]:
    return {"id": batch_line_id(request_id), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": response},
            "error": None}


def batch_error_line(request_id: str, custom_id: str | None,
                     error: dict[str, Any]) -> dict[str, Any]:
    """A failed line: a served request that failed carries an HTTP-like 400 response; a line
    that never ran (invalid, cancelled, expired) carries `error` and no response."""
    if error.get("source") == "serving":
        return {"id": batch_line_id(request_id), "custom_id": custom_id,
                "response": {"status_code": 400, "request_id": request_id,
                             "body": error_body(error)},
                "error": None}
    return {"id": batch_line_id(request_id), "custom_id": custom_id, "response": None,
            "error": {"code": error.get("code"), "message": error.get("message"),
                      "param": error.get("param"), "line": error.get("line")}}
