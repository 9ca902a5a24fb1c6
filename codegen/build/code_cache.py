"""The Python code objects of generated modules, kept beside them, so that a warm process does not
compile their source again.

Every process that runs a plan executes its driver module and its loop kernels' modules (their
functions are what Numba compiles, or finds in its cache, and what a Python-run driver runs).
compile() of that source was a large part of a warm first call: an unrolled 48-step LSTM's
modules 0.08-0.10 CPU s of 0.44-0.56, the bench transformer's 0.02-0.03 of 0.25. Here the code
object of each generated source is written once into the cache folder's `__pycache__`, marshalled
and signed with this user's key (codegen/build/cache_signing.py), with the hash of the source,
of the file name it runs under and of the Python version it was compiled by; a later process
whose source and file name hash the same runs the loaded code. Anything else (no file, an
unsigned or edited one, another source or Python) compiles the source as before and writes the
file again; a file this user did not sign is removed with a CacheWarning first, as a kernel's
cache file is (cache_signing.discard). marshal is only read from files this user signed: it is
not safe on untrusted bytes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os

from backplan.codegen.build import cache_health, cache_signing

# What a code object depends on besides its source and file name: the interpreter's bytecode.
_PYTHON = importlib.util.MAGIC_NUMBER


def compiled(source: str, path: str, directory: str | None):
    """The code object of `source` run under the file name `path`: loaded from the code file
    beside it when this user signed one for this very source, else compiled (and written when
    `directory`, the writable cache folder, is given; None: compiled in memory)."""
    identity = _identity(source, path)
    name = _name(path)
    cached = os.path.join(os.path.dirname(path), "__pycache__", name)
    code = _load(cached, name, identity)
    if code is not None:
        return code
    code = compile(source, path, "exec")
    if directory is not None:
        _save(cached, name, identity, code)
    return code


def _identity(source: str, path: str) -> bytes:
    return hashlib.sha256(_PYTHON + path.encode() + b"\0" + source.encode()).digest()


def _name(path: str) -> str:
    """The code file's name: the module's, so `cache info` counts it and `cache clear` removes
    it with the module (backplan/cache_cli.py)."""
    return os.path.splitext(os.path.basename(path))[0] + ".code"


def _load(cached: str, name: str, identity: bytes):
    try:
        with open(cached) as f:
            data = bytes.fromhex(f.read())
    except OSError:
        return None
    except (ValueError, UnicodeDecodeError):
        cache_signing.discard(cached, "is not a code file backplan wrote")
        return None
    payload, why = cache_signing.verified(name, data)
    if payload is None:  # unsigned, edited, planted: removed with a warning, as a kernel's file
        cache_signing.discard(cached, why)
        return None
    if payload[: len(identity)] != identity:
        return None  # ours, written for other source (an older plan): compiled and rewritten
    try:
        return marshal.loads(payload[len(identity) :])
    except (EOFError, ValueError, TypeError):
        return None


def _save(cached: str, name: str, identity: bytes, code) -> None:
    signed = cache_signing.signed(name, identity + marshal.dumps(code))
    try:
        os.makedirs(os.path.dirname(cached), mode=0o700, exist_ok=True)
        cache_health.write_atomic(cached, signed.hex())
    except OSError as error:
        cache_health.note_unwritable(os.path.dirname(os.path.dirname(cached)), error)
