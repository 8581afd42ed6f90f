"""Offline front end: `LLM(model).generate(prompts, params)` runs a whole batch to completion.
It prints nothing: a caller that shows progress passes `on_finished`."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from minimill.engine.config import EngineConfig
from minimill.engine.core import EngineCore
from minimill.engine.loading import load_with_config
from minimill.engine.params import (
    EngineError,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)
from minimill.models.tokenizer import Tokenizer
from minimill.models.types import LoadedModel, ModelConfig


class LLM:
    """Generate for many prompts at once with the builtin engine."""

    def __init__(self, model: str | LoadedModel, **config_overrides: Any) -> None:
        loaded, config = load_with_config(model, config_overrides)
        self.engine = EngineCore(loaded, config)
        self._counter = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def close(self) -> None:
        """Finish writing the KV flash tier, if any (nothing else needs closing)."""
        self.engine.close()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.loaded.config

    def generate(self, prompts: Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 resume_token_ids: Seq[Seq[int]] | None = None,
                 resume_texts: Seq[str | None] | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`, and
        each goes to `on_finished` (if given) as soon as it is finished.

        A text prompt is tokenized with the tokenizer's special tokens (e.g. BOS); a list of ids
        is used as is. `resume_token_ids[i]` continues prompt i after tokens it generated before:
        they are prefilled, count towards max_tokens and start the output's tokens and text;
        sampling continues at output position len(resume_token_ids[i]). Logprobs cover only
        the tokens generated in this call. `resume_texts[i]`, when given, is the text already
        handed out for those tokens (a checkpoint's); the output's text starts from it.
        """
        params = params if params is not None else SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(per_prompt)} params")
        if resume_token_ids is not None and len(resume_token_ids) != len(prompts):
            raise InvalidRequestError(
                f"{len(prompts)} prompts but {len(resume_token_ids)} resume_token_ids")
        if resume_texts is not None and (resume_token_ids is None
                                         or len(resume_texts) != len(prompts)):
            raise InvalidRequestError("resume_texts needs resume_token_ids, one per prompt")
        token_prompts = [self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str)
                         else list(p) for p in prompts]
        return self._run(token_prompts, per_prompt, resume_token_ids, resume_texts,
                         on_finished)

    def embed(self, prompts: Seq[str | list[int]]) -> list[list[float]]:
        """Each prompt's embedding: the final normed hidden state of its last token,
        L2-normalised (prefill only, nothing sampled). Text is tokenized as `generate` does."""
        outs = self.generate(prompts, SamplingParams(embed=True))
        return [out.embedding or [] for out in outs]

    def reset_prefix_cache(self) -> bool:
        """Forget the pool's cached prefixes (between runs of a benchmark); False while any
        request is running."""
        return self.engine.scheduler.block_manager.reset_prefix_cache()

    def chat(self, conversations: Seq[list[dict[str, str]]],
             params: SamplingParams | Seq[SamplingParams] | None = None, *,
             on_finished: Callable[[RequestOutput], None] | None = None,
             ) -> list[RequestOutput]:
        """Render each conversation with the chat template (adding the assistant turn's start)
        and generate the assistant's answer."""
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                 for c in conversations]
        # The template already spells out any special tokens (BOS, turn markers).
        prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return self.generate(prompts, params, on_finished=on_finished)

    def _run(self, prompts: list[list[int]], params: list[SamplingParams],
             resume: Seq[Seq[int]] | None, resume_texts: Seq[str | None] | None,
             on_finished: Callable[[RequestOutput], None] | None) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        for i, prompt in enumerate(prompts):
            request_id = f"offline-{self._counter}"
            self._counter += 1
            # Validate all before running any, so a bad prompt fails the call up front.
            engine.check_request(prompt, list(resume[i]) if resume else [])
            ids.append(request_id)
        try:
            for i, request_id in enumerate(ids):
                resumed = list(resume[i]) if resume else []
                # Deltas continue the resumed tokens' text; start from that text.
                seed, text = engine.add_request(request_id, prompts[i], params[i], resumed,
                                                resume_texts[i] if resume_texts else None)
                results[request_id] = RequestOutput(request_id, prompts[i], resumed, text, None,
                                                    seed, [] if _wants_logprobs(params[i])
                                                    else None)
            while engine.has_unfinished:
                step = engine.step()
                if step.failures:
                    request_id, exc = next(iter(step.failures.items()))
                    raise EngineError(f"request {request_id} failed: {exc}") from exc
                for delta in step.deltas:
                    out = results.get(delta.request_id)
                    if out is None:
                        continue  # left over from an earlier, interrupted call
                    out.output_token_ids.extend(delta.new_token_ids)
                    out.num_cached_tokens = delta.num_cached_tokens
                    if delta.embedding is not None:
                        out.embedding = delta.embedding
                    out.text += delta.new_text
                    if delta.logprobs and out.logprobs is not None:
                        out.logprobs.extend(delta.logprobs)
                    if delta.finish_reason is not None:
                        out.finish_reason = delta.finish_reason
                        if on_finished is not None:
                            on_finished(out)
        finally:
            for request_id in ids:
                if not results.get(request_id) or not results[request_id].finished:
                    engine.abort_request(request_id)
        return [results[i] for i in ids]


def _wants_logprobs(params: SamplingParams) -> bool:
    return params.logprobs or params.top_logprobs > 0
