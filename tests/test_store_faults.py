"""Every fault of the store tools: a clear error naming the thing and the fix, the right exit
code, and never a store that verifies as good."""

import json
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
from store_kit import (
    FailingWriter,
    copy_checkpoint,
    direct_dir,
    flip_byte,
    make_checkpoint,
    rewrite_header,
    shard_of,
)

from glm53._odirect import filesystem_of
from glm53.cli import main
from glm53.store import pack as pack_module
from glm53.store.compare import compare
from glm53.store.errors import StoreError, StoreMismatchError
from glm53.store.pack import pack
from glm53.store.reader import ExpertStore
from glm53.store.source import SourceReader
from glm53.store.verify import verify

RECORD = 77_824
EXPERT_KEY = "model.language_model.layers.3.mlp.experts.4"


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("faults") / "ckpt")


@pytest.fixture(scope="module")
def other_ckpt_dir(tmp_path_factory):
    # same config and file layout, other weights
    return make_checkpoint(tmp_path_factory.mktemp("faults-other") / "ckpt", seed=4)


@pytest.fixture(scope="module")
def good_store(ckpt_dir, tmp_path_factory):
    out = direct_dir(tmp_path_factory.mktemp("faults-store")) / "store"
    pack(ckpt_dir, out)
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def store(good_store, tmp_path):
    """A private copy of the good store, to damage."""
    dst = direct_dir(tmp_path) / "store"
    shutil.copytree(good_store, dst)
    yield dst
    shutil.rmtree(dst, ignore_errors=True)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["store", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_not_a_good_store(store_dir: Path, ckpt_dir: Path, capsys) -> None:
    code, out, err = run(capsys, "verify", "--store", store_dir, "--model", ckpt_dir)
    assert code == 1, out + err
    with pytest.raises(StoreError) as info:
        ExpertStore(store_dir, ckpt_dir).close()
    assert info.value.exit_code == 1


# --- bad checkpoints ---------------------------------------------------------------------


def test_missing_checkpoint_directory(tmp_path, capsys):
    code, _, err = run(capsys, "pack", "--model", tmp_path / "nope", "--out", tmp_path / "s")
    assert code == 2
    assert (
        f"--model {tmp_path / 'nope'} is not a directory; download it with `glm53 download`" in err
    )
    assert not (tmp_path / "s").exists()


def test_directory_without_config_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    code, _, err = run(capsys, "pack", "--model", tmp_path / "m", "--out", tmp_path / "s")
    assert code == 2
    assert f"{tmp_path / 'm'} has no config.json, so it is not a checkpoint directory" in err


def test_foreign_model_type_is_refused(ckpt_dir, tmp_path, capsys):
    ckpt = copy_checkpoint(ckpt_dir, tmp_path / "llama")
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "pack", "--model", ckpt, "--out", tmp_path / "s")
    assert code == 2
    assert (
        f"{ckpt} is a 'llama' checkpoint, not GLM-5.3-Flash (model_type 'glm5_next'); point "
        "--model at the GLM-5.3-Flash EXL3 checkpoint"
    ) in err


def test_non_exl3_checkpoint_is_refused(ckpt_dir, tmp_path, capsys):
    ckpt = copy_checkpoint(ckpt_dir, tmp_path / "gptq")
    quant = json.loads((ckpt / "quantization_config.json").read_text())
    quant["quant_method"] = "gptq"
    (ckpt / "quantization_config.json").write_text(json.dumps(quant))
    code, _, err = run(capsys, "pack", "--model", ckpt, "--out", tmp_path / "s")
    assert code == 2
    assert f"{ckpt} is not an EXL3 checkpoint (quant_method 'gptq'); the store packs EXL3" in err


