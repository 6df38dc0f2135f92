"""Layer-major prefill (issue 18): the memory its hidden states take, where they live, and
which prompts use it. Plain Python (no torch), so that the doctor's planner and the GPU engine
share one accounting.

Chunk-major prefill runs chunk 1 through every layer, then chunk 2, and so on: each chunk
streams every touched expert not in VRAM over PCIe, so a prompt of n chunks streams them n
times. Layer-major prefill runs every chunk through layer L before any chunk enters layer L+1:
each touched expert crosses the link once per layer per prompt, whatever the chunk size. Each
(chunk, layer) step runs the same kernels on the same inputs as in chunk-major order (a chunk of
layer L reads the KV pages and the KDA state that the earlier chunks of layer L left), so the
output is the same; what changes is what must be kept between layers.

What a token carries from one decoder layer to the next is its mHC residual streams and nothing
else: exllamav3 1.6.5 broadcasts the embedding into `hc_mult` fp32 streams (`ExpandStreams`,
`x.float()`) and each `TransformerBlock` takes and returns that [tokens, hc_mult, hidden] fp32
tensor. The KV pages of the DSA layers and the KDA recurrent state are per layer and written in
place, as in chunk-major order, and a chunk's other activations die inside its layer. So the
hidden states of a whole prompt take prompt_tokens x hc_mult x hidden x 4 bytes: 64 KiB a
token for GLM-5.3-Flash (4 streams x 4096 x fp32), 512 MiB at 8k, 2 GiB at 32k.

One more thing rides from layer to layer in a chunk's params dict: a DSA layer whose indexer is
"full" publishes its top-k selection there (`params["dsa_topk_indices"]`, int32, -1-padded to
a multiple of 32 columns: at most ceil32(index_topk + index_kpool - 1) a token), the "shared"
layers after it read it, and nothing frees it before the pass ends. Chunk-major holds one
chunk's; layer-major holds every chunk's at once: 8,320 B a token for GLM-5.3-Flash, on top of
the streams (`StreamGeometry.index_bytes`, an upper bound: shorter contexts pad less).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from glm53.plan.vram import VramPlan

STREAM_DTYPE_BYTES = 4  # exllamav3 1.6.5 keeps the mHC residual streams in fp32


@dataclass(frozen=True, slots=True)
class StreamGeometry:
    """The residual streams between decoder layers: hc_mult streams of hidden_size values."""

    hidden_size: int
    hc_mult: int  # mHC residual streams per token (GLM-5.3-Flash: 4)
    num_layers: int  # decoder layers the streams pass between
    dtype_bytes: int = STREAM_DTYPE_BYTES
    index_bytes: int = 0  # DSA top-k selection a token keeps in its chunk's params (upper bound)

    @property
    def stream_bytes_per_token(self) -> int:
        return self.hc_mult * self.hidden_size * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.stream_bytes_per_token + self.index_bytes

    @classmethod
    def from_text_config(cls, tc: dict) -> StreamGeometry:
        """A glm5_next text_config's streams and DSA selections; a config without mHC has one
        stream, one without softmax-attention (DSA) layers keeps no selection."""
        hc = int(tc.get("hc_mult", 4)) if tc.get("mhc", True) else 1
        layers = int(tc["num_hidden_layers"])
        types = tc.get("layer_types", [])[:layers]
        has_dsa = any(t != "linear_attention" for t in types) and "index_topk" in tc
        index = dsa_index_bytes(tc) if has_dsa else 0
        return cls(int(tc["hidden_size"]), hc, layers, index_bytes=index)


def dsa_index_bytes(tc: dict) -> int:
    """The widest top-k selection exllamav3 1.6.5 keeps for one token (MLAttention's kpool
    indexer: ceil32(pooled top-k + the kpool - 1 tail tokens) int32 columns)."""
    topk, pool = int(tc["index_topk"]), int(tc.get("index_kpool", 1))
    tail = pool - 1 if tc.get("index_kpool_always_select_tail", True) and pool > 1 else 0
    return 4 * (-(-(topk // pool * pool + tail) // 32) * 32)


GLM53_FLASH_STREAMS = StreamGeometry(hidden_size=4096, hc_mult=4, num_layers=45)
# what a layer-major pass of GLM-5.3-Flash keeps per token: the streams and the DSA selection
GLM53_FLASH_CARRY = StreamGeometry(4096, 4, 45, index_bytes=8320)


def num_chunks(prompt_tokens: int, chunk_tokens: int) -> int:
    return -(-prompt_tokens // chunk_tokens)


def uses_layer_major(prompt_tokens: int, chunk_tokens: int) -> bool:
    """Layer-major prefill only for prompts longer than one chunk. A prompt of one chunk
    streams each touched expert once in either order, so it gains nothing and would only add
    the whole-prompt buffer; decode steps (one token a stream) keep the normal path too.
    prompt_tokens are the tokens to prefill (after any cached prefix)."""
    return prompt_tokens > chunk_tokens


def hidden_state_bytes(geo: StreamGeometry, prompt_tokens: int) -> int:
    """The whole prompt's residual streams, held between two layers."""
    return prompt_tokens * geo.bytes_per_token


