"""Read faults of the RAM tier on the CPU engine over a packed store: a failed or short read
fails the request that needed the expert (naming its layer and expert), is counted, leaves the
tier consistent, and the other requests go on. In process with injected read errors
(store_kit.FailingReader), then through the real server with the real store file truncated and
deleted under it (real O_DIRECT short reads)."""

import errno
import os
import re
import time

import httpx
import openai
import pytest
import torch
from serving_kit import Server
from store_kit import FailingReader, StallingReader, resident_records

from glm53.engine.base import EngineError, StreamWork
from glm53.engine.cpu import CpuEngine
from glm53.engine.cpu_options import CpuEngineOptions

RECORD = 77_824  # demo record bytes
NUM_RECORDS = 192  # 6 MoE layers x 32 experts
PROMPT_A = [11, 12]
PROMPT_B = [901, 902]


@pytest.fixture(scope="module")
def engine(demo, good_store):
    """One engine for the in-process tests (room for every record); each test starts it cold
    and puts the real reader back."""
    options = CpuEngineOptions(
        max_batch=2, cpu_threads=1, ram_cap=NUM_RECORDS * RECORD, store=good_store
    )
    eng = CpuEngine(demo, options)
    eng.load()
    real = eng.tier.source.reader
    yield eng
    eng.tier.source.reader = real
    eng.close()


def cold(engine) -> CpuEngine:
    for slot in range(engine.num_slots):
        engine.release(slot)
    engine.tier.clock.clear()
    return engine


def inject(engine, records: list[int]) -> None:
    source = engine.tier.source
    real = getattr(source.reader, "reader", source.reader)
    source.reader = FailingReader(real, [r * RECORD + 4096 for r in records], errno.EIO)


def heal(engine) -> None:
    source = engine.tier.source
    source.reader = getattr(source.reader, "reader", source.reader)


