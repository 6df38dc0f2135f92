"""The CPU expert lane (glm53._gemv, glm53.tiers.cpu_lane): every kernel variant against the numpy
decoder (bit-exact weights, fp32-exact products), the MoE job against an fp64 reference, the job
API, bad input, and the CPU layout rules."""

import numpy as np
import pytest

from glm53 import _gemv
from glm53.models.exl3 import Exl3Weights, decode_tiles, mul1_table
from glm53.tiers import cpu_lane
from glm53.tiers.cpu_lane import (
    CpuLane,
    LaneConfigError,
    LaneLayout,
    expert_table,
    lane_layout,
    parse_cpu_list,
    random_expert,
    reference_moe,
)

ALL_VARIANTS = list(_gemv.VARIANTS)
VARIANTS = [
    pytest.param(v, marks=pytest.mark.skipif(not _gemv.variant_supported(v), reason="CPU lacks it"))
    for v in ALL_VARIANTS
]
RATES = [2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]  # k2 = 2 K: K = 1..8 and 1.5, 2.5, 3.5
REL_TOL = 1e-5  # fp32 accumulation over a few thousand products, against fp64


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def random_trellis(rng, kt, nt, k2):
    return rng.integers(-(2**15), 2**15, (kt, nt, 8 * k2), dtype=np.int16)


