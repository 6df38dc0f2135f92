"""Fast mode's hand-off with the real device kernels (cuda/lane.cu) and the real lane: publish,
bounded wait + combine, the fallback call and select, on a synthetic expert set.

WRITTEN FOR THE NEXT GPU SESSION, NOT YET RUN: this session had no GPU time. The CI side of the
protocol is tests/test_lane_mailbox.py (a host thread mocking the device).

The "MoE call" between the kernels is exllamav3's own EXL3 GEMV (LinearEXL3.forward per expert,
fp16 between steps, weighted fp32 sum), run on whatever selection the kernels leave, which is what
the decode kernel sees: a pick of weight 0 contributes nothing. The GPU-only output is that call
on the router's whole selection.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("exllamav3")
_cuda = pytest.importorskip("glm53._cuda")

from glm53.tiers.cpu_lane import (  # noqa: E402
    FAST_REL_TOL,
    SWIGLU_LIMIT,
    CpuLane,
    LaneLayout,
    expert_table,
    random_expert,
    reference_moe,
)
from glm53.tiers.lane_mailbox import MailboxLane, lane_dev_dtype  # noqa: E402

HIDDEN, INTER, BITS, NUM_EXPERTS, TOP_K = 1024, 512, 3, 16, 4
BUDGET_NS = 2_000_000_000  # a wait that must succeed
STALL_BUDGET_NS = 2_000_000  # a wait that must time out (the lane is held)


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(1616)
    return [random_expert(rng, HIDDEN, INTER, BITS) for _ in range(NUM_EXPERTS)]


@pytest.fixture(scope="module")
def gpu_linears(experts, device):
    from exllamav3.modules.quant.exl3 import LinearEXL3

    marker = torch.tensor(0, dtype=torch.int32, device=device)
    return [
        [
            LinearEXL3(
                None,
                lin.in_features,
                lin.out_features,
                mul1=marker,
                trellis=torch.from_numpy(lin.trellis).to(device),
                suh=torch.from_numpy(lin.suh).to(device),
                svh=torch.from_numpy(lin.svh).to(device),
            )
            for lin in expert
        ]
        for expert in experts
    ]


def moe_call(linears, x16, sel, rw, out):
    """exllamav3's EXL3 kernels on every active pick (weight != 0) into fp32 `out`."""
    out.zero_()
    sel_h, rw_h = sel.view(-1).tolist(), rw.view(-1).float().tolist()
    for s, (e, w) in enumerate(zip(sel_h, rw_h, strict=True)):
        if w == 0.0:
            continue
        gate, up, down = linears[e]
        xr = x16[s // TOP_K].view(1, -1)
        g = gate.forward(xr, {}).float().clamp(max=SWIGLU_LIMIT)
        u = up.forward(xr, {}).float().clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        a = (torch.nn.functional.silu(g) * u).half().contiguous()
        out[s // TOP_K] += w * down.forward(a, {}).float().view(-1)


class Step:
    """Device buffers of one layer-slot's hand-off."""

    def __init__(self, mailbox, device, n_rows):
        n_sel = n_rows * TOP_K
        dt = lane_dev_dtype(_cuda.lane_dev_layout())
        host = np.zeros(1, dt)
        host["mbox"] = mailbox.pin()
        self.dev = torch.from_numpy(host.view(np.uint8).copy()).to(device)
        self.orig_sel = torch.empty(n_sel, dtype=torch.long, device=device)
        self.orig_w = torch.empty(n_sel, dtype=torch.half, device=device)
        self.fb_sel = torch.empty(n_sel, dtype=torch.long, device=device)
        self.fb_w = torch.empty(n_sel, dtype=torch.half, device=device)
        self.acc = torch.empty((n_rows, HIDDEN), dtype=torch.float, device=device)
        self.dtype = dt

    def state(self):
        return self.dev.cpu().numpy().view(self.dtype)[0]


def run_layer(linears, step, x16, sel, rw, out, budget_ns, key_slot=None):
    stream = torch.cuda.current_stream().cuda_stream
    n_rows = x16.shape[0]
    _cuda.lane_publish(
        step.dev.data_ptr(), sel.data_ptr(), rw.data_ptr(), x16.data_ptr(), n_rows, TOP_K,
        HIDDEN, x16.stride(0), 0 if key_slot is None else key_slot.data_ptr(), 0, 0,
        NUM_EXPERTS, step.orig_sel.data_ptr(), step.orig_w.data_ptr(), 0, stream,
    )  # fmt: skip
    moe_call(linears, x16, sel, rw, out)  # the GPU's share
    _cuda.lane_wait(
        step.dev.data_ptr(), out.data_ptr(), n_rows, HIDDEN, out.stride(0), step.acc.data_ptr(),
        step.fb_sel.data_ptr(), step.fb_w.data_ptr(), step.orig_sel.data_ptr(),
        step.orig_w.data_ptr(), budget_ns, stream,
    )  # fmt: skip
    moe_call(linears, x16, step.fb_sel, step.fb_w, out)  # the fallback call
    _cuda.lane_select(
        step.dev.data_ptr(),
        out.data_ptr(),
        step.acc.data_ptr(),
        n_rows,
        HIDDEN,
        out.stride(0),
        stream,
    )
    torch.cuda.synchronize()


def routed(rng, n_rows, device):
    x16 = torch.from_numpy((rng.standard_normal((n_rows, HIDDEN)) * 4).astype(np.float16))
    sel = np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(n_rows)])
    rw = rng.uniform(0.05, 0.4, (n_rows, TOP_K)).astype(np.float16)
    return (
        x16.to(device),
        torch.from_numpy(sel).to(device),
        torch.from_numpy(rw).to(device),
    )


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("n_rows", [1, 4, 8])
def test_lane_picks_give_the_gpu_only_output(experts, gpu_linears, device, precision, n_rows):
    """The layer output with the lane's share differs from the GPU-only output by no more than
    the GPU kernel's own error against fp64 (issue #16's per-layer fidelity rule), and the
    selection the GPU computed had the lane's picks masked (id -1, weight 0)."""
    rng = np.random.default_rng(n_rows)
    cpu = CpuLane(LaneLayout((0, 0)), precision=precision)
    with MailboxLane(cpu, [expert_table(experts)]) as lane:
        mbox = lane.mailboxes[0]
        mbox.set_budget(3)
        step = Step(mbox, device, n_rows)
        # the experts of the first row are cached (hits); the rest miss
        key_slot = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32, device=device)
        x16, sel, rw = routed(rng, n_rows, device)
        key_slot[sel[0]] = 0
        want = torch.empty((n_rows, HIDDEN), dtype=torch.float, device=device)
        moe_call(gpu_linears, x16, sel.clone(), rw.clone(), want)
        out = torch.empty_like(want)
        run_layer(gpu_linears, step, x16, sel, rw, out, BUDGET_NS, key_slot)
        st = step.state()
        assert (st["published"], st["fallbacks"], st["timed_out"]) == (1, 0, 0)
        masked = (sel.view(-1) == -1).nonzero().view(-1).tolist()
        assert len(masked) == st["lane_picks"] > 0
        assert not set(sel[0].tolist()) & {-1}  # hits stay on the GPU
        assert (rw.view(-1)[masked] == 0).all()
        assert lane.stats()["jobs"] == 1
        x = x16.float().cpu().numpy()
        rows = np.repeat(np.arange(n_rows), TOP_K)
        ref = reference_moe(
            x, rows, step.orig_sel.cpu().numpy(), step.orig_w.float().cpu().numpy(), experts
        )
        want_h, out_h = want.cpu().numpy(), out.cpu().numpy()
        assert rel_err(out_h, want_h) <= rel_err(want_h, ref)
        if precision == "fast":
            assert rel_err(out_h, ref) < rel_err(want_h, ref) + FAST_REL_TOL
        mbox.unpin()


def test_a_stalled_lane_falls_back_to_the_gpu_only_output_and_is_counted(
    experts, gpu_linears, device
):
    rng = np.random.default_rng(99)
    cpu = CpuLane(LaneLayout((0, 0)))
    with MailboxLane(cpu, [expert_table(experts)]) as lane:
        mbox = lane.mailboxes[0]
        mbox.set_budget(4)
        step = Step(mbox, device, 2)
        lane.poller.stall(0, mbox.seq + 1)
        x16, sel, rw = routed(rng, 2, device)
        want = torch.empty((2, HIDDEN), dtype=torch.float, device=device)
        moe_call(gpu_linears, x16, sel.clone(), rw.clone(), want)
        out = torch.empty_like(want)
        run_layer(gpu_linears, step, x16, sel, rw, out, STALL_BUDGET_NS)
        st = step.state()
        assert (st["fallbacks"], st["timed_out"]) == (1, 1)
        assert torch.equal(out, want)  # the fallback call is the GPU-only call
        lane.poller.release()
        mbox.unpin()
