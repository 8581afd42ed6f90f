"""Every new architecture through `minimill serve` and a batch, as a user runs it: a tiny
random HF checkpoint pulled by path, served by its name; the chat completion and the batch
lines answer with the tokens the offline engine computes (bit for bit: the engine is
batch-invariant) and transformers' greedy tokens (up to a genuine near-tie)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from serve_process import Serve, make_home, read_jsonl

from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel
from tiny_hf import save_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import assert_greedy_close

from tiny_hf import hf_greedy

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def loaded_f32(model_file: Path) -> LoadedModel:
    """The default model (its tokenizer and chat template go into the tiny checkpoints)."""
    return load_model(str(model_file), torch.float32)
QUESTIONS = ["Name a tidal power station.", "Why do tides turn twice a day?"]


def _wait_batch(serve: Serve, batch_id: str, timeout: float = 300.0) -> Any:
    client = serve.client()
    deadline = time.time() + timeout
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.3)
    raise TimeoutError(f"batch {batch_id} did not finish in {timeout}s")


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3", "gpt_oss"])
def test_serve_and_batch_answer_as_the_engine_and_transformers(
        arch: str, tmp_path: Path, model_file: Path, loaded_f32: LoadedModel) -> None:
    source = tmp_path / f"tiny-{arch}"
    hf = save_tiny(arch, source, loaded_f32)
    home = make_home(tmp_path / "home-root", model_file.parent.parent)
    name = f"tiny-{arch.replace('_', '-')}"
    serve = Serve(home, model=name)
    pulled = serve.cli("pull", str(source), "--name", name)
    assert pulled.returncode == 0, pulled.stderr
    loaded = load_model(str(source), torch.float32)
    prompts = [loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True), add_special_tokens=False)
        for q in QUESTIONS]
    llm = LLM(loaded, dtype="float32", num_kv_blocks=128)
    # The prompts run past Gemma's and gpt-oss's sliding window (8 positions).
    assert min(len(p) for p in prompts) > 16
    # What the API does (it stops at end-of-sequence), and transformers' greedy tokens for as
    # long (it does not).
    offline = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert all(len(out.output_token_ids) > 2 for out in offline)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            top_logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy), strict=True):
        ref_tokens, ref_top = hf_greedy(hf, prompt, MAX_TOKENS)
        assert out.logprobs is not None
        assert_greedy_close(out.output_token_ids, [lp.top for lp in out.logprobs],
                            ref_tokens, ref_top, "the engine's matmul shapes differ from HF's")
    try:
        serve.start_and_wait()
        client = serve.client()
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": QUESTIONS[0]}],
            max_tokens=MAX_TOKENS, temperature=0)
        assert chat.choices[0].message.content == offline[0].text
        lines = [json.dumps({"custom_id": f"q{i}", "method": "POST",
                             "url": "/v1/chat/completions",
                             "body": {"model": name, "temperature": 0,
                                      "max_tokens": MAX_TOKENS,
                                      "messages": [{"role": "user", "content": q}]}})
                 for i, q in enumerate(QUESTIONS)]
        path = tmp_path / "batch.jsonl"
        path.write_text("\n".join(lines) + "\n")
        uploaded = client.files.create(file=path.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        done = _wait_batch(serve, batch.id)
        assert done.status == "completed", done
        answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
                   for r in read_jsonl(client.files.content(done.output_file_id).read())}
        assert answers == {f"q{i}": out.text for i, out in enumerate(offline)}
    finally:
        serve.stop()
