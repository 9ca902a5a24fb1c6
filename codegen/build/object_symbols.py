"""A function loaded from Numba's disk cache without parsing its linking bitcode first.

Numba caches a function as its object code plus the LLVM bitcode of its module, which is only
needed if a function compiled later links it in; yet loading parsed that bitcode at once, then
asked LLVM, one call per function and global, which symbols it defines. In a warm process's
first call that was most of Numba's load: mlp_deep's ten cached functions, 0.058 of its 0.14 s.
Here the bitcode is parsed when something links the library, and the defined symbols come
from the object code's ELF symbol table (struct unpacking, no LLVM): its global and weak
symbols with a section, the same names LLVM gives less the module's internal constants, which
nothing looks up by name. An object that is not 64-bit little-endian ELF, or that cannot be
read, takes Numba's own path.

Only what backplan already loaded is read here: the cache files are signed and checked before
Numba unpickles them (codegen/build/cache_signing.py).
"""

from __future__ import annotations

import struct
import threading

from llvmlite import binding as ll
from numba.core import codegen

_SYMBOL_TABLE = 2  # SHT_SYMTAB
_UNDEFINED = 0  # SHN_UNDEF
_GLOBAL, _WEAK = 1, 2  # symbol bindings
_SECTION = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
_SYMBOL = struct.Struct("<IBBHQQ")  # Elf64_Sym


def defined_symbols(obj: bytes) -> set[str] | None:
    """Names of the global and weak symbols a 64-bit little-endian ELF object defines; None
    for anything else."""
    if obj[:4] != b"\x7fELF" or obj[4:6] != b"\x02\x01":
        return None
    try:
        (table,) = struct.unpack_from("<Q", obj, 0x28)
        entry, count = struct.unpack_from("<HH", obj, 0x3A)
        sections = [_SECTION.unpack_from(obj, table + i * entry) for i in range(count)]
        names = set()
        for _, kind, _, _, offset, size, link, _, _, step in sections:
            if kind == _SYMBOL_TABLE:
                names |= _globals(obj, offset, size, step, sections[link][4])
        return names
    except (struct.error, IndexError, ValueError, UnicodeDecodeError):
        return None


def _globals(obj: bytes, offset: int, size: int, step: int, strings: int) -> set[str]:
    names = set()
    for k in range(offset, offset + size, step):
        name, info, _, section, _, _ = _SYMBOL.unpack_from(obj, k)
        if name and section != _UNDEFINED and info >> 4 in (_GLOBAL, _WEAK):
            start = strings + name
            names.add(obj[start : obj.index(b"\0", start)].decode())
    return names


_numba_unserialize = codegen.CPUCodeLibrary._unserialize.__func__
_numba_module_for_linking = codegen.CPUCodeLibrary._get_module_for_linking


def _unserialize(cls, codegen_, state):
    """Numba's CPUCodeLibrary._unserialize for object code, the bitcode kept unparsed."""
    name, kind, data = state
    symbols = defined_symbols(data[0]) if kind == "object" else None
    if symbols is None:
        return _numba_unserialize(cls, codegen_, state)
    library = codegen_.create_library(name)
    library.enable_object_caching()
    library._set_compiled_object(data[0])
    library._unparsed_bitcode = data[1]
    library._finalize_final_module()  # loads the object code into the engine
    library._codegen._engine._defined_symbols |= symbols
    return library


def _get_module_for_linking(library):
    """The linking module, parsed from the kept bitcode the first time it is asked for."""
    bitcode = getattr(library, "_unparsed_bitcode", None)
    if bitcode is not None:
        library._shared_module = ll.parse_bitcode(bitcode)
        library._unparsed_bitcode = None
    return _numba_module_for_linking(library)


_installed = threading.Lock()


def install() -> None:
    """Load cached functions this way in this process (once; Numba's compiler lock is held
    around every load and link)."""
    with _installed:
        if codegen.CPUCodeLibrary._get_module_for_linking is not _get_module_for_linking:
            codegen.CPUCodeLibrary._unserialize = classmethod(_unserialize)
            codegen.CPUCodeLibrary._get_module_for_linking = _get_module_for_linking
