"""Wire schemas of the Responses API and webhook endpoints (what clients see), in OpenAI's
shapes as the official client parses them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minimill.control.webhooks import WebhookEndpoint


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(BaseModel):
    """A call the model made: run the function, then answer with a function_call_output
    input item carrying its `call_id`."""

    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON text of the arguments.")
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    cost_usd: float = Field(description="What the response is billed, in US dollars: tokens "
                            "at the operator's price list for the model and service tier.")


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema's name, schema, strict...

    type: Literal["text", "json_object", "json_schema"]


class TextConfig(BaseModel):
    format: TextFormat
    verbosity: str


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    safety_identifier: str | None
    service_tier: str
    store: bool
    temperature: float
    text: TextConfig
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice
    tools: list[FunctionTool]
    top_p: float
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    completed_at: int | None


class InputPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "output_text"]
    text: str


class InputMessageItem(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    status: Literal["completed"]
    content: list[InputPart]


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputPart]
    status: Literal["completed"]


InputItem = Annotated[InputMessageItem | FunctionCall | FunctionCallOutput,
                      Field(discriminator="type")]


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool


class WebhookEndpointCreate(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1, max_length=200)
    url: str = Field(min_length=1, max_length=2000, description="http:// or https://")
    event_types: list[str] = Field(min_length=1, max_length=16, description=(
        "response.completed, response.failed, response.cancelled, response.incomplete, "
        "batch.completed, batch.failed, batch.expired, batch.cancelled"))


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    created_at: int
    updated_at: int
    name: str
    url: str
    event_types: list[str]
    signing_secret_hint: str

    @classmethod
    def of(cls, endpoint: WebhookEndpoint) -> WebhookEndpointObject:
        return cls(id=endpoint.id, created_at=int(endpoint.created_at),
                   updated_at=int(endpoint.created_at), name=endpoint.name, url=endpoint.url,
                   event_types=list(endpoint.event_types),
                   signing_secret_hint=endpoint.secret_hint)


class WebhookEndpointWithSecret(WebhookEndpointObject):
    signing_secret: str = Field(description="Shown once: sign-checking key of deliveries.")


class WebhookEndpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookEndpointObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool
