"""The NVMe expert store: format, pack, verify, compare, and a reader for serving."""
