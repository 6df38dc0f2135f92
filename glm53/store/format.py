"""The expert store, format v1: one data file of fixed-size records and one JSON manifest.

A record is one routed expert: the gate, up and down trellis back to back at offset 0 (the
bytes of one VRAM cache slot, `CacheGeometry` in tiers/vram_cache.py, padded to 256 bytes),
then the suh and svh of gate, up and down, each at a 64-byte aligned offset, then zeros up to
a multiple of 4 KiB. Records are layer-major: record = store_layer * experts_per_layer + expert.
docs/store-format.md describes every manifest key.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from glm53.store.errors import EXIT_CHECK_FAILED, StoreError

FORMAT_NAME = "glm53-expert-store"
FORMAT_VERSION = 1
DATA_FILE = "experts.bin"
MANIFEST_FILE = "manifest.json"
ALIGN = 4096  # record size and offsets: one O_DIRECT read per record
SLOT_ALIGN = 256  # the VRAM slot's padding (16-byte vector copies, CacheGeometry)
SCALE_ALIGN = 64  # suh/svh offsets: one cache line
PROJECTIONS = ("gate", "up", "down")
ORDER = "layer-major: record = store_layer * experts_per_layer + expert"


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class Field(msgspec.Struct, frozen=True):
    """One array of a record: `name` is `<projection>.<trellis|suh|svh>`, `offset` and
    `nbytes` are bytes from the record's start, `dtype` a safetensors dtype name."""

    name: str
    offset: int
    nbytes: int = msgspec.field(name="bytes")
    dtype: str
    shape: tuple[int, ...]


class StoreLayer(msgspec.Struct, frozen=True):
    """Store layer -> model layer -> the key prefix of its experts (`<prefix>.<e>.gate_proj`)."""

    store_layer: int
    model_layer: int
    prefix: str
    is_mtp: bool = False


class Fingerprint(msgspec.Struct, frozen=True):
    """Identifies the source checkpoint cheaply: canonical-JSON sha256 of config.json and of
    the quantization config, a sha256 over (key, shard, offset, bytes, dtype, shape) of every
    source tensor, and a sha256 of a content sample (gate suh and down svh of each layer's
    first and last expert). `revision` is the Hub commit when the download recorded one."""

    model_type: str
    config_sha256: str
    quantization_sha256: str
    tensors_sha256: str
    num_tensors: int
    sample_sha256: str
    revision: str | None = None


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: str
    version: int
    created: str
    model_dir: str
    data_file: str
    order: str
    align: int
    record_bytes: int
    slot_bytes: int  # the leading trellis part: one VRAM slot
    trellis_bytes: tuple[int, int, int]  # gate, up, down
    bits: int  # EXL3 K of the routed experts
    codebook: str  # mul1, mcg or 3inst
    codebook_marker: int | None  # the int32 value of every expert's `.mul1`/`.mcg` tensor
    hidden_size: int
    moe_intermediate_size: int
    experts_per_layer: int
    num_layers: int
    layers: list[StoreLayer]
    fields: list[Field]
    fingerprint: Fingerprint
    sha256: list[str]  # one per record, of its record_bytes bytes as written
    total_bytes: int

    @property
    def num_records(self) -> int:
        return self.num_layers * self.experts_per_layer

    def record_offset(self, record: int) -> int:
        return record * self.record_bytes

    def locate(self, record: int) -> tuple[StoreLayer, int]:
        """(store layer, expert) of a record index."""
        return self.layers[record // self.experts_per_layer], record % self.experts_per_layer

    def describe_record(self, record: int) -> str:
        layer, expert = self.locate(record)
        mtp = ", MTP" if layer.is_mtp else ""
        return f"record {record} (layer {layer.model_layer}{mtp}, expert {expert})"


class RecordLayout(msgspec.Struct, frozen=True):
    """Where the arrays of every record sit; what pack writes and readers view."""

    fields: tuple[Field, ...]
    slot_bytes: int
    record_bytes: int

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"the record has no field {name!r}")

    def gaps(self) -> list[tuple[int, int]]:
        """[start, end) byte ranges of the record that no field covers (must be zero)."""
        out, cursor = [], 0
        for f in sorted(self.fields, key=lambda f: f.offset):
            if f.offset > cursor:
                out.append((cursor, f.offset))
            cursor = max(cursor, f.offset + f.nbytes)
        if cursor < self.record_bytes:
            out.append((cursor, self.record_bytes))
        return out


