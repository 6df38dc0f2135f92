import io

import msgspec
import pytest
from rich.console import Console

from glm53.store.format import (
    Field,
    Fingerprint,
    Manifest,
    StoreLayer,
    manifest_problem,
    record_layout,
)
from glm53.store.plan import _expected_arrays
from glm53.store.progress import LazyBar
from glm53.tiers.vram_cache import CacheGeometry


def test_real_geometry_gives_the_seed_record_of_9474048_bytes():
    layout = record_layout(_expected_arrays(4096, 2048, 3))
    assert layout.record_bytes == 9_474_048
    assert layout.slot_bytes == 9_437_184
    assert [(f.name, f.offset, f.nbytes) for f in layout.fields] == [
        ("gate.trellis", 0, 3_145_728),
        ("up.trellis", 3_145_728, 3_145_728),
        ("down.trellis", 6_291_456, 3_145_728),
        ("gate.suh", 9_437_184, 8192),
        ("gate.svh", 9_445_376, 4096),
        ("up.suh", 9_449_472, 8192),
        ("up.svh", 9_457_664, 4096),
        ("down.suh", 9_461_760, 4096),
        ("down.svh", 9_465_856, 8192),
    ]
    assert layout.gaps() == []


@pytest.mark.parametrize("hidden,inter,bits", [(4096, 2048, 3), (4096, 2048, 4), (256, 256, 3)])
def test_trellis_part_is_laid_out_like_one_vram_slot(hidden, inter, bits):
    layout = record_layout(_expected_arrays(hidden, inter, bits))
    trellis = tuple(f.nbytes for f in layout.fields[:3])
    geo = CacheGeometry(n_layers=1, n_experts=1, part_bytes=trellis)
    assert tuple(f.offset for f in layout.fields[:3]) == geo.part_off
    assert layout.slot_bytes == geo.record_bytes
    assert layout.record_bytes % 4096 == 0


def test_gaps_are_the_bytes_no_field_covers():
    # demo widths: trellis 3 x 24,576 = 73,728 (a 256 multiple), six 512-byte scales, pad to 4 KiB
    layout = record_layout(_expected_arrays(256, 256, 3))
    assert layout.record_bytes == 77_824
    assert layout.gaps() == [(73_728 + 6 * 512, 77_824)]


def _manifest(**changes) -> Manifest:
    layout = record_layout(_expected_arrays(256, 256, 3))
    fp = Fingerprint("glm5_next", "a" * 64, "b" * 64, "c" * 64, 48, "d" * 64)
    base = dict(
        format="glm53-expert-store",
        version=1,
        created="2026-01-01T00:00:00+00:00",
        model_dir="/m",
        data_file="experts.bin",
        order="layer-major",
        align=4096,
        record_bytes=layout.record_bytes,
        slot_bytes=layout.slot_bytes,
        trellis_bytes=(24576, 24576, 24576),
        bits=3,
        codebook="mul1",
        codebook_marker=-2082680531,
        hidden_size=256,
        moe_intermediate_size=256,
        experts_per_layer=2,
        num_layers=1,
        layers=[StoreLayer(0, 2, "model.language_model.layers.2.mlp.experts")],
        fields=list(layout.fields),
        fingerprint=fp,
        sha256=["0" * 64, "1" * 64],
        total_bytes=2 * layout.record_bytes,
    )
    base.update(changes)
    return Manifest(**base)


def test_a_consistent_manifest_round_trips_through_json_with_bytes_as_the_field_key():
    m = _manifest()
    assert manifest_problem(m) == ""
    raw = msgspec.json.encode(m)
    assert b'"bytes":24576' in raw and b'"nbytes"' not in raw
    assert msgspec.json.decode(raw, type=Manifest) == m


@pytest.mark.parametrize(
    "changes,problem",
    [
        ({"format": "other"}, "format is 'other', not 'glm53-expert-store'"),
        ({"version": 2}, "store format version 2; this glm53 reads version 1"),
        ({"sha256": ["0" * 64]}, "1 record hashes for 2 records"),
        ({"total_bytes": 4096}, "total_bytes 4096 != 2 records x 77824 bytes"),
        ({"record_bytes": 77_825}, "record_bytes 77825 is not a positive multiple of 4096"),
    ],
)
def test_inconsistent_manifests_are_named(changes, problem):
    assert manifest_problem(_manifest(**changes)).startswith(problem)


def test_a_moved_field_breaks_the_v1_layout():
    fields = list(_manifest().fields)
    f = fields[3]
    fields[3] = Field(f.name, f.offset + 64, f.nbytes, f.dtype, f.shape)
    assert manifest_problem(_manifest(fields=fields)) == (
        "the field table does not follow the v1 record layout"
    )


def test_progress_bar_appears_only_after_a_second_on_a_terminal():
    now = [0.0]
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    bar = LazyBar("pack", console=console, clock=lambda: now[0])
    bar(10, 100)
    assert not bar.shown
    now[0] = 1.5
    bar(20, 100)
    assert bar.shown
    bar.close()
    assert "pack" in out.getvalue()

    plain = LazyBar("verify", console=Console(file=io.StringIO()), clock=lambda: now[0] + 5)
    plain(1, 2)
    assert not plain.shown
