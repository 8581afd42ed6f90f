"""The GGUF header reader and the torch dequantizers against the gguf package's reference code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize

from minimill.models.dequant import dequantize
from minimill.models.gguf_file import read_gguf_header, read_tensor_bytes


def test_header_matches_gguf_reader(model_file: Path) -> None:
    ours = read_gguf_header(model_file)
    reader = GGUFReader(model_file)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert ours.data_offset == reader.data_offset
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.offset == tensor.data_offset
        assert info.nbytes == tensor.n_bytes
        assert info.ggml_type == tensor.tensor_type
        assert info.shape == tuple(int(n) for n in reversed(tensor.shape))


def test_file_tensors_dequantize_bit_identically(model_file: Path) -> None:
    header = read_gguf_header(model_file)
    seen: set[GGMLQuantizationType] = set()
    with model_file.open("rb") as f:
        for info in header.tensors.values():
            if info.ggml_type in seen and not info.name.startswith("blk.29."):
                continue
            seen.add(info.ggml_type)
            raw = read_tensor_bytes(f, info, model_file)
            ours = dequantize(raw, info.ggml_type, info.shape, torch.float32)
            ref = reference_dequantize(np.frombuffer(raw, dtype=np.uint8), info.ggml_type)
            assert torch.equal(ours, torch.from_numpy(ref.astype(np.float32)).reshape(info.shape))
    assert {"Q4_1", "Q8_0", "F32"} <= {t.name for t in seen}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "F16", "BF16"])
def test_quant_types_match_reference(qtype: str) -> None:
    ggml_type = GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    packed = quantize(values, ggml_type)
    raw = bytearray(packed.tobytes())
    ref = reference_dequantize(packed, ggml_type).astype(np.float32)
    ours = dequantize(raw, ggml_type, (8, 128), torch.float32)
    assert torch.equal(ours, torch.from_numpy(ref).reshape(8, 128))
    # And the cast to the engine dtype is of those same values.
    assert torch.equal(dequantize(raw, ggml_type, (8, 128), torch.bfloat16),
                       ours.to(torch.bfloat16))
