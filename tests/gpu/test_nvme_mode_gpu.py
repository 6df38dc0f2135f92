"""nvme mode on the GPU engine (issue #27): nvme-exact (the RAM tier over the store as the
experts' home) + fast mode's CPU lane over the RAM tier (glm53.tiers.nvme_lane), GpuEngine(
mode="nvme").

Run on an H200 on 2026-12-05: 6 of 6 passed on the first run (bench/results/README.md). The CI
side is tests/test_nvme_lane.py (the lane over real RAM-tier records, the route's residency and
pointing against mocked device tables), tests/test_read_faults.py and
tests/test_gpu_engine_config.py (nvme mode served and its settings).

- A lane made to stall (its poller's stall hook) must give stock exllamav3's tokens and logits
  bit for bit (nvme-exact's answer, which equals stock: tests/gpu/test_nvme_exact_gpu.py), with
  every published layer counted as a fallback, at RAM caps of 40 % and 70 %.
- A working lane, teacher-forced on exact's greedy tokens: decode KL of nvme against exact and
  top-1 agreement, at c1 and at c4, each no worse than exllamav3's own batch-1 vs batch-4 floor
  on the same checkpoint and tokens (test_fast_mode_gpu.py's reference runs, shared).
- The real server (`--mode nvme`) answers the real openai client at c1 and
  c4, and /stats shows the lane and the RAM tier.

Needs GLM53_TEST_SLICE and the session's slice store (conftest.py's `slice_store`).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("exllamav3")
pytest.importorskip("glm53._cuda")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from glm53.engine.gpu import GpuEngine  # noqa: E402
from glm53.engine.gpu_options import EngineOptions  # noqa: E402
from glm53.tiers.fast_lane import NVME_STATUS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "gpu"))
from gpu_kit import (  # noqa: E402
    CHUNK,
    N_NEW,
    assert_same,
    checkpoint_dir,
    num_records,
    run_engine,
)
from serving_kit import Server  # noqa: E402

# fast mode's test file holds the shared pieces: its reference runs (c1 alone, c4 together, each
# with exllamav3's floor at the other batch), its teacher-forcing loop and its lane settings
from test_fast_mode_gpu import (  # noqa: E402
    EAGER_CT_B,
    SURE_WAIT_NS,
    lane_within_floor,
    slice_case,
)
from test_fast_mode_gpu import _spec as fast_spec  # noqa: E402

CONTEXT = 8192
RAM_SHARES = (0.4, 0.7)


def reference_specs():
    """The stock runs this file asks for: fast mode's, the same runs (conftest.py declares
    them; one reference process computes them for both files)."""
    path = checkpoint_dir("GLM53_TEST_SLICE")
    return [fast_spec(path)] if path else []


@pytest.fixture(scope="module")
def case(tmp_path_factory, slice_store):
    import json

    case = slice_case(tmp_path_factory, "nvme-mode")
    record = json.loads(Path(slice_store, "manifest.json").read_text())["record_bytes"]
    n = num_records(case["path"])
    return case | {"store": slice_store, "cap": {s: int(s * n) * record for s in RAM_SHARES}}


def nvme_engine(case, name, share, **kw):
    e = GpuEngine(case["path"], EngineOptions(
        mode="nvme", context=CONTEXT, max_batch=4, chunk_size=CHUNK,
        ec_max_slots=case["slots"], heat_file=str(case["tmp"] / f"heat-{name}.json"),
        cache_dir=str(case["tmp"] / f"cache-{name}"), store=case["store"],
        ram_cap=case["cap"][share], **kw,
    ))  # fmt: skip
    e.load()
    return e


def layer0_publishes_first(e) -> None:
    """Until the poller holds the stalled job, only layer 0 gets a lane budget. In nvme mode a
    layer publishes only a VRAM miss that the RAM tier holds, so from cold tiers another layer
    can have one steps before layer 0 does (its RAM-resident experts all admitted to VRAM);
    the poller, not yet stalled, would compute that job, and with the store reads of that
    layer's resolve between its publish and its wait the result could be in time: a lane
    result used, no fallback, tokens no longer stock's. With no other layer publishing until
    the hold, the stalled job is the lane's first."""
    lane, step = e.fast.lane, e.fast.step

    def step_layer0_first():
        budgets = step()
        if not lane.poller.held:
            for mbox in lane.mailboxes[1:]:
                mbox.set_budget(0)
        return budgets

    for mbox in lane.mailboxes[1:]:
        mbox.set_budget(0)
    e.fast.step = step_layer0_first  # GpuEngine.iterate calls it after each iteration


