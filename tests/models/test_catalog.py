"""`minimill pull PATH` and `minimill models list`: an HF directory of each architecture is
checked, cached under its name, listed with its parameters, and served by that name; an
unsupported architecture is refused with the list of supported ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minimill.cli import app
from minimill.models.hf_config import HF_ARCHITECTURES
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel
from tiny_hf import ARCHITECTURES, COMMON, save_tiny


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_pull_a_directory_then_list_and_load_it_by_name(arch: str, tmp_path: Path,
                                                        minimill_home: Path,
                                                        loaded_f32: LoadedModel) -> None:
    source = tmp_path / f"tiny-{arch}"
    hf = save_tiny(arch, source, loaded_f32)
    pulled = CliRunner().invoke(app, ["pull", str(source), "--name", f"my-{arch}"])
    assert pulled.exit_code == 0, pulled.output
    listed = CliRunner().invoke(app, ["models", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    models = {m["name"]: m for m in json.loads(listed.output)["models"]}
    assert set(models) == {"smollm2-135m", f"my-{arch}"}
    entry = models[f"my-{arch}"]
    assert entry["architecture"] == arch and entry["format"] == "safetensors"
    # Ours counts the matrices (transformers' count has norms, biases and sinks too).
    assert entry["params_total"] == sum(
        p.numel() for n, p in hf.named_parameters()
        if not ("norm" in n or "bias" in n or n.endswith("sinks")))
    if arch in ("qwen3_moe", "gpt_oss"):
        c = ARCHITECTURES[arch]
        idle = c.get("num_experts", c.get("num_local_experts", 0)) - c["num_experts_per_tok"]
        moe_layers = COMMON["num_hidden_layers"] - len(c.get("mlp_only_layers", []))
        width = c.get("moe_intermediate_size", COMMON["intermediate_size"])
        expert = 3 * COMMON["hidden_size"] * width
        assert entry["params_active"] == entry["params_total"] - moe_layers * idle * expert
    else:
        assert entry["params_active"] == entry["params_total"]
    assert entry["size_bytes"] > 4 * entry["params_total"]  # float32 weights
    assert models["smollm2-135m"]["architecture"] == "llama"
    loaded = load_model(f"my-{arch}", torch.float32)
    assert loaded.config.architecture == arch and loaded.name == f"my-{arch}"


def test_an_unsupported_architecture_lists_the_supported_ones(
        tmp_path: Path, minimill_home: Path, loaded_f32: LoadedModel) -> None:
    source = tmp_path / "other"
    save_tiny("qwen3", source, loaded_f32)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (source / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["pull", str(source)])
    assert result.exit_code == 1
    assert "FalconForCausalLM" in result.output and "not supported" in result.output
    assert all(name in result.output for name in HF_ARCHITECTURES)
    listed = CliRunner().invoke(app, ["models", "list", "--json"])
    assert [m["name"] for m in json.loads(listed.output)["models"]] == ["smollm2-135m"]


def test_a_cache_name_cannot_leave_the_cache(tmp_path: Path, minimill_home: Path,
                                             loaded_f32: LoadedModel) -> None:
    source = tmp_path / "tiny"
    save_tiny("qwen3", source, loaded_f32)
    for bad in ("../escape", "a/b", ".hidden", "smollm2-135m"):
        result = CliRunner().invoke(app, ["pull", str(source), "--name", bad])
        assert result.exit_code == 1, bad
        assert "cannot name a cached model" in result.output
    assert not (minimill_home.parent / "escape").exists()
