"""nvme-exact in-process against stock exllamav3 1.6.5's own Generator: greedy tokens and logits
identical (torch.equal) with the RAM tier capped at 40 % and 70 % of the routed experts and the
VRAM cache at the 24 GB card's 11.4 % share, with prefill staging (glm53.tiers.prefill_ahead; on
by default in-process, EngineOptions.ec_stage_gb None) and without it (--ec-stage-gb 0), and
with decode prefetch (--nvme-prefetch next-layer, glm53.tiers.decode_prefetch) at both caps,
alone and with the batch admitted together, and with layer-major prefill (--prefill layer-major
over the RAM tier, glm53.exl3.layer_major) at 40 %.
The served cases, the store's verify and its read faults are test_nvme_exact_store_gpu.py
(another group: its verify test flips store bytes).

History: 6 of 6 on an H200 (2026-12-02, staging off). H200, 2026-12-05 at dc7ef0e: every
in-process case with staging on failed (a forward's first staged hook let the next layer's wave
evict the layer's own zero-copy picks in a full tier; fixed, tests/test_prefill_ahead.py). H100,
2026-12-05 (later): all five in-process cases passed (72, 43, 50, 99 and 57 s); in the whole GPU
suite on an H100 that day all 6 passed, the layer-major case included.

Every counter assertion prints the tier's stats. Needs GLM53_TEST_SLICE (a `glm53 synth --preset
slice` checkpoint); the store is conftest.py's `slice_store`, packed once for the session unless
GLM53_TEST_SLICE_STORE names one already packed from it (16.4 GB; tools/gpu-check.sh packs one
per call for its groups: this file only reads it). The reference runs in a subprocess that never
imports glm53 (tools/exl3_reference.py), shared with the other slice files through gpu_kit (same
prompts, same runs: test_generator_parity.py's prompts of these lengths).
"""

from __future__ import annotations

import pytest

pytest.importorskip("exllamav3")
pytest.importorskip("glm53._cuda")

from gpu_kit import (  # noqa: E402
    CHUNK,
    N_NEW,
    assert_same,
    batch_prompts,
    run_engine,
    stock_reference,
    text_config,
)
from nvme_exact_kit import (  # noqa: E402
    CONTEXT,
    LENGTHS,
    RAM_SHARES,
    make_case,
    singles,
    slice_path,
    together,
)
from nvme_exact_kit import ram as _ram  # noqa: E402

from glm53.engine.gpu import GpuEngine  # noqa: E402
from glm53.engine.gpu_options import EngineOptions  # noqa: E402


def reference_specs():
    """The stock runs this file asks for (conftest.py declares them)."""
    path = slice_path()
    return [singles(path), together(path)] if path else []


@pytest.fixture(scope="module")
def case(tmp_path_factory, slice_store):
    path = slice_path()
    if path is None:
        pytest.skip("no slice checkpoint (GLM53_TEST_SLICE)")
    return make_case(path, slice_store, tmp_path_factory.mktemp("nvme-exact"))