def test_veltkamp_split_rounds_every_mul1_value_to_fp16():
    # The kernels' rounding (gemv_kern.h), emulated in fp32, over all 1021 byte sums.
    s = np.arange(1021, dtype=np.float32)
    v = s * np.float32(1774 / 2**18) + np.float32(-3.453125)
    c = v * np.float32(8193)
    assert np.array_equal(c - (c - v), mul1_table().astype(np.float32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernels_decode_all_65536_states_bit_exactly(variant):
    # K = 8: state t = stream bytes (t-1, t). Tiles [j, i0, j, i1, ...] hold every pair (j, i)
    # and (i, j); one-hot inputs read the decoded weights back exactly.
    stream = np.empty((512, 256), dtype=np.uint8)
    for j in range(256):
        for half in range(2):
            stream[2 * j + half, 0::2] = j
            stream[2 * j + half, 1::2] = np.arange(128) + 128 * half
    memory = stream[:, np.arange(256) ^ 3]  # stream byte q lives at memory byte q ^ 3
    trellis = np.ascontiguousarray(memory).view(np.int16).reshape(1, 512, 128)
    inner = decode_tiles(trellis)
    for first in (0, 8):
        xh = np.eye(16, dtype=np.float32)[first : first + 8]
        got = _gemv.tiles(variant, trellis, xh)
        assert np.array_equal(got, inner[first : first + 8].astype(np.float32))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k2", RATES)
def test_kernels_match_the_decoder_at_every_rate(variant, k2):
    rng = np.random.default_rng(k2)
    trellis = random_trellis(rng, 8, 16, k2)
    inner = Exl3Weights(trellis, np.ones(128, np.float16), np.ones(256, np.float16)).inner_weight()
    xh = rng.standard_normal((3, 128)).astype(np.float32)
    assert rel_err(_gemv.tiles(variant, trellis, xh), xh.astype(np.float64) @ inner) < REL_TOL
    part = _gemv.tiles(variant, trellis, xh, 2, 5)  # tile rows 2..4 only
    ref = xh[:, 32:80].astype(np.float64) @ inner[32:80]
    assert rel_err(part, ref) < REL_TOL


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", range(1, 9))
def test_kernels_take_one_to_eight_rows(variant, m):
    rng = np.random.default_rng(m)
    trellis = random_trellis(rng, 8, 8, 6)
    inner = Exl3Weights(trellis, np.ones(128, np.float16), np.ones(128, np.float16)).inner_weight()
    xh = rng.standard_normal((m, 128)).astype(np.float32)
    assert rel_err(_gemv.tiles(variant, trellis, xh), xh.astype(np.float64) @ inner) < REL_TOL


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(3)
    experts = [random_expert(rng, 256, 384, 3) for _ in range(6)]
    return experts, expert_table(experts)


def picks_for(rng, num_rows, num_picks, num_experts):
    rows = rng.integers(0, num_rows, num_picks)
    ids = rng.integers(0, num_experts, num_picks)
    weights = rng.uniform(-1, 2, num_picks).astype(np.float32)
    return rows, ids, weights


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_moe_matches_the_fp64_reference(layer, variant, threads):
    experts, table = layer
    rng = np.random.default_rng(threads)
    lane = CpuLane(LaneLayout((0,) * threads), variant)
    for num_rows in (1, 3, 8):
        x = (rng.standard_normal((num_rows, 256)) * 40).astype(np.float32)
        rows, ids, weights = picks_for(rng, num_rows, 2 * num_rows + 1, len(experts))
        out = lane.run(table, x, rows, ids, weights)
        assert out.dtype == np.float32 and out.shape == (num_rows, 256)
        assert rel_err(out, reference_moe(x, rows, ids, weights, experts)) < REL_TOL


def test_moe_clamps_like_glm_and_can_run_unclamped(layer):
    experts, table = layer
    lane = CpuLane(LaneLayout((0,)))
    x = (np.random.default_rng(5).standard_normal((2, 256)) * 400).astype(np.float32)
    gate, up, _ = experts[2]
    assert np.abs(gate.apply(x)).max() > 10 and np.abs(up.apply(x)).max() > 10
    rows, ids, weights = [0, 1, 1], [2, 2, 4], [1.0, 0.5, 0.25]
    for limit in (10.0, 0.0):
        out = lane.run(table, x, rows, ids, weights, act_limit=limit)
        ref = reference_moe(x, rows, ids, weights, experts, act_limit=limit)
        assert rel_err(out, ref) < REL_TOL
    assert not np.allclose(
        lane.run(table, x, rows, ids, weights, act_limit=10.0),
        lane.run(table, x, rows, ids, weights, act_limit=0.0),
    )


def test_rows_without_picks_are_zero_and_repeated_picks_add(layer):
    experts, table = layer
    lane = CpuLane(LaneLayout((0, 0)))
    x = np.random.default_rng(6).standard_normal((4, 256)).astype(np.float32)
    out = np.full((4, 256), np.nan, np.float32)
    lane.run(table, x, [1, 1, 3], [5, 5, 0], [0.25, 0.5, 0.0], out=out)
    assert not out[0].any() and not out[2].any() and not out[3].any()
    once = lane.run(table, x, [1], [5], [0.75])
    assert rel_err(out[1], once[1]) < REL_TOL


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bits", [2.5, 4])
def test_moe_at_other_bitrates(variant, bits):
    rng = np.random.default_rng(int(bits * 2))
    experts = [random_expert(rng, 128, 256, bits) for _ in range(3)]
    x = rng.standard_normal((2, 128)).astype(np.float32)
    out = CpuLane(LaneLayout((0,)), variant).run(
        expert_table(experts), x, [0, 1, 1], [0, 1, 2], [1, 1, 1]
    )
    assert rel_err(out, reference_moe(x, [0, 1, 1], [0, 1, 2], [1, 1, 1], experts)) < REL_TOL


def test_job_api_writes_the_done_word_after_the_output(layer):
    experts, table = layer
    pool = _gemv.Pool(2)
    x = np.random.default_rng(8).standard_normal((2, 256)).astype(np.float32)
    done = np.zeros(4, np.uint32)
    jobs = [pool.submit(table, x, [0, 1], [i, i + 1], [1.0, 1.0], done=done[i:]) for i in range(3)]
    results = [job.wait() for job in jobs]
    assert [int(d) for d in done[:3]] == [job.seq for job in jobs]
    assert len({job.seq for job in jobs}) == 3
    ref = reference_moe(x, [0, 1], [2, 3], [1.0, 1.0], experts)
    assert rel_err(results[2], ref) < REL_TOL
    again = pool.run(table, x, [0, 1], [2, 3], [1.0, 1.0])
    assert np.array_equal(again, results[2])  # same thread count, same job: same bits


@pytest.mark.parametrize("caller", [_gemv.CALLER_WAITS, _gemv.CALLER_HELPS, _gemv.CALLER_RUNS_ALL])
@pytest.mark.parametrize("threads", [1, 2])
def test_run_picks_is_one_job_per_pack_jobs_group_whoever_runs_it(layer, caller, threads):
    from glm53.tiers.moe import pack_jobs

    experts, table = layer
    rng = np.random.default_rng(11)
    num_rows, top_k = 40, 4  # every expert picked by more than 8 rows: several jobs each
    x = rng.standard_normal((num_rows, 256)).astype(np.float32)
    ids = rng.integers(0, len(experts), num_rows * top_k).astype(np.int32)
    rows = np.repeat(np.arange(num_rows, dtype=np.int64), top_k)
    weights = rng.uniform(-1, 2, len(ids)).astype(np.float32)
    pool = _gemv.Pool(threads)
    want = np.empty((len(ids), 256), np.float32)
    for job in pack_jobs(np.arange(len(ids)), ids, rows):
        one_row_each = np.arange(len(job))
        want[job] = pool.run(table, x[rows[job]], one_row_each, ids[job], weights[job])
    dest = np.arange(len(ids), dtype=np.int64)
    got = np.full_like(want, np.nan)
    jobs = pool.run_picks(table, x, rows, ids, weights, dest, got, caller=caller)
    assert jobs == len(pack_jobs(np.arange(len(ids)), ids, rows))
    assert np.array_equal(got, want)
    # a subset of the picks writes only its dest rows
    some = np.array([7, 3, 100], dtype=np.int64)
    out = np.zeros((len(ids), 256), np.float32)
    pool.run_picks(table, x, rows[some], ids[some], weights[some], some, out, caller=caller)
    assert np.flatnonzero(out.any(axis=1)).tolist() == [3, 7, 100]
    ref = reference_moe(x, rows[some], ids[some], weights[some], experts)
    assert rel_err(out[some], ref[rows[some]]) < REL_TOL


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"rows": np.array([0, 2])}, ValueError, "pick 1: row 2 is outside 0..1"),
        ({"experts": np.array([0, 6], np.int32)}, ValueError, "pick 1: expert 6 is outside"),
        ({"dest": np.array([0, 5])}, ValueError, "pick 1: dest 5 is outside 0..1"),
        ({"rows": np.array([0, 1], np.int32)}, TypeError, "rows must be a numpy int64 array"),
        ({"weights": np.array([1.0, np.nan], np.float32)}, ValueError, "batch job 1: pick 0"),
        ({"caller": 3}, ValueError, "caller 3 is not"),
    ],
)
def test_run_picks_refuses_bad_picks_with_the_reason(layer, change, error, message):
    _, table = layer
    args = dict(
        x=np.zeros((2, 256), np.float32),
        rows=np.array([0, 1]),
        experts=np.array([0, 1], np.int32),
        weights=np.array([1.0, 1.0], np.float32),
        dest=np.array([0, 1]),
        out=np.zeros((2, 256), np.float32),
    )
    caller = change.pop("caller", _gemv.CALLER_HELPS)
    args.update(change)
    with pytest.raises(error, match=message):
        _gemv.Pool(1).run_picks(table, **args, caller=caller)