def layer_expert(engine, record: int) -> tuple[int, int]:
    return engine.tier.source.moe_layers[record // 32], record % 32


@pytest.fixture(scope="module")
def clean_runs(engine):
    """Per prompt: the records it reads from a cold tier, and its prefill and first decode
    logits (no fault)."""
    out = {}
    for name, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        cold(engine)
        first = engine.step([StreamWork(0, prompt, 0, True)])[0]
        token = int(first.argmax())
        second = engine.step([StreamWork(0, [token], len(prompt), True)])[0]
        out[name] = (resident_records(engine), first, token, second)
    return out


def test_a_read_error_names_the_layer_and_expert_and_the_tier_stays_consistent(engine, clean_runs):
    bad = min(clean_runs["b"][0])
    layer, expert = layer_expert(engine, bad)
    cold(engine)
    errors_before = engine.stats()["tiers"]["ram"]["read_errors"]
    inject(engine, [bad])
    try:
        with pytest.raises(EngineError) as info:
            engine.step([StreamWork(0, PROMPT_B, 0, True)])
        assert info.value.slots == (0,)
        message = str(info.value)
        assert message.startswith(
            f"slot 0: forward failed: a read error for layer {layer} expert {expert}: reading "
            f"layer {layer} expert {expert} from the store failed at offset {bad * RECORD + 4096}"
        ), message
        assert engine.stats()["tiers"]["ram"]["read_errors"] == errors_before + 1
        assert bad not in resident_records(engine)  # its slot held partial bytes: un-admitted
        check = engine.verify_tiers(NUM_RECORDS)  # the check's own read of it fails too
        assert check.counts() == {"ram_bad": 1, "vram_bad": 0, "table_bad": 0}
        assert [(b.layer, b.expert, b.slot) for b in check.bad] == [(layer, expert, -1)]
        assert check.bad[0].problem.startswith(
            f"the store read failed: reading layer {layer} expert {expert} from the store failed"
        )
    finally:
        heal(engine)
    check = engine.verify_tiers(NUM_RECORDS)
    assert check.counts() == {"ram_bad": 0, "vram_bad": 0, "table_bad": 0}
    engine.release(0)
    again = engine.step([StreamWork(0, PROMPT_B, 0, True)])[0]
    assert torch.equal(again, clean_runs["b"][1])


def test_a_fault_in_one_stream_leaves_the_other_streams_of_the_step_going(engine, clean_runs):
    only_b = sorted(clean_runs["b"][0] - clean_runs["a"][0])
    assert only_b, "the two prompts read the same experts; pick other prompts"
    cold(engine)
    inject(engine, [only_b[0]])
    try:
        with pytest.raises(EngineError) as info:
            engine.step([StreamWork(0, PROMPT_A, 0, True), StreamWork(1, PROMPT_B, 0, True)])
    finally:
        heal(engine)
    assert info.value.slots == (1,)
    layer, expert = layer_expert(engine, only_b[0])
    assert f"a read error for layer {layer} expert {expert}" in str(info.value)
    engine.release(1)  # what the scheduler does with the failed stream
    _, first, token, second = clean_runs["a"]
    prefill_before = engine.stats()["prefill_tokens"]
    # the scheduler runs stream 0's work again: answered from what the failed step kept
    assert torch.equal(engine.step([StreamWork(0, PROMPT_A, 0, True)])[0], first)
    assert engine.stats()["prefill_tokens"] == prefill_before
    assert torch.equal(engine.step([StreamWork(0, [token], 2, True)])[0], second)


def test_a_read_that_never_answers_fails_its_request_at_the_timeout_and_never_hangs(
    engine, clean_runs
):
    only_b = sorted(clean_runs["b"][0] - clean_runs["a"][0])
    bad = only_b[0]
    layer, expert = layer_expert(engine, bad)
    cold(engine)
    tier, source = engine.tier, engine.tier.source
    real = getattr(source.reader, "reader", source.reader)
    stall = StallingReader(real, [bad * RECORD + 4096])
    source.reader, tier.read_timeout_s = stall, 0.2
    timeouts_before = tier.faults["read_timeouts"]
    try:
        with pytest.raises(EngineError) as info:
            engine.step([StreamWork(0, PROMPT_B, 0, True)])
        # the stuck request: one coalesced read of adjacent records, named by its first
        named = re.search(
            r"reading layer (\d+) expert (\d+)(?: \(and (\d+) more)?", str(info.value)
        )
        assert named, str(info.value)
        first, more = int(named[2]), int(named[3] or 0)
        assert int(named[1]) == layer and first <= expert <= first + more, str(info.value)
        assert "no answer within 0.2 s" in str(info.value), str(info.value)
        assert tier.faults["read_timeouts"] == timeouts_before + 1
        # the late read may still land in its slot: kept admitted, pinned, never handed out
        slot = tier.clock.lookup(bad)
        assert slot >= 0 and tier.clock.pin_count(slot) == 1
        # asked for again while the disk still does not answer: fails at once, names it
        engine.release(0)
        with pytest.raises(EngineError) as again:
            engine.step([StreamWork(0, PROMPT_B, 0, True)])
        named = re.search(r"layer (\d+) expert (\d+): its read from", str(again.value))
        assert named and int(named[1]) == layer, str(again.value)
        assert first <= int(named[2]) <= first + more, str(again.value)
        assert "has not finished since it timed out" in str(again.value)
        # a stream that needs none of the stuck experts goes on, with the same logits
        engine.release(0)
        assert torch.equal(engine.step([StreamWork(0, PROMPT_A, 0, True)])[0], clean_runs["a"][1])
    finally:
        stall.release()
    deadline = time.monotonic() + 30
    while tier._stuck and time.monotonic() < deadline:  # the late reads finish; then freed
        tier._reap()
        time.sleep(0.01)
    source.reader, tier.read_timeout_s = real, engine.options.read_timeout_s
    assert not tier._stuck and tier.clock.lookup(bad) < 0  # unpinned and un-admitted
    engine.release(0)
    assert torch.equal(engine.step([StreamWork(0, PROMPT_B, 0, True)])[0], clean_runs["b"][1])


def test_work_that_grew_after_a_failed_step_runs_only_its_new_tokens(engine, clean_runs):
    only_b = sorted(clean_runs["b"][0] - clean_runs["a"][0])
    cold(engine)
    inject(engine, [only_b[0]])
    try:
        with pytest.raises(EngineError):
            engine.step([StreamWork(0, PROMPT_A, 0, False), StreamWork(1, PROMPT_B, 0, True)])
    finally:
        heal(engine)
    engine.release(1)
    prefill_before = engine.stats()["prefill_tokens"]
    longer = [*PROMPT_A, 13, 14]  # the freed chunk budget gives stream 0 more tokens
    got = engine.step([StreamWork(0, longer, 0, True)])[0]
    assert engine.stats()["prefill_tokens"] == prefill_before + 2
    # what the engine did: the kept 2 tokens, then the new 2 from position 2 (one prefill of
    # all 4 would chunk the KDA recurrence differently and round differently)
    engine.step([StreamWork(1, PROMPT_A, 0, False)])
    want = engine.step([StreamWork(1, [13, 14], 2, True)])[0]
    assert torch.equal(got, want)


# --- through the server, with the real store file changed under it -----------------------


def serve(demo, store, tmp_path, slots: int) -> Server:
    server = Server(
        [
            "--model",
            str(demo),
            "--engine",
            "cpu",
            "--store",
            str(store),
            "--ram-cap",
            str(slots * RECORD),
            "--cpu-threads",
            "1",
            "-cs",
            "1024",
        ],
        log_path=tmp_path / "server.log",
    )
    server.wait_ready()
    return server


def complete(http: httpx.Client, prompt: str) -> httpx.Response:
    return http.post(
        "/v1/completions",
        json={"model": "glm-5.3-flash", "prompt": prompt, "max_tokens": 3, "temperature": 0},
    )


PROMPT = "The moon is far away, and the sky looks blue because of the way light scatters."


def test_a_store_changed_under_the_server_fails_requests_cleanly_and_never_hangs(
    demo, store, tmp_path
):
    """Truncated mid-record: requests that need a record past the cut get a 500 naming it, the
    short reads are counted and logged, the server stays up; made whole again, it serves and
    its tier checks clean. Then deleted: reads go on through the open file, logged once."""
    server = serve(demo, store, tmp_path, slots=16)
    try:
        http = httpx.Client(base_url=server.url, timeout=120)
        assert complete(http, PROMPT).status_code == 200
        data = store / "experts.bin"
        good = data.read_bytes()
        cut = 100 * RECORD + 5000  # records 100.. now read short
        os.truncate(data, cut)
        r = complete(http, PROMPT)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_error")
        found = re.search(
            r"a short read \(the file ends early\) for layer (\d+) expert (\d+)", error["message"]
        )
        assert found, error["message"]
        assert (int(found[1]) - 2) * 32 + int(found[2]) >= 100  # a record past the cut
        assert f"({data} was truncated to {cut} bytes while serving" in error["message"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="a short read"):
            client.completions.create(model="glm-5.3-flash", prompt=PROMPT, max_tokens=3)
        assert http.get("/health").status_code == 200
        ram = http.get("/stats").json()["engine"]["tiers"]["ram"]
        assert (ram["short_reads"], ram["read_errors"]) == (2, 0)
        assert "glm53_engine_tiers_ram_short_reads 2" in http.get("/metrics").text.splitlines()
        assert server.log().count("expert read failed (a short read (the file ends early))") == 2

        with open(data, "r+b") as f:  # the same file (the server's descriptor) made whole again
            f.write(good)
        assert complete(http, PROMPT).status_code == 200
        check = http.get("/admin/verify", params={"n": NUM_RECORDS}).json()
        assert (check["ram_bad"], check["vram_bad"], check["table_bad"]) == (0, 0, 0)

        data.unlink()
        line = (
            f"the expert source changed under the server: {data} was deleted while serving; "
            "reads go on through the open file until it fails them, and a restart will not load it"
        )
        for attempt in range(40):  # the tier looks at most once a second, on a read
            assert complete(http, f"{PROMPT} {attempt}").status_code == 200
            if line in server.log():
                break
        assert line in server.log()
        assert complete(http, PROMPT + " And again.").status_code == 200
        assert server.log().count("was deleted while serving; reads go on") == 1
        assert http.get("/stats").json()["engine"]["tiers"]["ram"]["read_errors"] == 0
    finally:
        assert server.stop() == 0, server.log()
