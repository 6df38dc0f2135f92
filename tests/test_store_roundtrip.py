import hashlib
import shutil

import numpy as np
import pytest
from store_kit import EXPERTS, add_mtp_layer, copy_checkpoint, direct_dir, make_checkpoint
from store_kit import record_bytes_of as checkpoint_fields

from glm53._odirect import aligned_empty
from glm53.cli import main
from glm53.models.checkpoint import Checkpoint
from glm53.store.compare import compare, sample_records
from glm53.store.format import read_manifest
from glm53.store.pack import pack
from glm53.store.reader import ExpertStore
from glm53.store.verify import verify


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("store") / "ckpt")


@pytest.fixture(scope="module")
def store_dir(ckpt_dir, tmp_path_factory):
    out = direct_dir(tmp_path_factory.mktemp("store-out")) / "store"
    result = pack(ckpt_dir, out, threads=2, io_threads=2)
    assert (result.num_records, result.records_written, result.records_kept) == (16, 16, 0)
    yield out
    shutil.rmtree(out, ignore_errors=True)


def test_pack_writes_one_record_per_expert_and_a_manifest(store_dir, ckpt_dir):
    m = read_manifest(store_dir)
    assert [(layer.store_layer, layer.model_layer, layer.is_mtp) for layer in m.layers] == [
        (0, 2, False),
        (1, 3, False),
    ]
    assert m.layers[1].prefix == "model.language_model.layers.3.mlp.experts"
    assert (m.experts_per_layer, m.record_bytes, m.slot_bytes) == (EXPERTS, 77_824, 73_728)
    assert (m.bits, m.codebook, m.codebook_marker) == (3, "mul1", -2082680531)
    assert m.total_bytes == 16 * 77_824 == (store_dir / "experts.bin").stat().st_size
    assert m.model_dir == str(ckpt_dir.resolve())
    assert not (store_dir / "pack-journal.json").exists()
    data = (store_dir / "experts.bin").read_bytes()
    for r in range(16):
        record = data[r * m.record_bytes : (r + 1) * m.record_bytes]
        assert hashlib.sha256(record).hexdigest() == m.sha256[r]


def test_records_hold_the_checkpoint_bytes_at_their_fields_and_zeros_elsewhere(store_dir, ckpt_dir):
    m = read_manifest(store_dir)
    ckpt = Checkpoint(ckpt_dir)
    data = np.fromfile(store_dir / "experts.bin", dtype=np.uint8)
    for record in (0, 7, 8, 13):
        layer, expert = 2 + record // EXPERTS, record % EXPERTS
        buf = data[record * m.record_bytes : (record + 1) * m.record_bytes]
        want = checkpoint_fields(ckpt, layer, expert)
        for f in m.fields:
            np.testing.assert_array_equal(buf[f.offset : f.offset + f.nbytes], want[f.name])
        end = max(f.offset + f.nbytes for f in m.fields)
        assert not buf[end:].any()
        # the leading slot is gate|up|down trellis back to back: one VRAM cache slot
        slot = np.concatenate([want["gate.trellis"], want["up.trellis"], want["down.trellis"]])
        np.testing.assert_array_equal(buf[: m.slot_bytes], slot)


def test_verify_passes_and_measures_the_read(store_dir, ckpt_dir):
    result = verify(store_dir, ckpt_dir, threads=2, io_threads=2)
    assert result.ok and result.bad == [] and result.size_problem == ""
    assert result.bytes_read == 16 * 77_824 and result.gbps > 0


def test_compare_checks_the_sample_plus_every_layers_first_and_last(store_dir, ckpt_dir):
    m = read_manifest(store_dir)
    assert sample_records(m, 0, seed=1) == [0, 7, 8, 15]
    assert len(sample_records(m, 5, seed=1)) >= 5
    assert sample_records(m, 1000, seed=1) == list(range(16))
    result = compare(store_dir, ckpt_dir, sample=3, seed=7)
    assert result.ok and set(result.records) >= {0, 7, 8, 15}
    assert result.bytes_compared == len(result.records) * 77_824


def test_reader_serves_records_by_layer_and_expert(store_dir, ckpt_dir):
    ckpt = Checkpoint(ckpt_dir)
    with ExpertStore(store_dir, ckpt, threads=2) as store:
        assert store.moe_layers == [2, 3] and store.num_experts == EXPERTS
        assert store.record_index(3, 5) == 13 and store.offset(3, 5) == 13 * 77_824
        bufs = [aligned_empty(store.record_bytes) for _ in range(2)]
        assert store.read([(3, 5, bufs[0]), (2, 0, bufs[1])]) == 2 * 77_824
        for buf, (layer, expert) in zip(bufs, [(3, 5), (2, 0)], strict=True):
            views = store.views(buf)
            want = checkpoint_fields(ckpt, layer, expert)
            for name, view in views.items():
                np.testing.assert_array_equal(view.reshape(-1).view(np.uint8), want[name])
            assert views["gate.trellis"].dtype == np.int16 and views["up.suh"].dtype == np.float16
            assert views["down.trellis"].shape == (16, 16, 48)
        # the expert-source interface: one layout per (layer, expert), arrays at field offsets
        (off, field), *_ = store.layouts[(3, 5)].arrays[1]
        assert (field.name, off, field.shape) == ("up.trellis", 24_576, (16, 16, 48))
        with pytest.raises(KeyError, match="no expert 8 of model layer 3"):
            store.record_index(3, 8)