class StatePlacement(StrEnum):
    VRAM = "vram"
    PINNED = "pinned"  # pinned host RAM, copied in and out over PCIe every layer


@dataclass(frozen=True, slots=True)
class HiddenStatePlan:
    """Where a layer-major prefill keeps its hidden states and what that costs. Bytes."""

    prompt_tokens: int
    chunk_tokens: int
    num_chunks: int
    state_bytes: int  # the whole prompt's streams
    placement: StatePlacement
    vram_room_bytes: int  # what the placement could take
    vram_bytes: int  # what it takes: the states, or (pinned) two chunks of streams in flight
    # and the DSA selections
    pinned_bytes: int  # host RAM it pins: the states when pinned, else 0
    h2d_bytes_per_layer: int  # pinned: each layer reads the states in (0 in VRAM)
    d2h_bytes_per_layer: int  # pinned: each layer writes them back
    h2d_bytes_per_prompt: int  # layer 0 reads embeddings instead: (num_layers - 1) reads
    d2h_bytes_per_prompt: int  # the last layer's output stays for the head: (num_layers - 1)


def plan_hidden_states(
    geo: StreamGeometry, prompt_tokens: int, chunk_tokens: int, vram_room_bytes: int
) -> HiddenStatePlan:
    """Place a layer-major prefill's hidden states: in VRAM when the whole prompt's streams fit
    in vram_room_bytes, else in pinned host RAM. Pinned, every layer but the first reads the
    states in over PCIe and every layer but the last writes them back, a chunk at a time through
    two chunk-sized VRAM buffers (one copying while the other computes); the reads share the
    host-to-device direction with the expert streaming, the writes use the other direction.
    Raises ValueError for a prompt of at most one chunk (uses_layer_major) and when not even
    the two chunk buffers fit."""
    if not uses_layer_major(prompt_tokens, chunk_tokens):
        raise ValueError(
            f"a prompt of {prompt_tokens} tokens fits one {chunk_tokens}-token chunk: it keeps "
            "the normal (chunk-major) prefill; layer-major is for longer prompts"
        )
    states = hidden_state_bytes(geo, prompt_tokens)
    chunks = num_chunks(prompt_tokens, chunk_tokens)
    if states <= vram_room_bytes:
        return HiddenStatePlan(
            prompt_tokens, chunk_tokens, chunks, states, StatePlacement.VRAM, vram_room_bytes,
            vram_bytes=states, pinned_bytes=0, h2d_bytes_per_layer=0, d2h_bytes_per_layer=0,
            h2d_bytes_per_prompt=0, d2h_bytes_per_prompt=0,
        )  # fmt: skip
    # the streams go to pinned RAM; the DSA selections are exllamav3's device tensors and stay
    index = prompt_tokens * geo.index_bytes
    in_flight = 2 * chunk_tokens * geo.stream_bytes_per_token + index
    if in_flight > vram_room_bytes:
        raise ValueError(
            f"layer-major prefill of {prompt_tokens} tokens: its {states / 2**30:.2f} GiB of "
            f"hidden states go to pinned RAM, and even their two {chunk_tokens}-token chunk "
            f"buffers ({in_flight / 2**20:.0f} MiB) exceed the {vram_room_bytes / 2**20:.0f} MiB "
            "of VRAM left; lower --chunk-size or the VRAM the expert cache takes"
        )
    crossings = geo.num_layers - 1
    pinned = states - index
    return HiddenStatePlan(
        prompt_tokens, chunk_tokens, chunks, states, StatePlacement.PINNED, vram_room_bytes,
        vram_bytes=in_flight, pinned_bytes=pinned, h2d_bytes_per_layer=pinned,
        d2h_bytes_per_layer=pinned, h2d_bytes_per_prompt=crossings * pinned,
        d2h_bytes_per_prompt=crossings * pinned,
    )  # fmt: skip


