"""Loading an HF-style model directory (config.json, safetensors, tokenizer.json) for Llama,
Mistral and Qwen2 decoders into a LoadedModel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from minimill.models.tokenizer import END_OF_TURN_TOKENS, Tokenizer
from minimill.models.tokenizer_files import load_hf_tokenizer, read_json
from minimill.models.types import LoadedModel, ModelConfig, ModelFileError

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
# Defaults of the corresponding transformers config classes, for keys a config.json omits.
_MAX_POSITIONS_DEFAULT = {"llama": 2048, "qwen2": 32768}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling")
    if scaling is None and isinstance(cfg.get("rope_parameters"), dict):
        # transformers >= 5 writes rope_theta and the scaling into one `rope_parameters` dict.
        scaling = {k: v for k, v in cfg["rope_parameters"].items() if k != "rope_theta"}
    if not scaling:
        return None
    scaling = dict(scaling)
    # Older configs say "type"; keep the dict as given but make "rope_type" always present.
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    return None if scaling["rope_type"] == "default" and len(scaling) == 1 else scaling


def config_from_hf(cfg: dict[str, Any], path: Path, tokenizer: Tokenizer,
                   generation_eos: list[int]) -> ModelConfig:
    """ModelConfig from an HF config.json dict."""
    names = cfg.get("architectures") or []
    arch = next((_ARCHITECTURES[n] for n in names if n in _ARCHITECTURES), None)
    if arch is None:
        raise ModelFileError(f"{path}: architectures {names} not supported "
                             f"(supported: {', '.join(_ARCHITECTURES)})")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias", False):
        raise ModelFileError(f"{path}: only SiLU-gated MLPs without bias are supported")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        rope_params = cfg.get("rope_parameters") or {}
        eos_ids = _ids(cfg.get("eos_token_id")) + generation_eos
        if tokenizer.eos_token_id is not None:
            eos_ids.append(tokenizer.eos_token_id)
        eos_ids += [i for t in END_OF_TURN_TOKENS if (i := tokenizer.token_to_id(t)) is not None]
        bos = cfg.get("bos_token_id", tokenizer.bos_token_id)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings")
                                        or _MAX_POSITIONS_DEFAULT[arch]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            rope_scaling=_rope_scaling(cfg),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: config.json is missing or has a bad value: {exc}") from exc


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


def _load_weights(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in _shard_files(directory):
        if not shard.is_file():
            raise ModelFileError(f"{shard}: weight file is missing")
        try:
            tensors = load_file(str(shard))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFileError(f"{shard}: truncated or corrupt safetensors file ({exc})") from exc
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints kept
                continue
            weights[name] = tensor.to(dtype)
    return weights


def load_hf_dir(directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                name: str | None = None) -> LoadedModel:
    """Config, weights (in `dtype`) and tokenizer of an HF-style model directory."""
    directory = Path(directory)
    cfg = read_json(directory / "config.json")
    tokenizer = load_hf_tokenizer(directory)
    generation_file = directory / "generation_config.json"
    generation_eos = (_ids(read_json(generation_file).get("eos_token_id"))
                      if generation_file.exists() else [])
    config = config_from_hf(cfg, directory / "config.json", tokenizer, generation_eos)
    weights = _load_weights(directory, dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # same tensor as the embedding; keep one layout
    required = ["model.embed_tokens.weight", "model.norm.weight",
                f"model.layers.{config.num_hidden_layers - 1}.mlp.down_proj.weight"]
    if not config.tie_word_embeddings:
        required.append("lm_head.weight")
    missing = [key for key in required if key not in weights]
    if missing:
        raise ModelFileError(f"{directory}: weights lack {', '.join(missing)}")
    return LoadedModel(
        name=name or directory.name, config=config, weights=weights, tokenizer=tokenizer,
        chat_template=tokenizer.chat_template, source_path=str(directory),
        extra={"format": "safetensors", "model_type": cfg.get("model_type"),
               "sliding_window": cfg.get("sliding_window")},
    )
