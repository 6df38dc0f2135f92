"""POST /v1/chat/completions: render with the checkpoint's template, generate, parse the output
into reasoning, content and tool calls, and answer as one JSON body or as SSE chunks."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from msgspec import UNSET

from glm53.api import generation as gen
from glm53.api.body import (
    check_depth,
    decode_request,
    join_path,
    lone_surrogate,
    surrogate_error,
)
from glm53.api.errors import ApiError
from glm53.api.http import DisconnectWatcher, Receive, Send, send_bytes
from glm53.api.limits import check_messages, check_prompt_chars, check_schema
from glm53.api.logprobs import TokenNames, chat_logprobs
from glm53.api.schemas import (
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChatDelta,
    ChatRequest,
    ChunkChoice,
    DeltaToolCall,
    ImagePart,
    Message,
    NamedToolChoice,
    OutFunction,
    OutMessage,
    OutToolCall,
)
from glm53.api.state import ServerState
from glm53.chat.parse import CompletionParser, Delta
from glm53.chat.render import RESERVED_VARIABLES, TemplateError, render
from glm53.engine.base import FinishReason, PromptTooLong
from glm53.engine.grammar import (
    Constraint,
    GrammarError,
    GrammarSpec,
    build_constraints,
    json_schema_grammar,
    tool_call_grammar,
)
from glm53.engine.requests import GenerationRequest
from glm53.engine.tokenizer import missing_template

_decoder = msgspec.json.Decoder(ChatRequest)
_encoder = msgspec.json.Encoder()
_RESERVED_KWARGS = ("documents", *sorted(RESERVED_VARIABLES))
# chat_template_kwargs the GLM templates read, and the JSON types they must have.
_KWARG_TYPES = {
    "enable_thinking": (bool, "true or false"),
    "clear_thinking": (bool, "true or false"),
    "reasoning_effort": (str, "a string such as 'low' or 'high'"),
}
# Bodies longer than this are rendered and tokenized, and their grammar built, on
# glm53.api.offload's threads (shorter ones render inline and compile a grammar on asyncio's).
_INLINE_RENDER_CHARS = 16384


def _message_dict(i: int, m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role}
    if isinstance(m.content, list):
        parts = []
        for j, part in enumerate(m.content):
            if isinstance(part, ImagePart):
                raise ApiError(
                    400,
                    "image input is not supported: glm53 serves GLM-5.3-Flash's text model",
                    param=f"messages[{i}].content[{j}]",
                )
            parts.append({"type": "text", "text": part.text})
        out["content"] = parts
    else:
        out["content"] = m.content
    for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
        out[key] = getattr(m, key)
    if m.tool_calls:
        out["tool_calls"] = [_tool_call_dict(i, j, tc) for j, tc in enumerate(m.tool_calls)]
    return out


def _tool_call_dict(i: int, j: int, tc) -> dict[str, Any]:
    args, param = tc.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"
    if isinstance(args, str):
        check_depth(args.encode("utf-8"), param)
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise ApiError(
                400, f"tool call arguments are not valid JSON: {exc}", param=param
            ) from None
        # Python's json takes "\ud800" alone, which no tokenizer can encode
        if (found := lone_surrogate(args)) is not None:
            raise surrogate_error(join_path(param, found[0]), found[1])
    if not isinstance(args, dict):
        raise ApiError(400, "tool call arguments must be a JSON object", param=param)
    return {
        "id": tc.id,
        "type": "function",
        "function": {"name": tc.function.name, "arguments": args},
    }


class _Plan(msgspec.Struct):
    """A validated chat request, ready to generate."""

    req: ChatRequest
    messages: list[dict[str, Any]]
    render_tools: list[dict[str, Any]] | None
    parse_tools: list[dict[str, Any]] | None
    tool_choice: Any
    template_kwargs: dict[str, Any]


def _text_chars(m: Message) -> int:
    if isinstance(m.content, str):
        return len(m.content)
    if isinstance(m.content, list):
        return sum(len(p.text) for p in m.content if not isinstance(p, ImagePart))
    return 0


def _check_limits(state: ServerState, req: ChatRequest) -> None:
    """The request-size limits (glm53.api.limits) that bound rendering and grammar work."""
    settings = state.settings
    check_messages(settings, len(req.messages))
    check_prompt_chars(settings, sum(_text_chars(m) for m in req.messages), "messages")
    if req.response_format is not None and req.response_format.type == "json_schema":
        schema = (req.response_format.json_schema or {}).get("schema")
        check_schema(settings, schema, "response_format.json_schema.schema")
    for i, tool in enumerate(req.tools or ()):
        parameters = tool.function.parameters
        if parameters is not None:
            check_schema(settings, parameters, f"tools[{i}].function.parameters")


def _plan(state: ServerState, body: bytes) -> _Plan:
    req = decode_request(_decoder, body)
    gen.check_model(state, req.model)
    gen.check_choices(state, req)
    _check_limits(state, req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400, "stream_options is only allowed with stream=true", param="stream_options"
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(
            400, "top_logprobs needs logprobs=true in the same request", param="top_logprobs"
        )
    if (
        req.response_format is not None
        and req.response_format.type == "json_schema"
        and not isinstance((req.response_format.json_schema or {}).get("schema"), dict)
    ):
        raise ApiError(
            400,
            "response_format json_schema needs json_schema.schema, a JSON schema object",
            param="response_format.json_schema.schema",
        )
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
    tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    render_tools, template_choice = tools, None
    if choice == "required" or isinstance(choice, NamedToolChoice):
        if not tools:
            raise ApiError(400, "tool_choice requires a non-empty tools list", param="tool_choice")
        template_choice = msgspec.to_builtins(choice)
    if isinstance(choice, NamedToolChoice):
        render_tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not render_tools:
            names = ", ".join(t["function"]["name"] for t in tools)
            raise ApiError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not among the tools ({names})",
                param="tool_choice",
            )
    if choice == "none":
        render_tools = None
    kwargs = dict(req.chat_template_kwargs or {})
    _check_template_kwargs(kwargs)
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if template_choice is not None:
        kwargs.setdefault("tool_choice", template_choice)
    parse_tools = tools if choice != "none" else None
    return _Plan(req, messages, render_tools, parse_tools, choice, kwargs)


def _check_template_kwargs(kwargs: dict[str, Any]) -> None:
    for key in _RESERVED_KWARGS:
        if key in kwargs:
            raise ApiError(
                400,
                f"chat_template_kwargs may not set {key!r}: the server or jinja sets it (names "
                f"taken: {', '.join(_RESERVED_KWARGS)})",
                param=f"chat_template_kwargs.{key}",
            )
    for key, (kind, valid) in _KWARG_TYPES.items():
        value = kwargs.get(key)
        if value is not None and not isinstance(value, kind):
            raise ApiError(
                400,
                f"chat_template_kwargs.{key} must be {valid}, not {value!r}",
                param=f"chat_template_kwargs.{key}",
            )
    choice = kwargs.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required"):
        function = choice.get("function") if isinstance(choice, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise ApiError(
                400,
                "chat_template_kwargs.tool_choice must be 'none', 'auto', 'required' or "
                f'{{"type": "function", "function": {{"name": "..."}}}}, not {choice!r}',
                param="chat_template_kwargs.tool_choice",
            )


def _prompt(
    state: ServerState, template: str, plan: _Plan, tokenizer, context_length: int
) -> tuple[str, list[int]]:
    try:
        text = render(
            template,
            plan.messages,
            tools=plan.render_tools,
            add_generation_prompt=True,
            **plan.template_kwargs,
        )
    except TemplateError as exc:
        raise ApiError(400, f"cannot render these messages: {exc}", param="messages") from None
    check_prompt_chars(state.settings, len(text), "messages")
    try:
        return text, tokenizer.encode(text, context_length)
    except PromptTooLong as exc:
        raise gen.too_long(exc, "messages") from None


def _tool_choice_error(choice: Any, calls: list[dict[str, Any]]) -> str | None:
    if choice == "required" and not calls:
        return "tool_choice is 'required' but the model answered without a tool call"
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        if not calls or any(c["function"]["name"] != wanted for c in calls):
            return f"tool_choice names {wanted!r} but the model did not call (only) it"
    return None


def _out_calls(calls: list[dict[str, Any]]) -> list[OutToolCall]:
    return [
        OutToolCall(c["id"], OutFunction(c["function"]["name"], c["function"]["arguments"]))
        for c in calls
    ]


def _needs_grammar(plan: _Plan) -> bool:
    choice, response_format = plan.tool_choice, plan.req.response_format
    return (
        choice == "required"
        or isinstance(choice, NamedToolChoice)
        or (response_format is not None and response_format.type != "text")
    )


def _grammar(plan: _Plan, tokenizer, in_reasoning: bool) -> GrammarSpec | None:
    """The grammar a chat request's output must follow: tool calls for tool_choice "required"
    or a named function, else JSON for response_format json_object / json_schema; it starts
    after </think> when the prompt opens the reasoning."""
    req, choice, tools = plan.req, plan.tool_choice, plan.parse_tools or []
    try:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            indexed = list(enumerate(tools))
            if isinstance(choice, NamedToolChoice):
                indexed = [
                    (i, t) for i, t in indexed if t["function"]["name"] == choice.function.name
                ]
            many = choice == "required" and req.parallel_tool_calls is not False
            grammar = tool_call_grammar(indexed, tokenizer, many=many)
        elif req.response_format is not None and req.response_format.type == "json_object":
            grammar = json_schema_grammar({"type": "object"}, tokenizer, "response_format")
        elif req.response_format is not None and req.response_format.type == "json_schema":
            schema = req.response_format.json_schema["schema"]
            grammar = json_schema_grammar(schema, tokenizer, "response_format.json_schema.schema")
        else:
            return None
    except GrammarError as exc:
        raise ApiError(400, str(exc), param=exc.path, code="invalid_grammar") from None
    start_after = tokenizer.token_to_id("</think>") if in_reasoning else None
    return GrammarSpec(grammar, start_after)


def _constraints(
    plan: _Plan, tokenizer, in_reasoning: bool
) -> tuple[GrammarSpec | None, list[Constraint] | None]:
    """The request's grammar and one matcher per choice (compiling and building both take
    from a millisecond to a second: call it off the event loop)."""
    spec = _grammar(plan, tokenizer, in_reasoning)
    if spec is None:
        return None, None
    return spec, build_constraints(spec, tokenizer, plan.req.n)


class _Choice:
    """One choice's answer in the making: its parser, last event and logprob entries."""

    def __init__(self, parser: CompletionParser):
        self.parser = parser
        self.last = None
        self.logprobs: list = []


