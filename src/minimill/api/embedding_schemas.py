"""Wire schemas of POST /v1/embeddings' answer (OpenAI's `list` of `embedding` objects)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int = Field(description="The input's position in the request's `input`.")
    embedding: list[float] | str = Field(
        description="The L2-normalised vector: numbers, or with encoding_format \"base64\" "
                    "its little-endian float32 bytes in base64.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int = Field(description="Equal to prompt_tokens: nothing is generated.")
    cost_usd: float = Field(description="What the request is billed, in US dollars: its "
                            "prompt tokens at the operator's price list.")


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
