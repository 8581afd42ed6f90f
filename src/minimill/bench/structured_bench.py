"""`minimill bench structured`: what grammar-constrained decoding costs the engine.

The workload's prompts (256 requests at once) each ask for a JSON answer under one of a mix of
schemas, enforced by the engine's grammar (`response_format` json_schema). The same requests
then run unconstrained, each generating exactly as many tokens as its constrained twin did
(ignore_eos): same prompts, same output lengths, same batch dynamics, so the two throughputs
differ only by what the grammar costs (filling a token mask per row and step, applying it in
the sampler). Rounds alternate, and so does which side of a pair runs first; the headline
is the median ratio (these VMs move by 10% from one minute to the next). Every constrained
answer that ends is validated against its schema
(one that max_tokens cut short, as in an unbounded number's digits, is counted apart, as
OpenAI answers it with finish_reason "length"), and each schema's grammar compile time is
measured cold and from the engine's cache.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from minimill.bench.stages import stage

TARGET_RATIO = 0.95

# A mix of schemas agents ask for: objects nested and flat, arrays, enums, anyOf, bounded
# numbers, optional fields. Strings are bounded so that every answer can finish.
SCHEMAS: dict[str, dict[str, Any]] = {
    "summary": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "points": {"type": "array", "items": {"type": "string", "maxLength": 80},
                   "minItems": 1, "maxItems": 4}},
        "required": ["title", "points"], "additionalProperties": False},
    "entity": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["person", "place", "thing", "idea"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["name", "kind", "confidence"], "additionalProperties": False},
    "plan": {"type": "object", "properties": {
        "steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {
                "action": {"enum": ["search", "read", "write", "ask"]},
                "target": {"type": "string", "maxLength": 40}},
            "required": ["action", "target"], "additionalProperties": False}}},
        "required": ["steps"], "additionalProperties": False},
    "review": {"type": "object", "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "verdict": {"anyOf": [{"type": "string", "maxLength": 80}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                 "maxItems": 3}},
        "required": ["rating", "verdict"], "additionalProperties": False},
}


@dataclass(frozen=True, slots=True)
class StructuredBenchOptions:
    workload: Path
    json_out: bool = False
    model: str = "smollm2-135m"
    dtype: str = "auto"
    limit: int | None = None
    rounds: int = 3
    max_tokens: int = 256  # enough for every schema's longest answer


@dataclass(slots=True)
class _Run:
    output_tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def _compile_times(llm: Any, specs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per schema: ms to compile its grammar cold (nothing cached) and from the cache."""
    from minimill.engine.guided import Guides
    from minimill.models import grammar

    out = {}
    for name, spec in specs.items():
        fresh = Guides(llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids)
        fresh.prepare()  # the tokenizer view is built once per engine, not per grammar
        grammar._grammar_cached.cache_clear()
        started = time.perf_counter()
        fresh.start(spec)
        cold = time.perf_counter() - started
        started = time.perf_counter()
        fresh.start(spec)
        cached = time.perf_counter() - started
        out[name] = {"cold_ms": round(cold * 1e3, 3), "cached_ms": round(cached * 1e3, 3)}
    return out


