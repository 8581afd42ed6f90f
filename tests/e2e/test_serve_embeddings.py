"""POST /v1/embeddings end to end: the official openai client against `minimill serve` (control
plane, local worker, builtin engine over SmolLM2, SQLite), realtime and in a batch."""

from __future__ import annotations

import base64
import json
import math
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from serve_process import MODEL, Serve, read_jsonl

from minimill.models.loader import load_model

pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
         "def add(a, b): return a + b"]


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(v * v for v in vector))


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (_norm(a) * _norm(b))


def _raw(serve: Serve, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{serve.base_url}/embeddings", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {serve.key}"})


def test_shape_usage_and_unit_vectors(serve: Serve, model_file: Path) -> None:
    resp = serve.client().embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert resp.object == "list" and resp.model == MODEL
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert {len(d.embedding) for d in resp.data} == {576}  # SmolLM2-135M's hidden size
    for d in resp.data:
        assert abs(_norm(d.embedding) - 1.0) < 1e-3
    assert _cosine(resp.data[0].embedding, resp.data[1].embedding) < 0.9999
    # Billed for the prompt alone: the tokens of each text as the model's tokenizer makes them.
    tokenizer = load_model(str(model_file), torch.float32).tokenizer
    expected = sum(len(tokenizer.encode(t, add_special_tokens=True)) for t in TEXTS)
    assert resp.usage.prompt_tokens == expected
    assert resp.usage.total_tokens == expected


def test_float_and_base64_are_the_same_vector(serve: Serve) -> None:
    floats = _raw(serve, {"model": MODEL, "input": TEXTS[0]}).json()["data"][0]["embedding"]
    encoded = _raw(serve, {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"})
    text = encoded.json()["data"][0]["embedding"]
    assert isinstance(text, str)
    raw = base64.b64decode(text)
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert decoded == floats  # float32 values, both ways exactly
    # The openai client asks for base64 by default and decodes it.
    default = serve.client().embeddings.create(model=MODEL, input=TEXTS[0])
    assert [float(v) for v in default.data[0].embedding] == floats


def test_token_id_inputs_equal_their_text(serve: Serve, model_file: Path) -> None:
    tokenizer = load_model(str(model_file), torch.float32).tokenizer
    ids = [tokenizer.encode(t, add_special_tokens=True) for t in TEXTS[:2]]
    client = serve.client()
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        assert _cosine(a.embedding, b.embedding) > 0.9999
    assert _cosine(one.data[0].embedding, by_text.data[0].embedding) > 0.9999
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)


def test_vector_is_the_pooled_normalised_hidden_state_of_transformers(
        serve: Serve, model_file: Path) -> None:
    from minimill.bench.hf_baseline import build_hf_model

    loaded = load_model(str(model_file), torch.float32)
    hf = build_hf_model(loaded, torch.float32)
    ids = loaded.tokenizer.encode(TEXTS[1], add_special_tokens=True)
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    ref = torch.nn.functional.normalize(hidden, dim=-1).tolist()
    ours = serve.client().embeddings.create(model=MODEL, input=TEXTS[1],
                                            encoding_format="float").data[0].embedding
    # Served in float32: equal but for the order of float sums.
    assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-4


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input[1]"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "hi", "dimensions": 64}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "temperature": 0.5}, "temperature"),
    ({"input": [[1, 2], [-3]]}, "input[1]"),
    ({"input": [7] * 9000}, "input"),
])
def test_bad_bodies_are_400s_naming_the_param(serve: Serve, body: dict[str, Any],
                                              param: str) -> None:
    resp = _raw(serve, {"model": MODEL, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_text_over_the_context_is_a_400_with_its_code(serve: Serve) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        serve.client().embeddings.create(model=MODEL, input="word " * 9000)
    assert info.value.code == "context_length_exceeded"


def test_unknown_model_is_a_404(serve: Serve) -> None:
    with pytest.raises(openai.NotFoundError):
        serve.client().embeddings.create(model="no-such-model", input="hi")


def test_batch_of_embedding_lines(serve: Serve, tmp_path: Path) -> None:
    lines = [json.dumps({"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": MODEL, "input": [TEXTS[i % 3], TEXTS[(i + 1) % 3]],
                                  **({"encoding_format": "base64"} if i == 1 else {})}})
             for i in range(6)]
    lines.append(json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                             "body": {"model": MODEL, "input": "", "dimensions": 3}}))
    path = tmp_path / "embeddings.jsonl"
    path.write_text("\n".join(lines) + "\n")
    client = serve.client()
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    deadline = time.time() + 300
    while (batch := client.batches.retrieve(batch.id)).status not in (
            "completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, "the batch did not finish"
        time.sleep(0.5)
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None and batch.error_file_id is not None
    out = {r["custom_id"]: r for r in read_jsonl(client.files.content(
        batch.output_file_id).read())}
    errors = read_jsonl(client.files.content(batch.error_file_id).read())
    assert sorted(out) == [f"e-{i}" for i in range(6)]
    assert [e["custom_id"] for e in errors] == ["bad"]
    realtime = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    first = out["e-0"]["response"]["body"]
    assert first["object"] == "list" and len(first["data"]) == 2
    assert first["usage"]["prompt_tokens"] == realtime.usage.prompt_tokens
    for line, ref in zip(first["data"], realtime.data, strict=True):
        assert _cosine(line["embedding"], ref.embedding) > 0.9999
    encoded = out["e-1"]["response"]["body"]["data"][0]["embedding"]
    assert isinstance(encoded, str) and len(base64.b64decode(encoded)) == 576 * 4