def test_cli_round_trip_exits_zero_and_prints_the_rate(ckpt_dir, tmp_path, capsys):
    out = direct_dir(tmp_path) / "cli-store"
    assert main(["store", "pack", "--model", str(ckpt_dir), "--out", str(out)]) == 0
    assert "packed 16 records" in capsys.readouterr().out
    assert main(["store", "verify", "--store", str(out), "--model", str(ckpt_dir)]) == 0
    text = capsys.readouterr().out
    assert "verified 16 records" in text and "GB/s" in text and "ok: every record" in text
    assert main(["store", "compare", "--store", str(out), "--model", str(ckpt_dir)]) == 0
    assert "compared 16 records" in capsys.readouterr().out
    assert main(["store", "probe", str(out)]) == 0
    assert "supports O_DIRECT writes and reads" in capsys.readouterr().out
    assert main(["store", "probe", str(out / "experts.bin")]) == 0
    # a second pack into a finished store is refused; --resume finds nothing to do
    assert main(["store", "pack", "--model", str(ckpt_dir), "--out", str(out)]) == 2
    assert "already holds a packed store" in capsys.readouterr().err
    assert main(["store", "pack", "--model", str(ckpt_dir), "--out", str(out), "--resume"]) == 0
    assert "all 16 records verified; nothing to pack" in capsys.readouterr().out
    shutil.rmtree(out)


def test_mtp_layer_is_packed_last_and_left_out_of_the_served_layers(ckpt_dir, tmp_path):
    ckpt = copy_checkpoint(ckpt_dir, tmp_path / "mtp-ckpt")
    mtp = add_mtp_layer(ckpt, copy_from_layer=3)
    out = direct_dir(tmp_path) / "mtp-store"
    assert pack(ckpt, out).num_records == 24
    m = read_manifest(out)
    assert [(layer.model_layer, layer.is_mtp, layer.prefix) for layer in m.layers][2] == (
        mtp,
        True,
        f"mtp.layers.{mtp}.mlp.experts",
    )
    assert compare(out, ckpt, sample=24).ok
    with ExpertStore(out, ckpt) as store:
        assert store.moe_layers == [2, 3]
        assert store.record_index(mtp, 1) == 17
    without = direct_dir(tmp_path) / "no-mtp-store"
    assert pack(ckpt, without, include_mtp=False).num_records == 16
    assert verify(without, ckpt).ok
    shutil.rmtree(out)
    shutil.rmtree(without)


def test_cpu_lane_computes_the_same_from_store_records_as_from_the_checkpoint(store_dir, ckpt_dir):
    from glm53 import _gemv

    ckpt = Checkpoint(ckpt_dir)
    expert = ckpt.experts(3)[5]
    with ExpertStore(store_dir, ckpt) as store:
        record = aligned_empty(store.record_bytes)
        store.read([(3, 5, record)])
        views = store.views(record)
    from_store = [
        tuple(views[f"{p}.{part}"] for part in ("trellis", "suh", "svh"))
        for p in ("gate", "up", "down")
    ]
    from_ckpt = [
        (ckpt.read(lin.trellis.key), ckpt.read(lin.suh.key), ckpt.read(lin.svh.key))
        for lin in expert.linears
    ]
    k2 = expert.gate.trellis.shape[2] // 8
    table = _gemv.ExpertTable(2, 256, 256, k2)
    table.set(0, *from_store)
    table.set(1, *from_ckpt)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    pool = _gemv.Pool(1)
    out_store = pool.run(table, x, [0], [0], [1.0])
    out_ckpt = pool.run(table, x, [0], [1], [1.0])
    assert np.abs(out_store).max() > 0
    np.testing.assert_array_equal(out_store, out_ckpt)


def test_four_bit_experts_give_larger_records_and_round_trip(tmp_path):
    ckpt = make_checkpoint(tmp_path / "k4", bits=4)
    out = direct_dir(tmp_path) / "k4-store"
    pack(ckpt, out)
    m = read_manifest(out)
    # trellis 256*256*4/8 = 32,768 per matrix; six 512-byte scales; padded to 4 KiB
    assert (m.bits, m.trellis_bytes, m.slot_bytes, m.record_bytes) == (
        4,
        (32_768, 32_768, 32_768),
        98_304,
        102_400,
    )
    assert m.fields[0].shape == (16, 16, 64)
    assert verify(out, ckpt).ok and compare(out, ckpt, sample=16).ok
    shutil.rmtree(out)


