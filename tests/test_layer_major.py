"""Layer-major prefill's memory accounting (glm53.plan.layer_major) against hand-computed
bytes for GLM-5.3-Flash and the slice and demo presets, its placement inside exact mode's
VRAM plan, and its decision rule."""

import subprocess
import sys
from dataclasses import replace

import pytest

from glm53.models.tokenizer import token_ids
from glm53.plan.layer_major import (
    GLM53_FLASH_CARRY,
    GLM53_FLASH_STREAMS,
    StatePlacement,
    StreamGeometry,
    dsa_index_bytes,
    hidden_state_bytes,
    layout_pass,
    lent_cache_slots,
    num_chunks,
    plan_hidden_states,
    uses_layer_major,
    vram_room,
)
from glm53.plan.vram import VramInputs, cache_geometry, chunk_activation_bytes, plan_vram
from glm53.synth.layout import text_config
from glm53.synth.shapes import DEEP, DEMO, SLICE

MIB, GIB = 1 << 20, 1 << 30
RECORD = 9_437_184  # one GLM-5.3-Flash expert at 3 bits: 3 x 4096 x 2048 x 3 / 8
# GLM-5.3-Flash's text config: the deep preset's 45-layer cycle at the real 288 experts
FLASH_CONFIG = text_config(replace(DEEP, name="flash", num_experts=288), token_ids())


def test_glm53_flash_carries_four_fp32_streams_of_4096_between_layers():
    geo = StreamGeometry.from_text_config(FLASH_CONFIG)
    assert geo == GLM53_FLASH_CARRY == StreamGeometry(4096, 4, 45, 4, index_bytes=8320)
    assert replace(geo, index_bytes=0) == GLM53_FLASH_STREAMS
    assert geo.stream_bytes_per_token == GLM53_FLASH_STREAMS.bytes_per_token == 4 * 4096 * 4
    assert GLM53_FLASH_STREAMS.bytes_per_token == 65_536
    assert hidden_state_bytes(GLM53_FLASH_STREAMS, 8192) == 8192 * 65_536 == 512 * MIB
    assert hidden_state_bytes(GLM53_FLASH_STREAMS, 32768) == 32768 * 65_536 == 2 * GIB


def test_the_dsa_selection_of_every_chunk_rides_along():
    """exllamav3's kpool indexer pads its top-k (2,048 pooled by 4, plus the 3-token tail)
    to 2,080 int32 columns: 8,320 B a token, on top of the 65,536 B of streams."""
    assert dsa_index_bytes(FLASH_CONFIG) == 4 * 2080 == 8320
    assert GLM53_FLASH_CARRY.bytes_per_token == 65_536 + 8320 == 73_856
    assert hidden_state_bytes(GLM53_FLASH_CARRY, 8192) == 8192 * 73_856  # 577 MiB
    assert hidden_state_bytes(GLM53_FLASH_CARRY, 32768) == 32768 * 73_856  # 2.25 GiB
    assert dsa_index_bytes({"index_topk": 2048, "index_kpool": 1}) == 8192
    no_dsa = {**FLASH_CONFIG, "layer_types": ["linear_attention"] * 45}
    assert StreamGeometry.from_text_config(no_dsa).index_bytes == 0


def test_slice_and_demo_streams_are_their_own_widths():
    sl = StreamGeometry.from_text_config(text_config(SLICE, token_ids()))
    assert sl == StreamGeometry(4096, 4, 8, index_bytes=8320)
    assert hidden_state_bytes(replace(sl, index_bytes=0), 8192) == 512 * MIB
    demo = StreamGeometry.from_text_config(text_config(DEMO, token_ids()))
    assert demo == StreamGeometry(256, 4, 8, index_bytes=8320)
    assert demo.stream_bytes_per_token == 4 * 256 * 4 == 4096
    assert hidden_state_bytes(replace(demo, index_bytes=0), 8192) == 32 * MIB
    assert hidden_state_bytes(replace(demo, index_bytes=0), 32768) == 128 * MIB
    # a config without mHC carries one stream
    plain = StreamGeometry.from_text_config({**text_config(DEMO, token_ids()), "mhc": False})
    assert plain.stream_bytes_per_token == 256 * 4


