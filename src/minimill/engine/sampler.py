"""Token choice from logits: greedy, temperature, top-k, top-p, logprobs.

The token at output position i depends only on (seed, i, logits): the uniform number that picks
it comes from a hash of (seed, i), then an inverse CDF over the filtered distribution. No
generator state is carried between steps, so a request resumed on another worker, or
recomputed after preemption, samples exactly as the uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from minimill.engine.params import SamplingParams

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, output_index: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, output_index)."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ output_index) >> 11) * 2.0**-53


SampledLogprob = tuple[float, list[tuple[int, float]]]
_ROWS_PER_CHUNK = 32


def sample(logits: torch.Tensor, params: Seq[SamplingParams], seeds: Seq[int],
           output_indices: Seq[int]) -> tuple[list[int], list[SampledLogprob | None]]:
    """Pick one token per row of `logits` [num_rows, vocab] (any float dtype).

    Returns the token ids and, per row, (logprob of the token, top alternatives) when asked.
    """
    num_rows = logits.shape[0]
    tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == num_rows:
        tokens = argmax(logits)
    elif greedy:
        greedy_rows = torch.tensor(greedy, device=logits.device)
        tokens[greedy_rows] = argmax(logits[greedy_rows])
    plain = [i for i, p in enumerate(params)
             if not p.greedy and p.top_k is None and p.top_p >= 1.0]
    filtered = [i for i, p in enumerate(params)
                if not p.greedy and (p.top_k is not None or p.top_p < 1.0)]
    for all_rows, fn in ((plain, _sample_plain), (filtered, _sample_filtered)):
        # A few rows at a time: float64 copies of many 50k-wide rows would be large fresh
        # allocations (page faults) every step.
        for start in range(0, len(all_rows), _ROWS_PER_CHUNK):
            rows = all_rows[start:start + _ROWS_PER_CHUNK]
            index = torch.tensor(rows, device=logits.device)
            u = torch.tensor([uniform_for(seeds[i], output_indices[i]) for i in rows],
                             dtype=torch.float64, device=logits.device)
            tokens[index] = fn(logits[index], [params[i] for i in rows], u)
    return tokens.tolist(), _logprobs(logits, params, tokens)


_ARGMAX_CHUNK = 1024


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """First index of the row maximum, like torch.argmax, but fast on CPU for wide rows.

    torch.argmax is not vectorised over a 50k vocabulary on CPU (tens of ms per step); amax is.
    So: the max of each 1024-wide chunk, the first chunk holding the row max, then argmax
    inside that chunk only.
    """
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 4 * _ARGMAX_CHUNK:
        return logits.argmax(dim=-1)
    c = _ARGMAX_CHUNK
    whole = vocab // c * c
    chunk_max = logits[:, :whole].view(rows, -1, c).amax(dim=-1)
    if whole < vocab:
        chunk_max = torch.cat([chunk_max, logits[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    best_chunk = chunk_max.argmax(dim=-1)
    # Past the end of the vocabulary, repeat the last column: argmax keeps the first hit.
    cols = (best_chunk[:, None] * c + torch.arange(c)).clamp_(max=vocab - 1)
    return best_chunk * c + logits.gather(1, cols).argmax(dim=-1)


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float64,
                         device=logits.device)
    return logits.double() / temps[:, None]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    # right=True: the first position whose cdf exceeds the target, so zero-probability tokens
    # (flat steps of the cdf) are never chosen.
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return index.clamp_(max=probs.shape[-1] - 1)


def _sample_plain(logits: torch.Tensor, params: list[SamplingParams],
                  u: torch.Tensor) -> torch.Tensor:
    # No filtering: the inverse CDF can walk the vocabulary in id order, no sort needed.
    return _inverse_cdf(torch.softmax(_scaled(logits, params), dim=-1), u)


def _sample_filtered(logits: torch.Tensor, params: list[SamplingParams],
                     u: torch.Tensor) -> torch.Tensor:
    scaled = _scaled(logits, params)
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    vocab = scaled.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=logits.device)
    # Keep the smallest prefix whose mass reaches top_p (the best token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    picked = _inverse_cdf(probs, u)
    return sorted_ids.gather(1, picked[:, None]).squeeze(1)


def _logprobs(logits: torch.Tensor, params: Seq[SamplingParams],
              tokens: torch.Tensor) -> list[SampledLogprob | None]:
    out: list[SampledLogprob | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs > 0]
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    # Logprobs of the model's own distribution, before temperature or filtering (as vLLM).
    logp = torch.log_softmax(logits[index].float(), dim=-1)
    chosen = logp.gather(1, tokens[index][:, None]).squeeze(1).tolist()
    max_top = max(params[i].top_logprobs for i in rows)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_top > 0:
        values, ids = logp.topk(max_top, dim=-1)
        top_vals, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        k = params[i].top_logprobs
        top = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True)) if k else []
        out[i] = (chosen[j], top)
    return out
