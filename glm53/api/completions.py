"""POST /v1/completions: a raw prompt (text or token ids, no chat template), plain text out.

`echo` with `logprobs` scores the prompt too (its first token has no logprob: null), and
`max_tokens: 0` with `echo` scores a prompt without generating, as evaluation harnesses do."""

from __future__ import annotations

import msgspec
from msgspec import UNSET

from glm53.api import generation as gen
from glm53.api.body import decode_request
from glm53.api.errors import ApiError
from glm53.api.http import DisconnectWatcher, Receive, Send, send_bytes
from glm53.api.logprobs import CompletionLogprobBuilder, TokenNames
from glm53.api.schemas import Completion, CompletionChoice, CompletionRequest
from glm53.api.state import ServerState
from glm53.engine.base import FinishReason
from glm53.engine.requests import GenerationRequest

_decoder = msgspec.json.Decoder(CompletionRequest)
_encoder = msgspec.json.Encoder()


def _validate(state: ServerState, req: CompletionRequest) -> None:
    gen.check_choices(state, req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400, "stream_options is only allowed with stream=true", param="stream_options"
        )
    if req.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported by glm53", param="suffix")
    if req.best_of not in (None, 1):
        raise ApiError(
            400, "best_of must be 1: glm53 does not rank candidates; use n", param="best_of"
        )
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(
            400,
            "max_tokens 0 generates nothing: add echo=true (with logprobs) to score the prompt",
            param="max_tokens",
        )


async def _prompt_ids(
    state: ServerState, watcher: DisconnectWatcher, tokenizer, prompt: str | list
) -> tuple[str, list[int]]:
    """The prompt as (text for echo, token ids): a string, a list of one string, or token ids."""
    if isinstance(prompt, str):
        return prompt, await gen.encode(state, watcher, tokenizer, prompt, "prompt")
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0], await gen.encode(state, watcher, tokenizer, prompt[0], "prompt")
    if len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        gen.check_token_ids(state, prompt, tokenizer.vocab_size, "prompt")
        return await gen.decode(state, watcher, tokenizer, prompt), list(prompt)
    raise ApiError(
        400,
        "prompt must be a string, a list of one string, or a list of token ids (one prompt per request)",
        param="prompt",
    )


class _Choice:
    """One choice: its text so far and, with logprobs, its logprobs builder."""

    def __init__(self, echo: str, builder: CompletionLogprobBuilder | None):
        self.parts = [echo]
        self.builder = builder
        self.logprobs = None
        self.last = None


async def completions(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    with DisconnectWatcher(receive) as watcher:
        if len(body) > gen.INLINE_BODY_BYTES:  # decoding a large body holds the GIL: off the loop
            req = await state.offload.run(watcher, _request, state, body)
        else:
            req = _request(state, body)
        return await _generate(state, req, watcher, send)


def _request(state: ServerState, body: bytes) -> CompletionRequest:
    req = decode_request(_decoder, body)
    gen.check_model(state, req.model)
    _validate(state, req)
    return req


async def _generate(
    state: ServerState, req: CompletionRequest, watcher: DisconnectWatcher, send: Send
) -> int:
    scheduler = state.ready_scheduler()
    tokenizer = scheduler.engine.tokenizer
    prompt_text, prompt_ids = await _prompt_ids(state, watcher, tokenizer, req.prompt)
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    scores_prompt = bool(req.echo) and (req.logprobs is not None or req.max_tokens == 0)
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        sampling=gen.request_sampling(
            scheduler.engine.generation_defaults, req, tokenizer.vocab_size
        ),
        max_new_tokens=req.max_tokens,
        stop_token_ids=frozenset(tokenizer.eos_token_ids),
        stop_strings=gen.stop_strings(req.stop),
        logprobs=req.logprobs,
        prompt_logprobs=(req.logprobs or 0) if scores_prompt else None,
    )
    streams = gen.submit_all(state, gen.choices(request, req.n), "prompt")
    run = gen.Run(state, streams, watcher)
    names = TokenNames(tokenizer, req.return_tokens_as_token_ids)
    echo = prompt_text if req.echo else ""
    picks = [
        _Choice(echo, CompletionLogprobBuilder(names) if req.logprobs is not None else None)
        for _ in streams
    ]
    try:
        if req.stream:
            await _stream(state, req, run, picks, prompt_ids, send)
            return 200
        async for index, event in run.choice_events():
            pick = picks[index]
            pick.parts.append(event.text)
            pick.last = event
            if pick.builder is not None:
                logprobs = _logprobs(pick, req, event, prompt_ids)
                if pick.logprobs is None:
                    pick.logprobs = logprobs
                else:
                    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(pick.logprobs, name).extend(getattr(logprobs, name))
        if run.is_gone or any(p.last is None for p in picks):
            return 499
        for pick in picks:
            if pick.last.finish_reason == FinishReason.ERROR:
                raise ApiError(500, f"generation failed: {pick.last.error}", code="engine_error")
        answer = Completion(
            id=gen.new_id("cmpl"),
            created=run.created,
            model=state.settings.served_name,
            choices=[
                CompletionChoice(i, "".join(p.parts), p.last.finish_reason, p.logprobs)
                for i, p in enumerate(picks)
            ],
            usage=run.usage([p.last for p in picks]),
        )
        await send_bytes(send, 200, _encoder.encode(answer))
        return 200
    finally:
        run.close()


def _logprobs(pick: _Choice, req: CompletionRequest, event, prompt_ids: list[int]):
    """The logprobs of what `event` adds to the choice's text: the echoed prompt's (from the
    event that carries them) and the generated tokens'."""
    token_ids, entries = list(event.token_ids), list(event.logprobs or ())
    if event.prompt_logprobs is not None and req.echo:
        token_ids = prompt_ids + token_ids
        entries = list(event.prompt_logprobs) + entries
    return pick.builder.build(token_ids, entries)


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    run: gen.Run,
    picks: list[_Choice],
    prompt_ids: list[int],
    send: Send,
) -> None:
    want_usage = req.stream_options is not None and req.stream_options.include_usage
    usage_field = None if want_usage else UNSET
    rid, model = gen.new_id("cmpl"), state.settings.served_name

    def chunk(index: int, text: str, finish: str | None, logprobs=None) -> bytes:
        choice = CompletionChoice(index, text, finish, logprobs)
        return _encoder.encode(Completion(rid, run.created, model, [choice], usage=usage_field))

    sse = run.sse(send)
    await sse.start()
    # the echo goes with the first event: that is where the prompt's logprobs arrive
    echoing = [bool(req.echo)] * len(picks)
    failed = None
    async for index, event in run.choice_events():
        pick = picks[index]
        pick.last = event
        if event.finish_reason == FinishReason.ERROR:
            failed = event
            break
        text = event.text
        if echoing[index]:
            text, echoing[index] = pick.parts[0] + text, False
        logprobs = _logprobs(pick, req, event, prompt_ids) if pick.builder is not None else None
        if text or event.finish_reason or logprobs is not None:
            await sse.event(chunk(index, text, event.finish_reason, logprobs))
    if run.is_gone or any(p.last is None for p in picks):
        return
    if failed is not None:
        error = ApiError(500, f"generation failed: {failed.error}", code="engine_error")
        await sse.close(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
        return
    if want_usage:
        usage = run.usage([p.last for p in picks])
        await sse.event(_encoder.encode(Completion(rid, run.created, model, [], usage=usage)))
    await sse.close()
