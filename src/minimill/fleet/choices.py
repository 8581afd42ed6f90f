"""A lease's OpenAI body turned into one generation job per choice (engine-independent).

The control plane has already validated the body; this module still raises `BodyError` (typed,
with the offending parameter) rather than crashing on anything it cannot use, so that one odd
request becomes a `failed` completion and never takes the worker down.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from minimill.engine.params import InvalidRequestError, SamplingParams
from minimill.fleet.output_rules import OutputRules, RulesError, guided_decoding, read_rules
from minimill.models.tool_calls import ToolFormat
from minimill.protocol import ChoiceProgress, Lease, ToolFormatName

# Seeds are kept inside a signed 63-bit range so every engine and JSON consumer can hold them.
_SEED_MASK = (1 << 63) - 1
# Odd 64-bit constant (golden ratio) spreads the choice index over the seed's bits.
_SEED_STEP = 0x9E3779B97F4A7C15
# Largest n a worker accepts for one request, whatever the control plane let through.
MAX_CHOICES = 128
# Without a tokenizer, a text-only checkpoint's token count is estimated at ~4 characters each.
_CHARS_PER_TOKEN = 4


class BodyError(ValueError):
    """A request body this worker cannot run; `param` names the field, as OpenAI errors do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ChoiceJob:
    """One choice of one leased request, as handed to an engine adapter."""

    engine_request_id: str  # unique per (lease epoch, choice) so aborts never hit a successor
    index: int  # the choice's index in the response
    kind: Literal["chat", "completion"]
    model: str
    # Chat: the message list; completion: a prompt string or a list of token ids.
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    params: SamplingParams  # max_tokens here is the body's, or the adapter's default
    max_tokens_from_body: bool  # False: the body set no limit ("up to the context")
    resume: ChoiceProgress | None  # generated-so-far state from the lease's checkpoint
    # Chat: the body's tools, tool_choice and response_format (params.guided enforces them).
    rules: OutputRules = field(default_factory=OutputRules)
    # The syntax the output's tool calls are written in (the control plane parses them).
    tool_format: ToolFormatName | None = None


def derive_seed(seed: int, index: int) -> int:
    """Seed for choice `index`: choice 0 keeps `seed`, the others differ but are reproducible."""
    if index == 0:
        return seed & _SEED_MASK
    return (seed + index * _SEED_STEP) & _SEED_MASK


def resumed_token_count(job: ChoiceJob) -> int:
    """Tokens the job's checkpoint already holds (estimated for a text-only checkpoint)."""
    if job.resume is None:
        return 0
    if job.resume.token_ids:
        return len(job.resume.token_ids)
    if job.resume.logprobs:
        return len(job.resume.logprobs)
    return -(-len(job.resume.text) // _CHARS_PER_TOKEN)


def _int_param(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BodyError(f"{name} must be an integer, got {value!r}", name)
    return value


def _float_param(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BodyError(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _stop_param(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise BodyError(f"stop must be a string or a list of strings, got {stop!r}", "stop")


def _logit_bias_param(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BodyError(f"logit_bias must be an object, got {bias!r}", "logit_bias")
    out = []
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise BodyError(f"logit_bias keys must be token ids, got {token!r}",
                            "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BodyError(f"logit_bias values must be numbers, got {value!r}", "logit_bias")
        out.append((token_id, float(value)))
    return tuple(sorted(out))


def _logprob_params(kind: str, body: dict[str, Any]) -> tuple[bool, int]:
    """(logprobs?, top alternatives): chat has a flag plus top_logprobs, completions an int."""
    if kind == "chat":
        flag = bool(body.get("logprobs") or False)
        top = _int_param(body, "top_logprobs") or 0
        return flag, top if flag else 0
    num_top = _int_param(body, "logprobs")
    if num_top is None:
        return False, 0
    return True, num_top


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The completion prompts: OpenAI accepts a string, tokens, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise BodyError("prompt must be a string, a list of strings, or a list of token ids",
                    "prompt")


def sampling_params(lease: Lease, index: int, default_max_tokens: int) -> tuple[SamplingParams,
                                                                                 bool]:
    """SamplingParams for choice `index` of the lease, and whether max_tokens came from the body.

    OpenAI's defaults apply: temperature 1, top_p 1, no stop, no limit but the context.
    """
    body = lease.body
    max_tokens = _int_param(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int_param(body, "max_tokens")
    seed = _int_param(body, "seed")
    logprobs, top_logprobs = _logprob_params(lease.kind, body)
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=_float_param(body, "temperature", 1.0),
            top_p=_float_param(body, "top_p", 1.0),
            seed=derive_seed(seed if seed is not None else lease.seed, index),
            stop=_stop_param(body),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            frequency_penalty=_float_param(body, "frequency_penalty", 0.0),
            presence_penalty=_float_param(body, "presence_penalty", 0.0),
            logit_bias=_logit_bias_param(body),
            cache_salt=lease.cache_salt,
        )
    except InvalidRequestError as exc:
        raise BodyError(str(exc)) from exc
    return params, max_tokens is not None


def _output_rules(lease: Lease, tool_format: ToolFormat | None, guides: bool
                  ) -> tuple[OutputRules, Any]:
    """The chat body's output rules, and the grammar enforcing them here (or None)."""
    if lease.kind != "chat":
        return OutputRules(), None
    try:
        rules = read_rules(lease.body)
        guided = guided_decoding(rules, tool_format)
    except RulesError as exc:
        raise BodyError(str(exc), exc.param) from exc
    if guided is not None and not guides:
        raise BodyError("this site's engine cannot enforce tools or response_format",
                        "tools" if rules.calls_tools else "response_format")
    return rules, guided


def choice_jobs(lease: Lease, default_max_tokens: int, tool_format: ToolFormat | None = None,
                guides: bool = False) -> list[ChoiceJob]:
    """One job per choice; completions with several prompts get n choices per prompt.
    `tool_format`: the syntax the engine's model calls tools in; `guides`: whether the engine
    can enforce a grammar (tools and response_format need it)."""
    body = lease.body
    rules, guided = _output_rules(lease, tool_format, guides)
    n = _int_param(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise BodyError(f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
    if lease.kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BodyError("messages must be a non-empty list", "messages")
        inputs: list[tuple[list[dict[str, Any]] | None, str | list[int] | None]] = [
            (messages, None)]
    else:
        inputs = [(None, p) for p in _prompts(body)]
    resumed = {c.index: c for c in (lease.checkpoint.choices if lease.checkpoint else [])}
    jobs = []
    for p, (messages, prompt) in enumerate(inputs):
        for j in range(n):
            index = p * n + j
            params, from_body = sampling_params(lease, index, default_max_tokens)
            if guided is not None:
                params = replace(params, guided=guided)
            jobs.append(ChoiceJob(
                engine_request_id=f"{lease.request_id}:{lease.epoch}:{index}",
                index=index, kind=lease.kind, model=lease.model, messages=messages,
                prompt=prompt, params=params, max_tokens_from_body=from_body,
                resume=resumed.get(index), rules=rules,
                tool_format=tool_format.name if tool_format and rules.calls_tools else None))
    return jobs
