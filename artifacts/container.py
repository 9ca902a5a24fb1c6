"""The zip around an artifact's members: written atomically, read with every limit checked before
the work it bounds (the member count and directory size from the zip's end record before the
directory is parsed, sizes before inflating, the signature before any member is read).

Members are read into memory, never extracted, so a member name cannot point outside a folder.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from dataclasses import dataclass

from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    MAX_INFLATED_BYTES,
    MAX_JSON_BYTES,
    MAX_MEMBERS,
    MAX_NAME_CHARS,
    ExportError,
    check_manifest,
    check_member_name,
    json_bytes,
    parse_json,
    sha256,
)
from .replacing_write import write_replacing
from .signing import SIGNATURE, Authenticity, check_signature, key_bytes, signature_member
from .zip_end import read_zip_end

CENTRAL_ENTRY_BYTES = 46  # a central-directory entry before its name and extras
MAX_DIRECTORY_BYTES = MAX_MEMBERS * (CENTRAL_ENTRY_BYTES + MAX_NAME_CHARS + 54)
MAX_SIGNATURE_BYTES = 4096


@dataclass(frozen=True)
class ArtifactContents:
    """Every member, checked against the manifest, and what the signature said."""

    manifest: dict
    members: dict[str, bytes]
    authenticity: Authenticity


def write_artifact(path: str | os.PathLike, members: dict[str, bytes], info: dict, key=None) -> str:
    """Write members plus a manifest (and, with key, its signature) atomically: a temp file in
    the same folder, then rename."""
    for name in members:
        check_member_name(name)
    if SIGNATURE in members or MANIFEST in members:
        raise ExportError(f"{SIGNATURE} and {MANIFEST} are written by the container itself")
    manifest = json_bytes(
        {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            **info,
            "members": {
                n: {"sha256": sha256(d), "bytes": len(d)} for n, d in sorted(members.items())
            },
        }
    )
    extra = {MANIFEST: manifest}
    if key is not None:
        extra[SIGNATURE] = signature_member(manifest, key)
    return _write_zip(os.fspath(path), {**extra, **dict(sorted(members.items()))})


def _write_zip(path: str, members: dict[str, bytes]) -> str:
    def write(raw) -> None:
        with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in members.items():
                zf.writestr(name, data, compress_type=compression(name))

    return write_replacing(path, write, lambda text, _: ExportError(text))


def compression(name: str) -> int:
    """Arrays are stored uncompressed, so their size is bounded by the file's own size."""
    return zipfile.ZIP_STORED if name.endswith(".npy") else zipfile.ZIP_DEFLATED


# ---- reading ----------------------------------------------------------------------------------

ZIP_ERRORS = (  # what zipfile and zlib raise reading a damaged zip
    zipfile.BadZipFile,
    zlib.error,
    EOFError,
    OSError,
    ValueError,
    KeyError,
    NotImplementedError,
    RuntimeError,
    struct.error,
    OverflowError,
    UnicodeError,
)


def read_artifact(path: str | os.PathLike, key=None) -> ArtifactContents:
    """Every member, checked against the manifest; with key, the signature first."""
    where = os.fspath(path)
    if key is not None:
        key_bytes(key)  # a bad key is the caller's mistake: say so before reading anything
    if os.path.isdir(where):
        raise ExportError(f"{where}: a folder, not an artifact file (a .bpz bp.export wrote)")
    if not os.path.isfile(where):
        raise ExportError(f"{where}: no such artifact file")
    try:
        with open(where, "rb") as raw:
            members = _check_zip_end(raw)
            with zipfile.ZipFile(raw) as zf:
                return _read_checked(zf, os.path.getsize(where), members, key)
    except ExportError as exc:
        raise ExportError(f"{where}: {exc}") from None
    except ZIP_ERRORS as exc:
        raise ExportError(
            f"{where}: not a readable artifact (truncated or corrupted zip): {exc}"
        ) from None


