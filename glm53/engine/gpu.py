"""The GPU engine: stock exllamav3 1.6.5 (unedited) runs the model through its own `Generator`
(paging, batching, prefill chunking, sampling), so exact mode is exllamav3's generation by
construction; in exact mode the routed experts live in pinned host memory behind the device-side
VRAM expert cache (glm53/exl3/hooks.py), which only rewrites exllamav3's pointer tables.
Implements glm53.engine.base.JobEngine: the scheduler starts and cancels requests, and each
`iterate` runs one Generator iteration (a prefill chunk per prefilling job, then one batched
decode step) and returns the new tokens.

A step loop of glm53's own over the same model was measured to drift from the Generator (logits
0.11 to 0.39 apart at the first generated token, different tokens within 10): the Generator cuts
a prompt's last page into a forward of its own and runs its last token as a decode row, and those
shapes change the rounding. Driving the Generator leaves no such gap to close.

Determinism and prefix reuse: every output is independent of what the prefix cache held
(glm53.exl3.prefix says how).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

from glm53 import exl3
from glm53.engine import gpu_tiers
from glm53.engine.base import EngineError, FinishReason, JobOutput
from glm53.engine.gpu_options import EngineOptions
from glm53.exl3 import PAGE
from glm53.modes import UNRUN_STATUS
from glm53.tiers.heat import read_heat
from glm53.units import GIB

log = logging.getLogger("glm53.engine.gpu")


class GpuEngine:
    name = "gpu"
    is_model = True
    drives_jobs = True  # the scheduler submits requests (glm53.engine.base.JobEngine)
    verify_tiers = None  # exact mode has no tier check; the nvme modes set one (gpu_tiers)

    def __init__(self, model_dir: str, options: EngineOptions | None = None):
        """`options` (glm53.engine.gpu_options.EngineOptions) were checked when they were built;
        None: every default (exact mode)."""
        o = self.options = options if options is not None else EngineOptions()
        self.model_dir, self.mode, self.device, self.gpus = model_dir, o.mode, o.device, o.gpus
        self.context_length, self.num_slots, self.chunk_size = o.context, o.max_batch, o.chunk_size
        self.prefix_cache, self.recurrent_cache_gb = o.prefix_cache, o.recurrent_cache_gb
        self.prefill = o.prefill  # layer-major: glm53.exl3.layer_major
        self.layer_major = None
        self.heat_file, self.warmup = o.heat_file, o.warmup
        self.cache_dir = o.cache_dir  # heat lists live here (glm53.config.cache_dir; None: default)
        self.store = o.store
        self.tier_check = None  # nvme-exact: the latest glm53.tiers.check.TierCheck
        self.fast = None  # fast: the FastLane
        self.warmup_failed: list[str] = []  # labels of exllamav3 warm-up passes that raised
        self.description = f"GPU engine (exllamav3 1.6.5 Generator, mode {o.mode}) on {model_dir}"
        if self.gpus:  # two or more entries: the layers split over them (glm53.exl3.split)
            self.description += f", layers split over GPUs {','.join(map(str, self.gpus))}"
        if self.prefill == "layer-major" and o.load.mode == "nvme-exact":
            self.description += (
                ", layer-major prefill over the RAM tier (its GPU test passed in nvme-exact at "
                "RAM 40 %, H100, 2026-12-05; in exact mode 6 of 6, H200)"
            )
            status = UNRUN_STATUS["store-pass-staging"]
            if o.store_pass_staging:
                self.description += f", each layer staged once per pass ({status})"
            else:
                self.description += (
                    f", each chunk of a pass reading its picks zero-copy (staging each layer once "
                    f"per pass {status}; --allow-unrun-modes turns it on)"
                )
        elif self.prefill == "layer-major":
            self.description += ", layer-major prefill (6 of 6 GPU tests passed, H200, 2026-12-05)"
        if o.nvme_prefetch != "off":
            self.description += (
                f", decode prefetch {o.nvme_prefetch} (GPU tests passed at RAM 40 % and 70 %, "
                "H100, 2026-12-05; not benchmarked)"
            )
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
        # exllamav3 is imported by exl3.load, after nvme-exact's refusals (store,
        # fingerprint, --ram-cap): those come first, also where exllamav3 is not installed
        from glm53.engine.tokenizer import CheckpointTokenizer, read_generation_defaults

        self.tokenizer = CheckpointTokenizer.from_dir(self.model_dir)
        self.generation_defaults = read_generation_defaults(self.model_dir)
        self.loaded = exl3.load(self.model_dir, self.options.load)
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
            if self.loaded.ec is not None:  # its random picks are no traffic: a cold cache,
                self.loaded.ec.empty(forget=True)  # which the heat list below may seed
        self.generator = exl3.make_generator(
            self.loaded, self.num_slots, self.chunk_size, self.recurrent_cache_gb
        )
        if self.prefill == "layer-major":
            self._start_layer_major()
        self.heat_file = self.heat_file or exl3.heat_path(self.model_dir, self.cache_dir)
        if self.mode == "fast":
            gpu_tiers.start_lane(self)
        if self.loaded.nvme is not None:
            gpu_tiers.start_nvme(self)
            if self.mode == "nvme":  # the lane over the warm RAM tier
                gpu_tiers.start_lane(self)
        elif self.loaded.ec is not None:
            keys = read_heat(self.heat_file, self.loaded.ec.num_keys)  # [] without a usable one
            if keys:
                self.loaded.ec.seed(keys)

    def _start_layer_major(self) -> None:
        with open(os.path.join(self.model_dir, "config.json"), encoding="utf-8") as f:
            text_config = json.load(f)["text_config"]
        self.layer_major = exl3.LayerMajorPrefill(
            self.loaded, self.generator, self.chunk_size, text_config,
            int(self.options.ec_reserve_gb * GIB), self.device,
        )  # fmt: skip
        nvme = getattr(self.loaded, "nvme", None)
        if nvme is not None:  # the store modes: each layer staged once per pass, or zero-copy
            nvme.pass_staging = self.options.store_pass_staging

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
            exl3.stop_fast(self.fast, self.loaded)
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
        from glm53.engine.logprobs import device_logprobs, unpack_logprobs
        from glm53.engine.sampling import sample

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
        exl_sampler = exl3.request_sampler(
            request.sampling, sampler, self.tokenizer.vocab_size,
            logprobs=device_logprobs, unpack=unpack_logprobs, sample=sample,
        )  # fmt: skip
        job = exl3.make_job(
            request.prompt_ids, max_new_tokens, exl_sampler,
            None if seed is None else seed & 0x7FFFFFFF, sorted(request.stop_token_ids),
            return_logits, key,
        )  # fmt: skip
        self.generator.enqueue(job)
        exl3.align_prefix_reuse(job, self.chunk_size, self.prefix_cache)
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
            params[exl3.NO_LANE] = True
        try:
            with nvme.lock if nvme is not None else contextlib.nullcontext():
                ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
                try:
                    logits = self.loaded.model.forward(ids, params)
                finally:
                    if nvme is not None:  # a decode prefetch wave left over (a short prompt)
                        nvme.end_forward()
                logits = logits[0, :, : self.tokenizer.vocab_size]
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
            failed = {}
            if self.layer_major is not None:  # one module of a layer-major pass, then decode
                if nvme is None:
                    self.layer_major.step()
                else:  # under the tiers' lock; a store read fault fails the pass's job alone
                    failed = gpu_tiers.step_layer_major_nvme(self, nvme)
            if nvme is None:
                results = self.generator.iterate()
            else:  # the tiers' owner; a decode read fault fails only the jobs that needed it
                results, decode_failed = gpu_tiers.iterate_nvme(self, self.generator, nvme)
                failed.update(decode_failed)
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
            key = exl3.result_key(r)  # a reaped job's error result names the Job only
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
        gpu_tiers.fail_jobs(self, outs, failed)
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
                loan = getattr(self.loaded.stager, "loan", None)
                if loan is not None:  # the staging loan (--ec-stage-loan)
                    out["tiers"]["vram_cache"].update(loan.stats())
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
