"""The prefix cache: engine-state snapshots at prefill chunk boundaries, found by a hash chain.

A snapshot is the whole state of one slot (KV, KDA recurrent and conv state, DSA indexer keys:
whatever the engine keeps per stream) right after a prefill chunk that ended at a multiple of
the chunk size `chunk_tokens`. The scheduler feeds every prompt in chunks cut at those
multiples, counted from position 0 whatever else is running (Scheduler._plan). So a request
that resumes from a snapshot at position p runs exactly the chunks a cold prefill of the same
prompt runs after p, on exactly the state the cold prefill has there, and its tokens and logits
are the cold ones bit for bit. A snapshot is never taken from decode-written positions: the
state after a decode step may round differently from a prefill over the same tokens.

Lookup key: chunk i of a prompt (tokens [i*C, (i+1)*C)) is keyed by
blake2b(key of chunk i-1 || its token ids), so a key names the whole prefix up to its boundary.

Memory is bounded by `capacity_bytes` (--prefix-cache-gb); the least recently used snapshot is
evicted first. A snapshot at boundary p holds the full KV up to p, so a prompt of n tokens
leaves snapshots of C, 2C, .. floor(n/C)*C tokens: about n^2/(2C) token-states in all.

Threading: owned by the scheduler's engine thread; `stats` may be read from any thread (it
copies a few ints).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_KEY_BYTES = 16


def chain_keys(token_ids: Sequence[int], chunk_tokens: int) -> list[bytes]:
    """The hash-chain key of every whole chunk of `token_ids`: keys[i] names tokens [0, (i+1)*C)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    keys, previous = [], b""
    for end in range(chunk_tokens, len(ids) + 1, chunk_tokens):
        digest = hashlib.blake2b(previous, digest_size=_KEY_BYTES)
        digest.update(ids[end - chunk_tokens : end].tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


@dataclass(slots=True)
class Snapshot:
    """One slot's state after `num_tokens` prompt tokens (an engine-owned object) and its size."""

    state: Any
    num_tokens: int
    num_bytes: int


class PrefixCache:
    """Snapshots by chain key, least recently used evicted first past `capacity_bytes`."""

    def __init__(self, chunk_tokens: int, capacity_bytes: int):
        if chunk_tokens < 1 or capacity_bytes < 1:
            raise ValueError(
                f"chunk_tokens ({chunk_tokens}) and capacity_bytes ({capacity_bytes}) must be >= 1"
            )
        self.chunk_tokens = chunk_tokens
        self.capacity_bytes = capacity_bytes
        self._entries: collections.OrderedDict[bytes, Snapshot] = collections.OrderedDict()
        self.num_bytes = 0
        self.counters = {
            "lookups": 0,
            "hits": 0,
            "hit_tokens": 0,
            "stored": 0,
            "evicted": 0,
            "too_large": 0,
        }

    def lookup(self, keys: Sequence[bytes], num_prompt_tokens: int) -> Snapshot | None:
        """The longest snapshot among `keys` that leaves at least one prompt token to run (the
        last prompt position must be computed for its logits); marks it recently used."""
        self.counters["lookups"] += 1
        usable = min(len(keys), (num_prompt_tokens - 1) // self.chunk_tokens)
        for i in range(usable - 1, -1, -1):
            snap = self._entries.get(keys[i])
            if snap is not None:
                self._entries.move_to_end(keys[i])
                self.counters["hits"] += 1
                self.counters["hit_tokens"] += snap.num_tokens
                return snap
        return None

    def has(self, key: bytes) -> bool:
        """Whether `key` is held; a held key becomes the most recently used."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        return False

    def store(self, key: bytes, snap: Snapshot) -> None:
        """Keep `snap` under `key`, evicting the least recently used snapshots to make room. A
        snapshot larger than the whole capacity is not kept (counted as too_large)."""
        if snap.num_bytes > self.capacity_bytes:
            self.counters["too_large"] += 1
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old.num_bytes
        while self._entries and self.num_bytes + snap.num_bytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
            self.counters["evicted"] += 1
        self._entries[key] = snap
        self.num_bytes += snap.num_bytes
        self.counters["stored"] += 1

    def stats(self) -> dict[str, int]:
        return {
            "chunk_tokens": self.chunk_tokens,
            "capacity_bytes": self.capacity_bytes,
            "bytes": self.num_bytes,
            "snapshots": len(self._entries),
            **self.counters,
        }
