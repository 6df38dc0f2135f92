"""Prefix reuse inside exllamav3 1.6.5's Generator, made independent of what the cache held.

The Generator reuses cached KV pages and recurrent (KDA) state
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

from glm53.exl3.patches import assign, shadow
from glm53.units import GIB

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
        assign(seq, "Sequence.page_hashes", seq.page_hashes[:std_pages])
        assign(seq, "Sequence.new_unique_pages", seq.new_unique_pages + dropped)
        assign(job, "Job.all_unique_hashes", list(set(seq.page_hashes)))
    hash_page = job.hash_completed_page
    stash = job.maybe_stash_recurrent

    def hash_completed_page(seq_, page_idx):
        if page_idx < std_pages:  # pages past the region (decode's too) keep their random hash
            hash_page(seq_, page_idx)

    def maybe_stash_recurrent(cache, interval=None):
        pos = job.sequences[0].kv_position
        if 0 < pos <= std_pages * PAGE and pos % chunk == 0:
            stash(cache, chunk)

    shadow(job, "Job.hash_completed_page", hash_completed_page)
    shadow(job, "Job.maybe_stash_recurrent", maybe_stash_recurrent)


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