@pytest.mark.parametrize("share", RAM_SHARES)
def test_a_stalled_lane_gives_nvme_exacts_tokens_and_logits_and_counts_every_fallback(case, share):
    e = nvme_engine(case, f"stall-{share}", share, ct_b=EAGER_CT_B)
    try:
        lane = e.fast.lane
        assert lane.tables[0] is e.loaded.nvme.tier.table  # the lane reads the RAM tier
        # hold the first job of layer 0: one poller serves every layer, so no layer of any
        # later step is answered either, and every published layer must fall back (layer 0's
        # job must then be the lane's first: layer0_publishes_first)
        lane.poller.stall(0, lane.mailboxes[0].seq + 1)
        layer0_publishes_first(e)
        for i, prompt in enumerate(case["prompts"][1]):  # c1: each alone
            (got,) = run_engine(e, [prompt], N_NEW)
            assert_same(got, case["ref"][1][i], f"stalled lane, RAM {share:.0%}, c1, {i}")
        assert lane.poller.held  # the stall engaged: layer 0 published and was held
        for i, got in enumerate(run_engine(e, case["prompts"][4], N_NEW)):  # c4: together
            assert_same(got, case["ref"][4][i], f"stalled lane, RAM {share:.0%}, c4, {i}")
        st = e.stats()
        lane_st, ram = st["lane"], st["tiers"]["ram"]
        assert lane_st["published"] > 0 and lane_st["lane_picks"] > 0, lane_st
        assert lane_st["fallbacks"] == lane_st["published"], lane_st
        assert ram["table_bad"] == 0 and ram["read_errors"] == 0
        assert ram["ram_reads"] > ram["slots"]  # the cap made the tier evict and read again
        lane.poller.release()
        check = e.verify_tiers(64)
        assert check.is_ok, check.summary()
    finally:
        e.close()


@pytest.fixture(scope="module")
def working(case):
    """One nvme engine (RAM 40 %) with a working lane for both teacher-forced cases: every miss
    sent to the lane (forced share 1.0, as test_fast_mode_gpu's `working`: what the lane gets
    must not depend on timing), and waits that must succeed."""
    e = nvme_engine(case, "kl", RAM_SHARES[0], ct_b=EAGER_CT_B)
    e.fast.router.set_forced_share(1.0)
    for layer in e.fast.layers:  # all misses may be more than 2 ms of lane work
        layer.budget_ns = SURE_WAIT_NS
    yield e
    e.close()


@pytest.mark.parametrize("batch", [1, 4])
def test_a_working_lane_stays_within_exllamav3s_floor_teacher_forced(
    case, working, batch, record_property
):
    """As test_fast_mode_gpu's floor test, with the lane over the RAM tier: c1 each prompt
    alone, c4 the batch together, against the reference (exact's) and its floor."""
    # teacher_forced drives the Generator itself: the table check GpuEngine.iterate makes
    lane_within_floor(case, working, batch, record_property, "nvme",
                      after=lambda e: e.loaded.nvme.check_table_bad())  # fmt: skip


@pytest.fixture(scope="module")
def server(case, working):
    working.close()  # one model and one lane at a time: the lane's threads poll on the CPUs
    tmp = case["tmp"] / "server"
    tmp.mkdir()
    args = ["--engine", "gpu", "--mode", "nvme", "--model",
            case["path"], "--store", str(case["store"]), "--ram-cap",
            str(case["cap"][RAM_SHARES[0]]), "--context", str(CONTEXT), "--chunk-size",
            str(CHUNK), "--max-batch", "4", "--ec-max-slots", str(case["slots"])]  # fmt: skip
    srv = Server(args, env={"XDG_CACHE_HOME": str(tmp / "cache")}, log_path=tmp / "server.log")
    srv.wait_ready(timeout_s=900)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("concurrency", [1, 4])
def test_the_server_in_nvme_mode_answers_the_openai_client_and_shows_lane_and_ram_tier(
    server, concurrency
):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=600)  # fmt: skip
    assert "tier check at start: ram_bad=0 vram_bad=0 table_bad=0" in server.log()
    results, errors = {}, []

    def one(i):
        try:
            results[i] = client.completions.create(
                model="glm-5.3-flash", prompt=f"Request {i}: the", max_tokens=32, temperature=0
            )
        except Exception as exc:  # collected and asserted below
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not errors and len(results) == concurrency, errors
    for r in results.values():
        assert r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.completion_tokens > 0
    chat = client.chat.completions.create(
        model="glm-5.3-flash", messages=[{"role": "user", "content": "Hello!"}], max_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert chat.usage.completion_tokens > 0
    engine = httpx.get(server.url + "/stats", timeout=60).json()["engine"]
    lane, ram = engine["lane"], engine["tiers"]["ram"]
    # nvme mode's own status line, not fast mode's (compared with the constant, not its words:
    # the words change when the status does)
    assert lane["status"] == NVME_STATUS, lane["status"]
    assert lane["steps"] > 0 and lane["layers"], lane
    assert ram["table_bad"] == 0 and ram["faults_isolated"] == 0
    assert ram["ram_hits"] + ram["ram_reads"] > 0
