"""The artifact container: one zip file whose members are JSON, IR text and .npy arrays, with a
manifest holding the SHA-256 and size of every member.

Reading never unpickles and never runs code from the file: JSON goes through a strict parser,
arrays through NumPy's header reader (allow_pickle=False, plain dtypes only), and members are
read into memory, never extracted, so a member name cannot point outside any folder.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import struct
import tempfile
import zipfile
import zlib

import numpy as np

from backplan.ir.errors import BackplanError
from backplan.ir.types import DTYPES, dtype_name

FORMAT_NAME = "backplan-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_JSON_BYTES = 16 * 2**20
MAX_TEXT_BYTES = 64 * 2**20
MAX_INFLATED_BYTES = 256 * 2**20  # all compressed (JSON and text) members together
MAX_MEMBERS = 10_000
MEMBER_NAME = re.compile(r"^[a-z][a-z0-9_]*(/[a-z0-9][a-z0-9_]*)*\.(json|txt|npy)$")


class ExportError(BackplanError, ValueError):
    """An artifact that cannot be written, or read back: truncated, corrupted, tampered with,
    from a newer format, or called with arguments it was not exported for. The message names
    the artifact, the member and what is wrong."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_member_name(name: str) -> None:
    """Names are relative, lower-case, without '..' or backslashes: nothing can escape a folder."""
    if not isinstance(name, str) or not MEMBER_NAME.match(name) or ".." in name:
        raise ExportError(f"member name {name!r} is not allowed (absolute, '..' or odd characters)")


def write_artifact(path: str | os.PathLike, members: dict[str, bytes], info: dict) -> str:
    """Write members plus a manifest atomically (temp file in the same folder, then rename)."""
    for name in members:
        check_member_name(name)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **info,
        "members": {n: {"sha256": sha256(d), "bytes": len(d)} for n, d in sorted(members.items())},
    }
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".bpz-", dir=folder)
    except OSError as exc:
        raise ExportError(f"cannot write {path}: {exc}") from None
    try:
        with os.fdopen(fd, "wb") as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(MANIFEST, json_bytes(manifest))
            for name in sorted(members):
                zf.writestr(name, members[name], compress_type=_compression(name))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def _compression(name: str) -> int:
    """Arrays are stored uncompressed, so their size is bounded by the file's own size."""
    return zipfile.ZIP_STORED if name.endswith(".npy") else zipfile.ZIP_DEFLATED


# ---- reading ----------------------------------------------------------------------------------

