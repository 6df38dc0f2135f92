"""The layer split over two or more GPUs (glm53.plan.split, issue #20), on CPU: the
assignment on several inventories against a brute force over every cut with the one-GPU
planner (glm53.plan.vram.plan_vram) as the reference for each GPU's slots, the refusals, the --gpus
setting, the doctor's per-GPU plan on captured hosts, and the bookkeeping of the per-GPU
caches (with stand-in caches: DeviceExpertCache itself needs a GPU)."""

import dataclasses
import itertools
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import msgspec
import pytest

from glm53.config import ConfigurationError, from_json, resolve, to_json
from glm53.doctor import multi_gpu as doctor_mg
from glm53.doctor.plan import PlanRequest, make_plan
from glm53.doctor.probes import probe_host
from glm53.doctor.source import FixtureSource
from glm53.exl3.split import SplitCaches, module_devices, planned_devices
from glm53.models.tokenizer import token_ids
from glm53.plan import split as mg
from glm53.plan import vram
from glm53.synth.layout import plan as synth_plan
from glm53.synth.layout import text_config as synth_text_config
from glm53.synth.shapes import SLICE
from glm53.units import GIB

FIX = Path(__file__).parent / "fixtures" / "doctor"
G = 10**9  # cards are sold in GB; free VRAM below is in bytes
TOKENS, BATCH, CHUNK, RESERVE = 32768, 4, 2048, 1.0


@pytest.fixture(scope="module")
def flash():
    tensors, tc = doctor_mg.flash_tensors()
    return mg.model_layers(tensors, tc), tc


@pytest.fixture(scope="module")
def slice_():
    tensors = {t.key: t.nbytes for group in synth_plan(SLICE) for t in group}
    tc = synth_text_config(SLICE, token_ids())
    return mg.model_layers(tensors, tc), tc


def inputs(geo, gpus, free, stage_gb=None, max_slots=None):
    layers, tc = geo
    return mg.split_inputs(layers, gpus, free, tc, TOKENS, BATCH, CHUNK, RESERVE, stage_gb,
                           max_slots)  # fmt: skip


def one_gpu(geo, budget, first=0, end=None, head=True, stage_gb=None):
    """plan_vram (the one-GPU planner) for layers [first, end) on one card; None
    when their fixed bytes do not fit, 0 slots when they fit but hold no expert slot."""
    layers, tc = geo
    end = layers.num_layers if end is None else end
    rng = range(first, end)
    model = sum(layers.weight_bytes[i] for i in rng) + (layers.head_bytes if head else 0)
    x = vram.VramInputs(
        budget_bytes=budget,
        model_bytes=model,
        record_bytes=layers.record_bytes,
        num_experts=layers.num_experts,
        num_moe_layers=sum(layers.moe[i] for i in rng),
        kv_bytes_per_token=sum(layers.kv_bytes_per_token[i] for i in rng),
        context_tokens=TOKENS,
        state_bytes_per_sequence=sum(layers.state_bytes_per_sequence[i] for i in rng),
        batch=BATCH,
        activation_bytes=vram.chunk_activation_bytes(tc, CHUNK),
        reserve_bytes=int(RESERVE * GIB),
        stage_gb=stage_gb,
    )
    fixed = x.model_bytes + x.kv_bytes_per_token * TOKENS + x.state_bytes_per_sequence * BATCH
    if fixed + x.activation_bytes + x.reserve_bytes > budget:
        return None
    try:
        return vram.plan_vram(x)
    except ValueError:
        return 0


def slots_of(p):
    return 0 if not p else p.cache_slots


