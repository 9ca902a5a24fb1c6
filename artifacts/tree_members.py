"""Reading the members of a saved tree (.npz) with every limit checked before the work it bounds,
as bp.load reads artifacts: the member count from the zip's end record before the directory is
parsed, every member's size from the central directory before anything is inflated, each
array's shape and dtype from its .npy header before its memory is allocated. A crafted file is
refused with a TreeFileError naming what is wrong, never answered with MemoryError or minutes of
work; an accepted leaf is read straight into its array (one copy of its bytes in memory)."""

from __future__ import annotations

import math
import zipfile

import numpy as np

from backplan.ir.types import DTYPES

from .container import MAX_DIRECTORY_BYTES
from .format import MAX_JSON_BYTES, MAX_MEMBERS
from .zip_end import read_zip_end

TREE_MEMBER = "__tree__"
NPY = ".npy"
MAX_LEAVES = MAX_MEMBERS * 10  # a large model's parameters with two moments each fit easily
MAX_HEADER_BYTES = 2**16  # np.save writes headers of a few hundred bytes
READ_CHUNK = 2**20


class TreeLimitError(ValueError):
    """Raised here; load_tree words it as a TreeFileError naming the file."""


def check_zip_end(raw) -> int:
    """The number of members the zip declares, refused before its directory is read."""
    end = read_zip_end(raw)
    if end is None:
        raise zipfile.BadZipFile("no end-of-central-directory record")
    if end.members > MAX_LEAVES + 1:
        raise TreeLimitError(
            f"the zip declares {end.members} members, more than a saved tree may hold "
            f"({MAX_LEAVES} leaves); refused before reading its directory"
        )
    if end.directory_bytes > MAX_DIRECTORY_BYTES * 10:
        raise TreeLimitError(
            f"the zip's directory is {end.directory_bytes} bytes, more than {MAX_LEAVES} "
            "leaves need; refused before reading it"
        )
    raw.seek(0)
    return end.members


def member_infos(zf: zipfile.ZipFile, declared: int, max_bytes: int) -> dict[str, zipfile.ZipInfo]:
    """name (without .npy) -> its directory entry, once each; the inflated sizes the directory
    declares add up to at most max_bytes, and the structure member to at most MAX_JSON_BYTES."""
    infos = zf.infolist()
    if len(infos) != declared:
        raise TreeLimitError(
            f"the zip's directory holds {len(infos)} members, its end says {declared}"
        )
    named = {info.filename.removesuffix(NPY): info for info in infos}
    if len(named) != len(infos):
        raise TreeLimitError("a member name appears twice in the zip")
    tree = named.get(TREE_MEMBER)
    if tree is not None and tree.file_size > MAX_JSON_BYTES + MAX_HEADER_BYTES:
        raise TreeLimitError(
            f"the structure member claims {tree.file_size} bytes, over {MAX_JSON_BYTES}"
        )
    total = sum(info.file_size for info in infos)
    if total > max_bytes:
        raise TreeLimitError(
            f"its members would take {total} bytes in memory, more than the {max_bytes} bytes "
            "allowed (max_bytes, default this machine's physical memory); refused before "
            "inflating any; pass max_bytes= to load_tree if this is intended"
        )
    return named


def read_array(zf: zipfile.ZipFile, info: zipfile.ZipInfo, what: str) -> np.ndarray:
    """The array of one .npy member: its header read and checked (dtype one of backplan's,
    shape within the member's declared size) before the array is allocated, then filled."""
    with zf.open(info) as stream:
        dtype, shape, fortran = _npy_header(stream, what)
        nbytes = math.prod(shape) * dtype.itemsize
        if stream.tell() + nbytes != info.file_size:
            raise TreeLimitError(
                f"{what}: its header claims shape {shape} of {dtype} ({nbytes} bytes), but the "
                f"member holds {info.file_size - stream.tell()} bytes of data"
            )
        buffer = np.empty(nbytes, np.uint8)
        filled = 0
        while filled < nbytes:  # in chunks: a zip stream's readinto reads the rest at once
            chunk = stream.read(min(READ_CHUNK, nbytes - filled))
            if not chunk:
                raise TreeLimitError(f"{what} is truncated")
            buffer[filled : filled + len(chunk)] = np.frombuffer(chunk, np.uint8)
            filled += len(chunk)
    return buffer.view(dtype).reshape(shape, order="F" if fortran else "C")


def _npy_header(stream, what: str) -> tuple[np.dtype, tuple[int, ...], bool]:
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream, MAX_HEADER_BYTES)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream, MAX_HEADER_BYTES)
        else:
            raise ValueError(f"npy format version {version}, which save_tree never writes")
    except ValueError as exc:
        raise TreeLimitError(f"{what}: not an array save_tree wrote ({exc})") from None
    if dtype not in DTYPES.values() and dtype != np.uint16:  # uint16: bfloat16 bits
        raise TreeLimitError(f"{what} has dtype {dtype}")
    return dtype, tuple(int(n) for n in shape), bool(fortran)
