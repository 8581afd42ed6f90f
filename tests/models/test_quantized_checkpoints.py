"""Quantized HF checkpoints: gpt-oss's MXFP4 experts are dequantized exactly as transformers
does it; any other quantization scheme is refused by name rather than read as plain weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minimill.models.hf_loader import mxfp4_dequantized
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel, ModelFileError
from tiny_hf import save_tiny


def test_mxfp4_experts_dequantize_as_transformers_does() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 134, (3, 10, 4), dtype=torch.uint8, generator=g)
    ours = mxfp4_dequantized(blocks, scales, torch.float32)
    assert ours.shape == (3, 4 * 32, 10)  # [experts, in, out], as the unquantized checkpoint
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def test_mismatched_mxfp4_scales_are_a_file_error() -> None:
    with pytest.raises(ModelFileError, match="do not fit"):
        mxfp4_dequantized(torch.zeros(2, 4, 3, 16, dtype=torch.uint8),
                          torch.zeros(2, 4, 2, dtype=torch.uint8), torch.float32)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_other_quantization_is_refused(method: str, tmp_path: Path,
                                       loaded_f32: LoadedModel) -> None:
    save_tiny("qwen3", tmp_path, loaded_f32)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=f"quantization '{method}' is not supported"):
        load_model(str(tmp_path), torch.float32)