_ZIP_ERRORS = (
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


def read_artifact(path: str | os.PathLike) -> tuple[dict, dict[str, bytes]]:
    """Every member, checked against the manifest. Returns (manifest, members)."""
    where = os.fspath(path)
    if not os.path.isfile(where):
        raise ExportError(f"{where}: no such artifact file")
    try:
        with zipfile.ZipFile(where) as zf:
            return _read_checked(zf, os.path.getsize(where))
    except ExportError as exc:
        raise ExportError(f"{where}: {exc}") from None
    except _ZIP_ERRORS as exc:
        raise ExportError(
            f"{where}: not a readable artifact (truncated or corrupted zip): {exc}"
        ) from None


def _read_checked(zf: zipfile.ZipFile, file_size: int) -> tuple[dict, dict[str, bytes]]:
    infos = zf.infolist()
    names = [i.filename for i in infos]
    if len(infos) > MAX_MEMBERS:
        raise ExportError(f"{len(infos)} members, more than an artifact can hold")
    if len(set(names)) != len(names):
        raise ExportError("a member name appears twice in the zip")
    for name in names:
        check_member_name(name)
    if MANIFEST not in names:
        raise ExportError(f"no {MANIFEST}; this is not a backplan artifact")
    _check_sizes(infos)
    manifest = parse_json(
        _read_member(zf, zf.getinfo(MANIFEST), MAX_JSON_BYTES, file_size), MANIFEST
    )
    listed = check_manifest(manifest)
    extra = sorted(set(names) - set(listed) - {MANIFEST})
    missing = sorted(set(listed) - set(names))
    if extra or missing:
        raise ExportError(
            f"the manifest does not match the zip: members not listed "
            f"{extra}, listed but absent {missing}"
        )
    members = {}
    for name, entry in listed.items():
        info = zf.getinfo(name)
        if info.file_size != entry["bytes"]:
            raise ExportError(
                f"member {name} holds {info.file_size} bytes, the manifest says {entry['bytes']}"
            )
        data = _read_member(zf, info, entry["bytes"], file_size)
        if sha256(data) != entry["sha256"]:
            raise ExportError(
                f"member {name} does not match its SHA-256 in the manifest "
                "(corrupted or tampered with)"
            )
        members[name] = data
    return manifest, members


_METHODS = {zipfile.ZIP_STORED: "uncompressed", zipfile.ZIP_DEFLATED: "deflated"}


def _check_sizes(infos: list[zipfile.ZipInfo]) -> None:
    """No zip bombs: arrays must be stored as they are, and compressed members are few and small."""
    inflated = 0
    for info in infos:
        method = _compression(info.filename)
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


def check_manifest(manifest) -> dict[str, dict]:
    """Format name and version first, so a newer artifact gets a clear 'upgrade' message."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ExportError(f"{MANIFEST} does not describe a {FORMAT_NAME}")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ExportError(f"unknown artifact format version {version!r}")
    if version > FORMAT_VERSION:
        made_by = manifest.get("backplan_version", "a newer backplan")
        raise ExportError(
            f"artifact format version {version} was written by backplan {made_by}; "
            f"this backplan reads format versions up to {FORMAT_VERSION}. Upgrade backplan, or "
            "re-export the model with this version."
        )
    members = manifest.get("members")
    if not isinstance(members, dict):
        raise ExportError(f"{MANIFEST} has no member table")
    for name, entry in members.items():
        check_member_name(name)
        ok = isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if not ok or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ExportError(f"manifest entry for {name} is malformed")
    return members


# ---- JSON and arrays --------------------------------------------------------------------------


def json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=False, allow_nan=False).encode("utf-8")


def _refuse_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"an object repeats a key among {sorted(set(keys))[:5]}")
    return dict(pairs)


def parse_json(data: bytes, member: str):
    """Strict JSON (no NaN, no Infinity), size-limited; any failure names the member."""
    if len(data) > MAX_JSON_BYTES:
        raise ExportError(f"member {member} is {len(data)} bytes, too large for a JSON member")
    try:
        return json.loads(
            data.decode("utf-8"), parse_constant=_refuse_constant, object_pairs_hook=_unique_keys
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ExportError(f"member {member} is not valid JSON: {exc}") from None


def parse_text(data: bytes, member: str) -> str:
    if len(data) > MAX_TEXT_BYTES:
        raise ExportError(f"member {member} is {len(data)} bytes, too large for IR text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ExportError(f"member {member} is not UTF-8 text: {exc}") from None


def array_to_npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def npy_to_array(data: bytes, member: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Read the header first and check dtype and shape against what the metadata promised, so a
    pickle payload or an absurd shape is refused before NumPy allocates or reads anything."""
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        reader = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        found_shape, fortran, found_dtype = reader(stream)
    except (ValueError, SyntaxError, TypeError, EOFError) as exc:
        raise ExportError(f"member {member} is not a valid .npy array: {exc}") from None
    if found_dtype.hasobject or found_dtype not in DTYPES.values():
        raise ExportError(
            f"member {member} holds dtype {found_dtype}; only {', '.join(DTYPES)} arrays are "
            "accepted (object arrays would need unpickling, which artifacts never do)"
        )
    if dtype_name(found_dtype) != dtype or tuple(found_shape) != tuple(shape):
        raise ExportError(
            f"member {member} holds {dtype_name(found_dtype)}{list(found_shape)}, "
            f"the metadata says {dtype}{list(shape)}"
        )
    expected = math.prod(shape) * found_dtype.itemsize
    if len(data) - stream.tell() != expected:
        raise ExportError(
            f"member {member} has {len(data) - stream.tell()} data bytes, a "
            f"{dtype}{list(shape)} array needs {expected}"
        )
    stream.seek(0)
    try:
        array = np.load(stream, allow_pickle=False)
    except ValueError as exc:
        raise ExportError(f"member {member} could not be read: {exc}") from None
    return np.ascontiguousarray(array) if fortran else array
