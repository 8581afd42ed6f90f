"""Loading an HF-style model directory (config.json, safetensors, tokenizer.json) of any
architecture hf_config.py knows into a LoadedModel.

A caller that needs only some of the weights (a pipeline stage: its own layers) names them
with `keep`: each tensor is read from its file by name, the others never are. Every tensor's
shape is recorded all the same (`extra["weight_shapes"]`, as meta tensors in the load's
dtype), so that the whole model can be planned without its bytes, and `extra["loaded_bytes"]`
counts the bytes of the tensors read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from minimill.models.hf_config import architecture_of, config_from_hf
from minimill.models.tokenizer import END_OF_TURN_TOKENS, Tokenizer
from minimill.models.tokenizer_files import load_hf_tokenizer, read_json
from minimill.models.types import LoadedModel, ModelFileError, kept_extra


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _special_ids(cfg: dict[str, Any], tokenizer: Tokenizer, generation_eos: list[int]
                 ) -> tuple[tuple[int, ...], int | None]:
    """(every id that ends generation, the bos id) from the config and the tokenizer."""
    try:
        eos_ids = _ids(cfg.get("eos_token_id")) + generation_eos
        bos = cfg.get("bos_token_id", tokenizer.bos_token_id)
        bos = None if bos is None else int(bos)
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"config.json has a bad token id: {exc}") from exc
    if tokenizer.eos_token_id is not None:
        eos_ids.append(tokenizer.eos_token_id)
    eos_ids += [i for t in END_OF_TURN_TOKENS if (i := tokenizer.token_to_id(t)) is not None]
    return tuple(dict.fromkeys(eos_ids)), bos


# The values of the 16 FP4 (e2m1) codes of MXFP4, low nibble first in each byte.
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantized(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                      ) -> torch.Tensor:
    """gpt-oss's MXFP4 experts as the [experts, in, out] tensor of its unquantized checkpoints.

    blocks: uint8 [experts, out, groups, 16], two 4-bit codes per byte (32 values a group);
    scales: uint8 [experts, out, groups], a power of two per group biased by 127."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ModelFileError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                             f"{tuple(scales.shape)} do not fit together")
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [experts, out, groups, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(1, 2).contiguous().to(dtype)


def _dequantize_mxfp4(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Replace every `X_blocks` / `X_scales` pair by the dequantized `X`, in place."""
    for name in [n for n in weights if n.endswith("_blocks")]:
        base = name[:-len("_blocks")]
        scales = weights.pop(base + "_scales", None)
        if scales is None:
            raise ModelFileError(f"weight {name!r} has no {base + '_scales'!r} beside it")
        weights[base] = mxfp4_dequantized(weights.pop(name), scales, dtype)


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFileError(f"{index}: has no weight_map")
        return [directory / name for name in sorted(set(weight_map.values()))]
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(f"{directory}: no *.safetensors weight files in the model directory")
    return shards


def _beyond_layers(name: str, num_layers: int) -> bool:
    """A weight of a layer past the decoder's (DeepSeek-V3's multi-token prediction layer,
    which the engine does not run)."""
    if not name.startswith("model.layers."):
        return False
    index = name.split(".", 3)[2]
    return index.isdigit() and int(index) >= num_layers


# Weights transformers keeps in float32 whatever the model dtype, by architecture: DeepSeek-V3's
# router (its scores pick the experts, and its correction bias is stored in float32).
_FLOAT32_WEIGHTS = {"deepseek_v3": (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")}


Keep = Callable[[str], bool]


def _load_weights(directory: Path, dtype: torch.dtype, num_layers: int,
                  float32_suffixes: tuple[str, ...] = (), keep: Keep | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the weights `keep` names, every weight's shape as a meta tensor)."""
    weights: dict[str, torch.Tensor] = {}
    shapes: dict[str, torch.Tensor] = {}
    for shard in _shard_files(directory):
        if not shard.is_file():
            raise ModelFileError(f"{shard}: weight file is missing")
        try:
            with safe_open(str(shard), framework="pt") as tensors:
                for name in tensors.keys():
                    if name.endswith("rotary_emb.inv_freq"):  # a buffer old checkpoints kept
                        continue
                    if _beyond_layers(name, num_layers):
                        continue
                    as_dtype = torch.float32 if name.endswith(float32_suffixes) else dtype
                    shapes[name] = torch.empty(tensors.get_slice(name).get_shape(),
                                               dtype=as_dtype, device="meta")
                    if keep is not None and not keep(name):
                        continue
                    tensor = tensors.get_tensor(name)
                    # MXFP4 codes and scales stay bytes until they are dequantized below.
                    quantized = (name.endswith(("_blocks", "_scales"))
                                 and tensor.dtype == torch.uint8)
                    weights[name] = tensor if quantized else tensor.to(as_dtype)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFileError(f"{shard}: truncated or corrupt safetensors file ({exc})") from exc
    _dequantize_mxfp4(weights, dtype)
    return weights, shapes


def load_hf_dir(directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                name: str | None = None, keep: Keep | None = None) -> LoadedModel:
    """Config, weights (in `dtype`; those `keep` names, if given) and tokenizer of an
    HF-style model directory."""
    directory = Path(directory)
    cfg = read_json(directory / "config.json")
    tokenizer = load_hf_tokenizer(directory)
    generation_file = directory / "generation_config.json"
    generation_eos = (_ids(read_json(generation_file).get("eos_token_id"))
                      if generation_file.exists() else [])
    architecture_of(cfg, directory / "config.json")  # before reading any weights
    eos_ids, bos = _special_ids(cfg, tokenizer, generation_eos)
    config = config_from_hf(cfg, directory / "config.json", eos_ids, bos)
    weights, shapes = _load_weights(directory, dtype, config.num_hidden_layers,
                                    _FLOAT32_WEIGHTS.get(config.architecture, ()), keep)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # same tensor as the embedding; keep one layout
        shapes.pop("lm_head.weight", None)
    last = f"model.layers.{config.num_hidden_layers - 1}."
    required = ["model.embed_tokens.weight", "model.norm.weight",
                last + ("mlp.down_proj.weight" if not config.is_moe(config.num_hidden_layers - 1)
                        else "mlp.router.weight" if config.expert_style == "gpt_oss"
                        else "mlp.gate.weight")]
    if not config.tie_word_embeddings:
        required.append("lm_head.weight")
    missing = [key for key in required
               if key not in weights and (keep is None or keep(key) or key not in shapes)]
    if missing:
        raise ModelFileError(f"{directory}: weights lack {', '.join(missing)}")
    return LoadedModel(
        name=name or directory.name, config=config, weights=weights, tokenizer=tokenizer,
        chat_template=tokenizer.chat_template, source_path=str(directory),
        extra={"format": "safetensors", "model_type": cfg.get("model_type"),
               "sliding_window": cfg.get("sliding_window"), **kept_extra(weights, shapes)},
    )