def test_missing_shard_is_named(ckpt_dir, tmp_path, capsys):
    ckpt = copy_checkpoint(ckpt_dir, tmp_path / "partial")
    shard = shard_of(ckpt, f"{EXPERT_KEY}.up_proj.trellis")
    shard.unlink()
    code, _, err = run(capsys, "pack", "--model", ckpt, "--out", tmp_path / "s")
    assert code == 2
    assert (
        f"{ckpt} is missing 1 shard(s) listed in model.safetensors.index.json: {shard.name}; "
        "the download is incomplete: rerun `glm53 download`"
    ) in err
    # without an index, the first expert tensor no shard holds is named
    (ckpt / "model.safetensors.index.json").unlink()
    code, _, err = run(capsys, "pack", "--model", ckpt, "--out", tmp_path / "s")
    assert code == 2
    assert "is not in checkpoint" in err and "no shard holds it" in err
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_tensor_with_an_unexpected_shape_is_named(ckpt_dir, tmp_path, capsys):
    ckpt = copy_checkpoint(ckpt_dir, tmp_path / "reshaped")
    key = f"{EXPERT_KEY}.down_proj.svh"
    rewrite_header(shard_of(ckpt, key), key, [2, 128])  # same bytes, another shape
    code, _, err = run(capsys, "pack", "--model", ckpt, "--out", tmp_path / "s")
    assert code == 2
    assert f"{EXPERT_KEY}.down_proj: suh [256] / svh [2, 128] do not match trellis" in err
    assert "the checkpoint is inconsistent" in err


def test_experts_that_disagree_with_the_config_widths_are_named(ckpt_dir, tmp_path, capsys):
    ckpt = copy_checkpoint(ckpt_dir, tmp_path / "wider")
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 512
    (ckpt / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "pack", "--model", ckpt, "--out", tmp_path / "s")
    assert code == 2
    assert (
        "tensor model.language_model.layers.2.mlp.experts.0.gate_proj.trellis is I16 "
        "[16, 16, 48], expected I16 [16, 32, 48] (hidden_size 256, moe_intermediate_size 512, "
        "3 bits like expert 0); the checkpoint is inconsistent"
    ) in err


def test_missing_mtp_experts_suggest_no_mtp(ckpt_dir, tmp_path, capsys):
    ckpt = copy_checkpoint(ckpt_dir, tmp_path / "mtp")
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "pack", "--model", ckpt, "--out", tmp_path / "s")
    assert code == 2
    assert "the config has MTP layer 4 but no shard holds its routed experts" in err
    assert "(--no-mtp)" in err
    out = direct_dir(tmp_path) / "s2"
    assert run(capsys, "pack", "--model", ckpt, "--out", out, "--no-mtp")[0] == 0


# --- bad targets -------------------------------------------------------------------------


def test_out_inside_the_model_directory_is_refused(ckpt_dir, capsys):
    for out in (ckpt_dir / "store", ckpt_dir):
        code, _, err = run(capsys, "pack", "--model", ckpt_dir, "--out", out)
        assert code == 2
        assert f"--out {out} is inside the model directory {ckpt_dir}" in err
    assert not (ckpt_dir / "store").exists()


def test_tmpfs_target_is_refused_and_left_clean(ckpt_dir, capsys):
    shm = Path("/dev/shm")
    if filesystem_of(shm)[0] != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this host")
    out = shm / f"glm53-store-test-{os.getpid()}"
    code, _, err = run(capsys, "pack", "--model", ckpt_dir, "--out", out)
    assert code == 2
    assert f"--out {out}: {out} (tmpfs at /dev/shm) is memory-backed" in err
    assert "put the store on local xfs or ext4" in err
    assert not out.exists()
    code, _, err = run(capsys, "probe", shm)
    assert code == 1 and "(tmpfs at /dev/shm) is memory-backed" in err


def test_free_space_floor_of_ten_percent(ckpt_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pack_module, "disk_space", lambda path: (100_000_000, 1_000_000_000))
    out = direct_dir(tmp_path) / "s"
    code, _, err = run(capsys, "pack", "--model", ckpt_dir, "--out", out)
    assert code == 2
    assert "packing needs 0.00 GB more in" in err
    assert (
        "which has 0.10 GB free of 1.00 GB; that would leave 9.9% free, under the 10% floor" in err
    )
    assert not (out / "experts.bin").exists()


