"""glm53's one adapter over stock exllamav3 1.6.5 (never edited): the only package that imports
exllamav3, patches it, or reads its insides (tests/test_exl3_confined.py fails CI otherwise).
Importing this package imports neither exllamav3 nor torch (nor the CPU lane's native modules):
what needs them imports them when called.

Every write onto an exllamav3 class or instance goes through glm53.exl3.patches, which refuses a
point not declared in its POINTS; tests/test_exl3_patch_points.py checks each declared point
against exllamav3 1.6.5's own source (the PyPI wheel, read with ast). The points, each as: what
is patched or read (its kind, patches' docstring), where it is in exllamav3 1.6.5; the module
here that does it, and why.
- SafetensorsCollection.get_tensor (class), loader/safetensors.py; hooks: the experts load into
  the expert home instead of VRAM.
- BlockSparseMLP.routing_fn (class property), modules/block_sparse_mlp.py; hooks, fast_hooks:
  the picks go through the VRAM cache, the nvme home and the CPU lane.
- BlockSparseMLP.cpu_split_combine (class), modules/block_sparse_mlp_cpu.py; fast_hooks: the
  lane's wait and combine.
- BlockSparseMLP._g53_* (6 slots: glm53's own entries on its instances); hooks, fast_hooks: what
  routing_fn reads.
- Model.prefill, Model._g53_prefill (instance), model/model.py; hooks: prefill stays exact (no
  lane); layer_major: the chunks are recorded.
- Job.hash_completed_page, Job.maybe_stash_recurrent (instance), Job.all_unique_hashes
  (attribute), generator/job.py; prefix: pages hashed in whole chunks, the standard region;
  layer_major: where recurrent state is stashed.
- Sequence.page_hashes, Sequence.new_unique_pages (attribute), generator/pagetable.py; prefix:
  the standard region.
- Job.prefill, Job.is_prefill_done, Job._g53_layer_major (instance, slot), generator/job.py;
  layer_major: the pass.
- Module.load (instance), modules/module.py, and Model.active_devices (attribute),
  model/model.py; split: each module on its GPU, the devices used.
- Sampler.__init__, Sampler.forward (subclass), generator/sampler/sampler.py; sampler_classes:
  the host and device-logprob samplers.
- Model._get_prefetch_layers, advance_recurrent_states, GDNLayerState.stash, RecurrentCache.put
  (read), model/model.py, cache/recurrent_util.py, modules/gated_delta_net.py,
  cache/recurrent.py; layer_major(_pass): the recorder and the stashes.
- exllamav3_ext.pinned_cuda_view (ext), exllamav3_ext/bindings.cpp; hooks: the home's CUDA
  alias.

The interface the engine calls (everything else here is this package's own):
- the version: EXLLAMAV3_VERSION, installed_version, version_problem, check_version;
- loading: load (LoadOptions -> Loaded), heat_path;
- generation: make_generator, make_job, request_sampler (exllamav3_sampler, device_logprob_sampler
  or host_sampler), result_key, decode_row_keys (the nvme modes' read-fault isolation);
- prefix reuse: PAGE, standard_region, align_prefix_reuse, generator_settings;
- layer-major prefill: LayerMajorPrefill; fast mode and nvme mode (start_fast on an nvme-exact
  load): start_fast, stop_fast, NO_LANE.

Modules: version (the pin and its check), patches (the declared points and the write helpers),
hooks (the expert homes and the class-level hooks), options / loader / loaded / split (loading,
one GPU or a layer split), nvme_device (nvme-exact's device glue), fast_hooks / fast (fast
mode), prefix (prefix reuse), generator / sampler_classes (Generator, Jobs, samplers),
layer_major / layer_major_pass (layer-major prefill).
"""

from glm53.exl3.generator import (
    decode_row_keys,
    device_logprob_sampler,
    exllamav3_sampler,
    host_sampler,
    make_generator,
    make_job,
    request_sampler,
    result_key,
)
from glm53.exl3.hooks import NO_LANE
from glm53.exl3.layer_major import LayerMajorPrefill
from glm53.exl3.loaded import Loaded
from glm53.exl3.loader import heat_path, load
from glm53.exl3.options import LoadMode, LoadOptions
from glm53.exl3.prefix import PAGE, align_prefix_reuse, generator_settings, standard_region
from glm53.exl3.version import (
    EXLLAMAV3_VERSION,
    UnsupportedExllamaV3,
    check_version,
    installed_version,
    version_problem,
)

__all__ = [
    "EXLLAMAV3_VERSION",
    "NO_LANE",
    "PAGE",
    "LayerMajorPrefill",
    "LoadMode",
    "LoadOptions",
    "Loaded",
    "UnsupportedExllamaV3",
    "align_prefix_reuse",
    "check_version",
    "decode_row_keys",
    "device_logprob_sampler",
    "exllamav3_sampler",
    "generator_settings",
    "heat_path",
    "host_sampler",
    "installed_version",
    "load",
    "make_generator",
    "make_job",
    "request_sampler",
    "result_key",
    "standard_region",
    "start_fast",
    "stop_fast",
    "trace_fast_ranges",
    "version_problem",
]


def start_fast(loaded, model_dir: str, cpu_lane, ct_b: float | None = None, budget_ns=None):
    """Fast mode on an exact-mode load, nvme mode on an nvme-exact one (glm53.exl3.fast.
    start_fast; imported here on call, as it loads the CPU lane's native modules)."""
    from glm53.exl3.fast import start_fast as start

    return start(loaded, model_dir, cpu_lane, ct_b=ct_b, budget_ns=budget_ns)


def stop_fast(fast, loaded) -> None:
    """glm53.exl3.fast.stop_fast: the hooks detached and the lane stopped."""
    from glm53.exl3.fast import stop_fast as stop

    stop(fast, loaded)


def trace_fast_ranges(on: bool) -> None:
    """glm53.exl3.fast.trace_ranges: the lane path's host work in named profiler ranges
    (bench/gpu_trace.py; off when serving)."""
    from glm53.exl3.fast import trace_ranges

    trace_ranges(on)
