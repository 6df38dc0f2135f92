"""GET /admin/verify?n=64: the tier check (glm53.tiers.check) on demand.

It samples n records per tier, reads each afresh from the store with O_DIRECT and compares it
with the tier's copy and the manifest's sha256, and checks the RAM tier's slot tables. It runs
between two engine steps (the engine holds its steps while it reads), so n is bounded."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import parse_qs

import msgspec

from glm53.api.errors import ApiError
from glm53.api.http import Send, send_bytes
from glm53.api.state import ServerState

log = logging.getLogger("glm53.server")

DEFAULT_SAMPLES = 64
MAX_SAMPLES = 4096  # 38 GB of reads at the full model's record size: about 20 s at 2 GB/s
_encoder = msgspec.json.Encoder()


def parse_samples(query: bytes) -> int:
    """`n` from the query string: an integer in 1..MAX_SAMPLES, DEFAULT_SAMPLES when absent."""
    values = parse_qs(query.decode("latin-1"), keep_blank_values=True).get("n")
    if not values:
        return DEFAULT_SAMPLES
    text = values[-1]
    if not text.isdigit() or not 1 <= int(text) <= MAX_SAMPLES:
        raise ApiError(
            400,
            f"n={text!r}: the number of records to check must be an integer in 1..{MAX_SAMPLES}",
            param="n",
        )
    return int(text)


async def verify(state: ServerState, query: bytes, send: Send) -> int:
    num_samples = parse_samples(query)
    state.ready_scheduler()
    check = state.engine.verify_tiers
    if check is None:
        raise ApiError(
            409,
            f"the {state.engine.name} engine has no tier check: it checks the expert tiers "
            "of the engines that keep them (the CPU engine's RAM tier; the GPU engine's in "
            "nvme-exact)",
            code="no_expert_tiers",
        )
    result = await asyncio.to_thread(check, num_samples)
    (log.info if result.is_ok else log.error)("tier check on demand: %s", result.summary())
    await send_bytes(
        send, 200, _encoder.encode({"ok": result.is_ok, **msgspec.to_builtins(result)})
    )
    return 200