async def chat_completions(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    with DisconnectWatcher(receive) as watcher:
        # decoding a large body and turning its messages into the template's dicts hold the
        # GIL for tens of ms: off the loop, as the render is
        if len(body) > gen.INLINE_BODY_BYTES:
            plan = await state.offload.run(watcher, _plan, state, body)
        else:
            plan = _plan(state, body)
        scheduler = state.ready_scheduler()
        tokenizer = scheduler.engine.tokenizer
        if not tokenizer.chat_template:
            raise ApiError(
                400, missing_template(state.checkpoint or "the checkpoint"), param="messages"
            )
        return await _generate(state, plan, body, tokenizer, watcher, send)


async def _generate(
    state: ServerState,
    plan: _Plan,
    body: bytes,
    tokenizer,
    watcher: DisconnectWatcher,
    send: Send,
) -> int:
    scheduler = state.ready_scheduler()
    is_large = len(body) > _INLINE_RENDER_CHARS
    template = tokenizer.chat_template
    context = scheduler.context_length
    if is_large:
        text, prompt_ids = await state.offload.run(
            watcher, _prompt, state, template, plan, tokenizer, context
        )
    else:
        text, prompt_ids = _prompt(state, template, plan, tokenizer, context)
    req = plan.req
    defaults = scheduler.engine.generation_defaults
    in_reasoning = text.rstrip().endswith("<think>")
    grammar = constraints = None
    if _needs_grammar(plan):
        if is_large:
            grammar, constraints = await state.offload.run(
                watcher, _constraints, plan, tokenizer, in_reasoning
            )
        else:  # a small request's grammar: milliseconds, and llguidance drops the GIL
            grammar, constraints = await asyncio.to_thread(
                _constraints, plan, tokenizer, in_reasoning
            )
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        sampling=gen.request_sampling(defaults, req, tokenizer.vocab_size),
        max_new_tokens=req.max_completion_tokens or req.max_tokens,
        stop_token_ids=frozenset(tokenizer.eos_token_ids),
        stop_strings=gen.stop_strings(req.stop),
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        grammar=grammar,
    )
    streams = gen.submit_all(state, gen.choices(request, req.n), "messages", constraints)
    run = gen.Run(state, streams, watcher)
    picks = [
        _Choice(CompletionParser(plan.parse_tools, in_reasoning=in_reasoning)) for _ in streams
    ]
    names = TokenNames(tokenizer, req.return_tokens_as_token_ids) if req.logprobs else None
    try:
        if req.stream:
            await _stream(state, plan, run, picks, names, send)
            return 200
        return await _answer(state, plan, run, picks, names, send)
    finally:
        run.close()


