"""Exact mode on stock exllamav3 1.6.5, without editing it.

Two class-level hooks and pointer-table writes, nothing else:

- `SafetensorsCollection.get_tensor` is wrapped: for a checkpoint registered with a
  `PinnedExpertHome`, a routed expert's `.trellis` is read straight from its shard into a
  per-layer pinned, mapped host arena, and exllamav3 gets a CUDA alias of those bytes
  (`ext.pinned_cuda_view`). So the loader never puts routed experts in VRAM, and the MoE
  pointer tables it builds point at host memory (UVA). `suh`/`svh` load normally (VRAM).
- `BlockSparseMLP.routing_fn` becomes a class-level property: on a module that has a
  `DeviceExpertCache` attached, the router's picks go through `cache.route` (device-side
  CLOCK: lookup, admission, table rewrite, slot copy) before the MoE kernel reads the tables.

A table entry always points at a byte-exact copy of its expert (home or slot), so the
output is bit-identical to stock exllamav3 with every expert in VRAM.

nvme decode prefetch (`attach_nvme(..., prefetch=True)`): a decode call's hook first runs the
next MoE module's own router on this layer's input (`predict_next`) and hands the predicted picks
to glm53.exl3.nvme_device, which reads them from the store ahead; only where bytes are read
from moves (it FAILED its first GPU run on 2026-12-05, with prefill staging on; after the staging
fix its GPU tests passed on an H100 the same day).
"""

from __future__ import annotations

import mmap
import os
import re
import resource
from dataclasses import dataclass, field

import numpy as np

from glm53.exl3.errors import Exl3Refused, UnsupportedCheckpoint
from glm53.exl3.patches import patch_class, shadow, unshadow

EXPERT_TRELLIS = re.compile(
    r"^(?P<mlp>.*\.layers\.(?P<layer>\d+)\.mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj)\.trellis$"
)
PROJ_INDEX = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
DECODE_MAX_ROWS = 8  # exllamav3's fused decode path (MAX_BSZN); larger calls are prefill
# fast mode (glm53.exl3.fast_hooks): a forward whose params hold this key runs exact, none of its
# MoE calls publish to the lane (prefill, and the engine's cache-free prompt scoring)
NO_LANE = "g53_no_lane"


def memlock_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return -1 if soft == resource.RLIM_INFINITY else soft


@dataclass
class _LayerArena:
    layer: int
    buf: mmap.mmap
    view: np.ndarray
    filled: set = field(default_factory=set)


def _init_home(home, directory: str, moe_layers: list[int], n_experts: int, part_bytes, device):
    """What every expert home knows: its checkpoint, its MoE layers and the record geometry."""
    from glm53.tiers.vram_cache import CacheGeometry

    home.directory = os.path.realpath(directory)
    home.moe_layers = list(moe_layers)
    home.moe_index = {layer: i for i, layer in enumerate(home.moe_layers)}
    home.geo = CacheGeometry(len(home.moe_layers), n_experts, tuple(part_bytes))
    home.device = device
    home.bytes_pinned = 0