def check_invariants(plan, x):
    """Every layer exactly once, ranges contiguous, ordered and in --gpus order, and each
    device's bytes (recomputed from the layer table) within its free VRAM."""
    L = x.layers
    assert [p.entry for p in plan.parts] == list(range(len(x.gpus)))
    assert [p.device for p in plan.parts] == list(x.gpus)
    assert plan.parts[0].first_layer == 0 and plan.parts[-1].end_layer == L.num_layers
    for a, b in itertools.pairwise(plan.parts):
        assert a.end_layer == b.first_layer and a.first_layer < a.end_layer
    covered = [i for p in plan.parts for i in range(p.first_layer, p.end_layer)]
    assert covered == list(range(L.num_layers))
    for p in plan.parts:
        assert p.moe_layers == [i for i in range(p.first_layer, p.end_layer) if L.moe[i]]
        assert p.cache_slots <= len(p.moe_layers) * L.num_experts
    for dev in plan.devices:
        parts = [p for p in plan.parts if p.device == dev.device]
        used = x.activation_bytes + x.reserve_bytes
        for p in parts:
            rng = range(p.first_layer, p.end_layer)
            used += sum(L.weight_bytes[i] for i in rng)
            used += sum(L.kv_bytes_per_token[i] for i in rng) * x.context_tokens
            used += sum(L.state_bytes_per_sequence[i] for i in rng) * x.batch
            used += (p.stage_slots * 2 + p.cache_slots) * L.record_bytes
        used += L.head_bytes if parts[-1] is plan.parts[-1] else 0
        assert used == dev.used_bytes <= x.free_bytes[dev.device]
    assert plan.total_slots == sum(p.cache_slots for p in plan.parts)


def brute_force(geo, free: list[int]) -> dict[tuple, tuple]:
    """Every cut of the layers over len(free) devices that fits: cut -> each device's slots,
    from plan_vram (the one-GPU planner) for its layer range."""
    layers, _ = geo
    n, found = layers.num_layers, {}
    for cuts in itertools.combinations(range(1, n), len(free) - 1):
        bounds = [0, *cuts, n]
        per = []
        for k, budget in enumerate(free):
            r = one_gpu(geo, budget, bounds[k], bounds[k + 1], head=k == len(free) - 1)
            if r is None:
                break
            per.append(slots_of(r))
        else:
            found[cuts] = tuple(per)
    return found


def worth(layers, cuts, slots):
    """The rule's score (multi_gpu's docstring), written out here: sum of 2 S - S^2 / (M E)."""
    bounds = [0, *cuts, layers.num_layers]
    out = Fraction(0)
    for k, s in enumerate(slots):
        m = sum(layers.moe[bounds[k] : bounds[k + 1]])
        out += 2 * s - Fraction(s * s, m * layers.num_experts) if m else 0
    return out


@pytest.mark.parametrize(
    ("free", "label"),
    [([24 * G, 24 * G], "2x 24 GB"), ([24 * G, 12 * G], "24 + 12 GB"),
     ([12 * G, 24 * G], "12 + 24 GB"), ([24 * G, 16 * G, 12 * G], "three cards")],
)  # fmt: skip
def test_flash_split_is_the_best_cut_by_the_one_gpu_planner(flash, free, label):
    layers, _ = flash
    x = inputs(flash, tuple(range(len(free))), dict(enumerate(free)))
    plan = mg.plan_split(x)
    check_invariants(plan, x)
    found = brute_force(flash, free)
    cuts = tuple(p.first_layer for p in plan.parts[1:])
    assert found[cuts] == tuple(p.cache_slots for p in plan.parts), label
    assert worth(layers, cuts, found[cuts]) == max(worth(layers, c, v) for c, v in found.items())
    # the most slots any cut gets, less flooring (a slot and staging's rounding, per part)
    assert plan.total_slots >= max(sum(v) for v in found.values()) - 3 * len(free)
    shares = [p.expert_share for p in plan.parts]
    assert max(shares) - min(shares) < 0.03, shares  # even, to about a layer's granularity
    assert plan.boundaries == len(free) - 1
    assert plan.total_experts == 42 * 288


@pytest.mark.parametrize("stage_gb", [None, 0.5])
@pytest.mark.parametrize("free", [[24 * G, 24 * G], [24 * G, 12 * G], [24 * G, 16 * G, 12 * G]])
def test_split_total_is_one_card_less_the_stated_overheads(flash, stage_gb, free):
    free = dict(enumerate(free))
    x = inputs(flash, tuple(free), free, stage_gb)
    plan = mg.plan_split(x)
    extra_devices = len(free) - 1
    # one card holding all the GPUs' VRAM less the other GPUs' activations and reserves
    budget = sum(free.values()) - extra_devices * (x.activation_bytes + x.reserve_bytes)
    one = one_gpu(flash, budget, stage_gb=stage_gb)
    assert one.cache_slots < plan.total_experts  # not capped: the bounds below are exact
    extra_staging = sum(2 * p.stage_slots for p in plan.parts) - 2 * one.stage_slots
    floors = len(plan.parts) - 1  # each GPU floors its own slot count
    assert plan.total_slots >= one.cache_slots - extra_staging - floors
    assert plan.total_slots <= one.cache_slots - extra_staging
    # and never below the first GPU alone
    alone = mg.plan_split(msgspec.structs.replace(x, gpus=(0,)))
    assert alone.total_slots == one_gpu(flash, free[0], stage_gb=stage_gb).cache_slots
    assert plan.total_slots > alone.total_slots


