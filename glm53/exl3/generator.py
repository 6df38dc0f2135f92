"""exllamav3 1.6.5's Generator, its Jobs and their samplers, as the GPU engine makes them.

A request that needs no host-side processing samples with exllamav3's own sampler
(`exllamav3_sampler`); one whose only host-side work is logprobs draws the same way and computes
its logprobs on the device (`device_logprob_sampler`); one with penalties, logit bias or a
grammar draws on the host with glm53's own sampler (`host_sampler`). The last two subclass
exllamav3's Sampler (glm53.exl3.sampler_classes, imported only when one is made).
"""

from __future__ import annotations

from collections.abc import Callable

from glm53.exl3.prefix import generator_settings


def make_generator(loaded, max_batch: int, chunk: int, recurrent_cache_gb: float):
    """The Generator over a load (glm53.exl3.loader), at glm53's settings (generator_settings)."""
    from exllamav3 import Generator

    return Generator(
        model=loaded.model,
        cache=loaded.cache,
        tokenizer=loaded.tokenizer,
        **generator_settings(max_batch, chunk, recurrent_cache_gb),
    )


def make_job(prompt_ids, max_new_tokens: int, sampler, seed, stop_token_ids, return_logits, key):
    """An exllamav3 Job for one request (not enqueued)."""
    import torch
    from exllamav3 import Job

    return Job(
        input_ids=torch.tensor([prompt_ids], dtype=torch.long),
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        seed=seed,
        stop_conditions=stop_token_ids,
        return_logits=return_logits,
        identifier=key,
    )


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


def request_sampler(sampling, stream_sampler, vocab: int, *, logprobs, unpack, sample):
    """The exllamav3 sampler of one request: `stream_sampler` is the scheduler's StreamSampler
    (None: none); a request it must process (penalties, logit bias, grammar, logprobs) samples
    through it on the host, or, when logprobs are its only processing, on the device."""
    if stream_sampler is not None and stream_sampler.is_processed:
        if only_logprobs(stream_sampler):
            return device_logprob_sampler(
                exllamav3_sampler(sampling), vocab, stream_sampler.num_logprobs, logprobs, unpack
            )
        return host_sampler(stream_sampler, vocab, sample)
    return exllamav3_sampler(sampling)


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


def device_logprob_sampler(inner, vocab: int, k: int, logprobs: Callable, unpack: Callable):
    """An exllamav3 Sampler that draws with `inner` (exllamav3_sampler: the same tokens as the
    request without logprobs) and computes each draw's logprobs on the device (`logprobs`,
    glm53.engine.logprobs.device_logprobs): the Generator's one synchronize per iteration covers
    them, and only 1 + 2k numbers per token cross to the host. `take(n)` hands back the first n
    drawn tokens' TokenLogprobs (`unpack`)."""
    from glm53.exl3.sampler_classes import DeviceLogprobSampler

    return DeviceLogprobSampler(inner, vocab, k, logprobs, unpack)


def host_sampler(stream_sampler, vocab: int, sample: Callable):
    """An exllamav3 Sampler that draws on the host with glm53's own StreamSampler (`sample`:
    glm53.engine.sampling.sample): penalties, logit bias, the grammar (glm53.engine.grammar) and
    logprobs then mean exactly what they mean on the CPU engine. It costs one device-to-host copy
    of the row per token, for the requests that ask for these only; every other request samples
    on the device."""
    from glm53.exl3.sampler_classes import HostSampler

    return HostSampler(stream_sampler, vocab, sample)


def decode_row_keys(generator) -> list:
    """The key (Job identifier) of each row of the Generator's decode forward, in row order:
    every active job whose prefill is done, one row per sequence (exllamav3 1.6.5's iterate_gen
    without draft tokens, which glm53 never configures). Read while that forward runs (a read
    fault's routing hook, glm53.exl3.nvme_device): the batch it was built from is unchanged."""
    keys = []
    for job in generator.active_jobs:
        if job.is_prefill_done():
            keys += [job.identifier] * len(job.sequences)
    return keys


def result_key(result: dict):
    """The key (Job identifier) of one of Generator.iterate's results. exllamav3 1.6.5 leaves
    `identifier` out of the error result of a job it reaped (reap_failed_job: a job whose
    prefill raised, e.g. an nvme read fault) and names the job there instead."""
    if "identifier" in result:
        return result["identifier"]
    return getattr(result.get("job"), "identifier", None)
