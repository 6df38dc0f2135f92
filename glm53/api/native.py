"""SGLang-shaped endpoints: POST /generate (text or token ids in, text and ids out; streamed
events carry the cumulative text) and POST /tokenize."""

from __future__ import annotations

import time

import msgspec

from glm53.api import generation as gen
from glm53.api.errors import ApiError, from_decode_error
from glm53.api.http import Receive, Send, send_bytes
from glm53.api.schemas import (
    FinishInfo,
    GenerateMeta,
    GenerateRequest,
    GenerateResponse,
    GenerateSampling,
    TokenizeRequest,
    TokenizeResponse,
)
from glm53.api.state import ServerState
from glm53.engine.scheduler import GenerationRequest, TokenEvent

_generate_decoder = msgspec.json.Decoder(GenerateRequest)
_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_encoder = msgspec.json.Encoder()


def _decode(decoder, body: bytes):
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None


async def tokenize(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    req = _decode(_tokenize_decoder, body)
    tokenizer = state.ready_scheduler().engine.tokenizer
    tokens = await gen.encode(tokenizer, req.prompt)
    await send_bytes(send, 200, _encoder.encode(TokenizeResponse(tokens, len(tokens))))
    return 200


def _finish(event: TokenEvent | None) -> FinishInfo | None:
    if event is None or event.finish_reason is None:
        return None
    if event.finish_reason == "error":
        return FinishInfo("abort", message=event.error)
    return FinishInfo(event.finish_reason, matched=event.matched_stop)


async def generate(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    req = _decode(_generate_decoder, body)
    if req.return_logprob:
        raise ApiError(
            400,
            "return_logprob (teacher-forced scoring) is not supported by glm53",
            param="return_logprob",
        )
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "send exactly one of text and input_ids", param="text")
    scheduler = state.ready_scheduler()
    tokenizer = scheduler.engine.tokenizer
    if req.input_ids is not None:
        gen.check_token_ids(req.input_ids, tokenizer.vocab_size, "input_ids")
        prompt_ids = list(req.input_ids)
    else:
        prompt_ids = await gen.encode(tokenizer, req.text)
    if not prompt_ids:
        raise ApiError(
            400, "the prompt is empty", param="text" if req.text is not None else "input_ids"
        )
    sp = req.sampling_params or GenerateSampling()
    stop_ids = set() if sp.ignore_eos else set(tokenizer.eos_token_ids)
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        sampling=gen.sampling_params(
            scheduler.engine.generation_defaults,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            seed=sp.seed,
        ),
        max_new_tokens=sp.max_new_tokens,
        stop_token_ids=frozenset(stop_ids | set(sp.stop_token_ids or ())),
        stop_strings=gen.stop_strings(sp.stop),
        request_id=req.rid or "",
    )
    rid = req.rid or gen.new_id("gen")
    run = gen.Run(
        state,
        gen.submit(state, request, "input_ids" if req.input_ids is not None else "text"),
        receive,
    )
    start = time.monotonic()
    texts: list[str] = []
    ids: list[int] = []

    def response(last: TokenEvent | None) -> GenerateResponse:
        n_gen = last.num_generated_tokens if last else 0
        meta = GenerateMeta(
            rid,
            len(prompt_ids),
            n_gen,
            _finish(last),
            round(time.monotonic() - start, 6),
            last.num_cached_tokens if last else 0,
        )
        return GenerateResponse("".join(texts), list(ids), meta)

    try:
        last = None
        if not req.stream:
            async for event in run.events():
                texts.append(event.text)
                ids.extend(event.token_ids)
                last = event
            if run.is_gone or last is None:
                return 499
            if last.finish_reason == "error":
                raise ApiError(500, f"generation failed: {last.error}", code="engine_error")
            await send_bytes(send, 200, _encoder.encode(response(last)))
            return 200
        sse = run.sse(send)
        await sse.start()
        async for event in run.events():
            texts.append(event.text)
            ids.extend(event.token_ids)
            last = event
            if event.finish_reason == "error":
                break
            await sse.event(_encoder.encode(response(event)))
        if run.is_gone or last is None:
            return 200
        if last.finish_reason == "error":
            error = ApiError(500, f"generation failed: {last.error}", code="engine_error")
            await sse.close(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
        else:
            await sse.close()
        return 200
    finally:
        run.close()
