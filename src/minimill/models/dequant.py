"""GGML tensor bytes to torch tensors.

The common types (F32, F16, BF16, Q8_0, Q4_0, Q4_1) are dequantized with torch ops, which use
every core and take well under a second for a small model; the arithmetic mirrors the gguf
package's reference numpy code operation for operation, so results are bit-identical to it.
Every other type goes through `gguf.quants.dequantize` (numpy, slower, but complete).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

_FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def dequantize(raw: bytearray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor:
    """Tensor of `shape` (torch order) and `dtype` from one tensor's raw GGML bytes."""
    data = torch.frombuffer(raw, dtype=torch.uint8)
    if ggml_type in _FLOAT_TYPES:
        values = data.view(_FLOAT_TYPES[ggml_type])
        # copy=True: the result must not alias the caller's read buffer.
        return values.reshape(shape).to(dtype, copy=True)
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    blocks = data.view(-1, block_bytes)
    if ggml_type == GGMLQuantizationType.Q8_0:
        out = _q8_0(blocks)
    elif ggml_type == GGMLQuantizationType.Q4_0:
        out = _q4_0(blocks)
    elif ggml_type == GGMLQuantizationType.Q4_1:
        out = _q4_1(blocks)
    else:
        array = gguf_dequantize(np.frombuffer(raw, dtype=np.uint8), ggml_type)
        out = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    return out.reshape(shape).to(dtype)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale stored at byte `start` of each block, as float32: [num_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[num_blocks, 16] bytes -> float32 [num_blocks, 32]: low nibbles first, then high."""
    out = torch.empty(packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
    half = packed.shape[1]
    torch.bitwise_and(packed, 0x0F, out=out[:, :half])
    torch.bitwise_right_shift(packed, 4, out=out[:, half:])
    return out


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 d, 32 x int8 q; x = q * d
    d = _half(blocks, 0)
    q = blocks[:, 2:].view(torch.int8).to(torch.float32)
    return q.mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 d, 16 bytes of 4-bit q; x = (q - 8) * d
    d = _half(blocks, 0)
    return _nibbles(blocks[:, 2:]).sub_(8.0).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 d, fp16 m, 16 bytes of 4-bit q; x = q * d + m (two roundings, as the reference)
    d = _half(blocks, 0)
    m = _half(blocks, 2)
    return _nibbles(blocks[:, 4:]).mul_(d).add_(m)
