import asyncio
import threading
import time

import pytest
import torch
from serving_kit import write_tokenizer_checkpoint

from glm53.engine.base import EngineError
from glm53.engine.sampling import SamplingParams
from glm53.engine.scheduler import GenerationRequest, PromptTooLong, QueueFull, Scheduler
from glm53.engine.scripted import Reply, Script, ScriptedEngine
from glm53.engine.tokenizer import CheckpointTokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tokenizer_checkpoint(tmp_path_factory.mktemp("tokenizer"))


class TableEngine:
    """Logits depend only on the last token fed (a fixed random table); records every step."""

    name = "table"
    description = "test table engine"
    is_model = False
    drives_jobs = False
    verify_tiers = None
    fast = None
    generation_defaults: dict = {}

    def __init__(self, checkpoint, *, num_slots=4, context_length=4096, fail_steps=()):
        self.tokenizer = CheckpointTokenizer.from_dir(checkpoint)
        self.num_slots = num_slots
        self.context_length = context_length
        self.fail_steps = set(fail_steps)
        generator = torch.Generator().manual_seed(0)
        self.table = (
            torch.randn(self.tokenizer.vocab_size, self.tokenizer.vocab_size, generator=generator)
            * 4
        )
        self.steps: list[list[tuple[int, int, int, bool]]] = []
        self.released: list[int] = []
        self.closed = False
        self.gate = threading.Event()  # steps wait for it; open unless a test closes it
        self.gate.set()

    def load(self):
        pass

    def step(self, work):
        self.gate.wait(30)
        self.steps.append([(w.slot, len(w.token_ids), w.start_pos, w.want_logits) for w in work])
        if len(self.steps) in self.fail_steps:
            raise RuntimeError("boom")
        rows = [self.table[w.token_ids[-1]] for w in work if w.want_logits]
        return torch.stack(rows) if rows else torch.empty(0, self.tokenizer.vocab_size)

    def release(self, slot):
        self.released.append(slot)

    def stream_usage(self, slot):
        return None  # no tier counts per stream

    def save_heat(self):
        return None

    def stats(self):
        return {}

    def close(self):
        self.closed = True


def scripted(checkpoint, *, num_slots=4, context_length=4096, **script):
    return ScriptedEngine(
        checkpoint, Script(**script), context_length=context_length, num_slots=num_slots
    )


async def started(engine, *, max_batch=4, chunk_size=512, queue_limit=16):
    scheduler = Scheduler(
        engine, max_batch=max_batch, chunk_size=chunk_size, queue_limit=queue_limit
    )
    await scheduler.start()
    return scheduler


async def collect(stream):
    events = [event async for event in stream]
    return "".join(e.text for e in events), [t for e in events for t in e.token_ids], events[-1]


