"""Token choice from logits: logit_bias and penalties, greedy, temperature, top-k, top-p,
logprobs.

The token at output position i depends only on (seed, i, logits, the tokens generated before
it): the uniform number that picks it comes from a hash of (seed, i), then an inverse CDF over
the filtered distribution. No generator state is carried between steps, so a request resumed on
another worker, or recomputed after preemption, samples exactly as the uninterrupted one would.

The work per row runs in the engine's kernels (kernels.py): minimill's CPU kernel, or the
PyTorch reference below, which defines the semantics:
- adjustments first: logit_bias[t], minus frequency_penalty * count[t], minus
  presence_penalty * (count[t] > 0), where count[t] is how often t appears among the request's
  output tokens so far (as OpenAI documents them);
- temperature 0 (or top_k 1): the first index of the maximum;
- otherwise logits / temperature, then the filters: the top_k best tokens, then the smallest
  prefix of them (best first; among equal logits, lower id first) whose probability reaches
  top_p (the best token always stays); the CDF then walks the kept tokens in id order, so no
  vocabulary-wide sort is needed.
- a guided row (engine/guided.py) has a bitmask of allowed token ids (bit t % 32 of word
  t // 32): every other token's logit is -inf after the adjustments, before the rest.
Logprobs are those of the model's own distribution (before adjustments, masks, temperature or
filters), as vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from minimill.engine.params import SamplingParams

_MASK64 = (1 << 64) - 1
_BITS = torch.arange(32, dtype=torch.int32)
SampledLogprob = tuple[float, list[tuple[int, float]]]
Adjustments = list[tuple[int, float]]  # (token id, amount added to its logit)


class TokenMasks:
    """Rows' allowed-token bitmasks as the kernels take them: `index[r]` is row r's row of
    `words` (int32 [masked rows, words]), -1 for an unconstrained row."""

    __slots__ = ("index", "words")

    def __init__(self, index: torch.Tensor, words: torch.Tensor) -> None:
        self.index = index
        self.words = words

    @classmethod
    def of(cls, masks: Seq[torch.Tensor | None] | None, rows: int) -> TokenMasks | None:
        if masks is None or all(m is None for m in masks):
            return None
        present = [m for m in masks if m is not None]
        index, k = [], 0
        for m in masks:
            index.append(-1 if m is None else k)
            k += m is not None
        return cls(torch.tensor(index, dtype=torch.long), torch.stack(present))

    def allowed(self, row: int, vocab: int) -> torch.Tensor | None:
        """Row `row`'s mask as bools [vocab], or None if unconstrained."""
        i = int(self.index[row])
        if i < 0:
            return None
        bits = (self.words[i].unsqueeze(-1) >> _BITS) & 1
        allowed = bits.flatten()[:vocab].bool()
        if allowed.shape[0] < vocab:  # ids past the mask's words are never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.shape[0])])
        return allowed


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, output_index: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, output_index)."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ output_index) >> 11) * 2.0**-53


def adjustments_for(params: SamplingParams, counts: Mapping[int, int] | None) -> Adjustments:
    """What logit_bias and the penalties add to each affected token's logit."""
    deltas: dict[int, float] = dict(params.logit_bias)
    if counts and (params.frequency_penalty or params.presence_penalty):
        for token, count in counts.items():
            deltas[token] = (deltas.get(token, 0.0) - params.frequency_penalty * count
                             - params.presence_penalty)
    return sorted(deltas.items())