def vram_room(plan: VramPlan) -> int:
    """The VRAM a layer-major prefill may give its hidden states on top of exact mode's plan
    (glm53.plan.vram.plan_vram): what the plan leaves free plus the expert cache, lent
    to the prefill and refilled after it. Lending beats pinning whenever there are more than
    three layers: states of S bytes in lent slots cost about 2 S of link traffic per prompt
    (the displaced experts stream once during the prefill and come back once at decode), in
    pinned RAM they cost (num_layers - 1) S in each direction. The model, KV, recurrent state,
    chunk activations, staging and reserve stay as planned."""
    return plan.free_bytes + plan.cache_bytes


def lent_cache_slots(state_plan: HiddenStatePlan, free_bytes: int, record_bytes: int) -> int:
    """Expert cache slots the hidden states (or, pinned, their chunk buffers) take beyond the
    plan's free bytes: the slots that hold no expert during this prefill."""
    return max(0, -(-(state_plan.vram_bytes - free_bytes) // record_bytes))


@dataclass(frozen=True, slots=True)
class PassLayout:
    """Where one layer-major pass puts its streams (glm53.exl3.layer_major). `pieces`
    are the stream tensors it keeps on the device: one per chunk when the states live in VRAM,
    the two chunk buffers when they live in pinned RAM. Each piece sits at its byte offset in
    the region of `lent_slots` expert-cache slots, or (offset None) is allocated from the
    VRAM the plan leaves free; the DSA selections are always exllamav3's own allocations."""

    plan: HiddenStatePlan
    lent_slots: int
    piece_bytes: tuple[int, ...]
    piece_offsets: tuple[int | None, ...]

    @property
    def region_bytes(self) -> int:
        return sum(
            b for b, o in zip(self.piece_bytes, self.piece_offsets, strict=True) if o is not None
        )

    @property
    def allocated_bytes(self) -> int:
        return sum(
            b for b, o in zip(self.piece_bytes, self.piece_offsets, strict=True) if o is None
        )


def layout_pass(
    geo: StreamGeometry,
    chunk_lengths: list[int],
    free_bytes: int,
    cache_slots: int,
    record_bytes: int,
) -> PassLayout:
    """Lay out a layer-major pass over chunks of `chunk_lengths` tokens (the Generator's cuts:
    full chunks, then the piece up to the prompt's last page boundary). The room is the VRAM
    left free (`free_bytes`, beyond exact mode's plan and its reserve) plus every cache slot but
    one (decode steps interleaved with the pass keep one slot to admit into). The DSA
    selections take the free VRAM first; the streams take what is left of it, then as few
    cache slots as hold the rest. Raises ValueError where plan_hidden_states does, and when the
    pass has no more than one chunk's tokens."""
    prompt, chunk = sum(chunk_lengths), max(chunk_lengths)
    room = free_bytes + max(0, cache_slots - 1) * record_bytes
    plan = plan_hidden_states(geo, prompt, chunk, room)
    per_token = geo.stream_bytes_per_token
    if plan.placement == StatePlacement.VRAM:
        pieces = [n * per_token for n in chunk_lengths]
    else:
        pieces = [chunk * per_token] * 2
    free_for_streams = max(0, free_bytes - prompt * geo.index_bytes)
    lend = max(0, -(-(sum(pieces) - free_for_streams) // record_bytes))
    while True:
        offsets, off, region = [], 0, lend * record_bytes
        for p in pieces:
            if off + p <= region:
                offsets.append(off)
                off += -(-p // 256) * 256
            else:
                offsets.append(None)
        rest = sum(p for p, o in zip(pieces, offsets, strict=True) if o is None)
        if rest <= free_for_streams:
            return PassLayout(plan, lend, tuple(pieces), tuple(offsets))
        if lend >= cache_slots - 1:
            raise ValueError(
                f"layer-major prefill of {prompt} tokens: {rest} bytes of streams fit neither "
                f"{cache_slots - 1} lent cache slots nor the {free_for_streams} bytes left free"
            )
        lend += 1