def test_the_hub_revision_is_recorded_and_checked(ckpt_dir, tmp_path, capsys):
    ckpt = copy_checkpoint(ckpt_dir, tmp_path / "hub")
    metadata = ckpt / ".cache" / "huggingface" / "download" / "config.json.metadata"
    metadata.parent.mkdir(parents=True)
    metadata.write_text("332ab457b709b7ba30dd9a448be5de03b80a7ac9\netag\n1700000000.0\n")
    out = direct_dir(tmp_path) / "hub-store"
    pack(ckpt, out)
    assert read_manifest(out).fingerprint.revision == "332ab457b709b7ba30dd9a448be5de03b80a7ac9"
    metadata.write_text("0123456789abcdef0123456789abcdef01234567\netag\n1700000000.0\n")
    assert main(["store", "verify", "--store", str(out), "--model", str(ckpt)]) == 1
    assert "(revision 332ab457b709 vs 0123456789ab)" in capsys.readouterr().err
    shutil.rmtree(out)


def test_both_sha256_engines_pack_and_verify_alike(ckpt_dir, store_dir, tmp_path):
    from glm53._odirect import SHA256_LANES

    want = read_manifest(store_dir).sha256
    for engine in ["openssl"] + (["x16"] if SHA256_LANES else []):
        out = direct_dir(tmp_path) / f"store-{engine}"
        result = pack(ckpt_dir, out, threads=2, io_threads=2, hash_threads=2, sha256=engine)
        assert result.sha256_engine == engine
        assert read_manifest(out).sha256 == want
        for check in ["openssl"] + (["x16"] if SHA256_LANES else []):
            checked = verify(out, ckpt_dir, threads=2, io_threads=2, sha256=check)
            assert checked.ok and checked.sha256_engine == check
        shutil.rmtree(out)


def test_a_buffer_budget_of_a_few_records_packs_and_verifies(ckpt_dir, store_dir, tmp_path):
    # 5 buffers: batches of 2 records, flushed part-full whenever the reads or fills run dry
    import glm53.store.verify as verify_module

    want = read_manifest(store_dir).sha256
    out = direct_dir(tmp_path) / "small"
    mp = pytest.MonkeyPatch()
    mp.setattr(verify_module, "BUFFER_BUDGET_BYTES", 5 * 77_824)
    try:
        pack(ckpt_dir, out, threads=3, io_threads=2)
        assert read_manifest(out).sha256 == want
        assert verify(out, ckpt_dir, io_threads=3).ok
    finally:
        mp.undo()
        shutil.rmtree(out, ignore_errors=True)


class _LaggingWriter:
    """A Writer whose poll() hands completions back only 8 at a time, as a slow drive does: the
    writes pile up and hold the buffers that the fills are waiting for."""

    def __init__(self, path, **kwargs):
        from glm53._odirect import Writer

        self.writer = Writer(path, **kwargs)
        self.held: list = []

    def poll(self):
        self.held += self.writer.poll()
        if len(self.held) < 8 and self.writer.num_in_flight:
            return []
        out, self.held = self.held, []
        return out

    def wait(self, tags):
        self.held += self.writer.poll()
        done = {c.tag for c in self.held}
        out = self.writer.wait([t for t in tags if t not in done])
        out, self.held = self.held + out, []
        return out

    def __getattr__(self, name):
        return getattr(self.writer, name)


def test_batches_stay_full_while_the_writes_hold_the_buffers(tmp_path, monkeypatch):
    # 128 records, 24 buffers (batches of 12): with the writes lagging, records still reach the
    # hasher in full batches, not one by one (x16 costs as much for one record as for 16)
    import glm53.store.pack as pack_module
    import glm53.store.verify as verify_module
    from glm53.store.hashing import RecordHasher
    from glm53.synth.shapes import preset
    from glm53.synth.writer import SynthWriter

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shape = preset("demo", num_layers=4, num_experts=64, num_experts_per_tok=2, bits=3)
    writer = SynthWriter(shape, 5, ckpt)
    writer.write_metadata()
    writer.write_shards(4 << 20)
    sizes: list[int] = []
    real_submit = RecordHasher.submit

    def submit(self, buffers):
        sizes.append(len(buffers))
        return real_submit(self, buffers)

    real_init = RecordHasher.__init__

    def init(self, engine="auto", threads=None):
        real_init(self, engine, threads)
        self.lanes = 16  # batch like x16, hash with openssl: the same on any CPU

    monkeypatch.setattr(RecordHasher, "submit", submit)
    monkeypatch.setattr(RecordHasher, "__init__", init)
    monkeypatch.setattr(verify_module, "BUFFER_BUDGET_BYTES", 24 * 77_824)
    monkeypatch.setattr(pack_module, "Writer", _LaggingWriter)
    out = direct_dir(tmp_path) / "s"
    result = pack(ckpt, out, threads=4, io_threads=2, hash_threads=2, sha256="openssl")
    assert result.records_written == 128 and sum(sizes) == 128
    assert sizes[:-1] == [12] * (len(sizes) - 1), sizes
    monkeypatch.undo()
    assert verify(out, ckpt).ok
