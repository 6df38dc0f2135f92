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
NumLogprobs = Annotated[int, Meta(ge=0, le=20)]


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
    n: PosInt = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    return_tokens_as_token_ids: bool = False
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
    top_logprobs: NumLogprobs | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    model: str
    prompt: str | list[Any]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: NumLogprobs | None = None
    best_of: PosInt | None = None


# --- chat and completion responses --------------------------------------------------------------
class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens restored from the prefix cache, not recomputed


class TierUsage(Struct):
    """`usage.glm53`: what the request cost in each tier (glm53.engine.base.StreamUsage says
    what each count means). `tiers_counted` is false where the engine does not count per
    request yet (the GPU engine): its counts are then 0, the seconds are still measured."""

    vram_hits: int
    zero_copy_misses: int
    cpu_lane_picks: int
    ram_hits: int
    ram_misses: int
    store_read_bytes: int
    prefix_cached_tokens: int
    prefill_seconds: float
    decode_seconds: float
    tiers_counted: bool


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    glm53: TierUsage | UnsetType = UNSET


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


class TopLogprob(Struct):
    token: str
    bytes: list[int]
    logprob: float


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]
    refusal: None = None


class ChatChoice(Struct):
    index: int
    message: OutMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


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
    logprobs: ChatLogprobs | None = None


class ChatChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


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
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None


class GenerateRequest(Struct, kw_only=True):
    text: str | None = None
    input_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    sampling_params: GenerateSampling | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: Annotated[int, Meta(ge=-1)] = -1
    top_logprobs_num: NumLogprobs = 0
    return_text_in_logprobs: bool = False
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
    input_token_logprobs: list[list] | UnsetType = UNSET
    output_token_logprobs: list[list] | UnsetType = UNSET
    input_top_logprobs: list[list[list] | None] | UnsetType = UNSET
    output_top_logprobs: list[list[list] | None] | UnsetType = UNSET


class GenerateResponse(Struct):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class TokenizeRequest(Struct, kw_only=True):
    prompt: str


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
