"""POST /v1/completions: a raw prompt (text or token ids, no chat template), plain text out."""

from __future__ import annotations

import msgspec
from msgspec import UNSET

from glm53.api import generation as gen
from glm53.api.errors import ApiError, from_decode_error
from glm53.api.http import Receive, Send, send_bytes
from glm53.api.schemas import Completion, CompletionChoice, CompletionRequest
from glm53.api.state import ServerState
from glm53.engine.scheduler import GenerationRequest

_decoder = msgspec.json.Decoder(CompletionRequest)
_encoder = msgspec.json.Encoder()


def _validate(req: CompletionRequest) -> None:
    gen.reject_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400, "stream_options is only allowed with stream=true", param="stream_options"
        )
    if req.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported by glm53", param="suffix")
    if req.logprobs is not None:
        raise ApiError(400, "logprobs are not supported by glm53", param="logprobs")
    if req.best_of not in (None, 1):
        raise ApiError(
            400, "best_of must be 1: glm53 returns one choice per request", param="best_of"
        )


async def _prompt_ids(tokenizer, prompt: str | list) -> tuple[str, list[int]]:
    """The prompt as (text for echo, token ids): a string, a list of one string, or token ids."""
    if isinstance(prompt, str):
        return prompt, await gen.encode(tokenizer, prompt)
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0], await gen.encode(tokenizer, prompt[0])
    if len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        gen.check_token_ids(prompt, tokenizer.vocab_size, "prompt")
        return tokenizer.decode(prompt), list(prompt)
    raise ApiError(
        400,
        "prompt must be a string, a list of one string, or a list of token ids (one prompt per request)",
        param="prompt",
    )


async def completions(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    try:
        req = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    gen.check_model(state, req.model)
    _validate(req)
    scheduler = state.ready_scheduler()
    tokenizer = scheduler.engine.tokenizer
    prompt_text, prompt_ids = await _prompt_ids(tokenizer, req.prompt)
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        sampling=gen.sampling_params(
            scheduler.engine.generation_defaults,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
        ),
        max_new_tokens=req.max_tokens,
        stop_token_ids=frozenset(tokenizer.eos_token_ids),
        stop_strings=gen.stop_strings(req.stop),
    )
    run = gen.Run(state, gen.submit(state, request, "prompt"), receive)
    echo = prompt_text if req.echo else ""
    try:
        if req.stream:
            await _stream(state, req, run, echo, send)
            return 200
        parts = [echo]
        last = None
        async for event in run.events():
            parts.append(event.text)
            last = event
        if run.is_gone or last is None:
            return 499
        if last.finish_reason == "error":
            raise ApiError(500, f"generation failed: {last.error}", code="engine_error")
        answer = Completion(
            id=gen.new_id("cmpl"),
            created=run.created,
            model=state.settings.served_name,
            choices=[CompletionChoice(0, "".join(parts), last.finish_reason)],
            usage=gen.usage(last),
        )
        await send_bytes(send, 200, _encoder.encode(answer))
        return 200
    finally:
        run.close()


async def _stream(
    state: ServerState, req: CompletionRequest, run: gen.Run, echo: str, send: Send
) -> None:
    want_usage = req.stream_options is not None and req.stream_options.include_usage
    usage_field = None if want_usage else UNSET
    rid, model = gen.new_id("cmpl"), state.settings.served_name

    def chunk(text: str, finish: str | None) -> bytes:
        choice = CompletionChoice(0, text, finish)
        return _encoder.encode(Completion(rid, run.created, model, [choice], usage=usage_field))

    sse = run.sse(send)
    await sse.start()
    if echo:
        await sse.event(chunk(echo, None))
    last = None
    async for event in run.events():
        last = event
        if event.finish_reason == "error":
            break
        if event.text or event.finish_reason:
            await sse.event(chunk(event.text, event.finish_reason))
    if run.is_gone or last is None:
        return
    if last.finish_reason == "error":
        error = ApiError(500, f"generation failed: {last.error}", code="engine_error")
        await sse.close(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
        return
    if want_usage:
        usage = gen.usage(last)
        await sse.event(_encoder.encode(Completion(rid, run.created, model, [], usage=usage)))
    await sse.close()
