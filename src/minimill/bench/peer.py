"""Another engine measured beside minimill in the same run (`bench engine --peer vllm`).

The peer lives in its own Python environment (`--peer-python`): minimill never imports it.
The model is handed over as an HF directory written from the weights minimill loaded (so both
engines run the same numbers), the prompts as token ids (so both run the same tokens).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from minimill.engine.memory import release_freed_memory
from minimill.models.types import LoadedModel

PEERS = ("vllm",)


class PeerError(RuntimeError):
    """The peer could not be run; the message says why (its own output's tail included)."""


def export_hf_dir(loaded: LoadedModel, dtype: torch.dtype, directory: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files of an HF checkpoint of
    `loaded`'s architecture holding its weights (experts one tensor each, as HF checkpoints
    keep them)."""
    from safetensors.torch import save_file

    from minimill.bench.hf_baseline import hf_class, hf_config

    c = loaded.config
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(c, dtype)
    config.architectures = [hf_class(c.architecture).__name__]
    config.save_pretrained(directory)
    weights = {name: w.to(dtype).contiguous() for name, w in loaded.weights.items()
               if not (c.tie_word_embeddings and name == "lm_head.weight")}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tok = loaded.tokenizer
    tok.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
        "eos_token": tok.eos_token, "pad_token": tok.pad_token, "unk_token": tok.unk_token,
        "chat_template": loaded.chat_template, "model_max_length": c.max_position_embeddings,
    }, indent=1))


def check_peer(peer: str, python: str | None) -> str:
    """The peer is one minimill knows and its Python exists; returns that Python. Checked
    before minimill's own rounds, which take minutes, not after them."""
    if peer not in PEERS:
        raise PeerError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    if python is None:
        raise PeerError(f"--peer {peer} needs --peer-python: the Python of the peer's "
                        "environment")
    if not Path(python).exists():
        raise PeerError(f"--peer-python {python} does not exist")
    return python


def run_peer(peer: str, python: str, loaded: LoadedModel, dtype: torch.dtype,
             prompts: list[list[int]], max_tokens: list[int], max_num_seqs: int,
             kv_cache_gib: int, timeout_s: float = 3600.0,
             drop_weights: bool = False) -> dict[str, Any]:
    """Run the peer over the same prompts; returns its JSON figures (output_tok_s, ...).
    `drop_weights`: empty `loaded.weights` once written for the peer (a caller that needs
    them no more leaves the peer the memory: a model the size of the machine's share fits
    once, not twice). `kv_cache_gib`: the peer's KV space on a CPU."""
    check_peer(peer, python)
    runner = Path(__file__).with_name("vllm_runner.py")
    with tempfile.TemporaryDirectory(prefix="minimill-peer-") as tmp:
        model_dir = Path(tmp) / "model"
        export_hf_dir(loaded, dtype, model_dir)
        if drop_weights:
            loaded.weights.clear()
            gc.collect()
            release_freed_memory()
        longest = max(len(p) + n for p, n in zip(prompts, max_tokens, strict=True))
        spec = {"model_dir": str(model_dir), "dtype": str(dtype).removeprefix("torch."),
                "prompts": prompts, "max_tokens": max_tokens, "max_num_seqs": max_num_seqs,
                "max_model_len": max(2048, longest), "kv_cache_gib": kv_cache_gib}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "ACTIVE")}
        env.pop("VIRTUAL_ENV", None)
        try:
            proc = subprocess.run([python, str(runner), str(spec_path)], capture_output=True,
                                  text=True, timeout=timeout_s, env=env, cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            raise PeerError(f"{peer} did not finish within {timeout_s:.0f} s") from exc
    for line in proc.stdout.splitlines():
        if line.startswith("PEER_RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("PEER_RESULT "))
            return result
    # The root cause of a failure is often printed well before the traceback that ends it.
    causes = [line for line in (proc.stdout + proc.stderr).splitlines()
              if "Error" in line or "error:" in line][-12:]
    tail = "\n".join(causes) + "\n...\n" + (proc.stdout + proc.stderr)[-2000:]
    raise PeerError(f"{peer} failed (exit {proc.returncode}):\n{tail}")