def bad_job(layer, **change):
    experts, table = layer
    args = dict(
        table=table,
        x=np.zeros((2, 256), np.float32),
        rows=[0, 1],
        experts=[0, 1],
        weights=[1.0, 1.0],
    )
    args.update(change)
    pool = _gemv.Pool(1)
    return pool.run(args.pop("table"), **args)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"x": np.zeros((2, 256), np.float64)}, TypeError, r"x must be a numpy float32 array"),
        ({"x": np.zeros((2, 128), np.float32)}, TypeError, r"shape \[2, 256\]"),
        ({"x": np.zeros((9, 256), np.float32)}, ValueError, "x has 9 rows; a job takes 1..8"),
        ({"experts": [0, 6]}, ValueError, "pick 1: expert 6 is outside 0..5"),
        ({"rows": [0, 2]}, ValueError, "pick 1: row 2 is outside 0..1"),
        ({"weights": [1.0, np.nan]}, ValueError, "pick 1: weight nan is not finite"),
        ({"rows": [0] * 65, "experts": [0] * 65, "weights": [1.0] * 65}, ValueError, "65 picks"),
        ({"rows": [0], "experts": [0, 1]}, ValueError, "of one length"),
        ({"experts": [0.5, 1.0]}, TypeError, "experts must hold integers"),
    ],
)
def test_bad_jobs_are_refused_with_the_reason(layer, change, error, message):
    with pytest.raises(error, match=message):
        bad_job(layer, **change)


