"""The GPU engine: stock exllamav3 1.6.5 (unedited) runs the model through its own `Generator`
(paging, batching, prefill chunking, sampling), so exact mode is exllamav3's generation by
construction; in exact mode the routed experts live in pinned host memory behind the device-side
VRAM expert cache (glm53/tiers/exl3_hooks.py), which only rewrites exllamav3's pointer tables.
Implements glm53.engine.base.JobEngine: the scheduler starts and cancels requests, and each
`iterate` runs one Generator iteration (a prefill chunk per prefilling job, then one batched
decode step) and returns the new tokens.

A step loop of glm53's own over the same model was measured to drift from the Generator (logits
0.11 to 0.39 apart at the first generated token, different tokens within 10): the Generator cuts
a prompt's last page into a forward of its own and runs its last token as a decode row, and those
shapes change the rounding. Driving the Generator leaves no such gap to close.

Determinism and prefix reuse. The Generator reuses cached KV pages and recurrent (KDA) state
snapshots of a prompt's longest cached prefix. Restoring state at an arbitrary page boundary
changes how the rest of the prompt is chunked, and with it the rounding (measured on the H200: a
6,216-token follow-up reusing 5,888 tokens gave other tokens than on a cold cache). glm53 keeps
every output independent of what the cache held:

- every prompt is prefilled in chunks cut at multiples of the chunk size from position 0, also
  while other jobs decode (`shared_chunk_size` = `max_chunk_size`, `prefill_cooldown` 0);
- a job publishes page hashes (what later jobs match) only for pages inside its *standard
  region*: the chunks [k*C, (k+1)*C) that a cold prefill of that prompt runs in full (C the chunk
  size; the region ends at the last multiple of C at or before the prompt's last page boundary,
  where exllamav3 cuts a forward of its own). Pages of the prompt's tail and every page written by
  decode keep exllamav3's random unique hashes, so no later job can match them;
- recurrent-state snapshots are stashed only at multiples of C inside that region, so a later
  job restores state only where its own cold prefill would also have cut, and then runs the same
  chunks a cold prefill runs from there.

So a hit reuses floor(prefix / C) * C tokens, and a prompt costs at most C - 1 + its tail more
than an ideal token-granular cache; on a small card each chunk costs about one pass of the
experts over the link whatever its length, so coarse boundaries cost little (see README).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

from glm53.engine.base import EngineError, FinishReason, JobOutput
from glm53.units import GIB

log = logging.getLogger("glm53.engine.gpu")

PAGE = 256  # exllamav3's KV page size


def standard_region(num_prompt_tokens: int, chunk: int) -> int:
    """Tokens of a prompt that a cold prefill runs in whole chunks of `chunk` from position 0.

    exllamav3 prefills positions [0, n - 1) (the last token runs as a decode row), cuts the chunk
    that holds the last page boundary b = (n - 1) // PAGE * PAGE there, and runs [b, n - 1) as a
    forward of its own. So the chunks [k*chunk, (k+1)*chunk) that end at or before b are the same
    for every prompt that shares those tokens; the region ends at the last multiple of chunk <= b.
    """
    if chunk % PAGE:
        raise ValueError(f"the chunk size ({chunk}) must be a multiple of the page size ({PAGE})")
    last_page = (num_prompt_tokens - 1) // PAGE * PAGE
    return last_page // chunk * chunk


def exllamav3_sampler(params):
    """exllamav3's own sampler for a request that needs no host-side processing (no penalties,
    logit bias, grammar or logprobs): greedy is ArgmaxSampler, the reference's; otherwise
    temperature, top_k, min_p and top_p in the order of glm53's CPU sampler, and one draw."""
    from exllamav3.generator.sampler import (
        ArgmaxSampler,
        CustomSampler,
        SS_MinP,
        SS_Sample,
        SS_Temperature,
        SS_TopK,
        SS_TopP,
    )

    if params.is_greedy:
        return ArgmaxSampler()
    steps = [SS_Temperature(float(params.temperature))]
    if params.top_k > 0:
        steps.append(SS_TopK(int(params.top_k)))
    if params.min_p > 0:
        steps.append(SS_MinP(float(params.min_p)))
    if params.top_p < 1.0:
        steps.append(SS_TopP(float(params.top_p)))
    steps.append(SS_Sample())
    return CustomSampler(steps)


def only_logprobs(stream_sampler) -> bool:
    """A StreamSampler whose only host-side work is logprobs (no penalties, logit bias or
    grammar): the device draws its tokens and computes its logprobs (`device_logprob_sampler`)."""
    p = stream_sampler.params
    return (
        stream_sampler.num_logprobs is not None
        and not p.has_penalties
        and not p.logit_bias
        and stream_sampler.constraint is None
    )


