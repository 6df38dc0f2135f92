"""The store read-rate measurement (glm53.store.read_rate) on a real store with O_DIRECT. What it
read is checked exactly; the rate itself is a measurement and is only checked to be a rate."""

import pytest

from glm53.store.read_rate import read_rate

RECORD_BYTES = 77_824  # store_kit's demo widths: 16 records, MoE layers 2 and 3


def test_reads_every_record_once_in_batches_through_the_engines_reader(small_store):
    r = read_rate(small_store, batch_records=3)
    assert (r.records_read, r.bytes_read) == (16, 16 * RECORD_BYTES)
    assert (r.threads, r.batch_records, r.record_bytes) == (4, 3, RECORD_BYTES)
    assert r.seconds > 0 and r.bytes_per_s == r.bytes_read / r.seconds


def test_max_records_caps_what_is_read(small_store):
    r = read_rate(small_store, threads=2, batch_records=2, max_records=5, seed=7)
    assert (r.records_read, r.bytes_read, r.threads) == (5, 5 * RECORD_BYTES, 2)


def test_a_batch_of_no_records_is_refused(small_store):
    with pytest.raises(ValueError, match="^batch_records 0 must be at least 1$"):
        read_rate(small_store, batch_records=0)
