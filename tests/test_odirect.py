import errno
import gc
import os
import tempfile
import weakref

import numpy as np
import pytest

from glm53._odirect import (
    FIX,
    Completion,
    DoneFlag,
    ODirectError,
    Priority,
    Reader,
    Writer,
    aligned_empty,
    filesystem_of,
    probe,
)

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
def disk_dir(tmp_path):
    # pytest's tmp_path is on the root filesystem here (ext4); where it is memory-backed (tmpfs
    # /tmp) the probe refuses it, and /var/tmp, which is disk-backed on common distributions,
    # is used instead.
    try:
        probe(tmp_path)
    except ODirectError as exc:
        reason = str(exc)
    else:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="glm53-odirect-") as d:
        try:
            probe(d)
        except ODirectError as exc:
            pytest.fail(f"no O_DIRECT-capable test directory: {reason}; {exc}")
        yield d


def write_random(path, nbytes, seed):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    data.tofile(path)
    return data


def buffered_read(path, offset, length):
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(length), dtype=np.uint8)


# ---- reads --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("threads", "piece_bytes"), [(1, 12 * KiB), (4, 64 * KiB), (3, 2 * MiB)])
def test_random_batches_match_buffered_reads(disk_dir, threads, piece_bytes):
    seed = 1000 + threads
    path = os.path.join(disk_dir, "data.bin")
    size = 24 * MiB
    write_random(path, size, seed)
    rng = np.random.default_rng(seed)
    arena = aligned_empty(32 * MiB)
    with Reader(path, threads=threads, piece_bytes=piece_bytes) as reader:
        for batch in range(4):
            requests, cursor = [], 0
            for i in range(int(rng.integers(1, 12))):
                length = int(rng.integers(1, 3 * MiB // 4096 + 1)) * 4096
                if cursor + length > arena.size:
                    break
                offset = int(rng.integers(0, (size - length) // 4096 + 1)) * 4096
                priority = Priority(int(rng.integers(0, 2)))
                dest = arena[cursor : cursor + length]
                requests.append((offset, length, dest, (batch, i), priority))
                cursor += length
            if batch % 2:
                reader.submit_many(requests)
            else:
                for offset, length, dest, tag, priority in requests:
                    reader.submit(offset, length, dest, tag, priority)
            done = reader.wait([r[3] for r in requests])
            assert [c.tag for c in done] == [r[3] for r in requests], f"seed {seed}"
            assert [c.status for c in done] == [0] * len(requests), f"seed {seed}"
            for offset, length, dest, tag, _ in requests:
                expected = buffered_read(path, offset, length)
                assert np.array_equal(dest, expected), f"seed {seed} request {tag}"


def test_done_flags_turn_ok_or_failed(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 1 * MiB, 1)
    flags = np.full(3, 77, dtype=np.uint32)
    buf = aligned_empty(2 * MiB)
    with Reader(path, threads=2, piece_bytes=256 * KiB) as reader:
        reader.submit(0, 1 * MiB, buf, "whole", flag=flags[0:1])
        reader.submit(512 * KiB, 1 * MiB, buf[1 * MiB :], "past end", flag=flags[2:3])
        reader.wait()
    assert flags.tolist() == [DoneFlag.OK, 77, DoneFlag.FAILED]


def test_demand_requests_are_served_before_prefetch(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 1 * MiB, 2)
    buf = aligned_empty(1 * MiB)
    reader = Reader(path, threads=1)
    # one batch is queued at once, so the single idle thread sees the demand request first
    batch = [(0, 64 * KiB, buf, f"p{i}", Priority.PREFETCH) for i in range(4)]
    batch.append((0, 64 * KiB, buf, "d", Priority.DEMAND))
    reader.submit_many(batch)
    reader.close()
    assert [c.tag for c in reader.poll()] == ["d", "p0", "p1", "p2", "p3"]


def test_buffer_is_kept_alive_until_its_request_is_collected(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 256 * KiB, 3)
    with Reader(path) as reader:
        buf = aligned_empty(256 * KiB)
        ref = weakref.ref(buf)
        reader.submit(0, 256 * KiB, buf, "t")
        del buf
        gc.collect()
        assert ref() is not None
        reader.wait(["t"])
        gc.collect()
        assert ref() is None


# ---- errors on completion -----------------------------------------------------------------------


def test_read_past_end_fails_with_offset_and_errno(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 1 * MiB, 4)
    buf = aligned_empty(2 * MiB)
    buf[:] = 0xAB
    with Reader(path, threads=2, piece_bytes=128 * KiB) as reader:
        reader.submit(768 * KiB, 512 * KiB, buf, "spans end")
        reader.submit(1 * MiB, 4 * KiB, buf[1 * MiB :], "after end")
        spans, after = reader.wait(["spans end", "after end"])
    assert spans.status == -errno.ENODATA
    assert spans.error.errno == errno.ENODATA
    assert spans.error.offset == 1 * MiB
    assert str(spans.error) == (
        f"[Errno {errno.ENODATA}] read of 524288 bytes at offset 786432 of {path} ran past the "
        "end of the file at offset 1048576 (the file has 1048576 bytes)"
    )
    assert after.status == -errno.ENODATA and after.error.offset == 1 * MiB
    assert (buf[1 * MiB : 1 * MiB + 4 * KiB] == 0xAB).all()  # nothing filled past the end
    with pytest.raises(ODirectError, match="ran past the end of the file"):
        spans.check()


def test_short_read_at_unaligned_end_of_file_fails(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    data = write_random(path, 64 * KiB + 100, 5)
    buf = aligned_empty(128 * KiB)
    with Reader(path) as reader:
        reader.submit(0, 64 * KiB, buf, "body")
        reader.submit(64 * KiB, 4 * KiB, buf[64 * KiB :], "tail")
        body, tail = reader.wait(["body", "tail"])
    assert body.ok and np.array_equal(buf[: 64 * KiB], data[: 64 * KiB])
    assert tail.status == -errno.ENODATA
    assert tail.error.offset == 64 * KiB + 100


# ---- misuse rejected before any I/O -------------------------------------------------------------


def test_misaligned_requests_raise_before_any_io(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 64 * KiB, 6)
    buf = aligned_empty(64 * KiB)
    buf[:] = 0
    with Reader(path) as reader:
        with pytest.raises(ValueError) as exc:
            reader.submit(100, 4096, buf, "a")
        assert str(exc.value) == (
            f"offset 100 is not a multiple of 4096, the O_DIRECT alignment of {path}"
        )
        with pytest.raises(ValueError, match=r"^length 1000 is not a positive multiple of 4096$"):
            reader.submit(0, 1000, buf, "a")
        with pytest.raises(ValueError, match=r"^length 0 is not a positive multiple of 4096$"):
            reader.submit(0, 0, buf, "a")
        addr = buf[8:].ctypes.data
        with pytest.raises(ValueError) as exc:
            reader.submit(0, 4096, buf[8:], "a")
        assert str(exc.value) == (
            f"buf address 0x{addr:x} is not 4096-aligned; allocate it with aligned_empty()"
        )
        with pytest.raises(ValueError, match=r"^buf holds 4096 bytes, fewer than length 8192$"):
            reader.submit(0, 8192, buf[:4096], "a")
        with pytest.raises(ValueError, match=r"^buf must be a writable, contiguous buffer"):
            reader.submit(0, 4096, bytes(8192), "a")
        with pytest.raises(ValueError, match=r"^buf must be a writable, contiguous buffer"):
            reader.submit(0, 4096, buf.reshape(2, -1)[:, :4096], "a")
        with pytest.raises(TypeError):
            reader.submit(0, 4096, object(), "a")
        with pytest.raises(ValueError, match=r"^5 is not a valid Priority$"):
            reader.submit(0, 4096, buf, "a", 5)
        # a batch is all or nothing: the good first request is not queued either
        with pytest.raises(ValueError, match=r"^request 1: offset 4097 is not a multiple of 4096"):
            reader.submit_many([(0, 4096, buf, "good"), (4097, 4096, buf, "bad")])
        assert reader.num_in_flight == 0
        assert reader.wait() == []
    assert (buf == 0).all()


def test_tags_in_use_are_rejected(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 64 * KiB, 7)
    buf = aligned_empty(64 * KiB)
    with Reader(path) as reader:
        reader.submit(0, 4096, buf, "x")
        with pytest.raises(ValueError, match=r"^tag 'x' is already used by a request not yet"):
            reader.submit(4096, 4096, buf[4096:], "x")
        with pytest.raises(ValueError, match=r"^request 1: tag 'y' is already used"):
            reader.submit_many([(0, 4096, buf, "y"), (0, 4096, buf, "y")])
        with pytest.raises(ValueError, match=r"^tag 'z' is not a request in flight or finished$"):
            reader.wait(["z"])
        assert [c.tag for c in reader.wait()] == ["x"]
        reader.submit(0, 4096, buf, "x")  # free again once collected
        assert [c.tag for c in reader.wait()] == ["x"]


def test_bad_configuration_is_rejected(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 64 * KiB, 8)
    with pytest.raises(ValueError, match=r"^threads must be 1\.\.256, got 0$"):
        Reader(path, threads=0)
    with pytest.raises(ValueError, match=r"^piece_bytes must be a positive multiple of 4096"):
        Reader(path, piece_bytes=5000)
    missing = os.path.join(disk_dir, "missing.bin")
    with pytest.raises(ODirectError) as exc:
        Reader(missing)
    assert exc.value.errno == errno.ENOENT
    assert str(exc.value) == (
        f"[Errno 2] cannot open {missing} for O_DIRECT reads: No such file or directory"
    )


def test_wait_times_out_and_leaves_requests_for_later(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 1 * MiB, 9)
    buf = aligned_empty(1 * MiB)
    with Reader(path) as reader:
        reader.submit(0, 1 * MiB, buf, "t")
        with pytest.raises(
            TimeoutError, match=r"^1 of 1 requests on .* still in flight after 0 s$"
        ):
            reader.wait(timeout=0)
        assert [c.status for c in reader.wait(["t"])] == [0]


# ---- close ---------------------------------------------------------------------------------------


def test_close_with_cancel_completes_queued_requests_as_cancelled(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 4 * MiB, 10)
    buf = aligned_empty(4 * MiB)
    reader = Reader(path, threads=1, piece_bytes=64 * KiB)
    assert reader.handle != 0
    reader.submit_many([(0, 4 * MiB, buf, i) for i in range(64)])
    reader.close(cancel=True)
    assert reader.closed and reader.num_in_flight == 0
    done = reader.poll()
    assert sorted(c.tag for c in done) == list(range(64))
    assert {c.status for c in done} <= {0, -errno.ECANCELED}
    cancelled = [c for c in done if c.status == -errno.ECANCELED]
    assert len(cancelled) >= 32  # one thread cannot read 128 MiB while close() runs
    last = max(cancelled, key=lambda c: c.tag)  # never started: FIFO order, >= 32 cancelled
    assert last.tag == 63
    assert str(last.error) == (
        f"[Errno {errno.ECANCELED}] read of 4194304 bytes at offset 0 of {path} was cancelled "
        "by close() at offset 0"
    )
    with pytest.raises(ValueError, match=r"^Reader for .* is closed$"):
        reader.submit(0, 4096, buf, "late")


def test_close_without_cancel_finishes_every_request(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    data = write_random(path, 2 * MiB, 11)
    bufs = [aligned_empty(2 * MiB) for _ in range(8)]
    reader = Reader(path, threads=2, piece_bytes=128 * KiB)
    reader.submit_many([(0, 2 * MiB, b, i) for i, b in enumerate(bufs)])
    reader.close()
    assert [c.status for c in reader.wait()] == [0] * 8
    assert all(np.array_equal(b, data) for b in bufs)


def test_leaving_the_context_on_an_exception_cancels(disk_dir):
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 4 * MiB, 12)
    buf = aligned_empty(4 * MiB)
    with pytest.raises(KeyError):
        with Reader(path, threads=1, piece_bytes=64 * KiB) as reader:
            reader.submit_many([(0, 4 * MiB, buf, i) for i in range(64)])
            raise KeyError("boom")
    assert reader.closed
    assert -errno.ECANCELED in {c.status for c in reader.poll()}


# ---- writes --------------------------------------------------------------------------------------


def test_writer_round_trip_matches_source(disk_dir):
    path = os.path.join(disk_dir, "store.bin")
    rng = np.random.default_rng(13)
    record_bytes = 300 * KiB
    num_records = 24
    source = aligned_empty(record_bytes * num_records)
    source[:] = rng.integers(0, 256, source.size, dtype=np.uint8)
    with Writer(path, threads=3, piece_bytes=64 * KiB, truncate=True) as writer:
        writer.preallocate(0, source.size)
        order = rng.permutation(num_records)
        writer.submit_many(
            [
                (int(i) * record_bytes, record_bytes, source[i * record_bytes :][:record_bytes], i)
                for i in order
            ]
        )
        assert all(c.ok for c in writer.wait())
        writer.sync()
    assert os.path.getsize(path) == source.size
    assert np.array_equal(np.fromfile(path, dtype=np.uint8), source)
    back = aligned_empty(source.size)
    with Reader(path, threads=2) as reader:
        reader.submit(0, source.size, back, "all")
        reader.wait()[0].check()
    assert np.array_equal(back, source)


def test_writer_accepts_read_only_buffers_and_truncates(disk_dir):
    path = os.path.join(disk_dir, "store.bin")
    write_random(path, 1 * MiB, 14)
    data = aligned_empty(8 * KiB)
    data[:] = 7
    data.flags.writeable = False
    with Writer(path, truncate=True) as writer:
        writer.submit(0, 8 * KiB, data, "w")
        writer.wait()[0].check()
    with open(path, "rb") as f:
        assert f.read() == bytes([7]) * 8 * KiB


def test_writer_open_error_names_path(disk_dir):
    path = os.path.join(disk_dir, "no-such-dir", "store.bin")
    with pytest.raises(ODirectError) as exc:
        Writer(path)
    assert str(exc.value) == (
        f"[Errno 2] cannot open {path} for O_DIRECT writes: No such file or directory"
    )


# ---- probe and filesystem facts ------------------------------------------------------------------


def test_probe_accepts_disk_directory_and_file_and_leaves_nothing(disk_dir):
    probe(disk_dir)
    assert os.listdir(disk_dir) == []
    path = os.path.join(disk_dir, "data.bin")
    write_random(path, 8 * KiB, 15)
    probe(path)


def test_probe_refuses_tmpfs_dev_shm():
    if filesystem_of("/dev/shm")[0] != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs on this host")
    with pytest.raises(ODirectError) as exc:
        probe("/dev/shm")
    assert exc.value.errno == errno.EINVAL
    assert str(exc.value) == (
        "[Errno 22] /dev/shm (tmpfs at /dev/shm) is memory-backed: the kernel may accept "
        "O_DIRECT there but serves it from RAM, so a store on it only duplicates RAM; "
        "put the store on local xfs or ext4"
    )
    assert FIX == "put the store on local xfs or ext4"


def test_probe_reports_missing_and_empty_paths(disk_dir):
    missing = os.path.join(disk_dir, "missing")
    with pytest.raises(FileNotFoundError, match="does not exist; give the store file or its dir"):
        probe(missing)
    empty = os.path.join(disk_dir, "empty.bin")
    open(empty, "wb").close()
    with pytest.raises(ODirectError, match=r"is empty; nothing to read with O_DIRECT$"):
        probe(empty)


def test_filesystem_of_takes_longest_mount_prefix():
    mounts = "\n".join(
        [
            "/dev/vda / ext4 rw 0 0",
            "tmpfs /mnt/a tmpfs rw 0 0",
            "/dev/nvme0n1 /mnt/ab xfs rw 0 0",
            "/dev/sdb /mnt/with\\040space ext4 rw 0 0",
            "fuse /mnt/a/deep fuse.sshfs rw 0 0",
            "/dev/sdc /mnt/a/deep xfs rw 0 0",
        ]
    )
    assert filesystem_of("/mnt/a/x", mounts) == ("tmpfs", "/mnt/a")
    assert filesystem_of("/mnt/ab/x", mounts) == ("xfs", "/mnt/ab")
    assert filesystem_of("/mnt/abc", mounts) == ("ext4", "/")
    assert filesystem_of("/mnt/with space/f", mounts) == ("ext4", "/mnt/with space")
    assert filesystem_of("/mnt/a/deep/f", mounts) == ("xfs", "/mnt/a/deep")  # mounted over
    assert filesystem_of("/x", "") == ("unknown", "")


# ---- aligned buffers -----------------------------------------------------------------------------


@pytest.mark.parametrize(("nbytes", "alignment"), [(0, 4096), (1, 4096), (12345, 64), (3, 2 * MiB)])
def test_aligned_empty_is_aligned_writable_uint8(nbytes, alignment):
    a = aligned_empty(nbytes, alignment)
    assert a.dtype == np.uint8 and a.shape == (nbytes,) and a.flags.writeable
    assert a.ctypes.data % alignment == 0
    a[:] = 1
    assert int(a.sum()) == nbytes


def test_aligned_empty_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"^alignment must be a power of two >= 8, got 100$"):
        aligned_empty(10, 100)
    with pytest.raises(ValueError, match=r"^nbytes must be >= 0, got -1$"):
        aligned_empty(-1)


def test_completion_reports_ok_and_repr():
    c = Completion("t", 0, None)
    assert c.ok and repr(c) == "Completion(tag='t', status=0)"
    c.check()
