"""How a driver running as Python calls an address kernel (codegen/render/kernel_source.py), which
has
no CPython wrapper and no C wrapper: through its loop's native entry with ctypes, each array
passed as the address of its first element. Numba's native calling convention is a status code
returned, a pointer to the result and a pointer to the exception slot first, then the arguments
as declared (pointers, intp, floats: each one machine value). A C wrapper would be one more
function to lower, and LLVM inlines the loop into it, so the loop was optimised and emitted
twice: a cold unrolled LSTM's kernels compiled about a fifth faster without it.

Addresses are looked up once per driver call (`with_addresses`): an
ndarray's address costs about 1.5 us to ask for, and a driver passes the same arena to dozens
of kernels."""

from __future__ import annotations

import ctypes
import math
import re
import threading

from backplan.codegen.flags import SMALL_LOOP_ELEMENTS
from backplan.codegen.jit import is_cached

# A parameter's Numba and C type, by its name (codegen/render/kernel_source.py): an array's address,
# a float literal of the loop (c0_f32), or an integer (offsets, sizes, strides).
_KINDS = {
    "address": ("voidptr", ctypes.c_void_p),
    "f32": ("float32", ctypes.c_float),
    "f64": ("float64", ctypes.c_double),
    "integer": ("intp", ctypes.c_ssize_t),
}


def _parameter_names(loop) -> tuple[str, ...]:
    code = loop.py_func.__code__
    return code.co_varnames[: code.co_argcount]


def parameter_kinds(loop) -> tuple:
    """(Numba type name, ctypes type) of each parameter of a loop taking addresses."""
    return tuple(_KINDS[_kind(name)] for name in _parameter_names(loop))


def _kind(name: str) -> str:
    if name.startswith("a"):
        return "address"
    if name.startswith("c") and name[-4:] in ("_f32", "_f64"):
        return name[-3:]
    return "integer"


class AddressCall:
    """A Python-run driver's call of an address kernel: arrays become their addresses and the
    loop's native entry runs, compiled (or loaded from the disk cache) on the first call.
    A call over at most SMALL_LOOP_ELEMENTS iterations (the product of its sizes) runs the
    loop compiled quickly (codegen/flags.py), any other the fully optimised one: each is
    compiled the first time a call needs it, except that a small call takes the full loop
    where that one is compiled or cached already (a resized model's first call compiles
    nothing)."""

    def __init__(self, loop, small_loop=None):
        self._loops = (loop, small_loop or loop)  # by whether the call is small
        names = _parameter_names(loop)
        self._kinds = parameter_kinds(loop)
        self._arrays = tuple(kind is _KINDS["address"] for kind in self._kinds)
        self._sizes = tuple(i for i, name in enumerate(names) if re.fullmatch(r"n\d+", name))
        self._entries = [None, None]
        self._libraries = [None, None]  # the Numba code library holding each entry's code
        self._symbols = [None, None]  # each entry's name in it
        self._lock = threading.RLock()  # a small call may compile the full loop
        # Where the native entry writes its (none) result and would point at an exception;
        # written by every call, read by none: threads may share them.
        self._result = ctypes.create_string_buffer(64)
        self._exception = ctypes.c_void_p()
        self.group = ()  # [(call, small)] of the plan loading it (codegen/build/loop_batch.py)

    def __call__(self, *args):
        small = bool(math.prod([args[i] for i in self._sizes]) <= SMALL_LOOP_ELEMENTS)
        entry = self._entries[small] or self._compile(small)
        status = entry(
            self._result,
            ctypes.byref(self._exception),
            *[address(a) if array else a for a, array in zip(args, self._arrays, strict=True)],
        )
        if status != 0:
            raise RuntimeError(
                f"loop kernel {self._loops[0].py_func.__module__} returned status {status}: "
                "loop kernels do not raise; run with BACKPLAN_KERNELS_AS_PYTHON=1 to see the line"
            )

    def is_small(self, sizes: list[int]) -> bool:
        """Whether a call over these sizes (the loop's size parameters, in order) is small."""
        return math.prod(sizes) <= SMALL_LOOP_ELEMENTS

    def loop(self, small: bool):
        return self._loops[small]

    def _compile(self, small: bool):
        from backplan.codegen.build import loop_batch

        with self._lock:
            if small and self._entries[True] is None and self._full_is_ready():
                self._entries[True] = self._entries[False] or self._compile(False)
            if self._entries[small] is None and (self, small) in self.group:
                loop_batch.compile_together(self.group)  # with the plan's other loops
            if self._entries[small] is None:
                self.needs_compiling(small)  # sets the entry where a batch on disk holds it
            if self._entries[small] is None:  # Numba's own compile, or its cache
                loop = self._loops[small]
                loop.compile(loop_batch.signature(loop))
                compiled = loop.overloads[loop_batch.signature(loop)]
                pointer = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
                self.set_entry(small, pointer, compiled.library, compiled.fndesc.llvm_func_name)
        return self._entries[small]

    def needs_compiling(self, small: bool) -> bool:
        """Whether this form has no entry yet and no cache holds it; an entry found in a batch
        on disk (codegen/build/loop_batch.py) is set here."""
        from backplan.codegen.build import loop_batch

        if self._entries[small] is not None or (small and self._full_is_ready()):
            return False  # a small call takes the full loop where that one is ready
        loop = self._loops[small]
        if loop.overloads or is_cached(loop):
            return False  # Numba loads it from its cache
        found = loop_batch.cached_entry(loop)
        if found is not None:
            self.set_entry(small, *found)
            return False
        return True

    def library(self, small: bool):
        """The code library holding the loop this form of call runs (None before it runs):
        Numba's own for a loop compiled alone, a batch's (codegen/build/loop_batch.py)."""
        return self._libraries[small] or (self._libraries[False] if small else None)

    def set_entry(self, small: bool, pointer: int, library, symbol: str) -> None:
        """The form's native entry, callable with ctypes, from its address in `library`, where
        `symbol` names it."""
        if not pointer:
            raise RuntimeError(
                f"loop kernel {self._loops[small].py_func.__module__} has no native entry"
            )
        prototype = ctypes.CFUNCTYPE(
            ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, *[kind[1] for kind in self._kinds]
        )
        self._libraries[small], self._symbols[small] = library, symbol
        self._entries[small] = prototype(pointer)

    def _full_is_ready(self) -> bool:
        from backplan.codegen.build import loop_batch

        full = self._loops[0]
        return self._entries[False] is not None or is_cached(full) or loop_batch.has_cached(full)


_driver_call = threading.local()


def address(array) -> int:
    """The address of an array's first element. Inside a driver call (with_addresses), each
    array is looked up once and held until the call ends, so that no other array can take
    its id meanwhile."""
    known = getattr(_driver_call, "addresses", None)
    if known is None:
        return array.ctypes.data
    entry = known.get(id(array))
    if entry is None:
        entry = known[id(array)] = (array, array.ctypes.data)
    return entry[1]


def with_addresses(run):
    """run, calling kernels with each array's address looked up once per call."""

    def call(*args):
        before = getattr(_driver_call, "addresses", None)
        _driver_call.addresses = {}
        try:
            return run(*args)
        finally:
            _driver_call.addresses = before

    call.__wrapped__ = run
    return call