def device_logprobs(logits, token, k: int):
    """On the logits' device, one row's logprobs as glm53.engine.logprobs defines them: the
    float64 log-softmax of the float32 logits [vocab], the drawn `token`'s value and the k most
    likely tokens, largest first with ties by the smaller id (a stable sort of the row: the
    log-softmax is the row less one constant, so it orders the tokens as the logits do). Returns
    one float64 tensor [1 + 2k]: the token's logprob, the k values, the k ids; no host sync."""
    import torch

    row = logits.reshape(-1).float()
    lp = row.double() - torch.logsumexp(row.double(), 0)
    parts = [lp[token.reshape(-1)[:1].long()]]
    if k > 0:
        ids = torch.sort(row, descending=True, stable=True).indices[:k]
        parts += [lp[ids], ids.double()]
    return torch.cat(parts)


def unpack_logprobs(packed, token: int, k: int):
    """The TokenLogprob of one `device_logprobs` result (on the host)."""
    from glm53.engine.logprobs import TokenLogprob

    values = packed.tolist()
    k = (len(values) - 1) // 2 if k > 0 else 0
    return TokenLogprob(token, values[0], [int(i) for i in values[1 + k :]], values[1 : 1 + k])


_DEVICE_LOGPROB_SAMPLER = None


def device_logprob_sampler(inner, vocab: int, k: int):
    """An exllamav3 Sampler that draws with `inner` (exllamav3_sampler: the same tokens as the
    request without logprobs) and computes each draw's logprobs on the device (device_logprobs):
    the Generator's one synchronize per iteration covers them, and only 1 + 2k numbers per token
    cross to the host. `take(n)` hands back the first n drawn tokens' TokenLogprobs."""
    global _DEVICE_LOGPROB_SAMPLER
    if _DEVICE_LOGPROB_SAMPLER is None:
        from exllamav3.generator.sampler import Sampler

        class DeviceLogprobSampler(Sampler):
            def __init__(self, inner, vocab, k):
                super().__init__()
                self.inner, self.vocab, self.k = inner, vocab, k
                self.reqs_past_ids = inner.reqs_past_ids
                self.reqs_torch_seed = inner.reqs_torch_seed
                self.pending: list = []  # (token tensor, packed logprobs), on the device

            def forward(self, logits, *args, **kwargs):
                token = self.inner.forward(logits, *args, **kwargs)
                self.pending.append(
                    (token, device_logprobs(logits[..., : self.vocab], token, self.k))
                )
                return token

            def take(self, n: int) -> list:
                done, self.pending = self.pending[:n], self.pending[n:]
                return [
                    unpack_logprobs(packed.cpu(), int(token.reshape(-1)[0]), self.k)
                    for token, packed in done
                ]

        _DEVICE_LOGPROB_SAMPLER = DeviceLogprobSampler
    return _DEVICE_LOGPROB_SAMPLER(inner, vocab, k)


_HOST_SAMPLER = None


def host_sampler(stream_sampler, vocab: int):
    """An exllamav3 Sampler that draws on the host with glm53's own StreamSampler: penalties,
    logit bias, the grammar (glm53.engine.grammar) and logprobs then mean exactly what they mean
    on the CPU engine. It costs one device-to-host copy of the row per token, for the requests
    that ask for these only; every other request samples on the device."""
    global _HOST_SAMPLER
    if _HOST_SAMPLER is None:
        import torch
        from exllamav3.generator.sampler import Sampler

        from glm53.engine.sampling import sample

        class HostSampler(Sampler):
            def __init__(self, ss, vocab):
                super().__init__()
                self.ss, self.vocab = ss, vocab
                self.logprobs: list = []  # one per drawn token, in order, until emitted

            def forward(self, logits, *args, **kwargs):
                row = logits.reshape(-1)[: self.vocab].float().cpu().numpy()[None]
                token = sample(row, [self.ss])[0]
                self.logprobs.append(self.ss.last_logprob)
                return torch.tensor([token], dtype=torch.long).view(logits.shape[:-1])

            def take(self, n: int) -> list:
                done, self.logprobs = self.logprobs[:n], self.logprobs[n:]
                return done if self.ss.num_logprobs is not None else []

        _HOST_SAMPLER = HostSampler
    return _HOST_SAMPLER(stream_sampler, vocab)