def test_unset_experts_and_bad_tables_are_refused():
    table = _gemv.ExpertTable(2, 128, 128, 6)
    with pytest.raises(ValueError, match="expert 1: gate trellis, suh and svh must all be set"):
        _gemv.Pool(1).run(table, np.zeros((1, 128), np.float32), [0], [1], [1.0])
    half = np.ones(128, np.float16)
    with pytest.raises(
        TypeError, match=r"expert 0 gate trellis must be a numpy int16 array of shape \[8, 8, 48\]"
    ):
        table.set(0, (np.zeros((8, 8, 32), np.int16), half, half), None, None)
    with pytest.raises(IndexError, match="expert 2 is outside 0..1"):
        table.set(2, None, None, None)
    with pytest.raises(ValueError, match="k2 9"):
        _gemv.ExpertTable(1, 128, 128, 9)


def test_non_mul1_experts_are_refused_by_name():
    rng = np.random.default_rng(0)
    gate, up, down = random_expert(rng, 128, 128)
    mcg = Exl3Weights(up.trellis, up.suh, up.svh, "mcg")
    with pytest.raises(
        ValueError,
        match="expert 0 up: the CPU lane decodes the mul1 codebook only, this linear uses mcg",
    ):
        expert_table([(gate, mcg, down)])


def test_scalar_variant_says_it_is_slow():
    assert _gemv.variant_name(_gemv.SCALAR) == "scalar (slow)"
    assert "scalar (slow)" in CpuLane(LaneLayout((0,)), "scalar (slow)").describe()


def test_cpu_lists_parse_and_bad_ones_are_named():
    assert parse_cpu_list("2-5,8, 10-11") == [2, 3, 4, 5, 8, 10, 11]
    for text, message in [
        ("2-x", "'2-x' is not a CPU number"),
        ("5-2", "runs backwards"),
        ("1,1", "names a CPU twice"),
        (",", "names no CPU"),
    ]:
        with pytest.raises(LaneConfigError, match=message):
            parse_cpu_list(text)


def fake_topology(tmp_path, cores):
    for cpu, (package, core) in enumerate(cores):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")


def test_default_layout_takes_one_cpu_per_core_but_the_first_two(tmp_path, monkeypatch):
    # 6 cores with SMT siblings numbered after them (cpus 6-11), as Linux numbers them
    fake_topology(tmp_path, [(0, c) for c in range(6)] * 2)
    monkeypatch.setattr(cpu_lane, "SYS_CPU", tmp_path)
    monkeypatch.setattr(cpu_lane.os, "sched_getaffinity", lambda pid: set(range(12)))
    assert cpu_lane.physical_cores() == [0, 1, 2, 3, 4, 5]
    assert lane_layout().cpus == (2, 3, 4, 5)
    assert lane_layout(threads=5).cpus == (2, 3, 4, 5, 0)
    assert lane_layout(cpus="6-7,9").cpus == (6, 7, 9)
    assert lane_layout(cpus="6-9", threads=2).cpus == (6, 7)
    with pytest.raises(
        LaneConfigError, match=r"CPUs \[12\] are outside this process's affinity mask 0-11"
    ):
        lane_layout(cpus="10-12")
    with pytest.raises(LaneConfigError, match="--cpu-threads 3 exceeds the 2 CPUs of --cpus 6-7"):
        lane_layout(cpus="6-7", threads=3)
    with pytest.raises(LaneConfigError, match="--cpu-threads 7 exceeds the 6 physical cores"):
        lane_layout(threads=7)