def _check_zip_end(raw) -> int:
    """The member count the zip's end record declares, refused before the directory is read."""
    end = read_zip_end(raw)
    if end is None:
        raise zipfile.BadZipFile("no end-of-central-directory record")
    if end.members > MAX_MEMBERS:
        raise ExportError(
            f"the zip declares {end.members} members, more than an artifact can hold "
            f"({MAX_MEMBERS}); refused before reading its directory"
        )
    if end.directory_bytes > MAX_DIRECTORY_BYTES:
        raise ExportError(
            f"the zip's directory is {end.directory_bytes} bytes, more than {MAX_MEMBERS} "
            f"members need ({MAX_DIRECTORY_BYTES}); refused before reading it"
        )
    raw.seek(0)
    return end.members


def _read_checked(zf: zipfile.ZipFile, file_size: int, declared: int, key) -> ArtifactContents:
    infos = zf.infolist()
    names = _check_names(infos, declared)
    _check_sizes(infos)
    manifest_bytes = _read_member(zf, zf.getinfo(MANIFEST), MAX_JSON_BYTES, file_size)
    signature = None
    if SIGNATURE in names:
        signature = _read_member(zf, zf.getinfo(SIGNATURE), MAX_SIGNATURE_BYTES, file_size)
    authenticity = check_signature(manifest_bytes, signature, key)
    manifest = parse_json(manifest_bytes, MANIFEST)
    listed = check_manifest(manifest)
    if SIGNATURE in listed or MANIFEST in listed:
        raise ExportError(f"the manifest lists {MANIFEST} or {SIGNATURE} as a member")
    extra = sorted(set(names) - set(listed) - {MANIFEST, SIGNATURE})
    missing = sorted(set(listed) - set(names))
    if extra or missing:
        raise ExportError(
            f"the manifest does not match the zip: members not listed "
            f"{extra}, listed but absent {missing}"
        )
    members = {name: _read_listed(zf, name, entry, file_size) for name, entry in listed.items()}
    return ArtifactContents(manifest, members, authenticity)


def _check_names(infos: list[zipfile.ZipInfo], declared: int) -> list[str]:
    names = [i.filename for i in infos]
    if len(infos) != declared:
        raise ExportError(
            f"the zip's directory holds {len(infos)} members, its end record says {declared}"
        )
    if len(set(names)) != len(names):
        raise ExportError("a member name appears twice in the zip")
    for name in names:
        check_member_name(name)
    if MANIFEST not in names:
        raise ExportError(f"no {MANIFEST}; this is not a backplan artifact")
    return names


def _read_listed(zf: zipfile.ZipFile, name: str, entry: dict, file_size: int) -> bytes:
    info = zf.getinfo(name)
    if info.file_size != entry["bytes"]:
        raise ExportError(
            f"member {name} holds {info.file_size} bytes, the manifest says {entry['bytes']}"
        )
    data = _read_member(zf, info, entry["bytes"], file_size)
    if sha256(data) != entry["sha256"]:
        raise ExportError(
            f"member {name} does not match its SHA-256 in the manifest (damaged, or edited "
            "without updating the manifest)"
        )
    return data


_METHODS = {zipfile.ZIP_STORED: "uncompressed", zipfile.ZIP_DEFLATED: "deflated"}


def _check_sizes(infos: list[zipfile.ZipInfo]) -> None:
    """No zip bombs: arrays must be stored as they are, and compressed members are few and small."""
    inflated = 0
    for info in infos:
        method = compression(info.filename)
        if info.compress_type != method:
            found = _METHODS.get(info.compress_type, "compressed an unknown way")
            raise ExportError(
                f"member {info.filename} is {found}, the format stores it {_METHODS[method]}"
            )
        if method == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise ExportError(f"member {info.filename} is stored but its sizes differ")
        if method == zipfile.ZIP_DEFLATED:
            inflated += info.file_size
    if inflated > MAX_INFLATED_BYTES:
        raise ExportError(
            f"compressed members would inflate to {inflated} bytes, over "
            f"the limit of {MAX_INFLATED_BYTES}"
        )


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, file_size: int) -> bytes:
    if info.file_size > limit:
        raise ExportError(f"member {info.filename} claims {info.file_size} bytes, over {limit}")
    if info.compress_type == zipfile.ZIP_STORED and info.header_offset + info.file_size > file_size:
        raise ExportError(f"member {info.filename} claims more bytes than the file holds")
    with zf.open(info) as handle:
        data = handle.read(limit + 1)
    if len(data) != info.file_size:
        raise ExportError(f"member {info.filename} is truncated")
    return data
