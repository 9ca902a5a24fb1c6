"""The zip's end-of-central-directory record, read on its own before `zipfile` parses the
directory: the member count and the directory's size are checked there, so a zip with 400,000
members is refused after reading a few bytes, not after building 400,000 ZipInfo objects.

The record is found the way `zipfile` finds it (the last 22 bytes, else the last occurrence of
its signature in the final 64 KiB), so both read the same record; a Zip64 record, where present,
gives the counts instead.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

END_SIGNATURE = b"PK\x05\x06"
END_FORMAT = "<4s4H2LH"  # signature, disk, directory disk, entries here, entries, size, offset,
END_SIZE = struct.calcsize(END_FORMAT)  # comment length: 22 bytes
ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
ZIP64_LOCATOR_FORMAT = "<4sLQL"
ZIP64_LOCATOR_SIZE = struct.calcsize(ZIP64_LOCATOR_FORMAT)
ZIP64_END_SIGNATURE = b"PK\x06\x06"
ZIP64_END_FORMAT = "<4sQ2H2L4Q"
ZIP64_END_SIZE = struct.calcsize(ZIP64_END_FORMAT)
MAX_COMMENT = 2**16 - 1


@dataclass(frozen=True)
class ZipEnd:
    """What the end record says about the central directory."""

    members: int
    directory_bytes: int


def read_zip_end(stream: BinaryIO) -> ZipEnd | None:
    """The member count and directory size, or None when there is no end record (not a zip)."""
    stream.seek(0, 2)
    file_size = stream.tell()
    if file_size < END_SIZE:
        return None
    stream.seek(file_size - END_SIZE)
    record = stream.read(END_SIZE)
    if record[:4] == END_SIGNATURE and record[-2:] == b"\x00\x00":
        return _with_zip64(stream, file_size - END_SIZE, record)
    tail_start = max(file_size - MAX_COMMENT - END_SIZE, 0)
    stream.seek(tail_start)
    tail = stream.read()
    found = tail.rfind(END_SIGNATURE)
    if found < 0 or len(tail) - found < END_SIZE:
        return None
    return _with_zip64(stream, tail_start + found, tail[found : found + END_SIZE])


def _with_zip64(stream: BinaryIO, end_offset: int, record: bytes) -> ZipEnd:
    fields = struct.unpack(END_FORMAT, record)
    plain = ZipEnd(members=fields[4], directory_bytes=fields[5])
    locator_offset = end_offset - ZIP64_LOCATOR_SIZE
    if locator_offset < ZIP64_END_SIZE:
        return plain
    stream.seek(locator_offset)
    locator = stream.read(ZIP64_LOCATOR_SIZE)
    if locator[:4] != ZIP64_LOCATOR_SIGNATURE:
        return plain
    stream.seek(locator_offset - ZIP64_END_SIZE)
    record64 = stream.read(ZIP64_END_SIZE)
    if record64[:4] != ZIP64_END_SIGNATURE:
        return plain
    fields64 = struct.unpack(ZIP64_END_FORMAT, record64)
    return ZipEnd(members=fields64[7], directory_bytes=fields64[8])