def test_unequal_cards_give_the_larger_one_more_slots_and_even_shares(flash):
    x = inputs(flash, (0, 1), {0: 24 * G, 1: 12 * G})
    plan = mg.plan_split(x)
    a, b = plan.parts
    assert a.cache_slots > b.cache_slots
    # one MoE layer moved across the cut changes a part's share by about a layer's worth
    layer_share = 1 / len(a.moe_layers) + 1 / len(b.moe_layers)
    assert abs(a.expert_share - b.expert_share) <= layer_share


def test_one_gpu_listed_twice_is_one_gpu_less_one_pair_of_staging_buffers(flash):
    free = 24 * G
    x = inputs(flash, (0, 0), {0: free})
    plan = mg.plan_split(x)
    check_invariants(plan, x)
    one = one_gpu(flash, free)
    assert one.stage_slots > 0 and one.cache_slots < plan.total_experts
    a, b = plan.parts
    assert a.stage_slots == b.stage_slots == one.stage_slots
    assert plan.total_slots == one.cache_slots - 2 * one.stage_slots
    assert abs(len(a.moe_layers) - len(b.moe_layers)) <= 1
    assert plan.boundaries == 0 and len(plan.devices) == 1
    # slots in proportion to MoE layers
    assert abs(a.cache_slots / len(a.moe_layers) - b.cache_slots / len(b.moe_layers)) <= 1


def test_one_gpu_listed_twice_with_fixed_staging(flash):
    x = inputs(flash, (0, 0), {0: 24 * G}, stage_gb=1.0)
    one = one_gpu(flash, 24 * G, stage_gb=1.0)
    assert mg.plan_split(x).total_slots == one.cache_slots - 2 * one.stage_slots


def test_slice_on_two_cards_caches_every_expert(slice_):
    layers, _ = slice_
    assert layers.num_layers == 8 and sum(layers.moe) == 6
    x = inputs(slice_, (0, 1), {0: 24 * G, 1: 24 * G})
    plan = mg.plan_split(x)
    check_invariants(plan, x)
    assert plan.total_slots == plan.total_experts == 6 * 288
    assert all(p.expert_share == 1.0 for p in plan.parts)  # both GPUs hold MoE layers
    assert [len(p.moe_layers) for p in plan.parts] == [3, 3]  # spread, not stacked on one
    small = inputs(slice_, (0, 1), {0: 8 * G, 1: 8 * G})
    p2 = mg.plan_split(small)
    check_invariants(p2, small)
    found = brute_force(slice_, [8 * G, 8 * G])
    assert p2.total_slots >= max(sum(v) for v in found.values()) - 6
    assert p2.total_slots < p2.total_experts


def test_max_slots_caps_the_total_in_proportion(flash):
    plan = mg.plan_split(inputs(flash, (0, 1), {0: 24 * G, 1: 12 * G}, max_slots=500))
    assert plan.total_slots == 500
    free = mg.plan_split(inputs(flash, (0, 1), {0: 24 * G, 1: 12 * G}))
    for p, q in zip(plan.parts, free.parts, strict=True):
        assert abs(p.cache_slots - 500 * q.cache_slots / free.total_slots) <= 1
        assert p.expert_share == p.cache_slots / (len(p.moe_layers) * 288)


