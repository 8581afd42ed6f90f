"""Rotary position embeddings: inverse frequencies as HF transformers computes them per
rope_type (default, linear, dynamic, yarn, llama3), and a cos/sin table indexed by position."""

from __future__ import annotations

import math
from typing import Any

import torch

from minimill.engine.params import InvalidRequestError
from minimill.models.types import ModelConfig


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(base: float, dim: int, s: dict[str, Any],
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def inv_freq_and_scale(config: ModelConfig, max_model_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the factor applied to cos/sin."""
    base, dim = config.rope_theta, config.head_dim
    s = dict(config.rope_scaling or {})
    rope_type = s.get("rope_type", s.get("type", "default"))
    if rope_type == "default":
        return _default_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, dim) / s["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(_default_inv_freq(base, dim), s), 1.0
    if rope_type == "dynamic":
        # HF grows the base once the sequence passes max_position_embeddings, per forward pass;
        # a fixed table for the engine's longest context keeps results batch-independent.
        seq_len = max(max_model_len, config.max_position_embeddings)
        factor = s["factor"]
        base = base * ((factor * seq_len / config.max_position_embeddings)
                       - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim), 1.0
    if rope_type == "yarn":
        return _yarn(base, dim, s, config.max_position_embeddings)
    raise InvalidRequestError(f"unsupported rope_scaling type {rope_type!r}")


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated in float32 by rows of a RotaryEmbedding table broadcast to it
    ([..., d]: cos in the first half, sin in the second; HF's rotate_half pairing)."""
    half = x.shape[-1] // 2
    cos, sin = table[..., :half], table[..., half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding:
    """cos and sin for every position below max_model_len, in one float32 table
    [positions, head_dim]: the first half holds cos, the second sin (HF's rotate_half
    convention repeats each frequency in both halves, so half of each is enough)."""

    def __init__(self, config: ModelConfig, max_model_len: int, device: torch.device) -> None:
        inv_freq, scale = inv_freq_and_scale(config, max_model_len)
        positions = torch.arange(max_model_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [positions, head_dim // 2]
        self.cos_sin = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).to(device)