class PinnedExpertHome:
    """Routed experts' trellis in pinned, mapped host arenas: one arena per MoE layer,
    record-major (`record = expert`, gate|up|down at `part_off`), registered with CUDA."""

    def __init__(self, directory: str, moe_layers: list[int], n_experts: int, part_bytes, device):
        _init_home(self, directory, moe_layers, n_experts, part_bytes, device)
        self.arenas: dict[int, _LayerArena] = {}
        need = self.geo.n_keys * self.geo.record_bytes
        limit = memlock_limit()
        if 0 <= limit < need:
            raise Exl3Refused(
                f"the locked-memory limit is {limit} bytes, but pinning the routed experts needs "
                f"{need} bytes: raise it (`ulimit -l unlimited`, or LimitMEMLOCK=infinity in the "
                "systemd unit) and start again"
            )

    def _arena(self, layer: int) -> _LayerArena:
        arena = self.arenas.get(layer)
        if arena is not None:
            return arena
        import torch

        nbytes = self.geo.n_experts * self.geo.record_bytes
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = np.frombuffer(buf, dtype=np.uint8)
        rc = torch.cuda.cudart().cudaHostRegister(
            view.ctypes.data, nbytes, 1 | 2
        )  # portable|mapped
        if int(rc) != 0:
            raise Exl3Refused(
                f"cudaHostRegister of {nbytes} bytes for MoE layer {layer} failed (error {int(rc)}): "
                "check `ulimit -l` (LimitMEMLOCK) and free RAM"
            )
        self.bytes_pinned += nbytes
        arena = self.arenas[layer] = _LayerArena(layer, buf, view)
        return arena

    def home_addresses(self) -> np.ndarray:
        """Device (UVA) address of every expert record, key order."""
        out = np.zeros(self.geo.n_keys, dtype=np.int64)
        for layer, i in self.moe_index.items():
            arena = self.arenas.get(layer)
            if arena is None or len(arena.filled) != 3 * self.geo.n_experts:
                got = 0 if arena is None else len(arena.filled)
                raise RuntimeError(
                    f"internal error: MoE layer {layer}: {got} of {3 * self.geo.n_experts} expert "
                    "trellis tensors reached the pinned home; the loader bypassed the hook"
                )
            base = arena.view.ctypes.data
            out[i * self.geo.n_experts : (i + 1) * self.geo.n_experts] = (
                base + np.arange(self.geo.n_experts, dtype=np.int64) * self.geo.record_bytes
            )
        return out

    def load(self, stc, key: str, m: re.Match, device):
        """Read one expert trellis into its place in the arena; return a CUDA alias."""
        import torch
        from exllamav3.ext import exllamav3_ext as ext

        layer, expert, proj, filename, header, h = _locate(self, stc, key, m)
        beg, end = h["data_offsets"]
        nbytes = end - beg
        arena = self._arena(layer)
        off = expert * self.geo.record_bytes + self.geo.part_off[proj]
        dst = memoryview(arena.buf)[off : off + nbytes]
        fd = os.open(filename, os.O_RDONLY)
        try:
            pos, done = header["_header_offset"] + beg, 0
            while done < nbytes:
                n = os.preadv(fd, [dst[done:]], pos + done)
                if n <= 0:
                    raise OSError(f"{filename}: short read of {key} at byte {pos + done}")
                done += n
            os.posix_fadvise(fd, pos, nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        arena.filled.add((expert, proj))
        host = torch.from_numpy(arena.view[off : off + nbytes]).view(torch.int16).view(h["shape"])
        dev = torch.device(device)
        return ext.pinned_cuda_view(host, dev.index if dev.index is not None else 0)

    def close(self) -> None:
        import torch

        for arena in self.arenas.values():
            torch.cuda.cudart().cudaHostUnregister(arena.view.ctypes.data)
        self.arenas.clear()


def _locate(home, stc, key: str, m: re.Match):
    """(layer, expert, projection, shard, its header, the tensor's header) of a routed expert's
    trellis, checked against the home's geometry."""
    layer, expert, proj = int(m["layer"]), int(m["expert"]), PROJ_INDEX[m["proj"]]
    if layer not in home.moe_index or not 0 <= expert < home.geo.n_experts:
        raise RuntimeError(
            f"internal error: {key}: not a routed expert of the layers this home was built for"
        )
    filename = stc.tensor_file_map[key]
    header = stc.file_headers[filename]
    h = header[key]
    beg, end = h["data_offsets"]
    nbytes = end - beg
    if h["dtype"] != "I16" or nbytes != home.geo.part_bytes[proj]:
        raise UnsupportedCheckpoint(
            f"{key}: expected I16 trellis of {home.geo.part_bytes[proj]} bytes, found "
            f"{h['dtype']} of {nbytes}: every routed expert of a layer must share its shape"
        )
    return layer, expert, proj, filename, header, h


class AbsentExpertHome:
    """nvme-exact's loader side: the routed experts stay in the store, so the loader reads none
    of them. Every expert's trellis is handed to exllamav3 as a view into one poison record in
    VRAM (zeros, one record of gate|up|down), so its pointer tables start out pointing there;
    glm53.exl3.nvme_device points each pick's entries at its VRAM slot or RAM-tier home before
    the MoE kernel reads them. The poison record is also the device home table's `absent`
    address: a read of it is a table_bad fault, counted. Ran on an H200 on 2026-12-02
    (tests/gpu/test_nvme_exact_gpu.py, 6 of 6 with prefill staging off)."""

    def __init__(self, directory: str, moe_layers: list[int], n_experts: int, part_bytes, device):
        import torch

        _init_home(self, directory, moe_layers, n_experts, part_bytes, device)
        self.poison = torch.zeros(self.geo.record_bytes, dtype=torch.uint8, device=device)
        self.address = self.poison.data_ptr()
        self.loaded: set = set()

    def home_addresses(self) -> np.ndarray:
        """The absent address for every key (what the device home table starts with)."""
        want = 3 * self.geo.n_keys
        if len(self.loaded) != want:
            raise RuntimeError(
                f"internal error: {len(self.loaded)} of {want} expert trellis tensors reached "
                "the absent home; "
                "the loader bypassed the hook"
            )
        return np.full(self.geo.n_keys, self.address, dtype=np.int64)

    def load(self, stc, key: str, m: re.Match, device):
        import torch

        layer, expert, proj, _, _, h = _locate(self, stc, key, m)
        off = self.geo.part_off[proj]
        self.loaded.add((layer, expert, proj))
        view = self.poison[off : off + self.geo.part_bytes[proj]]
        return view.view(torch.int16).view(h["shape"])

    def close(self) -> None:
        self.poison = None


_homes: dict[str, PinnedExpertHome | AbsentExpertHome] = {}
_installed = False


def install_hooks() -> None:
    """Install the two class-level hooks (idempotent). Call before Model.from_config."""
    global _installed
    if _installed:
        return
    from exllamav3.loader.safetensors import SafetensorsCollection
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    original_get_tensor = SafetensorsCollection.get_tensor

    def get_tensor(self, key, device=None, *args, **kwargs):
        home = _homes.get(os.path.realpath(self.directory)) if _homes else None
        if home is not None:
            m = EXPERT_TRELLIS.match(key)
            if m is not None and key in self.tensor_file_map:
                odd = {
                    k: v for k, v in kwargs.items() if k in ("transpose", "pad_to", "fidx") and v
                }
                if odd or args:
                    raise RuntimeError(
                        f"internal error: {key}: unexpected load options {odd or args} for a "
                        "routed expert"
                    )
                return home.load(self, key, m, device)
        return original_get_tensor(self, key, device, *args, **kwargs)

    get_tensor.__wrapped__ = original_get_tensor
    patch_class(SafetensorsCollection, "SafetensorsCollection.get_tensor", get_tensor)

    def _get(self):
        fn = self.__dict__.get("_g53_routing_fn")
        cache = self.__dict__.get("_g53_cache")
        if fn is None or cache is None:
            return fn
        layer = self.__dict__["_g53_moe_index"]

        stager = self.__dict__.get("_g53_stager")
        nvme = self.__dict__.get("_g53_nvme")  # nvme-exact: glm53.exl3.nvme_device.NvmeHome
        nxt = self.__dict__.get("_g53_next")  # decode prefetch: the next MoE module
        loan = getattr(stager, "loan", None)  # exact's staging loan (vram_cache.StagingLoan)

        def routed(bsz, cfg, z, params):
            predicted = predict_next(nxt, bsz, z, params)  # first: see predict_next
            selected, weights = fn(bsz, cfg, z, params)
            if nvme is not None:  # every pick's home made resident first (one sync per layer)
                decode = bsz <= DECODE_MAX_ROWS
                nvme.route(layer, selected, decode, params, weights, predicted=predicted)
                return selected, weights
            if params.get("activate_all_experts"):
                return selected, weights
            if bsz <= DECODE_MAX_ROWS:
                if loan is not None and layer == 0:  # a decode forward starts
                    loan.decode()
                cache.route(layer, selected.reshape(-1), admit=True)
            elif stager is not None and bsz >= stager.min_rows:
                stager.on_layer(layer)
            return selected, weights

        return routed

    def _set(self, fn):
        shadow(self, "BlockSparseMLP._g53_routing_fn", fn)

    patch_class(BlockSparseMLP, "BlockSparseMLP.routing_fn", property(_get, _set))
    _installed = True


def predict_next(nxt, bsz: int, z, params: dict):
    """nvme decode prefetch (glm53.tiers.decode_prefetch): the picks the next MoE module's own
    router (its un-hooked routing function and its config) makes from this layer's MoE input
    `z`, as a tensor of its own; None outside a decode call (more than DECODE_MAX_ROWS rows,
    marked NO_LANE, or reading every expert) or without prefetch (`nxt` None).

    Called before this layer's own routing, on the same stream: exllamav3's routers write their
    multi-row results into workspaces shared by every MoE layer (block_sparse_mlp_routing.
    _routing_buffers) and their one-row results into the config's own buffers, so the
    prediction is copied out (`clone`) before this layer's routing overwrites the shared ones,
    and this layer's picks are never touched. The router gets a copy of `params`: nothing is
    written back into the live forward's."""
    if nxt is None or bsz > DECODE_MAX_ROWS:
        return None
    if params.get(NO_LANE) or params.get("activate_all_experts"):
        return None
    fn, cfg = nxt.__dict__.get("_g53_routing_fn"), nxt.routing_cfg
    if fn is None or cfg is None:
        return None
    selected, _ = fn(bsz, cfg, z, dict(params))
    return selected.clone()


def mark_prefill_exact(model) -> None:
    """Prefill stays exact (issue #16; fast and nvme mode), and in the nvme modes a read fault
    in prefill fails its one job rather than being isolated (glm53.tiers.read_faults).
    exllamav3's Generator prefills through `model.prefill`, and a prompt's last chunk can be as
    small as a decode step, so the routing hook cannot tell it from one by its row count: this
    wraps the instance's `prefill` (the class is untouched)
    to put NO_LANE into the params it gets. The params dict is marked in place, not copied:
    exllamav3 hands results back through it. Idempotent; `unmark_prefill_exact` undoes it."""
    if "_g53_prefill" in model.__dict__:
        return
    prefill = model.prefill

    def marked(input_ids, params=None):
        params = {} if params is None else params
        params[NO_LANE] = True
        return prefill(input_ids, params)

    shadow(model, "Model._g53_prefill", prefill)
    shadow(model, "Model.prefill", marked)


def unmark_prefill_exact(model) -> None:
    if unshadow(model, "Model._g53_prefill") is not None:
        unshadow(model, "Model.prefill")  # the class's method again


def register_home(home: PinnedExpertHome) -> None:
    _homes[home.directory] = home


def unregister_home(home: PinnedExpertHome) -> None:
    _homes.pop(home.directory, None)


def moe_modules(model) -> list:
    """exllamav3's BlockSparseMLP modules in layer order, with their model layer index."""
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    found = []

    def walk(mod):
        if isinstance(mod, BlockSparseMLP):
            found.append(mod)
            return
        for sub in getattr(mod, "modules", []):
            walk(sub)

    for mod in model.modules:
        walk(mod)
    return found


def prefill_moe_count(model, moe: list) -> int:
    """How many of `moe` (moe_modules' list, in layer order) a prefill forward runs: exllamav3's
    prefill (`Model.prefill_ls`) stops at the last module with a KV cache
    (`Model.last_kv_module_idx`), and that block returns after its attention (TransformerBlock's
    forward with params["prefill"]), so the MoE layers in it and after it run only in decode and
    in full forwards. The PrefillStager stages no layer ahead past this count."""
    last = getattr(model, "last_kv_module_idx", None)
    if last is None:
        return len(moe)
    ran: set[int] = set()

    def walk(mod):
        ran.add(id(mod))
        for sub in getattr(mod, "modules", []):
            walk(sub)

    for mod in model.modules[:last]:
        walk(mod)
    count = sum(1 for m in moe if id(m) in ran)
    if any(id(m) in ran for m in moe[count:]):
        raise RuntimeError("internal error: the MoE modules are not in the model's layer order")
    return count


def table_addresses(modules) -> list[int]:
    """[layer][gate, up, down] device addresses of the trellis pointer tables."""
    out = []
    for mod in modules:
        gate = mod.multi_gate if mod.multi_gate is not None else mod.multi_up
        for multi in (gate, mod.multi_up, mod.multi_down):
            if multi is None:
                raise UnsupportedCheckpoint(
                    f"{mod.key}: no pointer tables (the MoE layer is not fully EXL3): glm53 "
                    "serves EXL3 checkpoints whose every expert projection is EXL3-quantized"
                )
            out.append(multi.ptrs_trellis.data_ptr())
    return out


def attach_cache(modules, cache, stager=None) -> None:
    for i, mod in enumerate(modules):
        shadow(mod, "BlockSparseMLP._g53_moe_index", i)
        shadow(mod, "BlockSparseMLP._g53_cache", cache)
        shadow(mod, "BlockSparseMLP._g53_stager", stager)


def attach_nvme(modules, nvme, prefetch: bool = False) -> None:
    """nvme-exact: route every call's picks through `nvme` (after attach_cache). `prefetch`
    (--nvme-prefetch next-layer): each module also gets the next one, whose router predicts
    the next layer's picks in decode (predict_next)."""
    for i, mod in enumerate(modules):
        shadow(mod, "BlockSparseMLP._g53_nvme", nvme)
        nxt = modules[i + 1] if prefetch and i + 1 < len(modules) else None
        shadow(mod, "BlockSparseMLP._g53_next", nxt)


def detach_cache(modules) -> None:
    for mod in modules:
        unshadow(mod, "BlockSparseMLP._g53_cache")
        unshadow(mod, "BlockSparseMLP._g53_nvme")
        unshadow(mod, "BlockSparseMLP._g53_next")