def run_structured_bench(options: StructuredBenchOptions) -> dict[str, Any]:
    """Run the bench; returns the report (the CLI prints it)."""
    import jsonschema

    from minimill.bench.engine_bench import read_workload
    from minimill.engine.hardware import cpu_report
    from minimill.engine.llm import LLM
    from minimill.engine.loading import load_with_config
    from minimill.engine.params import SamplingParams
    from minimill.models.grammar import GuidedDecoding
    from minimill.models.prompt import render_chat_prompt

    items = read_workload(options.workload, options.limit)
    loaded, config = load_with_config(options.model, {"dtype": options.dtype}, auto_pull=True)
    llm = LLM(loaded, dtype=config.dtype)
    names = list(SCHEMAS)
    specs = {n: GuidedDecoding(json_schema=json.dumps(s)) for n, s in SCHEMAS.items()}
    compile_ms = _compile_times(llm, specs)
    assigned = [names[i % len(names)] for i in range(len(items))]
    prompts = [render_chat_prompt(llm.tokenizer, [
        *item.messages, {"role": "user", "content": f"Answer as JSON: a {name}."}])
        for item, name in zip(items, assigned, strict=True)]
    guided = [SamplingParams(max_tokens=options.max_tokens, temperature=1.0, seed=n,
                             guided=specs[name]) for n, name in enumerate(assigned)]
    llm.generate(prompts[:2], guided[:2])  # warm-up (kernels, grammar cache)
    constrained: list[_Run] = []
    plain: list[_Run] = []
    valid = invalid = cut = 0
    problems: list[str] = []
    err = Console(stderr=True)

    def timed(params: list[Any]) -> tuple[_Run, list[Any]]:
        llm.reset_prefix_cache()
        which = "constrained" if params is guided else "unconstrained"
        with stage(err, f"{which} run {len(constrained) + len(plain) + 1} of "
                        f"{2 * max(1, options.rounds)}, {len(prompts)} requests ..."):
            started = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - started
        return _Run(sum(len(o.output_token_ids) for o in outs), seconds), outs

    # The first constrained run gives each request's output length (the answers are the same
    # every round: seeded, batch-invariant) and the answers to validate.
    first, outs = timed(guided)
    lengths = [max(1, len(o.output_token_ids)) for o in outs]
    for out, name in zip(outs, assigned, strict=True):
        if out.finish_reason == "length":
            # Stopped by max_tokens before the grammar let it end (a number's digits are
            # unbounded): a cut answer, as OpenAI returns with finish_reason "length", not one
            # the grammar let go wrong.
            cut += 1
            continue
        try:
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid += 1
            problems.append(f"{name}: {str(exc)[:80]} in {out.text[:80]!r}")
    same_work = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
                 for i, n in enumerate(lengths)]
    # Each round's pair runs in the other order from the last (constrained first, then
    # unconstrained first, ...), so that whatever favours the first or the second run of a
    # pair (caches, the VM's drift) does not favour one side.
    for round_no in range(max(1, options.rounds)):
        if round_no == 0:
            constrained.append(first)
            plain.append(timed(same_work)[0])
        elif round_no % 2:
            plain.append(timed(same_work)[0])
            constrained.append(timed(guided)[0])
        else:
            constrained.append(timed(guided)[0])
            plain.append(timed(same_work)[0])
    ratios = [c.tok_s / p.tok_s for c, p in zip(constrained, plain, strict=True)]
    ratio = statistics.median(ratios)
    return {
        "model": options.model, "dtype": config.dtype, "cpu": cpu_report(),
        "requests": len(items), "schemas": names,
        "constrained_tok_s": round(statistics.median(r.tok_s for r in constrained), 1),
        "unconstrained_tok_s": round(statistics.median(r.tok_s for r in plain), 1),
        "ratio": round(ratio, 3), "ratio_target": TARGET_RATIO,
        "rounds": [{"constrained_tok_s": round(c.tok_s, 1), "unconstrained_tok_s":
                    round(p.tok_s, 1), "ratio": round(r, 3)}
                   for c, p, r in zip(constrained, plain, ratios, strict=True)],
        "output_tokens": constrained[0].output_tokens,
        "valid_answers": valid, "invalid_answers": invalid, "cut_at_max_tokens": cut,
        "max_tokens": options.max_tokens,
        "valid_share": round(valid / max(1, valid + invalid), 4),
        "invalid_examples": problems[:5],
        "grammar_compile": compile_ms,
        "grammar_compiles_in_runs": llm.engine.guides.compiles,
        "meets_targets": ratio >= TARGET_RATIO and invalid == 0,
    }
