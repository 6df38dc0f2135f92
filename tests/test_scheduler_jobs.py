"""The scheduler's loop for job engines (glm53.engine.base.JobEngine), which the GPU engine is:
admission, stop/length, cancellation, per-job and whole-iteration failures.

MockJobEngine stands in for the GPU engine, whose exllamav3 Generator needs a CUDA GPU that CI
does not have: it is a mock, named so, and it exercises only the scheduler's side of the
protocol. The GPU engine itself is checked against stock exllamav3 in tests/gpu/.
"""

import asyncio
import threading

import numpy as np
import pytest
from serving_kit import write_tokenizer_checkpoint
from test_scheduler import collect, request, until_idle

from glm53.engine.base import EngineError, JobEngine, JobOutput
from glm53.engine.logprobs import block_logprobs
from glm53.engine.scheduler import Scheduler
from glm53.engine.tokenizer import CheckpointTokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tokenizer_checkpoint(tmp_path_factory.mktemp("tokenizer"))


class MockJobEngine:
    """MOCK of a job engine: admits up to num_slots jobs per iterate in start order; each job
    emits token (last prompt token + i + 1) % vocab, one per iterate, after a prefill iterate;
    `stop_at` = token that counts as a stop token when the request lists it. Records what ran."""

    name = "mock-job-engine"
    description = "MOCK job engine (tests only; not a model)"
    is_model = False
    drives_jobs = True
    verify_tiers = None
    fast = None
    generation_defaults: dict = {}

    def __init__(self, checkpoint, *, num_slots=2, context_length=4096):
        self.tokenizer = CheckpointTokenizer.from_dir(checkpoint)
        self.num_slots = num_slots
        self.context_length = context_length
        self.jobs: dict = {}  # key -> state, in start order
        self.batches: list[list] = []  # keys that produced a token, per iterate
        self.cancelled: list = []
        self.fail_iterate: set[int] = set()
        self.fail_job_after: dict[int, int] = {}  # first prompt token -> tokens before error
        self.iterations = 0
        self.closed = False
        self.hold: threading.Event | None = None  # set: iterations past the 2nd wait for it

    def load(self):
        pass

    def start(self, key, req, max_new_tokens, sampler):
        if req.prompt_ids[0] == 999:
            raise EngineError("mock refuses prompts starting with 999")
        self.jobs[key] = {"req": req, "max": max_new_tokens, "n": 0, "prefilled": False}
        if req.prompt_logprobs is not None:  # every prompt position's logits, fixed per length
            g = np.random.default_rng(len(req.prompt_ids))
            self.prompt_logits = g.standard_normal((len(req.prompt_ids), 64)).astype(np.float32)
            self.jobs[key]["prompt_logits"] = self.prompt_logits

    def cancel(self, key):
        if self.jobs.pop(key, None) is not None:
            self.cancelled.append(key)

    def iterate(self):
        if self.hold is not None and self.iterations >= 2:
            self.hold.wait(30)
        self.iterations += 1
        if self.iterations in self.fail_iterate:
            raise RuntimeError("mock iteration failure")
        outs, batch = [], []
        vocab = self.tokenizer.vocab_size
        for key, st in list(self.jobs.items())[: self.num_slots]:
            req = st["req"]
            if not st["prefilled"]:
                st["prefilled"] = True
                done = "length" if st["max"] == 0 else None
                if done:
                    del self.jobs[key]
                outs.append(JobOutput(key, [], cached_tokens=0, finish=done,
                                      prompt_logits=st.get("prompt_logits")))  # fmt: skip
                continue
            token = (req.prompt_ids[-1] + st["n"] + 1) % vocab
            st["n"] += 1
            batch.append(key)
            fail = self.fail_job_after.get(req.prompt_ids[0])
            if fail is not None and st["n"] > fail:
                del self.jobs[key]
                outs.append(JobOutput(key, [], finish="error", error="mock job failure"))
                continue
            finish = None
            if token in req.stop_token_ids:
                finish = "stop"
            elif st["n"] >= st["max"]:
                finish = "length"
            if finish:
                del self.jobs[key]
            outs.append(JobOutput(key, [token], finish=finish))
        self.batches.append(batch)
        return outs

    def save_heat(self):
        return None

    def stats(self):
        return {}

    def close(self):
        self.closed = True


async def started(engine, **kw):
    s = Scheduler(engine, max_batch=kw.get("max_batch", 4), chunk_size=512,
                  queue_limit=kw.get("queue_limit", 16))  # fmt: skip
    await s.start()
    return s


def test_the_mock_is_a_job_engine(checkpoint):
    assert isinstance(MockJobEngine(checkpoint), JobEngine)


