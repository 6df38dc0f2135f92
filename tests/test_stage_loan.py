"""The staging loan's schedule (glm53.tiers.vram_cache.StagingLoan), on this machine: when the
staging buffers go to the expert cache and when they come back. The cache and the stager here
are mocks (MockCache, MockStager) that record the calls, since DeviceExpertCache needs a GPU;
tests/gpu/test_expert_cache.py runs the real pair (the bytes and the table entries) and
tests/gpu/test_generator_parity.py the loan against stock exllamav3's Generator."""

import pytest

from glm53.tiers.vram_cache import LOAN_AFTER_DECODE_STEPS, PrefillStager, StagingLoan


class MockCache:
    """A mock of DeviceExpertCache's lend/unlend: it counts the active slots as the real one."""

    def __init__(self, n_slots):
        self.n_slots, self.n_active, self.calls = n_slots, n_slots, []

    def lend(self, n):
        if self.n_active != self.n_slots:
            raise RuntimeError("already lent")
        self.n_active -= n
        self.calls.append(("lend", n))
        return f"tail of {n}"

    def unlend(self):
        self.n_active = self.n_slots
        self.calls.append(("unlend",))


class MockStager:
    """A mock of PrefillStager's parts the loan touches (its CUDA-free `forget` is the real one)."""

    forget = PrefillStager.forget

    def __init__(self, cache, buf_slots):
        self.cache, self.buf_slots, self.hold = cache, buf_slots, False
        self.owner, self.unstaged, self.pending = [3, 4], "event", {5: "event"}

    def clear(self):
        self.cache.calls.append(("clear",))
        self.forget()


def make(n_slots=20, buf=4):
    cache = MockCache(n_slots)
    stager = MockStager(cache, buf)
    loan = StagingLoan(stager)
    assert loan.take() == "tail of 8"
    return cache, stager, loan


def test_the_buffers_start_as_the_stagers_and_go_to_clock_after_decode_steps_in_a_row():
    cache, stager, loan = make()
    assert cache.n_active == 12 and not loan.with_cache
    for _ in range(LOAN_AFTER_DECODE_STEPS - 1):
        loan.decode()
    assert not loan.with_cache and cache.calls == [("lend", 8)]
    loan.decode()
    assert loan.with_cache and cache.n_active == 20
    # the stager let go of every buffer before CLOCK may fill it
    assert cache.calls == [("lend", 8), ("clear",), ("unlend",)]
    loan.decode()  # already lent: nothing more
    assert cache.calls[-1] == ("unlend",) and loan.stats()["stage_loans"] == 1


def test_a_prefill_chunk_takes_the_buffers_back_and_forgets_what_they_staged():
    cache, stager, loan = make()
    for _ in range(LOAN_AFTER_DECODE_STEPS):
        loan.decode()
    stager.owner, stager.pending = [1, 2], {3: "event"}  # as if: (not possible while lent)
    loan.prefill()
    assert not loan.with_cache and cache.n_active == 12
    assert stager.owner == [-1, -1] and stager.pending == {} and stager.unstaged is None
    assert loan.stats() == {
        "stage_loan_slots": 8, "stage_loan_with_cache": False, "stage_loans": 1,
        "stage_recalls": 1,
    }  # fmt: skip
    loan.prefill()  # a second chunk: the buffers are the stager's already
    assert cache.calls.count(("lend", 8)) == 2


def test_chunks_between_decode_steps_keep_the_buffers():
    """A prompt prefilled chunk by chunk between the Generator's decode steps: no switch."""
    cache, stager, loan = make()
    for _ in range(10):
        loan.prefill()
        for _ in range(LOAN_AFTER_DECODE_STEPS - 1):
            loan.decode()
    assert cache.calls == [("lend", 8)] and not loan.with_cache


def test_a_held_stager_keeps_its_buffers():
    cache, stager, loan = make()
    stager.hold = True
    for _ in range(3 * LOAN_AFTER_DECODE_STEPS):
        loan.decode()
    assert not loan.with_cache
    stager.hold = False
    loan.decode()
    assert loan.with_cache


def test_a_loan_needs_more_cache_slots_than_staging_records():
    cache = MockCache(8)
    with pytest.raises(ValueError, match="needs more cache slots than its 8 staging records"):
        StagingLoan(MockStager(cache, 4))


def iterations_of_one_prompt(loan, chunks: int, cooldown: int) -> None:
    """exllamav3 1.6.5's Generator.iterate while another job generates and a prompt of `chunks`
    staged chunks is ingested (generator.py, the prefill round of iterate): an iteration with a
    prefill pass runs the chunk, then the batched decode forward; `cooldown` iterations with
    only the decode forward follow before the next pass."""
    for _ in range(chunks):
        loan.prefill()  # the chunk's first staged layer (PrefillStager.on_layer)
        loan.decode()  # the same iteration's decode forward of the generating job
        for _ in range(cooldown):
            loan.decode()


def test_glm53s_generator_settings_keep_the_buffers_through_a_prompt():
    """The loan's one-sync-per-prompt schedule rests on glm53's Generator settings: with
    prefill_cooldown 0 a prompt's chunks come on consecutive iterations (one decode forward
    between two), fewer than LOAN_AFTER_DECODE_STEPS; exllamav3's default cooldown (4) would
    lend and recall the buffers around every chunk (exact still, two syncs a chunk)."""
    from glm53.exl3.prefix import generator_settings

    cooldown = generator_settings(4, 2048, 4.0)["prefill_cooldown"]
    cache, stager, loan = make()
    iterations_of_one_prompt(loan, chunks=6, cooldown=cooldown)
    assert cache.calls == [("lend", 8)] and loan.stats()["stage_recalls"] == 0
    cache, stager, loan = make()
    iterations_of_one_prompt(loan, chunks=6, cooldown=4)  # exllamav3 1.6.5's default
    assert loan.stats()["stage_loans"] == 6 and loan.stats()["stage_recalls"] == 5
