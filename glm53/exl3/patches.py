"""Every point where glm53 touches exllamav3 1.6.5's insides, declared once (POINTS), and the
three helpers through which glm53/exl3/ makes every write onto an exllamav3 class or instance.

A helper refuses a point that POINTS does not declare (UndeclaredPatch), so a new patch cannot
be made without declaring it. tests/test_exl3_patch_points.py reads exllamav3 1.6.5's own source
(the PyPI wheel, never imported) and checks each declared point: the class, the method with its
parameter names, the attribute its `__init__` sets. tests/test_exl3_confined.py checks that no
module outside glm53/exl3/ imports exllamav3 or writes onto its objects, and that inside it every
write goes through these helpers with a declared point.

Kinds:
- `class`: the class attribute is replaced for every instance (patch_class);
- `instance`: one instance's attribute is shadowed, the class untouched (shadow / unshadow);
- `slot`: glm53's own entry in one instance's `__dict__`, read by a class-level hook (shadow);
- `attribute`: an attribute exllamav3's own `__init__` sets, rewritten on one instance (assign);
- `subclass`: glm53 subclasses the class and overrides the method (glm53.exl3.sampler_classes);
- `read`: a name glm53 reads or calls, private or easily moved (no write);
- `ext`: a function of exllamav3's compiled extension that glm53 calls (its bindings.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass

from glm53.errors import Glm53Error


@dataclass(frozen=True, slots=True)
class PatchPoint:
    module: str  # the exllamav3 module that defines `owner` (or the function)
    owner: str  # the class; "" for a module-level function
    name: str  # the attribute, method or function
    kind: str  # class, instance, slot, attribute, subclass, read or ext (module docstring)
    params: tuple[str, ...] | None  # a method's or function's parameter names; None: not callable
    where: str  # the glm53.exl3 module that touches it
    why: str

    @property
    def key(self) -> str:
        return f"{self.owner}.{self.name}" if self.owner else self.name


_MLP = "exllamav3.modules.block_sparse_mlp"
_JOB = "exllamav3.generator.job"
_MODEL = "exllamav3.model.model"
_SAMPLER = "exllamav3.generator.sampler.sampler"
_SLOT = "glm53's entry, read by the routing property"

POINTS: tuple[PatchPoint, ...] = (
    # the expert home and the VRAM cache (glm53.exl3.hooks)
    PatchPoint("exllamav3.loader.safetensors", "SafetensorsCollection", "get_tensor", "class",
               ("self", "key", "device", "optional", "allow_bf16", "float2half", "no_defer",
                "transpose", "pad_to", "fidx", "arena"), "hooks",
               "a routed expert's trellis is read into the pinned (or absent) home"),
    PatchPoint(_MLP, "BlockSparseMLP", "routing_fn", "class", None, "hooks",
               "set by __init__; a class property routes the picks through the VRAM cache"),
    PatchPoint("exllamav3.exllamav3_ext", "", "pinned_cuda_view", "ext", ("t", "device"),
               "hooks", "the loader gets a CUDA alias of the expert's pinned home bytes"),
    PatchPoint(_MLP, "BlockSparseMLP", "_g53_routing_fn", "slot", None, "hooks", _SLOT),
    PatchPoint(_MLP, "BlockSparseMLP", "_g53_moe_index", "slot", None, "hooks", _SLOT),
    PatchPoint(_MLP, "BlockSparseMLP", "_g53_cache", "slot", None, "hooks", _SLOT),
    PatchPoint(_MLP, "BlockSparseMLP", "_g53_stager", "slot", None, "hooks", _SLOT),
    PatchPoint(_MLP, "BlockSparseMLP", "_g53_nvme", "slot", None, "hooks", _SLOT),
    PatchPoint(_MLP, "BlockSparseMLP", "_g53_next", "slot", None, "hooks",
               "nvme decode prefetch: the next MoE module, whose router predicts its picks"),
    PatchPoint(_MLP, "BlockSparseMLP", "routing_cfg", "read", None, "hooks",
               "nvme decode prefetch: the next layer's router config, for its prediction"),
    # fast mode (glm53.exl3.fast_hooks)
    PatchPoint(_MLP, "BlockSparseMLP", "cpu_split_combine", "class",
               ("self", "final_hidden_states", "cpu_partial", "cpu_pending", "shape"),
               "fast_hooks", "the lane's wait and combine after the routed sum (inherited from "
               "BlockSparseMLP_CPU)"),
    PatchPoint(_MLP, "BlockSparseMLP", "_g53_fast", "slot", None, "fast_hooks", _SLOT),
    PatchPoint(_MODEL, "Model", "prefill", "instance", ("self", "input_ids", "params"),
               "hooks, layer_major",
               "fast, nvme: prefill marked exact (nvme: a read fault fails its one job); "
               "layer-major: a chunk's forward recorded"),
    PatchPoint(_MODEL, "Model", "_g53_prefill", "slot", None, "hooks",
               "the model's own prefill, kept while the prefill mark is on"),
    # prefix reuse (glm53.exl3.prefix)
    PatchPoint(_JOB, "Job", "hash_completed_page", "instance", ("self", "seq", "page_idx"),
               "prefix, layer_major", "pages past the standard region keep random hashes"),
    PatchPoint(_JOB, "Job", "maybe_stash_recurrent", "instance",
               ("self", "cache", "interval"), "prefix, layer_major",
               "recurrent state stashed only at chunk multiples of the standard region"),
    PatchPoint(_JOB, "Job", "all_unique_hashes", "attribute", None, "prefix",
               "the page hashes a job matches, cut to the standard region"),
    PatchPoint("exllamav3.generator.pagetable", "Sequence", "page_hashes", "attribute", None,
               "prefix", "cut to the standard region"),
    PatchPoint("exllamav3.generator.pagetable", "Sequence", "new_unique_pages", "attribute",
               None, "prefix", "the pages cut from page_hashes are allocated fresh"),
    # layer-major prefill (glm53.exl3.layer_major)
    PatchPoint(_JOB, "Job", "prefill", "instance", ("self", "results", "chunk_size"),
               "layer_major", "a long prompt's chunks recorded, then run layer by layer"),
    PatchPoint(_JOB, "Job", "is_prefill_done", "instance", ("self",), "layer_major",
               "the job is hidden from decode during its pass"),
    PatchPoint(_JOB, "Job", "_g53_layer_major", "slot", None, "layer_major",
               "the pass's state, shared by the job's shadows"),
    PatchPoint(_MODEL, "Model", "_get_prefetch_layers", "read", ("self",), "layer_major",
               "private: the recorder runs the prefetch Model.prefill runs"),
    PatchPoint("exllamav3.cache.recurrent_util", "", "advance_recurrent_states", "read",
               ("input_ids", "params", "model"), "layer_major",
               "the recorder advances recurrent state as Model.prefill does"),
    PatchPoint("exllamav3.modules.gated_delta_net", "GDNLayerState", "stash", "read",
               ("self", "slot", "position", "parity"), "layer_major_pass",
               "a checkpoint is stashed layer by layer"),
    PatchPoint("exllamav3.cache.recurrent", "RecurrentCache", "put", "read",
               ("self", "key", "state"), "layer_major_pass",
               "the assembled checkpoint handed over"),
    # the layer split (glm53.exl3.split)
    PatchPoint("exllamav3.modules.module", "Module", "load", "instance", ("self", "device"),
               "split", "each top-level module loads on its planned GPU"),
    PatchPoint(_MODEL, "Model", "active_devices", "attribute", None, "split",
               "the devices the split placed modules on"),
    # the samplers (glm53.exl3.sampler_classes)
    PatchPoint(_SAMPLER, "Sampler", "__init__", "subclass", ("self",), "sampler_classes",
               "host and device-logprob samplers subclass exllamav3's Sampler"),
    PatchPoint(_SAMPLER, "Sampler", "forward", "subclass",
               ("self", "logits", "sequence_ids", "rand_u32", "tokenizer", "blocked_tokens",
                "allowed_tokens", "return_state"), "sampler_classes",
               "overridden: glm53 draws the token"),
)  # fmt: skip

BY_KEY = {p.key: p for p in POINTS}


class UndeclaredPatch(KeyError, Glm53Error):
    pass


def declared(key: str, kinds: tuple[str, ...]) -> PatchPoint:
    """The point `key` ("Owner.name"), which must be declared in POINTS with one of `kinds`."""
    point = BY_KEY.get(key)
    if point is None or point.kind not in kinds:
        raise UndeclaredPatch(
            f"{key}: not declared in glm53.exl3.patches.POINTS as {' or '.join(kinds)}; "
            "declare it there (with its test) before patching exllamav3"
        )
    return point


def patch_class(cls, key: str, value) -> None:
    """Replace a class attribute of an exllamav3 class (every instance sees it)."""
    setattr(cls, declared(key, ("class",)).name, value)


def shadow(obj, key: str, value) -> None:
    """Set an instance attribute (a shadowed method, or glm53's own slot) on one object; its
    class is untouched. Written into `__dict__`: a class-level property is not called."""
    obj.__dict__[declared(key, ("instance", "slot")).name] = value


def unshadow(obj, key: str):
    """Remove what `shadow` set (the class's attribute shows again); returns it, or None."""
    return obj.__dict__.pop(declared(key, ("instance", "slot")).name, None)


def assign(obj, key: str, value) -> None:
    """Rewrite an attribute that exllamav3's own code set on one object."""
    setattr(obj, declared(key, ("attribute",)).name, value)