def align_prefix_reuse(job, chunk: int, enabled: bool = True) -> None:
    """Restrict an enqueued (not yet started) exllamav3 Job's prefix reuse to its standard region
    (see the module docstring): it matches and publishes page hashes only there, and stashes
    recurrent state only at multiples of `chunk` there (`enabled` False: nowhere). Instance
    attributes only: exllamav3's classes are untouched."""
    seq = job.sequences[0]
    std_pages = standard_region(len(seq.sequence_ids), chunk) // PAGE if enabled else 0
    dropped = len(seq.page_hashes) - std_pages
    if dropped > 0:
        # pages past the region are allocated as fresh pages under random hashes, as exllamav3
        # does for generated tokens, and prefill's rehash of full prompt pages skips them
        seq.page_hashes = seq.page_hashes[:std_pages]
        seq.new_unique_pages += dropped
        job.all_unique_hashes = list(set(seq.page_hashes))
    hash_page = job.hash_completed_page
    stash = job.maybe_stash_recurrent

    def hash_completed_page(seq_, page_idx):
        if page_idx < std_pages:  # pages past the region (decode's too) keep their random hash
            hash_page(seq_, page_idx)

    def maybe_stash_recurrent(cache, interval=None):
        pos = job.sequences[0].kv_position
        if 0 < pos <= std_pages * PAGE and pos % chunk == 0:
            stash(cache, chunk)

    job.hash_completed_page = hash_completed_page
    job.maybe_stash_recurrent = maybe_stash_recurrent