def record_layout(arrays: dict[str, tuple[str, tuple[int, ...], int]]) -> RecordLayout:
    """The layout for one expert's arrays: name -> (dtype, shape, bytes), names as in Field."""
    fields, offset = [], 0
    for proj in PROJECTIONS:
        dtype, shape, nbytes = arrays[f"{proj}.trellis"]
        fields.append(Field(f"{proj}.trellis", offset, nbytes, dtype, shape))
        offset += nbytes
    slot_bytes = round_up(offset, SLOT_ALIGN)
    offset = slot_bytes
    for proj in PROJECTIONS:
        for part in ("suh", "svh"):
            dtype, shape, nbytes = arrays[f"{proj}.{part}"]
            offset = round_up(offset, SCALE_ALIGN)
            fields.append(Field(f"{proj}.{part}", offset, nbytes, dtype, shape))
            offset += nbytes
    return RecordLayout(tuple(fields), slot_bytes, round_up(offset, ALIGN))


def layout_of(manifest: Manifest) -> RecordLayout:
    return RecordLayout(tuple(manifest.fields), manifest.slot_bytes, manifest.record_bytes)


# --- reading and writing -------------------------------------------------------------------


def encode_json(obj: msgspec.Struct) -> bytes:
    return msgspec.json.format(msgspec.json.encode(obj), indent=1) + b"\n"


def write_atomically(path: Path, data: bytes) -> None:
    """Write to path.tmp, fsync, rename over path, fsync the directory: a reader sees the old
    file or the whole new one, also after a crash."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(store_dir: str | os.PathLike) -> Manifest:
    """The manifest of a packed store, checked for consistency. StoreError (exit 2) when the
    directory does not exist, exit 1 when it holds no finished store or the manifest is bad."""
    store = Path(store_dir)
    if not store.is_dir():
        raise StoreError(
            f"store directory {store} does not exist; pack one with "
            f"`glm53 store pack --model CHECKPOINT --out {store}`"
        )
    path = store / MANIFEST_FILE
    if not path.is_file():
        partial = (store / DATA_FILE).exists()
        why = (
            f"{DATA_FILE} is there but no manifest: a pack was interrupted; continue it with "
            f"`glm53 store pack --model CHECKPOINT --out {store} --resume`"
            if partial
            else f"pack one with `glm53 store pack --model CHECKPOINT --out {store}`"
        )
        raise StoreError(f"{store} holds no finished store ({MANIFEST_FILE} missing): {why}", 1)
    try:
        manifest = msgspec.json.decode(path.read_bytes(), type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StoreError(
            f"{path} is not a valid store manifest ({exc}); repack the store", EXIT_CHECK_FAILED
        ) from None
    problem = manifest_problem(manifest)
    if problem:
        raise StoreError(f"{path}: {problem}", EXIT_CHECK_FAILED)
    return manifest


def manifest_problem(m: Manifest) -> str:
    """Why a decoded manifest cannot describe a usable store, or "" when it can."""
    if m.format != FORMAT_NAME:
        return f"format is {m.format!r}, not {FORMAT_NAME!r}; this is not a glm53 expert store"
    if m.version != FORMAT_VERSION:
        return (
            f"store format version {m.version}; this glm53 reads version {FORMAT_VERSION}: "
            "repack the store with this glm53 (or install the glm53 that packed it)"
        )
    if m.align != ALIGN or m.record_bytes <= 0 or m.record_bytes % ALIGN:
        return f"record_bytes {m.record_bytes} is not a positive multiple of {ALIGN}"
    if len(m.layers) != m.num_layers or m.experts_per_layer < 1:
        return f"{len(m.layers)} layers listed, num_layers says {m.num_layers}"
    if len(m.sha256) != m.num_records:
        return f"{len(m.sha256)} record hashes for {m.num_records} records"
    if m.total_bytes != m.num_records * m.record_bytes:
        return f"total_bytes {m.total_bytes} != {m.num_records} records x {m.record_bytes} bytes"
    names = {f"{p}.{part}" for p in PROJECTIONS for part in ("trellis", "suh", "svh")}
    if {f.name for f in m.fields} != names or len(m.fields) != len(names):
        return f"the field table must list exactly {sorted(names)}"
    for f in m.fields:
        want = "I16" if f.name.endswith(".trellis") else "F16"
        if f.dtype != want:
            return f"field {f.name} has dtype {f.dtype}, expected {want}"
    expected = record_layout({f.name: (f.dtype, f.shape, f.nbytes) for f in m.fields})
    if expected != layout_of(m):
        return "the field table does not follow the v1 record layout"
    if m.trellis_bytes != tuple(f.nbytes for f in m.fields[:3]):
        return "trellis_bytes disagrees with the field table"
    return ""