@pytest.mark.parametrize(
    ("share", "stage_gb"), [(s, None) for s in RAM_SHARES] + [(RAM_SHARES[0], 0.0)]
)
def test_in_process_nvme_exact_equals_stock_exllamav3(case, share, stage_gb):
    """stage_gb None: prefill staging on (its default; glm53.tiers.prefill_ahead), 0: off. The
    prompts of 257, 2,049 and 5,000 tokens are staged chunks (at least stage_min_rows rows),
    the last two crossing chunk edges (a pipeline drained and restarted per chunk)."""
    # each engine its own cache_dir: a cold RAM tier, not warm-started from the heat list an
    # earlier test's engine saved at close (~/.cache/glm53, shared by every in-process engine)
    e = GpuEngine(case["path"], EngineOptions(
        mode="nvme-exact", context=CONTEXT, max_batch=4, chunk_size=CHUNK,
        ec_max_slots=case["slots"], heat_file=str(case["tmp"] / f"heat-{share}-{stage_gb}.json"),
        cache_dir=str(case["tmp"] / f"cache-{share}-{stage_gb}"),
        store=case["store"], ram_cap=case["cap"][share], ec_stage_gb=stage_gb,
    ))  # fmt: skip
    e.load()
    try:
        for n in LENGTHS:
            (got,) = run_engine(e, [case["prompts"][n]], N_NEW)
            what = f"RAM {share:.0%}, stage {stage_gb}, prompt of {n}; ram {_ram(e)}"
            assert_same(got, case["ref"][n], what)
        ram = _ram(e)
        assert ram["table_bad"] == 0 and ram["read_errors"] == 0, ram
        if stage_gb is None:  # staging ran: layers read ahead and staged
            assert ram["stage_slots"] > 0 and ram["stage_layers"] > 0, ram
            assert ram["stage_waves"] > 0, ram
            assert ram["stage_faults"] == 0, ram
        else:
            assert ram["stage_slots"] == 0, ram
        assert ram["ram_reads"] > ram["slots"], ram  # the cap made the tier evict and read again
        check = e.verify_tiers(64)
        assert check.is_ok, f"{check.summary()}; ram {ram}"
        assert check.vram_checked > 0 and check.table_checked > 0, (check.summary(), ram)
    finally:
        e.close()


@pytest.mark.parametrize("share", RAM_SHARES)
def test_in_process_nvme_exact_with_decode_prefetch_equals_stock_exllamav3(case, share):
    """--nvme-prefetch next-layer (glm53.tiers.decode_prefetch; failed at both caps on the H200
    on 2026-12-05 with the first-hook bug, passed at both on an H100 after its fix): each
    decode MoE hook also runs the next layer's router on this layer's input and reads the
    predicted misses ahead. That moves only when bytes are read from the store, never the
    bytes, the picks or the kernels, and the prediction runs before the layer's own routing
    (exllamav3's routers share their multi-row workspaces), so tokens and logits stay
    torch.equal to stock exllamav3's, alone (one-row decode: the routers' one-row buffers) and
    with the batch admitted together (multi-row decode: the shared workspaces). The waves ran,
    their reads did not fault, and nothing stays pinned after the run."""
    e = GpuEngine(case["path"], EngineOptions(
        mode="nvme-exact", context=CONTEXT, max_batch=4, chunk_size=CHUNK,
        ec_max_slots=case["slots"], heat_file=str(case["tmp"] / f"heat-{share}-prefetch.json"),
        cache_dir=str(case["tmp"] / f"cache-{share}-prefetch"),
        store=case["store"], ram_cap=case["cap"][share], nvme_prefetch="next-layer",
    ))  # fmt: skip
    e.load()
    try:
        assert e.loaded.nvme.prefetch is not None
        for n in LENGTHS:
            (got,) = run_engine(e, [case["prompts"][n]], N_NEW)
            assert_same(got, case["ref"][n], f"RAM {share:.0%}, prefetch, prompt of {n}; {_ram(e)}")
        (batch,) = stock_reference(together(case["path"]), case["tmp"])
        prompts = batch_prompts(text_config(case["path"])["vocab_size"])
        got = run_engine(e, prompts, N_NEW)
        for i, (g, w) in enumerate(zip(got, batch, strict=True)):
            assert_same(g, w, f"RAM {share:.0%}, prefetch, batch job {i}; ram {_ram(e)}")
        ram = _ram(e)
        assert ram["table_bad"] == 0 and ram["read_errors"] == 0, ram
        assert ram["prefetch_waves"] > 0 and ram["prefetch_keys"] > 0, ram
        assert ram["prefetch_faults"] == 0, ram
        assert ram["prefetch_hits"] + ram["prefetch_wasted"] == ram["prefetch_keys"], ram
        pinned = e.loaded.nvme.tier.clock.n_pinned
        assert e.loaded.nvme.prefetch.idle() and pinned == 0, (pinned, ram)
        check = e.verify_tiers(64)
        assert check.is_ok, f"{check.summary()}; ram {ram}"
    finally:
        e.close()


