"""Byte units, defined once: sizes are counted in bytes everywhere and shown in GiB."""

GIB = 1 << 30
