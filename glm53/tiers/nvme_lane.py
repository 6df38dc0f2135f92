"""nvme mode's CPU lane over the RAM tier: which picks the lane may take, which table it reads,
and why no record it reads is overwritten while its result can still be used.

nvme mode is nvme-exact (glm53.tiers.gpu_home: the RAM tier is the experts' home, the store
behind it) plus fast mode's lane (glm53.tiers.fast_lane: the same mailboxes, router, bounded
wait and fallback; glm53.exl3.fast_hooks). Only what differs is here:

- **Eligibility.** A decode pick may go to the lane only when the VRAM cache misses it AND the
  RAM tier holds it. The device reads that at publish time from `key_lane` (int32 per key, in
  VRAM): the key's RAM slot, -1 when the tier does not hold it (cuda/lane_cuda.h's key_lane). A
  pick in neither tier is never the lane's: it is read from the store and computed on the GPU,
  the nvme-exact path. `key_lane` is written with the device home table, from the same
  HomeUpdate (`lane_slots`), so the two always agree: a key has a RAM slot exactly when its
  home is not `absent`.
- **Table.** The lane's expert table is the RAM tier's own (`RamTier.table`, one entry per
  slot, pointed at the slot's record each time a record is read into it: ram_tier._point), one
  table for every layer; a pick's `expert` field carries its slot. Entries of slots never read
  into are pointed at their own (zero) record first (`ram_lane_tables`), since the lane checks
  an entry when it binds a layer; no job reads them (no key maps to a free slot).
- **Residency for the fallback.** The routing hook resolves and points the selection as routed
  (the lane's picks included, from the publish's saved copy), so a lane pick's table entries on
  the device point at its RAM home: a stalled lane's fallback (exllamav3's MoE call on the saved
  selection) reads the same record the lane read, as nvme-exact would.

## Ordering: no RAM record the lane reads is overwritten while its result can be used

Only the engine thread writes the RAM tier (every eviction and read-in is in RamHome.resolve,
called from the routing hook, and in the warm start before serving), and it does so only after
the host synced on that layer's router output. exllamav3 runs a model on one stream, so each
layer's kernels run in order: publish(L) -> [host sync; resolve(L)] -> MoE(L) -> wait(L) ->
fallback MoE(L) -> select(L) -> ... -> publish(L+1) -> [host sync; resolve(L+1)].

Let job J be the lane's job published at layer L of step t, on slots S(J). The lane reads the
records of S(J) (and their table entries) from when it sees J's seq until it stores done = seq.
The device uses J's partial only in wait(L, t), and only if done == seq arrives before the
wait's budget ends. So J's records must stay put from publish(L, t) until wait(L, t) ends.
- resolve(L, t) runs inside that window (after publish(L, t), before MoE(L, t) is enqueued).
  It resolves the selection as routed, so S(J)'s keys are hits of its wave, and the tier never
  evicts a slot of the wave it is filling (RamTier.make_resident / Clock.batch_into). S(J)
  stays.
- Every later resolve (layer L+1 of step t, or any layer of a later step) runs after a host sync
  on a stream on which wait(L, t) came earlier: wait(L, t) has ended. Either it saw done == seq,
  and the lane had finished reading S(J) before it stored done; or it timed out, and J's result
  is never used (the device never reads a done of an older seq; the lane drops a result whose
  seq moved on: pyx/lane_mailbox.h). A lane still computing J then may read a record being
  overwritten: its output is garbage that is dropped, and every pointer it reads stays inside
  the tier's arena (table entries are views into records; ExpertTable.set frees nothing).
- The warm start and the tier check run while no decode step is in flight (before serving, and
  under the tiers' lock between iterations); the check only reads.
- Keys whose reads timed out stay `absent` in the home table (RamHome.expected) and so -1 in
  key_lane: the lane never takes a record whose bytes are not trusted.
Hence no record is pinned per step: the wave rule and the stream order pin it.

The router is fast mode's, unchanged: its n_miss counts every VRAM miss (the device takes at most
the eligible ones, so fewer than the split allows when some are not in RAM: the lane then ends
sooner than the router planned), and a decode call that read from the store is not timed for
the router's GPU rates (its host wait for the read would count as GPU time).

Torch-free; CI tests it with the real RAM tier, store and lane (tests/test_nvme_lane.py).
"""

from __future__ import annotations

import numpy as np

from glm53.tiers.expert_source import record_views
from glm53.tiers.ram_tier import RamTier


def lane_slots(addresses, absent: int, arena_address: int, slot_bytes: int) -> np.ndarray:
    """key_lane's values for home-table writes: the RAM slot of each address (the tier's arena
    at `arena_address`, records of `slot_bytes`), -1 for `absent`."""
    addresses = np.asarray(addresses, dtype=np.int64)
    out = np.full(addresses.shape, -1, dtype=np.int32)
    here = addresses != absent
    off = addresses[here] - arena_address
    if (off < 0).any() or (off % slot_bytes).any():
        raise ValueError("a home address that is not a RAM-tier record start")
    out[here] = off // slot_bytes
    return out


def ram_lane_tables(tier: RamTier, n_layers: int) -> list:
    """The lane's table for each of `n_layers` MoE layers: the RAM tier's own, after every
    entry never set is pointed at its slot's record (the store's records share one layout)."""
    layout = next(iter(tier.source.layouts.values()))
    for slot in range(tier.num_slots):
        if tier.table.addresses(slot)[0] == 0:
            tier.table.set(slot, *record_views(tier.record(slot), layout))
    return [tier.table] * n_layers