async def until_idle(scheduler, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while scheduler.stats()["num_running"] or scheduler.stats()["num_waiting"]:
        assert time.monotonic() < deadline, scheduler.stats()
        await asyncio.sleep(0.01)


def request(prompt, max_new=None, *, seed=None, temperature=0.0, stop_ids=(), stops=()):
    return GenerationRequest(
        list(prompt),
        SamplingParams(temperature=temperature, seed=seed),
        max_new,
        frozenset(stop_ids),
        tuple(stops),
    )


def test_greedy_stream_runs_to_max_new_tokens(checkpoint):
    async def main():
        engine = TableEngine(checkpoint)
        scheduler = await started(engine)
        text, ids, last = await collect(scheduler.submit(request([5, 6, 7], 12)))
        await scheduler.close()
        expected, token = [], 7
        for _ in range(12):
            token = int(engine.table[token].argmax())
            expected.append(token)
        assert ids == expected
        assert text == engine.tokenizer.decode(expected)
        assert (last.finish_reason, last.num_prompt_tokens, last.num_generated_tokens) == (
            "length",
            3,
            12,
        )
        assert engine.released == [0] and engine.closed

    asyncio.run(main())


def test_same_seed_gives_same_tokens_whatever_runs_beside_it(checkpoint):
    async def main():
        scheduler = await started(TableEngine(checkpoint))
        runs = [scheduler.submit(request([3], 30, seed=s, temperature=1.0)) for s in (11, 11, 12)]
        first, again, other = [r[1] for r in await asyncio.gather(*(collect(s) for s in runs))]
        alone = (await collect(scheduler.submit(request([3], 30, seed=11, temperature=1.0))))[1]
        await scheduler.close()
        assert first == again == alone
        assert first != other

    asyncio.run(main())


def test_steps_hold_at_most_max_batch_streams(checkpoint):
    async def main():
        engine = TableEngine(checkpoint, num_slots=8)
        scheduler = await started(engine, max_batch=2)
        results = await asyncio.gather(
            *(collect(scheduler.submit(request([i + 1], 5))) for i in range(6))
        )
        await scheduler.close()
        assert [r[2].num_generated_tokens for r in results] == [5] * 6
        assert max(len(step) for step in engine.steps) <= 2  # overlap depends on thread timing
        assert scheduler.num_slots == 2

    asyncio.run(main())


def test_prefill_is_fed_in_aligned_chunks_shared_by_the_streams(checkpoint):
    async def main():
        engine = TableEngine(checkpoint)
        scheduler = await started(engine, chunk_size=4)
        engine.gate.clear()  # B arrives before the second step is planned, however threads run
        a = scheduler.submit(request(range(1, 11), 2))
        b = scheduler.submit(request(range(1, 8), 2))
        engine.gate.set()
        await asyncio.gather(collect(a), collect(b))
        await scheduler.close()
        # (slot, tokens, start position, wants logits). When b's submission lands relative to
        # a's chunks depends on thread timing, so check the schedule's invariants, not one order.
        prompt_len = {}
        prompts = {0: 10, 1: 7}
        for step in engine.steps:
            # prefill tokens of one step share the chunk budget; decode rows do not count
            assert sum(n for slot, n, start, _ in step if start < prompts[slot]) <= 4
            assert len({slot for slot, _, _, _ in step}) == len(step)
        for slot, total in prompts.items():
            items = [i for step in engine.steps for i in step if i[0] == slot]
            pos = 0
            for _, n, start, wants in items:
                assert start == pos
                if start < total:  # a prefill chunk ends at a multiple of 4 or at the prompt's end
                    assert start % 4 == 0 and ((start + n) % 4 == 0 or start + n == total)
                pos += n
                assert wants == (pos >= total)  # logits on the prompt's last chunk and decode
            prompt_len[slot] = pos
        assert prompt_len == {0: 11, 1: 8}  # prompt + one fed-back token each (2 generated)

    asyncio.run(main())


def test_stop_token_finishes_with_stop(checkpoint):
    async def main():
        engine = TableEngine(checkpoint)
        greedy = []
        token = 7
        for _ in range(3):
            token = int(engine.table[token].argmax())
            greedy.append(token)
        scheduler = await started(engine)
        text, ids, last = await collect(scheduler.submit(request([7], 50, stop_ids=[greedy[2]])))
        await scheduler.close()
        assert ids == greedy
        assert text == engine.tokenizer.decode(greedy[:2])
        assert (last.finish_reason, last.matched_stop) == ("stop", greedy[2])

    asyncio.run(main())


def test_stop_string_cuts_the_text_and_frees_the_slot(checkpoint):
    async def main():
        engine = scripted(checkpoint, default="Hello there STOP and more text here", step_ms=1)
        prompt = engine_prompt(checkpoint, "hi")
        scheduler = await started(engine)
        text, _, last = await collect(scheduler.submit(request(prompt, stops=["STOP", "xyz"])))
        await until_idle(scheduler)
        await scheduler.close()
        assert (text, last.finish_reason, last.matched_stop) == ("Hello there ", "stop", "STOP")

    asyncio.run(main())


def test_stop_string_prefix_is_released_when_no_match_follows(checkpoint):
    async def main():
        engine = scripted(checkpoint, default="a ST b STO")
        scheduler = await started(engine)
        eos = engine.tokenizer.eos_token_ids
        text, _, last = await collect(
            scheduler.submit(request(engine_prompt(checkpoint, "x"), stop_ids=eos, stops=["STOP"]))
        )
        await scheduler.close()
        assert (text, last.finish_reason) == ("a ST b STO", "stop")

    asyncio.run(main())


def test_multibyte_text_decodes_exactly(checkpoint):
    async def main():
        reply = "héllo wörld, 日本語 ✓ <think>x</think>"
        engine = scripted(checkpoint, default=reply)
        scheduler = await started(engine)
        stream = scheduler.submit(
            request(
                engine_prompt(checkpoint, "x"),
                stop_ids=CheckpointTokenizer.from_dir(checkpoint).eos_token_ids,
            )
        )
        text, _, last = await collect(stream)
        await scheduler.close()
        assert (text, last.finish_reason) == (reply, "stop")

    asyncio.run(main())


def test_a_character_cut_by_the_length_limit_is_text_as_decode_renders_it(checkpoint):
    # the stream decoder holds back the bytes of an unfinished character; at the end they are
    # text too (U+FFFD, as Tokenizer.decode renders them), so text == decode(ids) at any cut
    async def main():
        engine = scripted(checkpoint, default="日本語のテキスト")
        tok = CheckpointTokenizer.from_dir(checkpoint)
        prompt = engine_prompt(checkpoint, "x")
        scheduler = await started(engine)
        _, ids, _ = await collect(scheduler.submit(request(prompt, stop_ids=tok.eos_token_ids)))
        cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
        assert cuts, [tok.decode([t]) for t in ids]  # the reply has multi-token characters
        for k in cuts[:3]:
            text, got, last = await collect(scheduler.submit(request(prompt, k)))
            assert (got, last.finish_reason) == (ids[:k], "length")
            assert text == tok.decode(ids[:k])
        await scheduler.close()

    asyncio.run(main())


def test_cancel_frees_the_slot_at_the_next_step(checkpoint):
    async def main():
        engine = scripted(checkpoint, default="word " * 200, step_ms=5)
        scheduler = await started(engine)
        stream = scheduler.submit(request(engine_prompt(checkpoint, "x")))
        first = await stream.__anext__()
        assert first.text
        stream.cancel()
        assert [e async for e in stream] == []
        await until_idle(scheduler)
        stats = scheduler.stats()
        after = await collect(scheduler.submit(request(engine_prompt(checkpoint, "y"), 3)))
        await scheduler.close()
        assert (stats["num_active"], stats["requests_cancelled"]) == (0, 1)
        assert after[2].finish_reason == "length"

    asyncio.run(main())


def test_full_queue_rejects_with_a_retry_hint(checkpoint):
    async def main():
        engine = scripted(checkpoint, num_slots=1, default="word " * 100, step_ms=5)
        scheduler = await started(engine, max_batch=1, queue_limit=1)
        prompt = engine_prompt(checkpoint, "x")
        running, waiting = scheduler.submit(request(prompt)), scheduler.submit(request(prompt))
        with pytest.raises(QueueFull) as info:
            scheduler.submit(request(prompt))
        running.cancel()
        waiting.cancel()
        await until_idle(scheduler)
        await scheduler.close()
        assert str(info.value) == "all 1 slots are busy and 1 requests are waiting"
        assert info.value.retry_after_s >= 1
        assert scheduler.stats()["requests_rejected"] == 1

    asyncio.run(main())


def test_prompt_that_fills_the_context_is_rejected_and_length_ends_at_the_context(checkpoint):
    async def main():
        scheduler = await started(TableEngine(checkpoint, context_length=12))
        with pytest.raises(
            PromptTooLong, match="the prompt has 12 tokens but the context holds 12"
        ):
            scheduler.submit(request(range(1, 13)))
        _, ids, last = await collect(scheduler.submit(request(range(1, 9))))
        await scheduler.close()
        assert (len(ids), last.finish_reason) == (4, "length")

    asyncio.run(main())


def test_engine_error_fails_only_the_named_stream(checkpoint):
    async def main():
        engine = scripted(
            checkpoint,
            default="fine " * 20,
            replies=[Reply(when="boom", text="bad " * 20, fail_after=3)],
            step_ms=1,
        )
        scheduler = await started(engine)
        eos = engine.tokenizer.eos_token_ids
        bad = scheduler.submit(request(engine_prompt(checkpoint, "boom"), stop_ids=eos))
        good = scheduler.submit(request(engine_prompt(checkpoint, "fine"), stop_ids=eos))
        (bad_text, _, bad_last), (good_text, _, good_last) = await asyncio.gather(
            collect(bad), collect(good)
        )
        later = await collect(scheduler.submit(request(engine_prompt(checkpoint, "again"), 2)))
        await scheduler.close()
        three_tokens = engine.tokenizer.decode(engine.tokenizer.encode("bad " * 20)[:3])
        assert (bad_text, bad_last.finish_reason, bad_last.error) == (
            three_tokens,
            "error",
            "engine error: scripted failure in slots [0]",
        )
        assert (good_text, good_last.finish_reason) == ("fine " * 20, "stop")
        assert later[2].finish_reason == "length"

    asyncio.run(main())


def test_unexpected_engine_exception_fails_that_step_and_the_scheduler_keeps_going(checkpoint):
    async def main():
        engine = TableEngine(checkpoint, fail_steps={2})
        scheduler = await started(engine)
        _, _, first = await collect(scheduler.submit(request([4], 5)))
        _, ids, second = await collect(scheduler.submit(request([4], 5)))
        await scheduler.close()
        assert (first.finish_reason, first.error) == ("error", "engine error: boom")
        assert (second.finish_reason, len(ids)) == ("length", 5)
        assert scheduler.stats()["step_errors"] == 1

    asyncio.run(main())


def test_failed_load_is_raised_by_start(checkpoint):
    class Broken(TableEngine):
        def load(self):
            raise EngineError("weights missing")

    async def main():
        engine = Broken(checkpoint)
        with pytest.raises(EngineError, match="weights missing"):
            await started(engine)
        assert engine.closed

    asyncio.run(main())


def test_events_carry_counts_and_monotonic_times(checkpoint):
    async def main():
        scheduler = await started(scripted(checkpoint, default="a b c d e f", step_ms=2))
        stream = scheduler.submit(request(engine_prompt(checkpoint, "x"), 4))
        events = [e async for e in stream]
        await scheduler.close()
        times = [e.time_ns for e in events]
        assert times == sorted(times) and stream.submitted_ns <= stream.first_token_ns <= times[0]
        assert [e.num_generated_tokens for e in events][-1] == 4
        assert all(e.num_prompt_tokens == len(engine_prompt(checkpoint, "x")) for e in events)

    asyncio.run(main())


def engine_prompt(checkpoint, text):
    return CheckpointTokenizer.from_dir(checkpoint).encode(f"<|user|>{text}<|assistant|>")


class SnapshotTableEngine(TableEngine):
    """TableEngine with PrefixSnapshots (a test double): a snapshot is (slot, steps so far),
    100 bytes; `restore` records what it was given, or raises when `fail_restore`."""

    def __init__(self, checkpoint, *, fail_restore=False):
        super().__init__(checkpoint)
        self.fail_restore = fail_restore
        self.restored: list = []

    def snapshot(self, slot):
        return (slot, len(self.steps)), 100

    def restore(self, slot, state):
        if self.fail_restore:
            raise RuntimeError("restore boom")
        self.restored.append((slot, state))


def test_a_prefix_hit_restores_the_snapshot_and_starts_at_its_position(checkpoint):
    async def main():
        engine = SnapshotTableEngine(checkpoint)
        scheduler = Scheduler(
            engine, max_batch=4, chunk_size=4, queue_limit=4, prefix_cache_bytes=1000
        )
        await scheduler.start()
        *_, first = await collect(scheduler.submit(request(range(1, 11), 2)))
        engine.steps.clear()
        *_, hit = await collect(scheduler.submit(request([*range(1, 10), 99], 2)))
        stats = scheduler.stats()
        await scheduler.close()
        # snapshots after the chunks ending at 4 and 8 (steps 1 and 2 of slot 0)
        assert engine.restored == [(0, (0, 2))]
        assert (first.num_cached_tokens, hit.num_cached_tokens) == (0, 8)
        assert engine.steps[0] == [(0, 2, 8, True)]  # tokens 8 and 9, then decode
        assert stats["prefix_cache"]["snapshots"] == 2
        assert (stats["cached_prompt_tokens"], stats["requests_prefix_hit"]) == (8, 1)
        assert stats["prompt_tokens"] == 10 + 2

    asyncio.run(main())


def test_a_failed_restore_fails_that_request_only(checkpoint):
    async def main():
        engine = SnapshotTableEngine(checkpoint, fail_restore=True)
        scheduler = Scheduler(
            engine, max_batch=4, chunk_size=4, queue_limit=4, prefix_cache_bytes=1000
        )
        await scheduler.start()
        await collect(scheduler.submit(request(range(1, 11), 2)))
        *_, failed = await collect(scheduler.submit(request([*range(1, 10), 99], 2)))
        *_, later = await collect(scheduler.submit(request([50, 51], 2)))
        await scheduler.close()
        assert (failed.finish_reason, failed.error) == (
            "error",
            "engine error: restoring the cached prefix failed: restore boom",
        )
        assert later.finish_reason == "length" and engine.released.count(0) == 3

    asyncio.run(main())
