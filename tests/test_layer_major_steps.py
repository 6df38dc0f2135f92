"""The torch-free parts of the GPU engine's layer-major prefill (glm53.exl3.layer_major):
which modules each step runs, and how the longest decode pause is counted. The GPU side is
tests/gpu/test_layer_major_gpu.py."""

from types import SimpleNamespace

from glm53.exl3.layer_major import LayerMajorPrefill
from glm53.exl3.layer_major_pass import _module_steps
from glm53.models.tokenizer import token_ids
from glm53.synth.layout import text_config
from glm53.synth.shapes import SLICE


def _model(num_blocks: int):
    """Embedding, ExpandStreams, the blocks, then the head (as glm5_next lays them out)."""
    names = ["embed", "expand"] + [f"block{i}" for i in range(num_blocks)] + ["hc_head", "norm"]
    fwd = [(SimpleNamespace(key=n), 0, i) for i, n in enumerate(names)]
    last_kv = 2 + num_blocks - 1
    return SimpleNamespace(fwd_modules=fwd, first_block_idx=2,
                           last_kv_module_idx_instance=(last_kv, 0))  # fmt: skip


def test_the_first_step_runs_everything_up_to_the_first_block_then_one_block_a_step():
    steps = _module_steps(_model(8))
    assert [[m[0].key for m in s] for s in steps] == (
        [["embed", "expand", "block0"]] + [[f"block{i}"] for i in range(1, 8)]
    )  # the head after the last KV module is not prefill's (prefill_ls stops there)


def _ctl():
    loaded = SimpleNamespace(
        model=SimpleNamespace(loaded_tp=False, config=SimpleNamespace()), cache=None, ec=None,
        stager=None, vram_plan=None,
    )  # fmt: skip
    gen = SimpleNamespace(draft_model=None)
    return LayerMajorPrefill(loaded, gen, 1024, text_config(SLICE, token_ids()), 0, "cuda:0")


def test_a_pause_counts_only_between_two_iterations_that_gave_tokens(monkeypatch):
    import glm53.exl3.layer_major as lm

    clock = iter([1.0, 1.5, 3.0, 10.0, 10.2])
    monkeypatch.setattr(lm.time, "perf_counter", lambda: next(clock))
    ctl = _ctl()
    ctl.after_iterate(True)  # t=1.0: a stream decodes
    ctl.after_iterate(True)  # t=1.5: no pass step in between: not a pause
    assert ctl.longest_pause_s == 0
    ctl._stepped_since_decode = True  # a pass step ran (step() sets it)
    ctl.after_iterate(True)  # t=3.0: the stream waited 1.5 s
    assert ctl.longest_pause_s == 1.5
    ctl.after_iterate(False)  # t=10: nothing decoding
    ctl._stepped_since_decode = True
    ctl.after_iterate(True)  # t=10.2: the first token after idle is no pause
    assert ctl.longest_pause_s == 1.5
    assert ctl.stats()["longest_decode_pause_s"] == 1.5


class _SharedSelection:
    """A mock of exllamav3 1.6.5's graph-captured decode-class DSA attention (the real one needs
    a GPU): every forward of it writes its top-k selection into one workspace shared by all
    forwards and publishes that workspace in params (bc_mla.py's "bcm_dsa_idx")."""

    workspace = None

    def __init__(self, key: str, full: bool):
        self.key, self.full = key, full

    def prepare_for_device(self, x, params):
        return x

    def forward(self, x, params):
        import torch

        if self.full:  # this chunk's selection, from its input
            _SharedSelection.workspace.copy_(x.reshape(-1)[:4].to(torch.int32))
            params["dsa_topk_indices"] = _SharedSelection.workspace
            return x
        return x + params["dsa_topk_indices"].to(x.dtype).sum()  # a "shared" layer reads it


def test_a_chunk_keeps_its_own_dsa_selection_across_other_streams_forwards():
    """Between two steps of a pass the Generator decodes other streams, whose forwards write the
    decode-class attention's shared selection workspace; a chunk's "shared" indexer layer must
    still read the selection its own "full" layer made."""
    import torch

    from glm53.exl3.layer_major_pass import LayerMajorPass, _Chunk

    _SharedSelection.workspace = torch.zeros(4, dtype=torch.int32)
    full, shared = _SharedSelection("layers.3", True), _SharedSelection("layers.4", False)
    p = object.__new__(LayerMajorPass)  # _run only: no job, no placement (streams as allocated)
    model = SimpleNamespace(last_kv_module_idx_instance=(9, 0))
    p.ctl, p.layout, p.step_i, p.points = SimpleNamespace(model=model), None, 1, {}
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    chunk = _Chunk(None, {}, 4, 4, x)
    chunk.x = p._run(chunk, chunk.x, [(full, 0, 3)])
    _SharedSelection.workspace.fill_(-1)  # another stream's decode step ran the same attention
    got = p._run(chunk, chunk.x, [(shared, 0, 4)])
    assert torch.equal(got, x + 10.0)  # its own selection (1 + 2 + 3 + 4), not the other's


class _MockStager:
    """A mock of PrefillStager (the real one needs CUDA streams): records order_unstage calls."""

    def __init__(self):
        self.ordered = 0

    def order_unstage(self):
        self.ordered += 1


def test_each_pass_step_orders_the_stagers_unstage_before_decode_steps_may_run():
    """Between two steps of a pass the Generator may decode other streams, whose admissions
    rewrite table entries; the side stream's unstage (which rewrites the buffer's old layer's
    entries from the slots it read) must come first on the main stream: every step ends with
    PrefillStager.order_unstage."""
    import torch

    from glm53.exl3.layer_major_pass import LayerMajorPass, _Chunk

    stager = _MockStager()
    p = object.__new__(LayerMajorPass)
    model = SimpleNamespace(last_kv_module_idx_instance=(9, 0))
    p.ctl = SimpleNamespace(model=model, stager=stager, counters={"layers_run": 0})
    p.layout, p.copy, p.points, p.step_i = None, None, {}, 1
    block = _SharedSelection("layers.1", True)
    _SharedSelection.workspace = torch.zeros(4, dtype=torch.int32)
    p.steps = [[(block, 0, 0)], [(block, 0, 1)], [(block, 0, 2)], [(block, 0, 3)]]
    p.chunks = [_Chunk(None, {}, 4, 4, torch.ones(1, 4))]
    assert p.step() is False and stager.ordered == 1
    assert p.step() is False and stager.ordered == 2
