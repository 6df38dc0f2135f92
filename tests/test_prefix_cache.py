"""The prefix cache (glm53/engine/prefix_cache.py) on the CPU engine: a request that resumes from
a cached prefix gives the same tokens and logits (torch.equal) as the same request prefilled
cold, through the engine, the scheduler and the real server.

The cold reference is a second CpuEngine on the same demo checkpoint, prefilled in chunks of
C tokens cut at multiples of C from position 0 (what the scheduler feeds, see
Scheduler._plan) and decoded greedily; nothing there touches a snapshot. Chunk size C = 64
keeps prompts at chunk edges short.
"""

import asyncio
import threading

import pytest
import torch

from glm53.engine.base import StreamWork
from glm53.engine.cpu import CpuEngine
from glm53.engine.cpu_options import CpuEngineOptions
from glm53.engine.prefix_cache import PrefixCache, Snapshot, chain_keys
from glm53.engine.sampling import SamplingParams
from glm53.engine.scheduler import GenerationRequest, Scheduler
from glm53.synth.shapes import preset
from glm53.synth.writer import write_checkpoint

C = 64
NEW_TOKENS = 6


# --- the cache on its own ----------------------------------------------------------------------
def test_chain_keys_name_the_whole_prefix_of_each_chunk():
    a = chain_keys(list(range(10)), 4)
    b = chain_keys([*range(4), 99, *range(5, 10)], 4)
    assert len(a) == 2 and len(chain_keys(list(range(8)), 4)) == 2
    assert a[0] == b[0] and a[1] != b[1]
    # the same chunk after another prefix gets another key
    assert chain_keys([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != a[1]


def test_lookup_takes_the_longest_snapshot_that_leaves_a_token_to_run():
    cache = PrefixCache(4, 1000)
    keys = chain_keys(list(range(12)), 4)
    for i, key in enumerate(keys):
        cache.store(key, Snapshot(f"state{i}", 4 * (i + 1), 10))
    assert cache.lookup(keys, 13).num_tokens == 12
    assert cache.lookup(keys, 12).num_tokens == 8  # 12 cached would leave nothing to run
    assert cache.lookup(keys, 4) is None
    assert cache.stats()["hits"] == 2 and cache.stats()["hit_tokens"] == 20


def test_evicts_the_least_recently_used_snapshot_when_full():
    cache = PrefixCache(4, 30)
    keys = chain_keys(list(range(16)), 4)
    for i in range(3):
        cache.store(keys[i], Snapshot(i, 4 * (i + 1), 10))
    assert cache.has(keys[0])  # now the most recently used
    cache.store(keys[3], Snapshot(3, 16, 10))
    assert [cache.has(k) for k in keys] == [True, False, True, True]
    cache.store(keys[1], Snapshot(1, 8, 31))  # larger than the whole cache: not kept
    stats = cache.stats()
    assert (stats["snapshots"], stats["bytes"]) == (3, 30)
    assert (stats["evicted"], stats["too_large"]) == (1, 1)


# --- the CPU engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefix") / "demo"
    write_checkpoint(preset("demo"), out, seed=0, routing_source="stand-in")
    return out


@pytest.fixture(scope="module")
def reference(demo):
    eng = CpuEngine(demo, CpuEngineOptions(max_batch=2, cpu_threads=1))
    eng.load()
    yield eng
    eng.close()


def prompt(engine, n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, engine.tokenizer.vocab_size, (n,), generator=generator).tolist()


def prefill(engine, slot: int, ids: list[int], start: int, snapshots: dict | None = None):
    """Feed ids[start:] in chunks cut at multiples of C; the logits of the last position. With
    `snapshots`, keep the slot's state at each chunk boundary (by position)."""
    pos, logits = start, None
    while pos < len(ids):
        end = min((pos // C + 1) * C, len(ids))
        out = engine.step([StreamWork(slot, ids[pos:end], pos, end == len(ids))])
        pos = end
        if end == len(ids):
            logits = out[0]
        if snapshots is not None and pos % C == 0:
            snapshots[pos] = engine.snapshot(slot)[0]
    return logits


def greedy(engine, slot: int, ids: list[int], logits: torch.Tensor, n: int):
    """n greedy tokens after the prompt `ids` whose last logits are `logits`: (tokens, logits)."""
    tokens, rows = [], [logits]
    for _ in range(n):
        tokens.append(int(rows[-1].argmax()))
        if len(tokens) < n:
            pos = len(ids) + len(tokens) - 1
            rows.append(engine.step([StreamWork(slot, [tokens[-1]], pos, True)])[0])
    return tokens, torch.stack(rows)


def cold(engine, ids: list[int], n: int = NEW_TOKENS):
    out = greedy(engine, 0, ids, prefill(engine, 0, ids, 0), n)
    engine.release(0)
    return out


def test_a_restored_snapshot_continues_exactly_as_the_cold_prefill(reference):
    ids = prompt(reference, 2 * C + 10, seed=1)
    snapshots: dict = {}
    cold_logits = prefill(reference, 0, ids, 0, snapshots)
    cold_tokens, cold_rows = greedy(reference, 0, ids, cold_logits, NEW_TOKENS)
    assert sorted(snapshots) == [C, 2 * C]
    for _ in range(2):  # restoring does not change the snapshot
        reference.restore(1, snapshots[2 * C])
        logits = prefill(reference, 1, ids, 2 * C)
        tokens, rows = greedy(reference, 1, ids, logits, NEW_TOKENS)
        assert tokens == cold_tokens and torch.equal(rows, cold_rows)
    reference.release(0)
    reference.release(1)


class RecordingEngine(CpuEngine):
    """The CPU engine, keeping each slot's fed tokens and logits rows since the last `clear`."""

    def clear(self):
        self.fed = {s: [] for s in range(self.num_slots)}
        self.rows = {s: [] for s in range(self.num_slots)}
        self.starts = {s: None for s in range(self.num_slots)}

    def load(self):
        super().load()
        self.clear()

    def step(self, work):
        out = super().step(work)
        rows = iter(out)
        for w in work:
            if self.starts[w.slot] is None:
                self.starts[w.slot] = w.start_pos
            self.fed[w.slot] += w.token_ids
            if w.want_logits:
                self.rows[w.slot].append(next(rows).clone())
        return out

    def of(self, ids: list[int], tokens: list[int]):
        """(first position fed, logits rows) of the one slot that ran prompt `ids` then `tokens`."""
        full = ids + tokens
        found = [
            (start, torch.stack(self.rows[s]))
            for s, start in self.starts.items()
            if start is not None
            and self.fed[s] == full[start : start + len(self.fed[s])]
            and start + len(self.fed[s]) == len(full) - 1
        ]
        assert len(found) == 1, found
        return found[0]


class Served:
    """A started Scheduler (chunk C) on a RecordingEngine, driven from its own event loop thread."""

    def __init__(self, demo, *, num_slots: int, prefix_cache_bytes: int):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = RecordingEngine(demo, CpuEngineOptions(max_batch=num_slots, cpu_threads=1))
        self.scheduler = Scheduler(
            self.engine,
            max_batch=num_slots,
            chunk_size=C,
            queue_limit=4,
            prefix_cache_bytes=prefix_cache_bytes,
        )
        self._wait(self.scheduler.start())

    def _wait(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    def run(self, *prompts):
        """Submit the prompts together: each one's (greedy tokens, num_cached_tokens)."""

        async def one(ids):
            req = GenerationRequest(list(ids), SamplingParams(temperature=0.0), NEW_TOKENS)
            events = [e async for e in self.scheduler.submit(req)]
            return [t for e in events for t in e.token_ids], events[-1].num_cached_tokens

        async def together():
            return await asyncio.gather(*(one(p) for p in prompts))

        return self._wait(together())

    def check(self, reference, prompts, cached):
        """Run the prompts together (from a cleared record); each one's tokens and logits equal
        the cold reference's, and it resumed at `cached` tokens."""
        self.engine.clear()
        results = self.run(*prompts)
        for (tokens, num_cached), ids, want in zip(results, prompts, cached, strict=True):
            ref_tokens, ref_rows = cold(reference, ids)
            start, rows = self.engine.of(ids, tokens)
            assert (num_cached, start) == (want, want)
            assert tokens == ref_tokens
            assert torch.equal(rows, ref_rows)
        return results

    def close(self):
        self._wait(self.scheduler.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(demo):
    served = Served(demo, num_slots=2, prefix_cache_bytes=256 << 20)
    yield served
    served.close()


def test_a_conversation_resumes_each_turn_from_the_last_chunk_boundary(served, reference):
    turn = prompt(reference, C + 40, seed=2)
    for expected_cached in (0, C, 2 * C):
        [(tokens, _)] = served.check(reference, [turn], [expected_cached])
        turn = turn + tokens + prompt(reference, 30, seed=len(turn))


@pytest.mark.parametrize("shared", [C - 1, C, C + 1, 2 * C + 1])
def test_prompts_sharing_a_prefix_at_chunk_edges(served, reference, shared):
    base = prompt(reference, 3 * C, seed=100 + shared)
    served.run(base)  # leaves snapshots at C, 2C and 3C
    other = base[:shared] + prompt(reference, 20, seed=200 + shared)
    other[shared] = (base[shared] + 1) % reference.tokenizer.vocab_size  # diverges right there
    served.check(reference, [other], [shared // C * C])


def test_a_hit_prefilled_beside_another_prefilling_stream(served, reference):
    base = prompt(reference, 2 * C + 5, seed=7)
    served.run(base)
    hit = base[: 2 * C + 3] + prompt(reference, 20, seed=9)  # 23 tokens left to prefill
    # the cold one's last chunk (17 tokens) leaves room for the hit's 23 in the same step
    served.check(reference, [prompt(reference, 2 * C + 17, seed=8), hit], [0, 2 * C])
    # the hit first: the cold one's first chunk (64) does not fit beside it and waits a step
    served.check(reference, [hit, prompt(reference, 2 * C + 17, seed=13)], [2 * C, 0])


def test_an_evicted_prefix_is_prefilled_cold_with_the_same_output(demo, reference):
    # room for one snapshot of 2C tokens: each new snapshot evicts the one before
    ids = prompt(reference, 2 * C, seed=10)
    prefill(reference, 0, ids, 0)
    room = reference.snapshot(0)[1] + 1
    reference.release(0)
    served = Served(demo, num_slots=1, prefix_cache_bytes=room)
    try:
        first = prompt(reference, 2 * C + 10, seed=11)
        second = prompt(reference, 2 * C + 9, seed=12)
        served.check(reference, [first], [0])
        served.check(reference, [second], [0])
        stats = served.scheduler.prefix_cache.stats()
        assert (stats["snapshots"], stats["evicted"]) == (1, 3)
        served.check(reference, [first + [5, 6, 7]], [0])  # first's snapshots are gone
    finally:
        served.close()
