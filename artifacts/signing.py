"""Optional signing of an artifact: an HMAC-SHA256 over the exact bytes of its manifest, stored
in the member `signature.json`.

The manifest holds the SHA-256 of every other member, so the one HMAC covers the whole file.
Without a key, loading detects damage and inconsistency (a member that does not match its hash,
a plan whose stored facts disagree with its IR), but not a careful edit whose hashes and facts
were recomputed. With the key, any edit is refused, and so is a file without a signature.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os

from .format import ExportError, json_bytes, parse_json

SIGNATURE = "signature.json"
ALGORITHM = "hmac-sha256"
MAX_KEY_FILE_BYTES = 2**16


class Authenticity(enum.Enum):
    """What a load could say about who wrote the file."""

    VERIFIED = "signed; HMAC-SHA256 signature verified with the given key"
    NOT_VERIFIED = "signed, but NOT verified: no key was given (pass key= or --key-file)"
    UNSIGNED = "unsigned: damage is detected, a careful edit is not"


def key_bytes(key) -> bytes:
    """A key as bytes: bytes as they are, str as UTF-8. Empty keys sign nothing: refused."""
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, bytes | bytearray):
        raise ExportError(f"key must be bytes or str, got {type(key).__name__}")
    if not key:
        raise ExportError("key is empty; use a secret of at least 16 random bytes")
    return bytes(key)


def signature_member(manifest: bytes, key) -> bytes:
    """The signature.json written next to the manifest."""
    digest = hmac.new(key_bytes(key), manifest, hashlib.sha256).hexdigest()
    return json_bytes({"algorithm": ALGORITHM, "hmac": digest})


def check_signature(manifest: bytes, signature: bytes | None, key) -> Authenticity:
    """Refuses, with key, an unsigned file or a signature the key did not make."""
    if signature is None:
        if key is not None:
            raise ExportError(
                "the artifact is not signed, but a key was given: it was exported without "
                "key=, or its signature was removed. Re-export it with bp.export(..., key=...)"
            )
        return Authenticity.UNSIGNED
    stored = parse_json(signature, SIGNATURE)
    if (
        not isinstance(stored, dict)
        or set(stored) != {"algorithm", "hmac"}
        or stored["algorithm"] != ALGORITHM
        or not isinstance(stored["hmac"], str)
    ):
        raise ExportError(f"{SIGNATURE} is malformed (expected an {ALGORITHM} digest)")
    if key is None:
        return Authenticity.NOT_VERIFIED
    expected = hmac.new(key_bytes(key), manifest, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, stored["hmac"]):
        raise ExportError(
            "the signature does not match the key: the file was changed after it was signed, "
            "or it was signed with a different key"
        )
    return Authenticity.VERIFIED


def read_key_file(path: str | os.PathLike) -> bytes:
    """A key kept in a file (for the command line): its bytes, one trailing newline ignored."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ExportError(f"cannot read key file {os.fspath(path)}: {exc}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ExportError(f"key file {os.fspath(path)} is over {MAX_KEY_FILE_BYTES} bytes")
    data = data.removesuffix(b"\n").removesuffix(b"\r")
    if not data:
        raise ExportError(f"key file {os.fspath(path)} is empty")
    return data