def test_tokens_length_and_stop(checkpoint):
    async def main():
        engine = MockJobEngine(checkpoint)
        s = await started(engine)
        _, ids, last = await collect(s.submit(request([10], 5)))
        assert ids == [11, 12, 13, 14, 15] and last.finish_reason == "length"
        _, ids, last = await collect(s.submit(request([10], 50, stop_ids=[13])))
        assert ids == [11, 12, 13] and last.finish_reason == "stop" and last.matched_stop == 13
        stats = s.stats()
        await s.close()
        assert engine.closed
        assert stats["generated_tokens"] == 8 and stats["prompt_tokens"] == 2

    asyncio.run(main())


def test_jobs_submitted_together_start_together_in_order(checkpoint):
    async def main():
        engine = MockJobEngine(checkpoint, num_slots=2)
        s = await started(engine)
        streams = s.submit_many([request([100 + i], 3) for i in range(3)])
        results = await asyncio.gather(*(collect(x) for x in streams))
        await s.close()
        assert [r[1] for r in results] == [[101 + i, 102 + i, 103 + i] for i in range(3)]
        keys = list(dict.fromkeys(k for b in engine.batches for k in b))
        # the first two were started in one iteration (prefill), then decoded as one batch from
        # their first token on; the third waited for a slot
        assert engine.batches[0] == [] and engine.batches[1] == keys[:2]
        assert all(keys[2] not in b for b in engine.batches[:4])

    asyncio.run(main())


def test_a_cancelled_stream_is_cancelled_in_the_engine(checkpoint):
    async def main():
        engine = MockJobEngine(checkpoint)
        # the engine waits after the first token until the stream is cancelled (unheld, it can
        # finish all its tokens before the event loop has read the first)
        engine.hold = threading.Event()
        s = await started(engine)
        stream = s.submit(request([1], 1000))
        async for _ in stream:
            stream.cancel()
            break
        engine.hold.set()
        await until_idle(s)
        assert len(engine.cancelled) == 1 and not engine.jobs
        await s.close()

    asyncio.run(main())


def test_a_failing_job_fails_alone_and_a_failing_iteration_fails_all(checkpoint):
    async def main():
        engine = MockJobEngine(checkpoint)
        engine.fail_job_after[7] = 2
        s = await started(engine)
        bad, good = s.submit(request([7], 10)), s.submit(request([8], 10))
        (_, bad_ids, bad_last), (_, good_ids, good_last) = await asyncio.gather(
            collect(bad), collect(good)
        )
        assert bad_last.finish_reason == "error" and "mock job failure" in bad_last.error
        assert bad_ids == [8, 9] and good_last.finish_reason == "length" and len(good_ids) == 10
        refused = await collect(s.submit(request([999, 1], 4)))
        assert refused[2].finish_reason == "error" and "refuses" in refused[2].error
        engine.fail_iterate.add(engine.iterations + 2)
        # one group, so both are in the engine by then (two submits race the engine thread:
        # it can start the first and reach the failing iteration before the second arrives)
        a, b = s.submit_many([request([20], 10), request([21], 10)])
        ra, rb = await asyncio.gather(collect(a), collect(b))
        assert ra[2].finish_reason == rb[2].finish_reason == "error"
        assert "mock iteration failure" in ra[2].error
        # and the scheduler serves the next request
        _, ids, last = await collect(s.submit(request([30], 2)))
        assert ids == [31, 32] and last.finish_reason == "length"
        await s.close()

    asyncio.run(main())


def test_prompt_logprobs_come_from_the_engines_prompt_logits(checkpoint):
    async def main():
        engine = MockJobEngine(checkpoint)
        s = await started(engine)
        prompt = [5, 9, 2, 7, 3]
        req = request(prompt, 0)
        req.prompt_logprobs, req.prompt_logprobs_from = 3, 2
        events = [e async for e in s.submit(req)]
        assert events[-1].finish_reason == "length" and events[-1].num_generated_tokens == 0
        got = events[0].prompt_logprobs
        want = block_logprobs(engine.prompt_logits[1:4], prompt[2:], 3)
        assert [(e.token_id, e.logprob, e.top_ids) for e in got] == [
            (e.token_id, e.logprob, e.top_ids) for e in want
        ]
        req = request(prompt, 2)
        req.prompt_logprobs = 0
        events = [e async for e in s.submit(req)]
        entries = events[0].prompt_logprobs
        assert entries[0] is None and len(entries) == len(prompt)
        assert sum(len(e.token_ids) for e in events) == 2
        await s.close()

    asyncio.run(main())
