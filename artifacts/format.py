"""What an artifact's members are: names, the manifest (format, version, SHA-256 and size of
every member), strict JSON, IR text and .npy arrays. The zip around them is container.py.

Reading never unpickles and never runs code from the file: JSON goes through a strict parser,
arrays through NumPy's header reader (allow_pickle=False, plain dtypes only), and members are
read into memory, never extracted, so a member name cannot point outside any folder.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re

import numpy as np

from backplan.ir.errors import BackplanError
from backplan.ir.types import BFLOAT16, DTYPES, dtype_name

FORMAT_NAME = "backplan-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_JSON_BYTES = 16 * 2**20
MAX_TEXT_BYTES = 64 * 2**20
MAX_INFLATED_BYTES = 256 * 2**20  # all compressed (JSON and text) members together
MAX_MEMBERS = 10_000
MAX_NAME_CHARS = 200
MEMBER_NAME = re.compile(r"^[a-z][a-z0-9_]*(/[a-z0-9][a-z0-9_]*)*\.(json|txt|npy)$")


class ExportError(BackplanError, ValueError):
    """An artifact that cannot be written, or read back: truncated, corrupted, edited, unsigned,
    from a newer format, or called with arguments it was not exported for. The message names
    the artifact, the member and what is wrong."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_member_name(name: str) -> None:
    """Names are relative, lower-case, without '..' or backslashes: nothing can escape a folder."""
    if (
        not isinstance(name, str)
        or not MEMBER_NAME.match(name)
        or ".." in name
        or len(name) > MAX_NAME_CHARS
    ):
        raise ExportError(
            f"member name {str(name)[:80]!r} is not allowed (absolute, '..', odd characters or "
            f"over {MAX_NAME_CHARS} characters)"
        )


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
    """bfloat16 is written as its 16-bit patterns (uint16): .npy has no bfloat16 (NumPy would
    write an opaque 'V2'); the metadata's dtype says how to read them back."""
    buffer = io.BytesIO()
    array = np.ascontiguousarray(array)
    if array.dtype == BFLOAT16:
        array = array.view(np.uint16)
    np.save(buffer, array, allow_pickle=False)
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
    bits = dtype == "bf16" and found_dtype == np.uint16  # bfloat16 as stored by array_to_npy
    if not bits and (found_dtype.hasobject or found_dtype not in DTYPES.values()):
        raise ExportError(
            f"member {member} holds dtype {found_dtype}; only {', '.join(DTYPES)} arrays are "
            "accepted (object arrays would need unpickling, which artifacts never do)"
        )
    found_name = "bf16" if bits else dtype_name(found_dtype)
    if found_name != dtype or tuple(found_shape) != tuple(shape):
        raise ExportError(
            f"member {member} holds {found_name}{list(found_shape)}, "
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
    array = np.ascontiguousarray(array) if fortran else array
    return array.view(BFLOAT16) if bits else array
