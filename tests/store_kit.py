"""Helpers of the store tests: small synthetic checkpoints, damaged copies, an ENOSPC writer."""

from __future__ import annotations

import atexit
import errno
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from glm53._odirect import Completion, ODirectError, Writer, probe
from glm53.models.checkpoint import Checkpoint
from glm53.synth.shapes import preset
from glm53.synth.writer import SynthWriter

LAYERS, EXPERTS = 4, 8  # demo widths, MoE layers 2 and 3: 16 records of 77,824 bytes


def make_checkpoint(out: Path, seed: int = 3, bits: int = 3) -> Path:
    """A demo-width checkpoint in 1 MiB shards; the router is left uncalibrated (the store
    does not read it), which keeps this to a second."""
    shape = preset("demo", num_layers=LAYERS, num_experts=EXPERTS, num_experts_per_tok=2, bits=bits)
    out.mkdir(parents=True)
    writer = SynthWriter(shape, seed, out)
    writer.write_metadata()
    writer.write_shards(1 << 20)
    return out


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def direct_dir(tmp_path: Path) -> Path:
    """A directory that takes O_DIRECT: tmp_path, or one under /var/tmp where /tmp is tmpfs."""
    try:
        probe(tmp_path)
        return tmp_path
    except ODirectError:
        path = tempfile.mkdtemp(dir="/var/tmp", prefix="glm53-store-test-")
        atexit.register(shutil.rmtree, path, True)
        return Path(path)


def shard_of(ckpt_dir: Path, key: str) -> Path:
    return Checkpoint(ckpt_dir).info(key).path


def rewrite_header(shard: Path, key: str, shape: list[int]) -> None:
    """Give one tensor of a shard another shape of the same byte count (data untouched)."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[key]["shape"] = shape
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def add_mtp_layer(ckpt_dir: Path, copy_from_layer: int) -> int:
    """Append an MTP layer whose routed experts are copies of another layer's, in
    mtp.safetensors under the prefix `mtp.layers.N.mlp.experts`; returns N."""
    ckpt = Checkpoint(ckpt_dir)
    layer = ckpt.num_layers
    src = f"model.language_model.layers.{copy_from_layer}.mlp.experts."
    tensors = {}
    for key in ckpt.tensors:
        if key.startswith(src):
            tensors[f"mtp.layers.{layer}.mlp.experts." + key[len(src) :]] = ckpt.read(key)
    save_file(tensors, str(ckpt_dir / "mtp.safetensors"))
    config = json.loads((ckpt_dir / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 1
    (ckpt_dir / "config.json").write_text(json.dumps(config))
    return layer


class FailingWriter:
    """A Writer whose writes of record `fail_at` and later fail with ENOSPC (never reaching
    the disk), the way a full filesystem reports them through the native writer."""

    def __init__(self, fail_at: int):
        self.fail_at = fail_at

    def __call__(self, path, **kwargs):
        self.writer = Writer(path, **kwargs)
        self.failed: list[Completion] = []
        return self

    def submit(self, offset, length, buf, tag):
        if tag >= self.fail_at:
            error = ODirectError(
                errno.ENOSPC,
                f"write of {length} bytes at offset {offset} of {self.writer.path} failed at "
                f"offset {offset}: No space left on device",
                offset,
            )
            self.failed.append(Completion(tag, -errno.ENOSPC, error))
        else:
            self.writer.submit(offset, length, buf, tag)

    def poll(self):
        out, self.failed = self.writer.poll() + self.failed, []
        return out

    def wait(self, tags):
        failed = [c for c in self.failed if c.tag in tags]
        if failed:
            self.failed = [c for c in self.failed if c.tag not in tags]
            return failed
        return self.writer.wait(tags)

    def __getattr__(self, name):
        return getattr(self.writer, name)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x40]))


def record_bytes_of(ckpt: Checkpoint, layer: int, expert: int) -> dict[str, np.ndarray]:
    """The checkpoint's bytes of each field of one expert, by field name."""
    out = {}
    for proj in ("gate", "up", "down"):
        lin = ckpt.linear(f"model.language_model.layers.{layer}.mlp.experts.{expert}.{proj}_proj")
        for part, info in (("trellis", lin.trellis), ("suh", lin.suh), ("svh", lin.svh)):
            out[f"{proj}.{part}"] = (
                np.ascontiguousarray(ckpt.read(info.key)).view(np.uint8).reshape(-1)
            )
    return out


class FailingReader:
    """Fault injection for the read path (not a disk): wraps a real O_DIRECT Reader; a request
    whose range covers one of `fail_offsets` completes with `errno_` at that offset, the way the
    native reader reports a failed read, without touching the disk. Other requests are read."""

    def __init__(self, reader, fail_offsets: list[int], errno_: int = errno.EIO):
        self.reader = reader
        self.fail_offsets = sorted(fail_offsets)
        self.errno = errno_
        self.failed: dict = {}

    def submit(self, offset, length, buf, tag, *args, **kwargs):
        hit = next((o for o in self.fail_offsets if offset <= o < offset + length), None)
        if hit is None:
            self.reader.submit(offset, length, buf, tag, *args, **kwargs)
            return
        error = ODirectError(
            self.errno,
            f"read of {length} bytes at offset {offset} of {self.reader.path} failed at offset "
            f"{hit}: {os.strerror(self.errno)}",
            hit,
        )
        self.failed[tag] = Completion(tag, -self.errno, error)

    def wait(self, tags=None, timeout=None):
        tags = list(tags)
        failed = [self.failed.pop(t) for t in tags if t in self.failed]
        rest = [t for t in tags if t not in {c.tag for c in failed}]
        return failed + (self.reader.wait(rest, timeout) if rest else [])

    def __getattr__(self, name):
        return getattr(self.reader, name)


class StallingReader:
    """A stand-in for a hung disk (a real one cannot be made here): wraps a real O_DIRECT
    Reader; a request whose range covers one of `stall_offsets` is held, not read, until
    `release()` hands the held requests to the real reader, so a wait for it times out the way
    the native reader's does. Other requests are read."""

    def __init__(self, reader, stall_offsets: list[int]):
        self.reader = reader
        self.stall_offsets = sorted(stall_offsets)
        self.held: dict = {}  # tag -> the submit's arguments
        self.released = False

    def submit(self, offset, length, buf, tag, *args, **kwargs):
        if not self.released and any(offset <= o < offset + length for o in self.stall_offsets):
            self.held[tag] = (offset, length, buf, tag, args, kwargs)
            return
        self.reader.submit(offset, length, buf, tag, *args, **kwargs)

    def release(self) -> None:
        self.released = True
        for offset, length, buf, tag, args, kwargs in self.held.values():
            self.reader.submit(offset, length, buf, tag, *args, **kwargs)
        self.held.clear()

    def wait(self, tags=None, timeout=None):
        tags = list(tags)
        if any(t in self.held for t in tags):
            time.sleep(timeout or 0)
            raise TimeoutError(f"{len(tags)} requests on {self.reader.path} held after {timeout} s")
        return self.reader.wait(tags, timeout)

    def __getattr__(self, name):
        return getattr(self.reader, name)


def resident_records(engine) -> set[int]:
    """The keys a CPU engine's RAM tier holds now."""
    tier = engine.tier
    return {tier.clock.key_of(s) for s in range(tier.num_slots) if tier.clock.key_of(s) >= 0}
