"""Wire schemas of responses (what clients see), separate from store rows and records."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from minimill.control.files import MAX_EXPIRES_AFTER_S, MIN_EXPIRES_AFTER_S
from minimill.control.records import BatchRecord, FileRecord


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minimill"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def of(cls, record: FileRecord) -> FileObject:
        return cls(id=record.id, bytes=record.bytes, created_at=int(record.created_at),
                   filename=record.filename, purpose=record.purpose,
                   expires_at=None if record.expires_at is None else int(record.expires_at))


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class ExpiresAfter(BaseModel):
    """OpenAI's file expiration policy: `seconds` after the file's creation."""

    model_config = ConfigDict(extra="ignore", strict=True)

    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRES_AFTER_S, le=MAX_EXPIRES_AFTER_S)


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    input_file_id: str = Field(min_length=1, max_length=100)
    endpoint: str = Field(description="/v1/chat/completions, /v1/completions, "
                                      "/v1/embeddings or /v1/responses")
    completion_window: str = Field("24h", description='"24h", or longer ("48h", "7d")')
    metadata: dict[str, str] | None = None
    # When the output and error files expire (default: the server's file expiry).
    output_expires_after: ExpiresAfter | None = None


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    cost_usd: float = Field(description="What the batch is billed so far, in US dollars.")


def _ts(value: float | None) -> int | None:
    return None if value is None else int(value)


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    usage: BatchUsage

    @classmethod
    def of(cls, b: BatchRecord) -> BatchObject:
        errors = (BatchErrors(data=[BatchError.model_validate(e) for e in b.errors])
                  if b.errors else None)
        return cls(
            id=b.id, endpoint=b.endpoint, errors=errors, input_file_id=b.input_file_id,
            completion_window=b.completion_window, status=b.status.value,
            output_file_id=b.output_file_id, error_file_id=b.error_file_id,
            created_at=int(b.created_at), in_progress_at=_ts(b.in_progress_at),
            expires_at=_ts(b.expires_at), finalizing_at=_ts(b.finalizing_at),
            completed_at=_ts(b.completed_at), failed_at=_ts(b.failed_at),
            expired_at=_ts(b.expired_at), cancelling_at=_ts(b.cancelling_at),
            cancelled_at=_ts(b.cancelled_at),
            request_counts=RequestCounts(total=b.counts.total, completed=b.counts.completed,
                                         failed=b.counts.failed),
            metadata=b.metadata,
            usage=BatchUsage(input_tokens=b.usage.prompt_tokens,
                             output_tokens=b.usage.completion_tokens,
                             total_tokens=b.usage.prompt_tokens + b.usage.completion_tokens,
                             cost_usd=b.usage.billed_usd))


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(default=0, description="Prompt tokens served from the KV "
                               "cache (billed at the cached-input price).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    cost_usd: float = Field(description="What the request is billed, in US dollars: tokens "
                            "at the operator's price list for the model and service tier.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="The call's arguments as JSON text, as generated.")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    service_tier: str
    system_fingerprint: str


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    service_tier: str
    system_fingerprint: str


class OutageWindow(BaseModel):
    start_at: float = Field(description="Unix seconds.")
    end_at: float = Field(description="Unix seconds.")


class OutageCreate(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    start_at: float = Field(description="Unix seconds.")
    end_at: float = Field(description="Unix seconds; after start_at.")


class OutageCreated(BaseModel):
    id: int
    object: Literal["outage"] = "outage"
    site: str
    start_at: float
    end_at: float


class OutageObject(OutageCreated):
    created_at: float


class OutageList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OutageObject]


class OutageDeleted(BaseModel):
    id: int
    object: Literal["outage.deleted"] = "outage.deleted"
    deleted: bool = True
