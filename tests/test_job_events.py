"""What the engine thread posts (glm53.engine.stream.JobEvent) reaches a JobStream as the
TokenEvents it gave when events were tuples: an error after tokens keeps their text and ends the
stream with FinishReason.ERROR and no prompt logprobs; a scored prompt ends with LENGTH and no
tokens; and the engines declare their optional capabilities instead of being probed for them."""

import ast
import asyncio
import json
import math
from pathlib import Path

import msgspec
import pytest
from serving_kit import write_tokenizer_checkpoint
from test_scheduler import request, scripted, started

from glm53.engine.base import Engine, FinishReason, JobEngine
from glm53.engine.cpu import CpuEngine
from glm53.engine.gpu import GpuEngine
from glm53.engine.logprobs import TokenLogprob
from glm53.engine.sampling import SamplingParams, StreamSampler
from glm53.engine.scripted import ScriptedEngine
from glm53.engine.stops import StopMatcher
from glm53.engine.stream import EventKind, Job, JobEvent, JobState, JobStream
from glm53.engine.tokenizer import CheckpointTokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tokenizer_checkpoint(tmp_path_factory.mktemp("tokenizer"))


class RecordingOwner:
    """A JobOwner (glm53.engine.stream) that records what the stream asks of its scheduler."""

    def __init__(self):
        self.cancelled: list[tuple[Job, bool]] = []
        self.done: list[FinishReason] = []

    def cancel_job(self, job, *, counted):
        self.cancelled.append((job, counted))

    def on_stream_done(self, stream):
        self.done.append(stream.finish_reason)


def new_stream(checkpoint, prompt, *, prompt_logprobs=None, stops=()):
    tokenizer = CheckpointTokenizer.from_dir(checkpoint)
    req = request(prompt, 8, stops=stops)
    req.prompt_logprobs = prompt_logprobs
    job = Job(req, StreamSampler(SamplingParams(), prompt_ids=req.prompt_ids), 8)
    if prompt_logprobs is not None:
        job.prompt_logprobs = [None, TokenLogprob(prompt[1], -1.5, [], [])]
    owner = RecordingOwner()
    job.stream = JobStream(owner, job, tokenizer.new_decoder(), StopMatcher(req.stop_strings))
    return tokenizer, job, owner


def test_an_error_after_tokens_keeps_their_text_and_ends_the_stream(checkpoint):
    tokenizer, job, owner = new_stream(checkpoint, [5, 6], prompt_logprobs=0)
    ids = tokenizer.encode("hello world")[:2]

    async def main():
        job.stream.push(JobEvent(job, EventKind.TOKEN, 10, ids[0]))
        job.stream.push(JobEvent(job, EventKind.TOKEN, 20, ids[1]))
        job.stream.push(JobEvent.failed(job, "engine error: boom", 30))
        return [event async for event in job.stream]

    (event,) = asyncio.run(main())
    assert event.token_ids == ids and event.text == tokenizer.decode(ids)
    assert event.finish_reason is FinishReason.ERROR and event.error == "engine error: boom"
    assert event.time_ns == 30 and event.num_generated_tokens == 2
    assert event.prompt_logprobs is None  # a failed stream gives none
    assert job.stream.first_token_ns == 10 and job.stream.last_token_ns == 20
    assert owner.done == [FinishReason.ERROR] and owner.cancelled == []


def test_a_scored_prompt_event_ends_with_length_and_its_prompt_logprobs(checkpoint):
    _, job, owner = new_stream(checkpoint, [5, 6], prompt_logprobs=0)
    entries = job.prompt_logprobs

    async def main():
        job.stream.push(JobEvent.scored(job, 40))
        return [event async for event in job.stream]

    (event,) = asyncio.run(main())
    assert (event.token_ids, event.text, event.time_ns) == ([], "", 40)
    assert event.finish_reason is FinishReason.LENGTH and event.error is None
    assert event.prompt_logprobs is entries and job.prompt_logprobs is None
    assert owner.done == [FinishReason.LENGTH]


def test_a_stop_string_cancels_the_job_uncounted_and_ends_with_stop(checkpoint):
    tokenizer, job, owner = new_stream(checkpoint, [5], stops=("world",))
    ids = tokenizer.encode("hello world again")

    async def main():
        for i, token in enumerate(ids):
            job.stream.push(JobEvent(job, EventKind.TOKEN, i + 1, token))
        return [event async for event in job.stream]

    (event,) = asyncio.run(main())
    assert event.finish_reason is FinishReason.STOP and event.matched_stop == "world"
    assert event.text == "hello "
    assert owner.cancelled == [(job, False)] and owner.done == [FinishReason.STOP]


def test_a_scored_prompt_through_the_step_loop(checkpoint):
    async def main():
        engine = scripted(checkpoint, default="never said")
        scheduler = await started(engine)
        req = request([7, 8, 9], 0)
        req.prompt_logprobs = 1
        events = [event async for event in scheduler.submit(req)]
        stats = scheduler.stats()
        await scheduler.close()
        return engine.tokenizer.vocab_size, events, stats

    vocab_size, events, stats = asyncio.run(main())
    (event,) = events
    assert event.token_ids == [] and event.finish_reason is FinishReason.LENGTH
    assert [e if e is None else (e.token_id, e.logprob) for e in event.prompt_logprobs] == [
        None,
        (8, -math.log(vocab_size)),
        (9, -math.log(vocab_size)),
    ]
    assert (stats["requests_length"], stats["num_running"], stats["generated_tokens"]) == (1, 0, 0)


def test_finish_reasons_encode_as_the_plain_strings():
    reasons = {r.name: r for r in FinishReason}
    assert (
        msgspec.json.encode(reasons)
        == json.dumps({name: name.lower() for name in reasons}, separators=(",", ":")).encode()
    )
    assert f"requests_{FinishReason.CANCELLED}" == "requests_cancelled"
    assert JobState.RUNNING == "running" and EventKind.SCORED == "scored"


def test_every_engine_declares_its_optional_capabilities():
    assert (CpuEngine.drives_jobs, ScriptedEngine.drives_jobs, GpuEngine.drives_jobs) == (
        False,
        False,
        True,
    )
    # a class-level None: no tiers to check (the GPU engine sets one in nvme-exact at load)
    assert ScriptedEngine.verify_tiers is None and GpuEngine.verify_tiers is None
    assert callable(CpuEngine.verify_tiers)
    for engine in (CpuEngine, ScriptedEngine, GpuEngine):
        assert callable(engine.save_heat)
    for engine in (CpuEngine, ScriptedEngine):
        assert callable(engine.stream_usage)
    for protocol in (Engine, JobEngine):  # declared members, not probes
        assert {"drives_jobs", "verify_tiers"} <= protocol.__annotations__.keys()
        assert callable(vars(protocol)["save_heat"])


def _engine_probes(path: Path) -> list[str]:
    """getattr/hasattr calls on something named like an engine, as 'file:line'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and "engine" in ast.unparse(node.args[0])
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_scheduler_and_the_api_do_not_probe_engines_for_capabilities():
    paths = [
        *sorted((ROOT / "glm53" / "engine").glob("*.py")),
        *sorted((ROOT / "glm53" / "api").glob("*.py")),
        ROOT / "glm53" / "serve.py",
    ]
    assert [probe for path in paths for probe in _engine_probes(path)] == []
