"""The journal of a pack in progress: which records are durably on disk, with their sha256.

pack rewrites it atomically after each fdatasync of the data file; `pack --resume` reads it
back, re-verifies the records it lists and packs the rest. The manifest, written last,
replaces it.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from glm53.store.errors import StoreError
from glm53.store.format import FORMAT_NAME, Field, Fingerprint, StoreLayer, write_atomically
from glm53.store.plan import StorePlan

JOURNAL_FILE = "pack-journal.json"
JOURNAL_FORMAT = f"{FORMAT_NAME}-journal"


class Journal(msgspec.Struct, frozen=True, kw_only=True):
    format: str
    fingerprint: Fingerprint
    layers: list[StoreLayer]
    fields: list[Field]
    record_bytes: int
    sha256: list[str]  # "" for a record not (yet) durably written


def write_journal(store_dir: Path, plan: StorePlan, sha256: list[str]) -> None:
    journal = Journal(
        format=JOURNAL_FORMAT,
        fingerprint=plan.fingerprint,
        layers=list(plan.layers),
        fields=list(plan.layout.fields),
        record_bytes=plan.record_bytes,
        sha256=sha256,
    )
    write_atomically(store_dir / JOURNAL_FILE, msgspec.json.encode(journal))


def read_journal(store_dir: Path, plan: StorePlan) -> list[str]:
    """The durable records' hashes ("" elsewhere); StoreError when the journal belongs to a
    pack of another checkpoint or layout."""
    path = store_dir / JOURNAL_FILE
    try:
        journal = msgspec.json.decode(path.read_bytes(), type=Journal)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StoreError(
            f"{path} is damaged ({exc}); delete it and {store_dir / 'experts.bin'} and pack again"
        ) from None
    same = (
        journal.format == JOURNAL_FORMAT
        and journal.fingerprint == plan.fingerprint
        and tuple(journal.layers) == plan.layers
        and tuple(journal.fields) == plan.layout.fields
        and journal.record_bytes == plan.record_bytes
        and len(journal.sha256) == plan.num_records
    )
    if not same:
        raise StoreError(
            f"the interrupted pack in {store_dir} was started from another checkpoint or with "
            f"another layout than {plan.checkpoint.directory}; pack into an empty directory, or "
            f"delete {path.name} and experts.bin there and pack again"
        )
    return list(journal.sha256)