class SamplingKernels(Protocol):
    """What sampling needs of the engine's kernels (kernels.py's TorchKernels and CpuKernels,
    which run this module's references or a compiled equivalent)."""

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, u: torch.Tensor, adjustments: list[Adjustments],
               masks: TokenMasks | None = None) -> torch.Tensor: ...

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, num_top: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def sample(logits: torch.Tensor, params: Seq[SamplingParams], seeds: Seq[int],
           output_indices: Seq[int], kernels: SamplingKernels,
           output_counts: Seq[Mapping[int, int] | None] | None = None,
           masks: Seq[torch.Tensor | None] | None = None,
           ) -> tuple[list[int], list[SampledLogprob | None]]:
    """Pick one token per row of `logits` [num_rows, vocab] (any float dtype).

    `output_counts[r]` counts row r's output tokens so far (needed only for penalties);
    `masks[r]`, if not None, is row r's allowed-token bitmask (int32 [words]).
    Returns the token ids and, per row, (logprob of the token, top alternatives) when asked.
    """
    rows = len(params)
    cpu = torch.device("cpu")
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k or 0 for p in params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    u = torch.tensor([0.0 if p.greedy else uniform_for(seeds[r], output_indices[r])
                      for r, p in enumerate(params)], dtype=torch.float64)
    adjustments: list[Adjustments] = []
    for r, p in enumerate(params):
        needs = p.logit_bias or p.frequency_penalty or p.presence_penalty
        counts = output_counts[r] if output_counts is not None else None
        adjustments.append(adjustments_for(p, counts) if needs else [])
    tokens = kernels.sample(logits, temperature, top_k, top_p, u, adjustments,
                            TokenMasks.of(masks, rows)).to(cpu)
    token_list = tokens.tolist()
    out: list[SampledLogprob | None] = [None] * rows
    wanted = [r for r, p in enumerate(params) if p.logprobs or p.top_logprobs > 0]
    if wanted:
        num_top = max(params[r].top_logprobs for r in wanted)
        index = torch.tensor(wanted, device=logits.device)
        chosen, top_ids, top_vals = kernels.token_logprobs(
            logits.index_select(0, index), tokens.to(logits.device).index_select(0, index),
            num_top)
        chosen_l, ids_l, vals_l = chosen.tolist(), top_ids.tolist(), top_vals.tolist()
        for j, r in enumerate(wanted):
            k = params[r].top_logprobs
            out[r] = (chosen_l[j], list(zip(ids_l[j][:k], vals_l[j][:k], strict=True)))
    return token_list, out


# The reference implementations (portable PyTorch; TorchKernels runs them).

def reference_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, u: torch.Tensor, adjustments: Seq[Adjustments],
                     masks: TokenMasks | None = None) -> torch.Tensor:
    """tokens [rows] int64, by the semantics in the module docstring (float64 arithmetic)."""
    x = logits.double()
    for r, adjust in enumerate(adjustments):
        if adjust:
            ids = torch.tensor([t for t, _ in adjust], device=x.device)
            x[r].index_add_(0, ids, torch.tensor([v for _, v in adjust], dtype=x.dtype,
                                                 device=x.device))
    if masks is not None:
        for r in range(x.shape[0]):
            allowed = masks.allowed(r, x.shape[1])
            if allowed is not None and bool(allowed.any()):
                x[r].masked_fill_(~allowed.to(x.device), float("-inf"))
    greedy = (temperature == 0) | (top_k == 1)
    tokens = x.argmax(dim=-1)
    for r in (~greedy).nonzero().flatten().tolist():
        row = x[r]
        t, k, p = float(temperature[r]), int(top_k[r]), float(top_p[r])
        row = row / t
        if k <= 0 and p >= 1.0:
            tokens[r] = _inverse_cdf(torch.softmax(row, -1), float(u[r]))
            continue
        # Stable sort of -row: descending logits, lower id first among equals.
        ids = torch.sort(-row, stable=True).indices
        ranked = row[ids]
        if k > 0:
            ranked[k:] = float("-inf")
        probs = torch.softmax(ranked, -1)
        mass_before = probs.cumsum(-1) - probs
        keep = probs > 0
        if p < 1.0:
            keep &= mass_before < p
        kept = torch.zeros_like(keep)
        kept[ids[keep]] = True
        # The kept tokens' probabilities, walked in id order.
        weights = torch.exp(row - row.max()).masked_fill(~kept, 0.0)
        tokens[r] = _inverse_cdf(weights, float(u[r]))
    return tokens


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    cdf = probs.cumsum(-1)
    # right=True: the first position whose cdf exceeds the target, so zero-probability tokens
    # (flat steps of the cdf) are never chosen.
    target = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    index = int(torch.searchsorted(cdf, target, right=True)[0])
    return min(index, probs.shape[-1] - 1)


def reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each row's token [rows], top ids [rows, num_top], top logprobs)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    if num_top == 0:
        empty = torch.empty(logits.shape[0], 0)
        return chosen, empty.long(), empty
    # Stable sort: lower id first among equal logprobs, as the CPU kernel orders them.
    order = torch.sort(-logp, dim=-1, stable=True).indices[:, :num_top]
    return chosen, order, logp.gather(1, order)
