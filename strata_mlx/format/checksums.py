"""The store's checksums: crc32c (what new stores record) and zlib's crc32 (stores made
before crc32c), computed by the native extension with the GIL released, of a buffer or of a
whole file read in chunks. Never reads a store's layout (store.py) or records."""

from __future__ import annotations

from pathlib import Path

from .. import _reader

CHECKSUM = "crc32c"  # what new stores record; "crc32" (zlib's) in stores made before it
CHECKSUMS = ("crc32c", "crc32")


def checksum(name: str, data, value: int = 0) -> int:
    """`name` ("crc32c" or "crc32") of a bytes-like object, continuing from `value`:
    checksum(n, a + b) == checksum(n, b, checksum(n, a)); crc32 equals zlib.crc32."""
    return _reader.checksum(name, data, value)


def file_checksum(path: str | Path, name: str = CHECKSUM, chunk_bytes: int = 8 << 20) -> int:
    """`name` ("crc32c" or "crc32") of a whole file, read in chunks; each chunk is summed
    natively with the GIL released."""
    value = 0
    view = memoryview(bytearray(chunk_bytes))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            value = checksum(name, view[:n], value)
    return value