def test_a_file_size_limit_fails_the_preallocation(ckpt_dir, tmp_path, capsys):
    out = direct_dir(tmp_path) / "s"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    try:
        code, _, err = run(capsys, "pack", "--model", ckpt_dir, "--out", out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert code == 2
    assert f"cannot reserve 0.00 GB for {out / 'experts.bin'}" in err
    assert "File too large; raise the file size limit (ulimit -f)" in err
    assert not (out / "manifest.json").exists()
    assert_not_a_good_store(out, ckpt_dir, capsys)


def test_full_disk_mid_pack_keeps_what_is_written_and_resume_finishes(
    ckpt_dir, tmp_path, monkeypatch, capsys
):
    # ENOSPC is injected where the native writer reports it: the completion of record 5's write
    failing = FailingWriter(fail_at=5)
    monkeypatch.setattr(pack_module, "Writer", failing)
    out = direct_dir(tmp_path) / "s"
    code, _, err = run(capsys, "pack", "--model", ckpt_dir, "--out", out, "--threads", 2)
    assert code == 2
    fstype, mount = filesystem_of(out)
    assert "pack stopped writing record 5 (layer 2, expert 5)" in err
    assert f"No space left on device; free space on {mount} ({fstype})" in err
    assert "records are safe on disk; continue with `glm53 store pack" in err and "--resume" in err
    assert not (out / "manifest.json").exists() and (out / "pack-journal.json").exists()
    assert_not_a_good_store(out, ckpt_dir, capsys)
    code, _, err = run(capsys, "verify", "--store", out)
    assert code == 1
    assert "experts.bin is there but no manifest: a pack was interrupted" in err

    monkeypatch.undo()
    result = pack(ckpt_dir, out, resume=True)
    assert result.records_kept == 5 and result.records_written == 11
    assert verify(out, ckpt_dir).ok and compare(out, ckpt_dir, sample=16).ok
    assert not (out / "pack-journal.json").exists()


def test_interrupt_exits_130_and_resume_continues(ckpt_dir, tmp_path, monkeypatch, capsys):
    real_fill = SourceReader.fill

    def fill(self, record, buf):
        if record == 9:
            raise KeyboardInterrupt
        real_fill(self, record, buf)

    monkeypatch.setattr(SourceReader, "fill", fill)
    out = direct_dir(tmp_path) / "s"
    code, _, err = run(capsys, "pack", "--model", ckpt_dir, "--out", out)
    assert code == 130
    assert "pack interrupted;" in err and "--resume" in err
    assert_not_a_good_store(out, ckpt_dir, capsys)
    monkeypatch.undo()
    code, out_text, _ = run(capsys, "pack", "--model", ckpt_dir, "--out", out)
    assert code == 2  # not without --resume
    code, out_text, _ = run(capsys, "pack", "--model", ckpt_dir, "--out", out, "--resume")
    assert code == 0 and "kept" in out_text
    assert verify(out, ckpt_dir).ok


# --- damaged stores ----------------------------------------------------------------------


def test_truncated_data_file_lists_the_missing_records(store, ckpt_dir, capsys):
    data = store / "experts.bin"
    os.truncate(data, 14 * RECORD + 1000)
    code, out, _ = run(capsys, "verify", "--store", store)
    assert code == 1
    assert (
        f"BAD: experts.bin has {14 * RECORD + 1000} bytes, the manifest says {16 * RECORD}" in out
    )
    assert "layer 3, expert 6: record 14 missing: experts.bin ends at byte" in out
    assert "layer 3, expert 7: record 15 missing" in out
    assert "--resume" in out
    with pytest.raises(StoreError, match="the store is truncated"):
        ExpertStore(store, ckpt_dir)
    code, out, _ = run(capsys, "compare", "--store", store, "--model", ckpt_dir, "--sample", 0)
    assert code == 1 and "layer 3, expert 7 (record 15): record" in out
    result = pack(ckpt_dir, store, resume=True)
    assert (result.records_kept, result.records_written) == (14, 2)
    assert verify(store, ckpt_dir).ok


def test_one_flipped_byte_names_its_record_and_resume_rewrites_only_it(store, ckpt_dir, capsys):
    flip_byte(store / "experts.bin", 13 * RECORD + 30_000)  # up.trellis of layer 3, expert 5
    code, out, _ = run(capsys, "verify", "--store", store)
    assert code == 1
    assert "BAD: 1 of 16 records fail:\n  layer 3, expert 5: record 13 sha256 mismatch\n" in out
    code, out, _ = run(capsys, "compare", "--store", store, "--model", ckpt_dir, "--sample", 16)
    assert code == 1
    assert (
        "layer 3, expert 5 (record 13): up.trellis differs from "
        f"{EXPERT_KEY[:-1]}5.up_proj.trellis from byte 5424 of the field (record byte 30000)"
    ) in out
    result = pack(ckpt_dir, store, resume=True)
    assert (result.records_kept, result.records_written) == (15, 1)
    assert verify(store).ok and compare(store, ckpt_dir, sample=16).ok


def test_a_nonzero_padding_byte_is_found_by_verify_and_compare(store, ckpt_dir, capsys):
    flip_byte(store / "experts.bin", 3 * RECORD - 10)
    assert run(capsys, "verify", "--store", store)[0] == 1
    code, out, _ = run(capsys, "compare", "--store", store, "--model", ckpt_dir, "--sample", 16)
    assert code == 1
    assert f"layer 2, expert 2 (record 2): padding byte {RECORD - 10} is not zero" in out


def test_store_from_another_checkpoint_is_refused(store, ckpt_dir, other_ckpt_dir, capsys):
    code, _, err = run(capsys, "verify", "--store", store, "--model", other_ckpt_dir)
    assert code == 1
    assert (
        f"store {store} was packed from another checkpoint than {other_ckpt_dir} (the sampled "
        "expert bytes differ (other weights)); the store was packed from "
        f"{ckpt_dir.resolve()}: serve it with that checkpoint, or repack"
    ) in err
    assert run(capsys, "compare", "--store", store, "--model", other_ckpt_dir)[0] == 1
    with pytest.raises(StoreMismatchError):
        ExpertStore(store, other_ckpt_dir)
    code, _, err = run(capsys, "pack", "--model", other_ckpt_dir, "--out", store, "--resume")
    assert code == 2 and "--resume: store" in err


def test_manifest_copied_from_another_store_fails_every_record(
    store, other_ckpt_dir, ckpt_dir, tmp_path, capsys
):
    other = direct_dir(tmp_path) / "other"
    pack(other_ckpt_dir, other)
    shutil.copy(other / "manifest.json", store / "manifest.json")
    code, out, _ = run(capsys, "verify", "--store", store)
    assert code == 1 and "BAD: 16 of 16 records fail" in out
    code, _, err = run(capsys, "verify", "--store", store, "--model", ckpt_dir)
    assert code == 1 and "was packed from another checkpoint" in err


def test_damaged_manifest_is_a_failed_check(store, capsys):
    (store / "manifest.json").write_text('{"format": "glm53-expert-store"')
    code, _, err = run(capsys, "verify", "--store", store)
    assert code == 1 and "manifest.json is not a valid store manifest" in err


def test_missing_store_directory_is_a_usage_error(tmp_path, capsys):
    code, _, err = run(capsys, "verify", "--store", tmp_path / "none")
    assert code == 2
    assert f"store directory {tmp_path / 'none'} does not exist; pack one with" in err


def test_a_store_copied_to_tmpfs_is_refused_for_serving(good_store, ckpt_dir):
    shm = Path("/dev/shm")
    if filesystem_of(shm)[0] != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this host")
    copy = shm / f"glm53-store-test-{os.getpid()}"
    shutil.copytree(good_store, copy)
    try:
        with pytest.raises(StoreError) as info:
            ExpertStore(copy, ckpt_dir)
        assert info.value.exit_code == 2
        assert f"store {copy}: {copy / 'experts.bin'} (tmpfs at /dev/shm) is memory-backed" in str(
            info.value
        )
    finally:
        shutil.rmtree(copy)