def fake_numa(tmp_path, monkeypatch, gpu_node: str, nodes: dict[int, str]):
    """Eight single-thread cores; sysfs nodes with these cpulists; a GPU at 0000:3b:00.0 whose
    numa_node file says `gpu_node`."""
    fake_topology(tmp_path / "cpu", [(0, c) for c in range(8)])
    for node, cpulist in nodes.items():
        (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "pci" / "0000:3b:00.0").mkdir(parents=True)
    (tmp_path / "pci" / "0000:3b:00.0" / "numa_node").write_text(gpu_node + "\n")
    monkeypatch.setattr(cpu_lane, "SYS_CPU", tmp_path / "cpu")
    monkeypatch.setattr(cpu_lane, "SYS_NODE", tmp_path / "node")
    monkeypatch.setattr(cpu_lane, "SYS_PCI", tmp_path / "pci")
    monkeypatch.setattr(cpu_lane.os, "sched_getaffinity", lambda pid: set(range(8)))


def test_the_default_layout_keeps_to_the_gpus_numa_node(tmp_path, monkeypatch):
    fake_numa(tmp_path, monkeypatch, "1", {0: "0-3", 1: "4-7"})
    layout = lane_layout(gpu_pci="0000:3b:00.0")
    assert layout.cpus == (6, 7)  # node 1's cores but its first two
    assert layout.note == "every physical core but the first 2, on NUMA node 1, GPU 0000:3b:00.0's"
    # --cpus and --cpu-threads are taken over the whole mask, as validated before the load
    assert lane_layout(threads=3, gpu_pci="0000:3b:00.0").cpus == (2, 3, 4)
    assert lane_layout(cpus="0-1", gpu_pci="0000:3b:00.0").cpus == (0, 1)


@pytest.mark.parametrize(
    "gpu_node, gpu_pci, why",
    [
        ("-1", "0000:3b:00.0", "sysfs gives no NUMA node for GPU 0000:3b:00.0"),
        ("1", None, None),  # no address asked: today's layout, nothing said
        ("1", "0000:99:00.0", "sysfs gives no NUMA node for GPU 0000:99:00.0"),
    ],
)
def test_without_the_gpus_node_the_lane_spans_every_node_and_says_why(
    tmp_path, monkeypatch, gpu_node, gpu_pci, why
):
    fake_numa(tmp_path, monkeypatch, gpu_node, {0: "0-3", 1: "4-7"})
    layout = lane_layout(gpu_pci=gpu_pci)
    assert layout.cpus == (2, 3, 4, 5, 6, 7)
    note = "every physical core but the first 2"
    assert layout.note == (note if why is None else f"{note}, on every node ({why})")


def test_two_core_hosts_get_one_thread_and_a_note(tmp_path, monkeypatch):
    fake_topology(tmp_path, [(0, 0), (0, 1)])
    monkeypatch.setattr(cpu_lane, "SYS_CPU", tmp_path)
    monkeypatch.setattr(cpu_lane.os, "sched_getaffinity", lambda pid: {0, 1})
    layout = lane_layout()
    assert layout.cpus == (1,)
    assert layout.note.startswith("only 2 physical core(s): the CPU lane runs 1 thread on cpu 1")


def test_pinning_outside_the_machine_fails_cleanly():
    with pytest.raises(RuntimeError, match="cannot start CPU lane thread 1 pinned to cpu 1000"):
        _gemv.Pool(2, [0, 1000])  # thread 0 already runs and must be stopped
    with pytest.raises(RuntimeError, match="cpu 4000 is not a valid CPU number"):
        _gemv.Pool(1, [4000])


def test_calibration_fits_a_line_per_thread_count_and_rows():
    cost = cpu_lane.calibrate(
        thread_counts=[1],
        rows=[1, 2],
        expert_counts=[1, 2],
        hidden=128,
        inter=128,
        layout=LaneLayout((0,)),
        pool_bytes=0,
        repeats=1,
    )
    assert set(cost.fits) == {(1, 1), (1, 2)}
    assert len(cost.samples) == 4 and cost.variant == _gemv.variant_name(_gemv.best_variant())
    a, b = cost.fits[(1, 2)]
    assert cost.ms(1, 2, 3) == pytest.approx(a + 3 * b)