def test_prompts_of_one_chunk_and_decode_keep_the_normal_path():
    assert not uses_layer_major(1, 2048)  # a decode step
    assert not uses_layer_major(512, 2048) and not uses_layer_major(2048, 2048)
    assert uses_layer_major(2049, 2048) and num_chunks(2049, 2048) == 2
    with pytest.raises(ValueError) as err:
        plan_hidden_states(GLM53_FLASH_STREAMS, 2048, 2048, 10 * GIB)
    assert str(err.value) == (
        "a prompt of 2048 tokens fits one 2048-token chunk: it keeps the normal (chunk-major) "
        "prefill; layer-major is for longer prompts"
    )


def test_states_live_in_vram_when_they_fit_and_cost_no_link_traffic():
    p = plan_hidden_states(GLM53_FLASH_STREAMS, 8192, 2048, 512 * MIB)
    assert p.placement == StatePlacement.VRAM and p.num_chunks == 4
    assert (p.state_bytes, p.vram_bytes, p.pinned_bytes) == (512 * MIB, 512 * MIB, 0)
    assert p.h2d_bytes_per_layer == p.d2h_bytes_per_layer == p.h2d_bytes_per_prompt == 0


def test_pinned_states_are_read_and_written_every_layer():
    p = plan_hidden_states(GLM53_FLASH_STREAMS, 8192, 2048, 512 * MIB - 1)
    assert p.placement == StatePlacement.PINNED and p.pinned_bytes == 512 * MIB
    # two 2,048-token chunks of streams in flight: 2 x 2048 x 64 KiB
    assert p.vram_bytes == 256 * MIB
    assert p.h2d_bytes_per_layer == p.d2h_bytes_per_layer == 512 * MIB
    # layer 0 reads embeddings and layer 44's output stays for the head: 44 crossings each way
    assert p.h2d_bytes_per_prompt == p.d2h_bytes_per_prompt == 44 * 512 * MIB
    sl = plan_hidden_states(StreamGeometry(4096, 4, 8), 32768, 2048, GIB)
    assert sl.placement == StatePlacement.PINNED
    assert sl.h2d_bytes_per_prompt == 7 * 2 * GIB


def test_pinned_states_need_two_chunk_buffers_in_vram():
    with pytest.raises(ValueError) as err:
        plan_hidden_states(GLM53_FLASH_STREAMS, 8192, 2048, 256 * MIB - 1)
    assert str(err.value) == (
        "layer-major prefill of 8192 tokens: its 0.50 GiB of hidden states go to pinned RAM, and "
        "even their two 2048-token chunk buffers (256 MiB) exceed the 256 MiB of VRAM left; "
        "lower --chunk-size or the VRAM the expert cache takes"
    )


def _flash_plan(context_tokens: int):
    """Exact mode's plan of GLM-5.3-Flash in a 24 GiB budget for one stream whose cache holds
    context_tokens (the prompt)."""
    from glm53.doctor.geometry import GLM53_FLASH

    kv, state = cache_geometry(FLASH_CONFIG)
    assert (kv, state) == (14_080, 147_619_840)  # 11 DSA x 2 x (512 + 128); 34 KDA states
    return plan_vram(
        VramInputs(
            budget_bytes=24 * GIB, model_bytes=GLM53_FLASH.non_expert_bytes, record_bytes=RECORD,
            num_experts=288, num_moe_layers=42, kv_bytes_per_token=kv,
            context_tokens=context_tokens, state_bytes_per_sequence=state, batch=1,
            activation_bytes=chunk_activation_bytes(FLASH_CONFIG, 2048), reserve_bytes=GIB,
        )
    )  # fmt: skip


def test_a_24_gib_card_keeps_the_states_in_vram_up_to_198627_tokens():
    """By hand at 198,627 tokens: model 4,076,764,420 + KV 14,080 x 198,627 = 2,796,668,160 +
    KDA state 147,619,840 + activations 335,544,320 = 7,356,596,740 B fixed; 25,769,803,776 -
    that = 18,413,207,036 free; staging floor(0.25 x (free - 1 GiB) / (2 x 9,437,184)) = 229
    slots a buffer; room = free - 2 x 229 x 9,437,184 - 1 GiB = 13,017,234,940 B, and the
    states take 198,627 x 65,536 = 13,017,219,072 B: they fit. One token more, 65,536 B more
    states against 14,080 B less room: they do not."""
    assert chunk_activation_bytes(FLASH_CONFIG, 2048) == 335_544_320
    last = _flash_plan(198_627)
    assert last.stage_slots == 229 and vram_room(last) == 13_017_234_940
    fits = plan_hidden_states(GLM53_FLASH_STREAMS, 198_627, 2048, vram_room(last))
    assert fits.placement == StatePlacement.VRAM and fits.state_bytes == 13_017_219_072
    first = _flash_plan(198_628)
    assert vram_room(first) == 13_017_220_860
    pinned = plan_hidden_states(GLM53_FLASH_STREAMS, 198_628, 2048, vram_room(first))
    assert pinned.placement == StatePlacement.PINNED
    for tokens in (8192, 32768, 131072):
        plan = _flash_plan(tokens)
        placed = plan_hidden_states(GLM53_FLASH_STREAMS, tokens, 2048, vram_room(plan))
        assert placed.placement == StatePlacement.VRAM, tokens