def test_refusals_name_the_fix(flash):
    with pytest.raises(ValueError, match="GPU 1 cannot hold even one layer's non-expert"):
        mg.plan_split(inputs(flash, (0, 1), {0: 24 * G, 1: int(1.2 * G)}))
    with pytest.raises(ValueError, match="GPU 3, which this host does not have .GPUs: 0, 1."):
        mg.plan_split(inputs(flash, (0, 3), {0: 24 * G, 1: 24 * G}))
    with pytest.raises(ValueError, match="--gpus is empty"):
        mg.plan_split(inputs(flash, (), {0: 24 * G}))
    with pytest.raises(ValueError, match="GPU 0 appears again after another GPU"):
        mg.plan_split(inputs(flash, (0, 1, 0), {0: 24 * G, 1: 24 * G}))
    with pytest.raises(ValueError, match="cannot hold the model's non-expert layers between"):
        mg.plan_split(inputs(flash, (0, 1), {0: 4 * G, 1: 4 * G}))
    with pytest.raises(ValueError, match="write GPU indices separated by commas"):
        mg.parse_gpus("0,a")


def test_flash_layer_bytes_match_the_checkpoint_facts(flash):
    """The per-layer table of GLM-5.3-Flash against the block sizes of the layouts that loaded
    on the H200 (exllamav3-glm5next-checkpoint.md §4, in doctor/geometry.py), plus the routed
    experts' suh/svh/mul1, which load to VRAM."""
    layers, _ = flash
    kda, dsa, dense, router, norms = 57_459_464, 76_136_980, 56_721_420, 11_834_508, 3_162_328
    routed_scales = 288 * (2 * (4096 + 2048) * 2 * 3 // 2 + 3 * 4)
    assert layers.weight_bytes[0] == kda + dense + norms
    assert layers.weight_bytes[3] == dsa + router + norms + routed_scales
    assert layers.weight_bytes[4] == kda + router + norms + routed_scales
    assert layers.record_bytes == 3 * 4096 * 2048 * 3 // 8
    assert layers.kv_bytes_per_token[3] == 2 * (512 + 128) and layers.kv_bytes_per_token[4] == 0
    assert layers.state_bytes_per_sequence[4] == 4 * 64 * 128 * 128 + 2 * 3 * 3 * 64 * 128
    assert layers.hop_bytes_per_token == 4 * 4 * 4096
    assert sum(layers.moe) == 42 and layers.moe[:3] == (False, False, False)


def test_layer_cache_geometry_sums_to_cache_geometry(flash):
    _, tc = flash
    per = vram.layer_cache_geometry(tc)
    assert len(per) == 45 and sum(kv > 0 for kv, _ in per) == 11
    kv, state = vram.cache_geometry(tc)
    assert kv == 11 * 1280 and state == 34 * (4 * 64 * 128 * 128 + 2 * 3 * 3 * 64 * 128)


def test_planner_imports_without_torch():
    code = "import sys, glm53.plan.split; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- the --gpus setting ------------------------------------------------------------------------
def test_gpus_setting_from_flag_and_environment():
    assert resolve({}, {})[0].gpus is None
    assert resolve({"gpus": "0,1"}, {})[0].gpus == (0, 1)
    assert resolve({}, {"GLM53_GPUS": "0, 0"})[0].gpus == (0, 0)
    settings, sources = resolve({"gpus": "1,0"}, {})
    assert from_json(to_json(settings, sources))[0].gpus == (1, 0)  # the hand-off to the worker
    with pytest.raises(ConfigurationError, match="GLM53_GPUS='0,x': write indices separated"):
        resolve({}, {"GLM53_GPUS": "0,x"})


def test_gpus_on_an_engine_without_a_gpu_is_refused():
    from glm53.engine import create_engine

    settings, _ = resolve({"demo": True, "engine": "cpu", "gpus": "0,1"}, {})
    with pytest.raises(ConfigurationError, match="--gpus 0,1: the cpu engine runs on no GPU"):
        create_engine(settings)


# --- the engine side, without a GPU --------------------------------------------------------------
class Module:  # a stand-in for an exllamav3 top-level module: only its key matters here
    def __init__(self, key):
        self.key = key


def test_module_devices_follow_the_plan(slice_):
    plan = mg.plan_split(inputs(slice_, (0, 1), {0: 24 * G, 1: 24 * G}))
    p = "model.language_model"
    mods = [Module(f"{p}.embed_tokens")] + [Module(f"{p}.layers.{i}") for i in range(8)]
    mods += [Module(f"{p}.norm"), Module("lm_head")]
    cut = plan.parts[1].first_layer
    assert module_devices(mods, plan) == [0] + [0] * cut + [1] * (8 - cut) + [1, 1]
    with pytest.raises(RuntimeError, match="layer 8 is outside the plan's layers 0-7"):
        module_devices([*mods, Module(f"{p}.layers.8")], plan)


class LoadingModule(Module):
    """A stand-in module whose load records the device it was given (exllamav3's own loader
    calls `module.load(device)` on each top-level module)."""

    def __init__(self, key):
        super().__init__(key)
        self.loaded_on = None

    def load(self, device, **kwargs):
        self.loaded_on = str(device)


def test_planned_devices_shadow_each_modules_load_and_go_away():
    import torch

    mods = [LoadingModule(f"m{i}") for i in range(3)]
    with planned_devices(mods, [0, 1, 1]):
        mods[0].load(torch.device("cuda", 0))
        mods[1].load(torch.device("cuda", 0), max_chunk_size=2048)
        mods[2].load(torch.device("cpu"))  # a module that prefers host memory keeps it
    assert [m.loaded_on for m in mods] == ["cuda:0", "cuda:1", "cpu"]
    assert all("load" not in m.__dict__ for m in mods)
    mods[1].load("cuda:0")
    assert mods[1].loaded_on == "cuda:0"


class StandInCache:
    """Stands in for DeviceExpertCache (which needs a GPU): records what it is seeded with and
    reports a heat list and counters as the real one's interface does."""

    def __init__(self, n_layers, heat, hits, misses):
        self.device, self.n_layers, self.heat = "cpu", n_layers, heat
        self.hits, self.misses, self.seeded = hits, misses, None

    def seed(self, keys):
        self.seeded = list(keys)
        return len(self.seeded)

    def empty(self, forget=False):
        self.emptied = forget

    def heat_list(self):
        return list(self.heat)

    def state(self):
        counters = dict.fromkeys(
            ("admits", "evictions", "pinned_skips", "no_victim", "bytes_copied", "rejected"), 0
        )
        return {**counters, "hits": self.hits, "misses": self.misses, "slots": 10, "used": 3,
                "layer_hit_rate": [0.5] * self.n_layers}  # fmt: skip


def test_split_caches_map_global_keys_to_each_part(slice_):
    plan = mg.plan_split(inputs(slice_, (0, 0), {0: 24 * G}))
    a, b = plan.parts
    na, nb = len(a.moe_layers), len(b.moe_layers)
    ca, cb = StandInCache(na, [5, 1], 3, 1), StandInCache(nb, [7, 2, 9], 1, 3)
    caches = SplitCaches(plan, [ca, cb], 288)
    first_b = na * 288
    keys = [first_b + 4, 0, 17, first_b]
    assert caches.seed(keys) == 4
    assert ca.seeded == [0, 17] and cb.seeded == [4, 0]
    assert caches.heat_list() == [5, first_b + 7, 1, first_b + 2, first_b + 9]
    s = caches.state()
    assert (s["hits"], s["misses"], s["slots"], s["hit_rate"]) == (4, 4, 20, 0.5)
    assert [g["layers"] for g in s["per_gpu"]] == [[0, a.end_layer], [b.first_layer, 8]]
    assert len(s["layer_hit_rate"]) == na + nb
    with pytest.raises(ValueError, match="outside"):
        caches.seed([(na + nb) * 288])
    caches.empty(forget=True)  # after the warm-up: every part's cache
    assert ca.emptied is True and cb.emptied is True


# --- glm53 doctor ------------------------------------------------------------------------------
def host_with_gpus(host_dir, free_mib):
    """The captured host with its GPU repeated, one per entry of free_mib (that much free)."""
    host = probe_host(FixtureSource(FIX / host_dir))
    (gpu,) = host.gpus
    gpus = [msgspec.structs.replace(gpu, index=i, uuid=f"{gpu.uuid}-{i}", memory_free_mib=f)
            for i, f in enumerate(free_mib)]  # fmt: skip
    return msgspec.structs.replace(host, gpus=gpus)


def test_doctor_plans_the_split_on_a_two_gpu_host():
    host = host_with_gpus("reference-3090-epyc-raid0", [24_000, 24_000])
    plan = make_plan(host, PlanRequest())
    o = plan.multi_gpu
    assert o.gpus == [0, 1] and o.chosen_by == "every GPU of this host" and not o.reason
    assert [p.device for p in o.split.parts] == [0, 1]
    assert o.split.total_slots > o.one_gpu_slots > 0
    assert "prediction" in o.label
    # two distinct GPUs: the split serve runs only with the flag (glm53.modes.UNRUN["split"])
    assert o.label.endswith("never over two distinct GPUs: serve needs --allow-unrun-modes for it)")
    # the hop, recomputed from its stated parts
    pcie = next(v.value for v in next(x for x in plan.options if x.mode == "exact").inputs
                if v.name == "pcie_gbps")  # fmt: skip
    hop = doctor_mg.HOP_LATENCY_MS + 4 * 4 * 4096 / (pcie * 1e6)
    assert o.hop_ms_per_token == pytest.approx(hop, abs=1e-4)
    same_ms = 1000 / o.same_cache_decode_tok_s
    assert o.two_gpu_vs_one_gpu_same_cache == pytest.approx(same_ms / (same_ms + hop), rel=1e-3)
    assert o.two_gpu_vs_one_gpu_same_cache < 1
    assert o.decode_tok_s > o.one_gpu_decode_tok_s  # twice the cache beats one hop


def test_doctor_leaves_one_gpu_alone_and_plans_gpus_given():
    host = probe_host(FixtureSource(FIX / "reference-3090-epyc-raid0"))
    assert make_plan(host, PlanRequest()).multi_gpu is None
    o = make_plan(host, PlanRequest(gpus=[0, 0])).multi_gpu
    assert o.chosen_by == "--gpus" and [p.device for p in o.split.parts] == [0, 0]
    assert o.split.boundaries == 0 and o.hop_ms_per_token == 0
    # one GPU listed twice: served without the flag (its GPU tests passed, 2026-12-05)
    assert o.label.endswith("serve runs this one without --allow-unrun-modes)")
    assert "needs --allow-unrun-modes" not in o.label
    with pytest.raises(ValueError, match="GPU 2, which this host does not have"):
        make_plan(host, PlanRequest(gpus=[0, 2]))
    with pytest.raises(ValueError, match="GPU 3, which this host does not have .GPUs: 0."):
        make_plan(host, PlanRequest(gpus=[3]))


def test_doctor_names_why_a_host_gets_no_split():
    host = host_with_gpus("reference-3090-epyc-raid0", [24_000, 900])
    o = make_plan(host, PlanRequest()).multi_gpu
    assert o.split is None and "GPU 1 cannot hold even one layer" in o.reason


def run_doctor(*args):
    return subprocess.run(
        [sys.executable, "-m", "glm53", "doctor", "--replay", str(FIX / "reference-3090-epyc-raid0"),
         "--no-measure", *args], capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_doctor_cli_shows_the_split_in_json_and_text():
    done = run_doctor("--gpus", "0,0", "--json")
    assert done.returncode == 0, done.stderr
    o = json.loads(done.stdout)["plan"]["multi_gpu"]
    assert [p["entry"] for p in o["split"]["parts"]] == [0, 1]
    assert o["label"].startswith("prediction")
    assert o["split"]["parts"][0]["end_layer"] == o["split"]["parts"][1]["first_layer"]
    text = run_doctor("--gpus", "0,0")
    assert text.returncode == 0, text.stderr
    assert "Layer split over GPUs 0,0 (--gpus; serve --gpus 0,0)" in text.stdout
    flat = " ".join(text.stdout.split())  # the caption wraps
    assert "prediction (cost model; the split has run only on one GPU" in flat
    assert "serve runs this one without --allow-unrun-modes" in flat
    bad = run_doctor("--gpus", "0,5")
    assert bad.returncode == 2 and "GPU 5, which this host does not have" in bad.stderr


def test_flash_shape_is_the_deep_preset_at_full_size():
    tensors, tc = doctor_mg.flash_tensors()
    assert tc["num_hidden_layers"] == 45 and tc["n_routed_experts"] == 288
    assert tc["vocab_size"] == doctor_mg.FLASH_VOCAB
    assert dataclasses.is_dataclass(SLICE)