def _finish(plan: _Plan, pick: _Choice) -> FinishReason:
    """The finish reason of a finished choice. A choice the request's own limits cut short is
    answered as it stands, as OpenAI does, grammar complete or not: "length" (max_tokens or the
    context ran out, often inside the reasoning) or "stop" (one of its stop strings, even in a
    tool call: the parser keeps the arguments written so far). Raises
    when the model ended by itself without satisfying tool_choice, which the grammar cannot
    prevent in two cases: the model ended inside its free reasoning, or the engine's logits
    ruled out every token the grammar allowed (the matcher then lets only the end through)."""
    last = pick.last
    if last.finish_reason == FinishReason.ERROR:
        raise ApiError(500, f"generation failed: {last.error}", code="engine_error")
    if last.finish_reason == FinishReason.LENGTH:
        return FinishReason.LENGTH
    if isinstance(last.matched_stop, str):
        return FinishReason.STOP
    calls = pick.parser.tool_calls
    if (problem := _tool_choice_error(plan.tool_choice, calls)) is not None:
        raise ApiError(500, problem, code="tool_choice_not_satisfied")
    return FinishReason.TOOL_CALLS if calls else FinishReason.STOP


async def _answer(
    state: ServerState,
    plan: _Plan,
    run: gen.Run,
    picks: list[_Choice],
    names: TokenNames | None,
    send: Send,
) -> int:
    async for index, event in run.choice_events():
        pick = picks[index]
        pick.parser.feed(event.text)
        pick.last = event
        if event.logprobs:
            pick.logprobs.extend(event.logprobs)
    if run.is_gone or any(p.last is None for p in picks):
        return 499
    choices = []
    for index, pick in enumerate(picks):
        parser = pick.parser
        if pick.last.finish_reason != FinishReason.ERROR:
            parser.finish()
        finish = _finish(plan, pick)
        calls = parser.tool_calls
        reasoning = parser.reasoning
        message = OutMessage(
            content=parser.content if parser.content or not calls else None,
            reasoning_content=reasoning,
            reasoning=reasoning if state.settings.reasoning_field else UNSET,
            tool_calls=_out_calls(calls) if calls else UNSET,
        )
        logprobs = chat_logprobs(pick.logprobs, names) if names is not None else None
        choices.append(ChatChoice(index, message, finish, logprobs))
    body = ChatCompletion(
        id=gen.new_id("chatcmpl"),
        created=run.created,
        model=state.settings.served_name,
        choices=choices,
        usage=run.usage([p.last for p in picks]),
    )
    await send_bytes(send, 200, _encoder.encode(body))
    return 200


