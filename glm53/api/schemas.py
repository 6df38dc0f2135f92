"""Request and response bodies of the HTTP API, as msgspec Structs (OpenAI and SGLang shapes).

Requests ignore unknown keys (clients send extensions through `extra_body`); fields glm53 cannot
honour are declared so that a request using them gets a 400 instead of being silently ignored.
Optional response keys default to UNSET, which leaves them out of the JSON.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

PosInt = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
StopString = Annotated[str, Meta(min_length=1)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=16)]
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=-1)]
MinP = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]


# --- chat requests ------------------------------------------------------------------------------
class TextPart(Struct, tag_field="type", tag="text"):
    text: str


class ImageURL(Struct):
    url: str
    detail: str | None = None


class ImagePart(Struct, tag_field="type", tag="image_url"):
    image_url: ImageURL


class FunctionCall(Struct):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text; a JSON object is accepted too


class ToolCall(Struct):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class Message(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # clients echo it back; the template decides what to keep
    reasoning: str | None = None


class FunctionDef(Struct):
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(Struct):
    include_usage: bool = False


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(Struct, kw_only=True):
    """Sampling fields shared by chat and completions."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    n: int = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    user: str | None = None


class ChatRequest(SamplingFields, kw_only=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0)] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    model: str
    prompt: str | list[Any]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PosInt | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: Annotated[int, Meta(ge=0)] | None = None
    best_of: PosInt | None = None


# --- chat and completion responses --------------------------------------------------------------
class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens restored from the prefix cache, not recomputed


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class OutFunction(Struct):
    name: str
    arguments: str


class OutToolCall(Struct):
    id: str
    function: OutFunction
    type: str = "function"


class OutMessage(Struct):
    content: str | None
    role: str = "assistant"
    reasoning_content: str | None | UnsetType = UNSET
    reasoning: str | None | UnsetType = UNSET
    tool_calls: list[OutToolCall] | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: OutMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class DeltaToolCall(Struct):
    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: OutFunction | UnsetType = UNSET


class ChatDelta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "text_completion"


# --- models, health, errors ---------------------------------------------------------------------
class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    owned_by: str = "glm53"
    object: str = "model"
    root: str | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class Health(Struct):
    status: str


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(Struct):
    error: ErrorDetail


# --- SGLang-shaped native endpoints -------------------------------------------------------------
class GenerateSampling(Struct, kw_only=True):
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    max_new_tokens: PosInt | None = None
    stop: Stop | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    seed: Seed | None = None
    ignore_eos: bool = False


class GenerateRequest(Struct, kw_only=True):
    text: str | None = None
    input_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    sampling_params: GenerateSampling | None = None
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = None


class FinishInfo(Struct):
    type: str
    matched: str | int | None = None
    message: str | None | UnsetType = UNSET


class GenerateMeta(Struct):
    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishInfo | None
    e2e_latency: float
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache


class GenerateResponse(Struct):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class TokenizeRequest(Struct, kw_only=True):
    prompt: str


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