def test_states_in_vram_borrow_expert_cache_slots():
    at8k, at32k = _flash_plan(8192), _flash_plan(32768)
    assert (at8k.cache_slots, at8k.free_bytes) == (1591, 4_522_748)
    assert (at32k.cache_slots, at32k.free_bytes) == (1564, 7_668_476)
    s8 = plan_hidden_states(GLM53_FLASH_STREAMS, 8192, 2048, vram_room(at8k))
    s32 = plan_hidden_states(GLM53_FLASH_STREAMS, 32768, 2048, vram_room(at32k))
    # ceil((512 MiB - 4,522,748) / 9,437,184) = 57; ceil((2 GiB - 7,668,476) / 9,437,184) = 227
    assert lent_cache_slots(s8, at8k.free_bytes, RECORD) == 57
    assert lent_cache_slots(s32, at32k.free_bytes, RECORD) == 227
    roomy = plan_hidden_states(GLM53_FLASH_STREAMS, 4096, 2048, 2 * GIB)
    assert lent_cache_slots(roomy, 2 * GIB, RECORD) == 0


def test_the_accounting_and_the_doctor_import_without_torch():
    code = (
        "import sys, glm53.plan.layer_major, glm53.doctor.cli, glm53.doctor.prefill; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_pinned_states_keep_the_dsa_selections_in_vram():
    """Pinned, only the streams leave the device: the selections are exllamav3's tensors."""
    p = plan_hidden_states(GLM53_FLASH_CARRY, 8192, 2048, 400 * MIB)
    assert p.placement == StatePlacement.PINNED
    assert p.pinned_bytes == p.h2d_bytes_per_layer == 512 * MIB
    assert p.vram_bytes == 256 * MIB + 8192 * 8320


def test_a_pass_fills_free_vram_first_then_lends_as_few_slots_as_hold_the_rest():
    geo = GLM53_FLASH_CARRY
    chunks = [2048, 2048, 2048, 2047]  # an 8,192-token prompt: its last token runs as decode
    index = sum(chunks) * 8320
    # free VRAM holds the selections and the first chunk's streams (128 MiB): the other three
    # chunks (128 + 128 + ~128 MiB) take ceil(...) = 43 slots of 9 MiB, packed from offset 0
    lay = layout_pass(geo, chunks, index + 128 * MIB, 1591, RECORD)
    assert lay.plan.placement == StatePlacement.VRAM
    assert lay.piece_bytes == (128 * MIB, 128 * MIB, 128 * MIB, 2047 * 65_536)
    assert lay.lent_slots == 43
    assert lay.piece_offsets == (0, 128 * MIB, 256 * MIB, None)
    assert lay.allocated_bytes == 2047 * 65_536 <= 128 * MIB
    # room to spare: nothing is lent
    roomy = layout_pass(geo, chunks, GIB, 1591, RECORD)
    assert roomy.lent_slots == 0 and set(roomy.piece_offsets) == {None}


def test_a_pass_too_big_for_vram_keeps_two_chunk_buffers_in_lent_slots():
    chunks = [2048] * 15 + [2047]  # 32k: 2.25 GiB of carry
    lay = layout_pass(GLM53_FLASH_CARRY, chunks, 32768 * 8320, 100, RECORD)  # 99 slots of room
    assert lay.plan.placement == StatePlacement.PINNED
    assert lay.piece_bytes == (128 * MIB, 128 * MIB)
    assert lay.lent_slots == 29 and lay.piece_offsets == (0, 128 * MIB)  # ceil(256 MiB / 9 MiB)
    with pytest.raises(ValueError, match="two 2048-token chunk buffers"):
        layout_pass(GLM53_FLASH_CARRY, chunks, 32768 * 8320, 20, RECORD)


def test_one_chunk_of_tokens_is_not_laid_out():
    with pytest.raises(ValueError, match="keeps the normal"):
        layout_pass(GLM53_FLASH_CARRY, [2048], GIB, 100, RECORD)