@pytest.mark.parametrize("pass_staging", [False, True])  # served default; the flag's path
@pytest.mark.parametrize("share", RAM_SHARES[:1])  # 40 %: the most store reads; one share for
def test_in_process_nvme_exact_layer_major_equals_stock_exllamav3(
    case, share, pass_staging
):  # e's time
    """--prefill layer-major over the RAM tier (glm53.exl3.layer_major in the store modes;
    unstaged, it passed on an H100 in the whole GPU suite on 2026-12-05): the 5,000-token prompt
    (four forwards of the Generator's) runs one pass, every chunk of a layer resolving its picks
    in the RAM tier and the layer's records pinned until the pass leaves it, so the store is
    read once per layer per prompt. Prefill staging is on (its default). Without pass staging
    (served without --allow-unrun-modes) every chunk reads its picks zero-copy; with it
    (EngineOptions.store_pass_staging, UNRUN["store-pass-staging"]: written after that run,
    first run here) each layer is staged once per pass at its first chunk
    (NvmeHome._stage_pass_layer) and its later chunks read the stage. The pass sees no free
    VRAM (as on a 24 GB card), so its streams take lent VRAM-cache slots, whose keys then point
    at their RAM homes or absent. Tokens and logits torch.equal to stock exllamav3's Generator
    prefilling chunk-major, at every length (the shorter prompts keep the Generator's path);
    the pass's store reads are printed; its pins and lent slots are gone after it; the tier
    check is clean."""
    e = GpuEngine(case["path"], EngineOptions(
        mode="nvme-exact", context=CONTEXT, max_batch=4, chunk_size=CHUNK,
        ec_max_slots=case["slots"], heat_file=str(case["tmp"] / f"heat-{share}-{pass_staging}-lm.json"),
        cache_dir=str(case["tmp"] / f"cache-{share}-{pass_staging}-lm"),
        store=case["store"], ram_cap=case["cap"][share], prefill="layer-major",
        store_pass_staging=pass_staging,
    ))  # fmt: skip
    e.load()
    e.layer_major.free_bytes = lambda: 0  # no VRAM beside the cache: the streams borrow slots
    try:
        for n in LENGTHS:
            (got,) = run_engine(e, [case["prompts"][n]], N_NEW)
            assert_same(got, case["ref"][n], f"RAM {share:.0%}, layer-major, prompt of {n}; "
                                             f"{_ram(e)}")  # fmt: skip
        lm = e.stats()["layer_major"]
        long = [n for n in LENGTHS if n - 1 > CHUNK]  # the prompts a pass prefills
        assert lm["passes"] == len(long) and lm["passes_cancelled"] == 0, lm
        last = lm["last_pass"]
        print(f"RAM {share:.0%}: the {long[-1]}-token pass read {last['store_reads']} records "
              f"({last['store_bytes'] / 1e9:.2f} GB) from the store; {last}")  # fmt: skip
        end = long[-1] - 1  # the Generator's forwards: whole chunks to the last page edge, then
        edge = end // 256 * 256  # the rest of the prompt but its last token
        assert last["chunks"] == -(-edge // CHUNK) + (end > edge), last
        assert last["lent_slots"] > 0 and e.loaded.ec.lent == 0, last
        ram = _ram(e)
        assert ram["table_bad"] == 0 and ram["read_errors"] == 0, ram
        passes = e.loaded.nvme.pass_stats()
        assert passes["pass_pinned"] == 0, passes
        stager = e.loaded.nvme.stager
        assert stager is not None and e.loaded.nvme.pass_staging is pass_staging
        # with pass staging, each MoE layer a prefill runs staged once per pass; else none
        stages = stager.prefill_layers * len(long) if pass_staging else 0
        assert passes["pass_stages"] == stages, (passes, stager.prefill_layers)
        assert e.loaded.nvme.tier.clock.n_pinned == 0, ram
        check = e.verify_tiers(64)
        assert check.is_ok, f"{check.summary()}; ram {ram}"
    finally:
        e.close()
