"""SGLang-shaped endpoints: POST /generate (text or token ids in, text and ids out; streamed
events carry the cumulative text and logprobs) and POST /tokenize.

`return_logprob` gives meta_info `output_token_logprobs` ([logprob, id, text] per token, text
only with `return_text_in_logprobs`) and, from prompt position `logprob_start_len` on (-1, the
default: none), `input_token_logprobs` (position 0's logprob is null); `top_logprobs_num` > 0
adds `output_top_logprobs` / `input_top_logprobs`, as SGLang does."""

from __future__ import annotations

import time

import msgspec

from glm53.api import generation as gen
from glm53.api.body import decode_request
from glm53.api.errors import ApiError
from glm53.api.http import DisconnectWatcher, Receive, Send, send_bytes
from glm53.api.logprobs import TokenNames, sglang_lists
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
from glm53.engine.base import FinishReason
from glm53.engine.requests import GenerationRequest, TokenEvent

_generate_decoder = msgspec.json.Decoder(GenerateRequest)
_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_encoder = msgspec.json.Encoder()


async def tokenize(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    req = decode_request(_tokenize_decoder, body)
    tokenizer = state.ready_scheduler().engine.tokenizer
    with DisconnectWatcher(receive) as watcher:
        tokens = await gen.encode(
            state, watcher, tokenizer, req.prompt, "prompt", within_context=False
        )
    await send_bytes(send, 200, _encoder.encode(TokenizeResponse(tokens, len(tokens))))
    return 200


def _finish(event: TokenEvent | None) -> FinishInfo | None:
    if event is None or event.finish_reason is None:
        return None
    if event.finish_reason == FinishReason.ERROR:
        return FinishInfo("abort", message=event.error)  # sglang's word for it
    return FinishInfo(event.finish_reason, matched=event.matched_stop)


async def generate(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    req = decode_request(_generate_decoder, body)
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "send exactly one of text and input_ids", param="text")
    with DisconnectWatcher(receive) as watcher:
        return await _generate(state, req, watcher, send)


async def _generate(
    state: ServerState, req: GenerateRequest, watcher: DisconnectWatcher, send: Send
) -> int:
    scheduler = state.ready_scheduler()
    tokenizer = scheduler.engine.tokenizer
    if req.input_ids is not None:
        gen.check_token_ids(state, req.input_ids, tokenizer.vocab_size, "input_ids")
        prompt_ids = list(req.input_ids)
    else:
        prompt_ids = await gen.encode(state, watcher, tokenizer, req.text, "text")
    if not prompt_ids:
        raise ApiError(
            400, "the prompt is empty", param="text" if req.text is not None else "input_ids"
        )
    sp = req.sampling_params or GenerateSampling()
    gen.check_top_k(sp.top_k, tokenizer.vocab_size, "sampling_params.top_k")
    if sp.stop_token_ids:
        gen.check_vocab(sp.stop_token_ids, tokenizer.vocab_size, "sampling_params.stop_token_ids")
    if req.return_logprob and req.logprob_start_len >= len(prompt_ids):
        raise ApiError(
            400,
            f"logprob_start_len {req.logprob_start_len} is past the prompt's "
            f"{len(prompt_ids)} tokens",
            param="logprob_start_len",
        )
    scores_prompt = req.return_logprob and req.logprob_start_len >= 0
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
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
        ),
        max_new_tokens=sp.max_new_tokens,
        stop_token_ids=frozenset(stop_ids | set(sp.stop_token_ids or ())),
        stop_strings=gen.stop_strings(sp.stop),
        request_id=req.rid or "",
        logprobs=req.top_logprobs_num if req.return_logprob else None,
        prompt_logprobs=req.top_logprobs_num if scores_prompt else None,
        prompt_logprobs_from=max(req.logprob_start_len, 0),
    )
    rid = req.rid or gen.new_id("gen")
    run = gen.Run(
        state,
        gen.submit(state, request, "input_ids" if req.input_ids is not None else "text"),
        watcher,
    )
    start = time.monotonic()
    texts: list[str] = []
    ids: list[int] = []
    output_entries: list = []
    input_entries: list = []
    names = TokenNames(tokenizer) if req.return_text_in_logprobs else None
    with_top = req.top_logprobs_num > 0

    def collect(event: TokenEvent) -> None:
        texts.append(event.text)
        ids.extend(event.token_ids)
        output_entries.extend(event.logprobs or ())
        input_entries.extend(event.prompt_logprobs or ())

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
        if req.return_logprob:
            tokens, tops = sglang_lists(ids, output_entries, names, with_top)
            meta.output_token_logprobs = tokens
            if with_top:
                meta.output_top_logprobs = tops
            if scores_prompt:
                scored_ids = prompt_ids[request.prompt_logprobs_from :]
                tokens, tops = sglang_lists(
                    scored_ids[: len(input_entries)], input_entries, names, with_top
                )
                meta.input_token_logprobs = tokens
                if with_top:
                    meta.input_top_logprobs = tops
        return GenerateResponse("".join(texts), list(ids), meta)

    try:
        last = None
        if not req.stream:
            async for event in run.events():
                collect(event)
                last = event
            if run.is_gone or last is None:
                return 499
            if last.finish_reason == FinishReason.ERROR:
                raise ApiError(500, f"generation failed: {last.error}", code="engine_error")
            await send_bytes(send, 200, _encoder.encode(response(last)))
            return 200
        sse = run.sse(send)
        await sse.start()
        async for event in run.events():
            collect(event)
            last = event
            if event.finish_reason == FinishReason.ERROR:
                break
            await sse.event(_encoder.encode(response(event)))
        if run.is_gone or last is None:
            return 200
        if last.finish_reason == FinishReason.ERROR:
            error = ApiError(500, f"generation failed: {last.error}", code="engine_error")
            await sse.close(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
        else:
            await sse.close()
        return 200
    finally:
        run.close()
