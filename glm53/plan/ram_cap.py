"""How large the RAM tier may be: --ram-cap, or planned from the host's memory when it is not set,
and the least it must hold.

The plan follows the seed's rule (measured there: a 55 GiB container cap gave a 42.5 GiB tier
and a 49 to 51 GiB peak): after the non-expert weights are loaded, the tier gets what is left
of the tighter of MemAvailable and the cgroup's `memory.max - memory.current`, less a margin
for what grows while serving (caches, buffers): 3 GiB, 1.5 GiB where that room is under
24 GiB, plus 0.3 GiB. It never takes more than every expert.

The least a tier may hold is the working set of one MoE layer in one decode step: top-k
experts for each of --max-batch streams (at most the layer's experts). Below it a decode step
evicts experts the same step still needs and reads them again, layer after layer.
"""

from __future__ import annotations

from glm53.errors import Glm53Error
from glm53.plan.host_memory import HostMemory
from glm53.units import GIB

SMALL_BELOW_BYTES = 24 * GIB
MARGIN_BYTES = 3 * GIB
SMALL_MARGIN_BYTES = 3 * GIB // 2
EXTRA_BYTES = 3 * GIB // 10


class RamCapError(ValueError, Glm53Error):
    """--ram-cap (given or planned) cannot hold what one decode step needs; says why and the fix."""


def margin_bytes(room_bytes: int) -> int:
    small = room_bytes < SMALL_BELOW_BYTES
    return (SMALL_MARGIN_BYTES if small else MARGIN_BYTES) + EXTRA_BYTES


def working_set_records(top_k: int, max_batch: int, experts_per_layer: int) -> int:
    return min(experts_per_layer, top_k * max_batch)


def planned_cap_bytes(memory: HostMemory, record_bytes: int, num_records: int) -> int:
    """The default --ram-cap: the room left less the margin, at most every record."""
    room = memory.room_bytes()
    return max(0, min(num_records * record_bytes, room - margin_bytes(room)))


def check_cap(
    cap_bytes: int, record_bytes: int, working_set: int, top_k: int, max_batch: int, planned_from=""
) -> None:
    """RamCapError when cap_bytes holds fewer records than one decode step's working set."""
    need = working_set * record_bytes
    if cap_bytes >= need:
        return
    what = (
        f"the RAM tier planned from free memory ({planned_from}) is {cap_bytes / 2**20:.1f} MiB"
        if planned_from
        else f"--ram-cap {cap_bytes} bytes ({cap_bytes / 2**20:.1f} MiB)"
    )
    fix = (
        "free memory or raise the cgroup's memory.max, or set --ram-cap"
        if planned_from
        else "raise --ram-cap"
    )
    raise RamCapError(
        f"{what}: {cap_bytes // record_bytes} expert records of {record_bytes} bytes, but one "
        f"decode step needs {working_set} of a layer at once (top-k {top_k} x --max-batch "
        f"{max_batch}), {need} bytes ({need / 2**20:.1f} MiB): {fix}, or lower --max-batch"
    )