def _delta(
    deltas: list[Delta], parser: CompletionParser, with_reasoning_field: bool
) -> ChatDelta | None:
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
    if not (reasoning or content or calls):
        return None
    first_index = len(parser.tool_calls) - len(calls)
    return ChatDelta(
        reasoning_content=reasoning or UNSET,
        reasoning=reasoning if reasoning and with_reasoning_field else UNSET,
        content=content or UNSET,
        tool_calls=[
            DeltaToolCall(
                first_index + k,
                c["id"],
                "function",
                OutFunction(c["function"]["name"], c["function"]["arguments"]),
            )
            for k, c in enumerate(calls)
        ]
        or UNSET,
    )


async def _stream(
    state: ServerState,
    plan: _Plan,
    run: gen.Run,
    picks: list[_Choice],
    names: TokenNames | None,
    send: Send,
) -> None:
    """SSE chunks; a chunk carries the logprobs of the tokens that arrived with it (every
    generated token, reasoning and markup included: a token with no text yet still gets a
    chunk, with an empty delta, for its logprobs)."""
    req = plan.req
    want_usage = req.stream_options is not None and req.stream_options.include_usage
    usage_field = None if want_usage else UNSET
    rid, model, created = gen.new_id("chatcmpl"), state.settings.served_name, run.created
    with_reasoning_field = state.settings.reasoning_field

    def chunk(index: int, delta: ChatDelta, finish: str | None = None, logprobs=None) -> bytes:
        choice = ChunkChoice(index, delta, finish, logprobs)
        return _encoder.encode(ChatChunk(rid, created, model, [choice], usage=usage_field))

    sse = run.sse(send)
    await sse.start()
    for index in range(len(picks)):
        await sse.event(chunk(index, ChatDelta(role="assistant", content="")))
    num_open, failed = len(picks), None
    async for index, event in run.choice_events():
        pick = picks[index]
        pick.last = event
        if event.finish_reason == FinishReason.ERROR:
            failed = event
            break
        deltas = pick.parser.feed(event.text)
        if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            deltas += pick.parser.finish()
        delta = _delta(deltas, pick.parser, with_reasoning_field)
        logprobs = (
            chat_logprobs(event.logprobs, names) if names is not None and event.logprobs else None
        )
        if delta is not None or logprobs is not None:
            await sse.event(chunk(index, delta or ChatDelta(), None, logprobs))
        if event.finish_reason is not None:
            num_open -= 1
            try:
                finish = _finish(plan, pick)
            except ApiError as error:
                await sse.close(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
                return
            await sse.event(chunk(index, ChatDelta(), finish))
    if run.is_gone:
        return
    if failed is not None:
        error = ApiError(500, f"generation failed: {failed.error}", code="engine_error")
        await sse.close(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
        return
    if num_open:
        return
    if want_usage:
        usage = run.usage([p.last for p in picks])
        await sse.event(_encoder.encode(ChatChunk(rid, created, model, [], usage=usage)))
    await sse.close()