class GpuEngine:
    name = "gpu"
    is_model = True
    drives_jobs = True  # the scheduler submits requests (glm53.engine.base.JobEngine)
    verify_tiers = None  # exact mode has no tier check; nvme-exact sets one (_start_nvme)

    def __init__(
        self,
        model_dir: str,
        mode: str = "exact",
        context: int = 8192,
        max_batch: int = 4,
        chunk_size: int = 2048,
        ec_max_slots: int | None = None,
        ec_reserve_gb: float = 1.0,
        ec_stage_gb: float | None = None,
        ec_freq_window: int | None = None,
        prefix_cache: bool = True,
        recurrent_cache_gb: float = 4.0,
        cache_tokens: int | None = None,
        vram_budget: int | None = None,
        device: str = "cuda:0",
        allow_unsupported: bool = False,
        heat_file: str | None = None,
        warmup: bool = False,
        gpus: tuple[int, ...] | None = None,
        store: str | None = None,
        ram_cap: int | None = None,
        read_timeout_s: float | None = 30.0,
        lane_cpus: str | None = None,
        lane_threads: int | None = None,
        lane_precision: str = "fast",
        ct_b: float | None = None,
        prefill: str = "chunk",
        cache_dir: str | None = None,
    ):
        # nvme-exact (the RAM tier over --store as the experts' home) and fast (exact mode's
        # tiers + the CPU lane, glm53.tiers.fast_lane) are accepted here; serve runs them only
        # with --allow-unrun-modes until their GPU tests have passed (create)
        if mode not in ("exact", "stock", "zerocopy", "nvme-exact", "fast"):
            raise ValueError(
                f"mode {mode!r}: the GPU engine runs 'exact', 'fast' and 'nvme-exact' (and the "
                "reference modes 'stock' and 'zerocopy'); 'nvme' (nvme-exact with the CPU lane) "
                "is not wired in yet"
            )
        if chunk_size % PAGE:
            raise ValueError(
                f"--chunk-size {chunk_size}: the GPU engine needs a multiple of {PAGE} "
                "(exllamav3's page size)"
            )
        if prefill not in ("chunk", "layer-major") or (prefill != "chunk" and mode != "exact"):
            raise ValueError(f"prefill {prefill!r}: chunk, or layer-major in exact mode")
        self.prefill = prefill  # layer-major: glm53.engine.layer_major_gpu (not yet run on a GPU)
        self.layer_major = None
        self.model_dir, self.mode, self.device = model_dir, mode, device
        self.context_length, self.num_slots, self.chunk_size = context, max_batch, chunk_size
        self.ec_max_slots, self.ec_reserve_gb = ec_max_slots, ec_reserve_gb
        self.ec_stage_gb, self.ec_freq_window = ec_stage_gb, ec_freq_window
        self.prefix_cache, self.recurrent_cache_gb = prefix_cache, recurrent_cache_gb
        pages = -(-context // PAGE)
        self.cache_tokens = cache_tokens or max_batch * pages * PAGE
        self.allow_unsupported = allow_unsupported
        self.vram_budget = vram_budget  # bytes: plan the cache, staging and KV as on that card
        self.heat_file = heat_file
        self.cache_dir = cache_dir  # heat lists live here (glm53.config.cache_dir; None: default)
        self.warmup = warmup
        self.store, self.ram_cap, self.read_timeout_s = store, ram_cap, read_timeout_s
        self.tier_check = None  # nvme-exact: the latest glm53.tiers.check.TierCheck
        # fast: the lane's CPUs (--cpus, --cpu-threads), its precision, --ct-b; the FastLane
        self.lane_cpus, self.lane_threads = lane_cpus, lane_threads
        self.lane_precision, self.ct_b = lane_precision, ct_b
        self.fast = None
        self.warmup_failed: list[str] = []  # labels of exllamav3 warm-up passes that raised
        if gpus is not None and len(gpus) == 1:
            device = f"cuda:{gpus[0]}"  # one entry: the one-GPU path on that GPU
        self.device = device
        # two or more entries: the layers split over them (glm53.engine.exl3_split; not yet
        # run on a GPU)
        self.gpus = tuple(gpus) if gpus is not None and len(gpus) > 1 else None
        self.description = f"GPU engine (exllamav3 1.6.5 Generator, mode {mode}) on {model_dir}"
        if self.gpus:
            self.description += f", layers split over GPUs {','.join(map(str, self.gpus))}"
        if mode == "fast":
            self.description += " (fast mode: not yet run on a GPU)"
        if prefill == "layer-major":
            self.description += ", layer-major prefill (not yet run on a GPU)"
        self.generation_defaults: dict[str, float] = {}
        self.loaded = None
        self.generator = None
        self._jobs: dict[Any, Any] = {}  # key -> exllamav3 Job
        self._scored: list[JobOutput] = []  # prompts scored at start, nothing to generate
        self._pending_prompt_logits: dict[Any, Any] = {}  # key -> logits, out with "started"
        self._keys: dict[int, Any] = {}  # id(exllamav3 Job) -> key
        self._lock = threading.Lock()
        self._stats = {
            "iterations": 0,
            "jobs_started": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "cached_tokens": 0,
            "iterate_s": 0.0,
        }

    # --- life cycle ----------------------------------------------------------------------------
    def load(self) -> None:
        # exllamav3 is imported by exl3_load.load, after nvme-exact's refusals (store,
        # fingerprint, --ram-cap): those come first, also where exllamav3 is not installed
        from glm53.engine import exl3_load
        from glm53.engine.tokenizer import CheckpointTokenizer, read_generation_defaults

        self.tokenizer = CheckpointTokenizer.from_dir(self.model_dir)
        self.generation_defaults = read_generation_defaults(self.model_dir)
        self.loaded = exl3_load.load(
            self.model_dir,
            "exact" if self.mode == "fast" else self.mode,  # fast: exact's tiers + the lane
            device=self.device,
            cache_tokens=self.cache_tokens,
            max_batch=self.num_slots,
            max_chunk=self.chunk_size,
            ec_max_slots=self.ec_max_slots,
            ec_reserve_gb=self.ec_reserve_gb,
            ec_stage_gb=self.ec_stage_gb,
            ec_freq_window=self.ec_freq_window,
            allow_unsupported=self.allow_unsupported,
            vram_budget=self.vram_budget,
            gpus=list(self.gpus) if self.gpus else None,
            store=self.store,  # these three: nvme-exact only
            ram_cap=self.ram_cap,
            read_timeout_s=self.read_timeout_s,
        )
        if self.warmup:
            # exllamav3 picks its GEMM kernels (the cooperative autotuner, keyed by row count up to
            # 64 rows) and its Triton KDA configs by timing them at first use, and rounding follows
            # the pick. Its warm-up makes every pick now, before any request, and both tuners keep
            # their picks on disk (exllamav3's tune cache, Triton's cache): every request of this
            # process, a restart, and a stock exllamav3 sharing those caches run the same kernels
            t0 = time.perf_counter()
            self.warmup_failed = self.loaded.model.warmup(
                cache=self.loaded.cache, max_chunk_size=self.chunk_size,
                max_batch_size=self.num_slots,
            ) or []  # fmt: skip
            log.info(
                "exllamav3 warm-up in %.1f s%s", time.perf_counter() - t0,
                f"; passes that raised: {self.warmup_failed}" if self.warmup_failed else "",
            )  # fmt: skip
        from exllamav3 import Generator

        self.generator = Generator(
            model=self.loaded.model,
            cache=self.loaded.cache,
            tokenizer=self.loaded.tokenizer,
            **generator_settings(self.num_slots, self.chunk_size, self.recurrent_cache_gb),
        )
        if self.prefill == "layer-major":
            self._start_layer_major()
        self.heat_file = self.heat_file or exl3_load.heat_path(self.model_dir, self.cache_dir)
        if self.mode == "fast":
            self._start_fast()
        if self.loaded.nvme is not None:
            self._start_nvme()
        elif self.loaded.ec is not None and os.path.isfile(self.heat_file):
            with open(self.heat_file) as f:
                self.loaded.ec.seed(json.load(f)["keys"])

    def _start_layer_major(self) -> None:
        from glm53.engine.layer_major_gpu import LayerMajorPrefill

        with open(os.path.join(self.model_dir, "config.json"), encoding="utf-8") as f:
            text_config = json.load(f)["text_config"]
        self.layer_major = LayerMajorPrefill(
            self.loaded, self.generator, self.chunk_size, text_config,
            int(self.ec_reserve_gb * GIB), self.device,
        )  # fmt: skip

    def _start_fast(self) -> None:
        """fast (not yet run on a GPU): the CPU lane over the pinned home, the hooks, the router
        (glm53.tiers.fast_lane)."""
        from glm53.tiers.cpu_lane import CpuLane, lane_layout
        from glm53.tiers.fast_lane import start_fast

        layout = lane_layout(self.lane_cpus, self.lane_threads, _pci_address(self.device))
        cpu = CpuLane(layout, precision=self.lane_precision)
        self.fast = start_fast(self.loaded, self.model_dir, cpu, ct_b=self.ct_b)
        log.info("fast mode (not yet run on a GPU): %s", cpu.describe())

    def _start_nvme(self) -> None:
        """nvme-exact: warm start (the RAM tier's heat list, then the VRAM cache's among the keys
        now in RAM), then the tier check; a bad count refuses to serve. /admin/verify repeats
        the check (verify_tiers, an attribute in this mode only: exact mode has no tier check)."""
        from glm53.engine.base import EngineUnavailable
        from glm53.tiers.heat import heat_path, read_heat

        nvme = self.loaded.nvme
        self.ram_heat_file = heat_path(self.model_dir, "ram", self.store, cache_dir=self.cache_dir)
        vram = []
        if os.path.isfile(self.heat_file):
            with open(self.heat_file) as f:
                vram = json.load(f)["keys"]
        warm = nvme.warm_start(read_heat(self.ram_heat_file, nvme.tier.num_keys), vram)
        log.info("nvme-exact warm start: %s", warm)
        self.verify_tiers = self._verify_nvme
        result = self.verify_tiers(64)
        (log.info if result.is_ok else log.error)("tier check at start: %s", result.summary())
        if not result.is_ok:  # closed without writing heat lists of tiers that failed
            self.generator.close()
            self.generator = None
            self.loaded.close()
            self.loaded = None
            raise EngineUnavailable(
                f"the tier check at start failed, so glm53 does not serve: {result.summary()}; "
                f"check the store with `glm53 store verify --store {self.store}` and repack it"
            )

    def _verify_nvme(self, num_samples: int):
        with self.loaded.nvme.lock:
            self.tier_check = self.loaded.nvme.verify(num_samples)
        return self.tier_check

    def close(self) -> None:
        if self.loaded is None:
            return
        self.save_heat()
        for key in list(self._jobs):
            self.cancel(key)
        if self.generator is not None:
            self.generator.close()
            self.generator = None
        if self.fast is not None:
            from glm53.tiers.fast_lane import stop_fast

            stop_fast(self.fast, self.loaded)
            self.fast = None
        self.loaded.close()
        self.loaded = None

    # --- requests ------------------------------------------------------------------------------
    def start(
        self, key, request, max_new_tokens: int, sampler=None, *, return_logits: bool = False
    ) -> None:
        """Enqueue `request` (a glm53 GenerationRequest) as an exllamav3 Job under `key`.
        `sampler` is the scheduler's StreamSampler: a request it must process (penalties, logit
        bias, grammar, logprobs) samples through it on the host. `return_logits` hands back the
        logits each token was sampled from (JobOutput.logits), as exllamav3 returns them."""
        import torch
        from exllamav3 import Job

        if key in self._jobs:
            raise EngineError(f"job {key!r} is already running")
        prompt_logits = None
        if request.prompt_logprobs is not None:
            prompt_logits = self._prompt_logits(request.prompt_ids)
            if max_new_tokens == 0:  # scored, nothing to generate
                self._scored.append(
                    JobOutput(
                        key,
                        [],
                        prompt_logits=prompt_logits,
                        finish=FinishReason.LENGTH,
                        cached_tokens=0,
                    )
                )
                return
        n = len(request.prompt_ids)
        if n + max_new_tokens > self.context_length:
            raise EngineError(
                f"{n} prompt tokens + {max_new_tokens} new exceed the context of "
                f"{self.context_length} tokens (--context)"
            )
        seed = request.sampling.seed
        if sampler is not None and sampler.is_processed and only_logprobs(sampler):
            exl_sampler = device_logprob_sampler(
                exllamav3_sampler(request.sampling), self.tokenizer.vocab_size, sampler.num_logprobs
            )
        elif sampler is not None and sampler.is_processed:
            exl_sampler = host_sampler(sampler, self.tokenizer.vocab_size)
        else:
            exl_sampler = exllamav3_sampler(request.sampling)
        job = Job(
            input_ids=torch.tensor([request.prompt_ids], dtype=torch.long),
            max_new_tokens=max_new_tokens,
            sampler=exl_sampler,
            seed=None if seed is None else seed & 0x7FFFFFFF,
            stop_conditions=sorted(request.stop_token_ids),
            return_logits=return_logits,
            identifier=key,
        )
        self.generator.enqueue(job)
        align_prefix_reuse(job, self.chunk_size, self.prefix_cache)
        if self.layer_major is not None:
            self.layer_major.watch(job)
        if prompt_logits is not None:
            self._pending_prompt_logits[key] = prompt_logits
        self._jobs[key] = job
        self._stats["jobs_started"] += 1

    def _prompt_logits(self, prompt_ids):
        """Every prompt position's logits from one cache-free forward of the prompt: what
        `glm53 reference make --engine stock-exllamav3` computes on stock exllamav3, so exact
        mode scores a panel made there with KL 0. Outside the Generator: its pages and state are
        untouched. A prompt too long for the card's activations fails this request only."""
        import torch

        nvme = self.loaded.nvme  # nvme-exact: the forward reads the store, under the tiers' lock
        params = {}
        if self.fast is not None:  # fast: scoring stays exact, as prefill does
            from glm53.tiers.fast_hooks import NO_LANE

            params[NO_LANE] = True
        try:
            with nvme.lock if nvme is not None else contextlib.nullcontext():
                ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
                logits = self.loaded.model.forward(ids, params)[0, :, : self.tokenizer.vocab_size]
                if nvme is not None:
                    nvme.check_table_bad()
            return logits.float().cpu()
        except Exception as exc:
            raise EngineError(f"scoring the prompt (prompt logprobs) failed: {exc}") from exc

    def cancel(self, key) -> None:
        self._pending_prompt_logits.pop(key, None)
        self._scored = [o for o in self._scored if o.key != key]
        job = self._jobs.pop(key, None)
        if job is not None:
            if self.layer_major is not None:
                self.layer_major.cancel(job)  # its pass's streams and lent slots, now
            self.generator.cancel(job)

    def has_work(self) -> bool:
        return bool(self._jobs or self._scored)

    def iterate(self) -> list[JobOutput]:
        """One Generator iteration; the new tokens of every job that produced some. An exception
        out of exllamav3 fails every job (EngineError without keys); a job exllamav3 reaped (its
        own per-job error) fails alone."""
        import torch

        t0 = time.perf_counter()
        nvme = self.loaded.nvme
        try:
            if self.layer_major is not None:
                self.layer_major.step()  # one module of a layer-major pass, then the decode
            if nvme is None:
                results = self.generator.iterate()
            else:  # the tiers' owner; a read fault names its layer and expert
                with nvme.lock:
                    results = self.generator.iterate()
                    nvme.check_table_bad()
        except Exception as exc:
            raise EngineError(f"exllamav3 Generator.iterate failed: {exc}") from exc
        if self.fast is not None:  # the router's budgets for the next decode step
            with self._lock:
                self.fast.step()
        if self.layer_major is not None:
            self.layer_major.after_iterate(any("token_ids" in r for r in results))
        vocab = self.tokenizer.vocab_size
        outs: dict[Any, JobOutput] = {o.key: o for o in self._scored}
        self._scored = []
        for r in results:
            key = r.get("identifier")
            if key not in self._jobs:
                continue
            stage = r["stage"]
            if stage == "error":
                self._jobs.pop(key, None)
                outs[key] = JobOutput(
                    key, [], finish=FinishReason.ERROR, error=f"engine error: {r['error']}"
                )
                continue
            if stage == "started":
                job = self._jobs[key]
                cached = job.cached_pages * PAGE + job.cached_tokens
                self._stats["cached_tokens"] += cached
                self._stats["prefill_tokens"] += len(job.sequences[0].sequence_ids) - cached
                out = outs.setdefault(key, JobOutput(key, []))
                out.cached_tokens = cached
                out.prompt_logits = self._pending_prompt_logits.pop(key, None)
                continue
            if stage != "streaming":
                continue
            out = outs.setdefault(key, JobOutput(key, []))
            job = self._jobs[key]
            for part in (r, r.get("held") if r.get("eos") else None):
                if not part or "token_ids" not in part:
                    continue
                ids = part["token_ids"].view(-1).tolist()
                out.token_ids.extend(ids)
                take = getattr(job.sampler, "take", None)
                drawn = take(len(ids)) if take is not None else []
                if drawn:  # a host or device logprob sampler: its entries, in the order drawn
                    out.logprobs = (out.logprobs or []) + drawn
                if "logits" in part:
                    rows = part["logits"][0, :, :vocab].float()
                    out.logits = rows if out.logits is None else torch.cat((out.logits, rows))
            if r.get("eos"):
                self._jobs.pop(key, None)
                reason = r.get("eos_reason")
                out.finish = FinishReason.STOP if reason == "stop_token" else FinishReason.LENGTH
        self._stats["iterations"] += 1
        self._stats["decode_tokens"] += sum(len(o.token_ids) for o in outs.values())
        self._stats["iterate_s"] += time.perf_counter() - t0
        return list(outs.values())

    # --- introspection -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = dict(self._stats)
        out["chunk_size"] = self.chunk_size
        out["prefix_cache"] = self.prefix_cache
        out["prefill"] = self.prefill
        if self.layer_major is not None:
            out["layer_major"] = self.layer_major.stats()
        out["warmup"] = {"ran": self.warmup, "passes_that_raised": list(self.warmup_failed)}
        if self.loaded is not None and self.loaded.ec is not None:
            with self._lock:
                out["tiers"] = {"vram_cache": self.loaded.ec.state()}
                if self.loaded.nvme is not None:
                    out["tiers"]["ram"] = self.loaded.nvme.stats()
                    if self.tier_check is not None:
                        out["tiers"]["check"] = self.tier_check.counts()
                if self.fast is not None:
                    out["lane"] = self.fast.stats()
        return out

    def save_heat(self) -> str | None:
        """Write the cache's keys, hottest first, as the warm-start heat list."""
        if self.loaded is None or self.loaded.ec is None:
            return None
        from glm53.tiers.heat import write_heat

        write_heat(self.heat_file, self.model_dir, self.loaded.ec.heat_list())
        nvme = self.loaded.nvme
        if nvme is not None:
            with nvme.lock:  # the tier's owner is the engine thread
                keys = nvme.tier.heat_list() if nvme.tier.clock.n_used else []
            if keys:
                write_heat(self.ram_heat_file, self.model_dir, keys)
        return self.heat_file


def generator_settings(max_batch: int, chunk: int, recurrent_cache_gb: float) -> dict:
    """The Generator arguments glm53 uses, shared by the engine and by the GPU tests' reference
    Generator (stock exllamav3 at these settings is what exact mode must equal)."""
    return {
        "max_batch_size": max_batch,
        "max_chunk_size": chunk,
        # full chunks cut at multiples of `chunk` also while other jobs decode (module docstring)
        "shared_chunk_size": chunk,
        "prefill_cooldown": 0,
        "recurrent_cache_size": int(recurrent_cache_gb * GIB),
        "recurrent_checkpoint_interval": chunk,
        "recurrent_checkpoint_interval_pp": chunk,
    }


# The tier modes this build's GPU engine serves (glm53 doctor recommends only these): fast is
# wired in but has not yet run on a GPU (only with --allow-unrun-modes); nvme needs the CPU lane
# and the store wired in together, which has not landed.
SERVED_MODES = ("exact",)


# Paths written but not yet run on a GPU: served only with --allow-unrun-modes (for their GPU
# tests). mode -> what it is, for the refusal.
UNRUN_MODES = {
    "nvme-exact": "the GPU engine's nvme-exact (the RAM tier over --store as the experts' home)",
    "fast": "the GPU engine's fast mode (exact mode's tiers + the CPU lane taking the coldest "
    "decode misses, docs/fast-mode.md)",
}


def _unrun(what: str, instead: str):
    from glm53.config import ConfigurationError

    return ConfigurationError(
        f"{what} is written but has not yet run on a GPU, so serve refuses it; "
        f"--allow-unrun-modes runs it anyway (for its GPU tests). {instead}"
    )


def _pci_address(device) -> str | None:
    """The CUDA device's PCI address in sysfs form (0000:3b:00.0), from torch's device
    properties; None where this torch does not give it."""
    import torch

    return pci_address_of(torch.cuda.get_device_properties(torch.device(device)))


def pci_address_of(props) -> str | None:
    """torch's CUDA device properties (pci_domain_id, pci_bus_id, pci_device_id) as a sysfs
    PCI address; None where one is missing."""
    parts = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if any(not isinstance(x, int) for x in parts):
        return None
    domain, bus, dev = parts
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def _common(settings) -> dict:
    """The GpuEngine arguments every mode takes from the settings."""
    from glm53.config import cache_dir

    return {
        "cache_dir": str(cache_dir(settings)),
        "context": settings.context,
        "max_batch": settings.max_batch,
        "chunk_size": settings.chunk_size,
        "ec_max_slots": settings.ec_max_slots,
        "ec_reserve_gb": settings.ec_reserve_gb,
        "ec_freq_window": settings.ec_freq_window,
        "vram_budget": settings.vram_budget,
        "warmup": settings.warmup,
        "gpus": settings.gpus,
    }


def _refuse_split(settings, mode: str) -> None:
    from glm53.config import ConfigurationError

    if settings.gpus is not None and len(settings.gpus) > 1:
        raise ConfigurationError(
            f"--gpus {','.join(map(str, settings.gpus))}: {mode} runs on one GPU; name one"
        )


def _refuse_chunk(settings) -> None:
    from glm53.config import ConfigurationError

    if settings.chunk_size % PAGE:
        raise ConfigurationError(
            f"--chunk-size {settings.chunk_size}: the GPU engine needs a multiple of {PAGE} "
            f"(exllamav3's page size), e.g. {max(PAGE, settings.chunk_size // PAGE * PAGE)}"
        )


def _refuse_layer_major(settings, mode: str) -> None:
    """--prefill layer-major: exact mode on one GPU, and only with --allow-unrun-modes until
    tests/gpu/test_layer_major_gpu.py has passed."""
    from glm53.config import ConfigurationError

    if settings.prefill == "chunk":
        return
    if mode != "exact":
        raise ConfigurationError(
            f"--prefill layer-major runs in exact mode only (its staging and expert cache); "
            f"--mode {settings.mode} prefills chunk by chunk: leave --prefill out"
        )
    if settings.gpus is not None and len(settings.gpus) > 1:
        raise ConfigurationError(
            f"--prefill layer-major runs on one GPU; --gpus {','.join(map(str, settings.gpus))} "
            "names more"
        )
    if not settings.allow_unrun_modes:
        raise _unrun(
            "--prefill layer-major (every chunk through a layer before the next, "
            "docs/layer-major.md)",
            "Leave --prefill out (chunk).",
        )


def create(settings, checkpoint_dir) -> GpuEngine:
    """The GPU engine for these Settings (not loaded)."""
    from glm53.config import ConfigurationError

    mode = "exact" if settings.mode in ("auto", "exact") else settings.mode
    if settings.gpus is not None and len(settings.gpus) > 1 and not settings.allow_unrun_modes:
        raise _unrun(
            f"--gpus {','.join(map(str, settings.gpus))}: the layer split over several GPUs "
            "(docs/multi-gpu.md)",
            "Name one GPU, or run one replica per GPU behind a router (docs/fleet.md).",
        )
    if mode in UNRUN_MODES and not settings.allow_unrun_modes:
        raise _unrun(f"--mode {mode}: {UNRUN_MODES[mode]}", "Use --mode exact.")
    _refuse_layer_major(settings, mode)
    if mode == "nvme-exact":
        return _create_nvme_exact(settings, checkpoint_dir)
    if mode == "fast":
        return _create_fast(settings, checkpoint_dir)
    if mode not in SERVED_MODES:
        raise ConfigurationError(
            f"--mode {settings.mode}: this build's GPU engine serves exact mode only (VRAM cache + "
            "pinned RAM, bit-identical to stock exllamav3); nvme mode needs the CPU lane and the "
            "store wired into the GPU engine together, which has not landed. Use --mode exact "
            "(or --mode nvme-exact / fast with --allow-unrun-modes, not yet run on a GPU)."
        )
    if settings.store:
        raise ConfigurationError(
            f"--store {settings.store}: exact mode keeps every routed expert in pinned RAM and "
            "does not read a store; leave --store out"
        )
    _refuse_chunk(settings)
    return GpuEngine(
        str(checkpoint_dir),
        mode,
        ec_stage_gb=settings.ec_stage_gb,
        **_common(settings),
        prefill=settings.prefill,
    )


def _create_fast(settings, checkpoint_dir) -> GpuEngine:
    """fast under --allow-unrun-modes: exact mode's settings plus the lane's (--cpus,
    --cpu-threads, --ct-precision: auto is fast here) and --ct-b for the router. The lane's
    CPUs are resolved now, so a bad --cpus is refused before anything loads."""
    from glm53.config import ConfigurationError
    from glm53.tiers.cpu_lane import LaneConfigError, lane_layout, lane_precision

    if settings.store:
        raise ConfigurationError(
            f"--store {settings.store}: fast mode keeps every routed expert in pinned RAM, as "
            "exact mode does, and does not read a store; leave --store out"
        )
    _refuse_split(settings, "fast mode")
    _refuse_chunk(settings)
    try:
        lane_layout(settings.cpus, settings.cpu_threads)
        precision = lane_precision(settings.ct_precision, "gpu", "fast")
    except LaneConfigError as exc:
        raise ConfigurationError(str(exc)) from None
    return GpuEngine(
        str(checkpoint_dir),
        "fast",
        ec_stage_gb=settings.ec_stage_gb,
        lane_cpus=settings.cpus,
        lane_threads=settings.cpu_threads,
        lane_precision=precision,
        ct_b=settings.ct_b,
        **_common(settings),
    )


def _create_nvme_exact(settings, checkpoint_dir) -> GpuEngine:
    """nvme-exact under --allow-unrun-modes: exact mode's settings (no prefill staging) plus the
    store, --ram-cap and the read timeout (the refusals happen at load, before anything loads)."""
    from glm53.config import ConfigurationError

    if not settings.store:
        raise ConfigurationError(
            "--mode nvme-exact reads the routed experts from a packed store: pass --store DIR "
            "(`glm53 store pack`)"
        )
    _refuse_split(settings, "nvme-exact")
    return GpuEngine(
        str(checkpoint_dir),
        "nvme-exact",
        store=settings.store,
        ram_cap=settings.ram_cap,
        read_timeout_s=settings.read_timeout,
        **_common(settings),
    )
