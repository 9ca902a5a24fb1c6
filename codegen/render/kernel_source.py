"""One fused loop as a kernel function of its own, in a canonical form, so that every plan with
the same loop body (any value names, any sizes) shares one compiled kernel.

The loop lines take each array as a base (b3: a 1-D array) and an offset (o3), make their own
views (w3) from them with sizes (n0, s1_n0) and strides in bytes (d3_1), and name locals t12,
accumulators acc_v12 and partial rows part_v12. Here every such name is renumbered by first
appearance, bases, offsets, sizes and strides become the kernel's parameters in that order,
and the source is keyed by its hash. A serial kernel takes one base parameter per view, so
that where a plan keeps an array (scratch, input, output) never changes its source and plans
share it (one array parameter per plan array instead cut an unrolled LSTM's kernel compile by
about a third, but split kernels a forward-only plan shares with its training plan). A parallel
kernel takes each plan array once, so that its views alias (see _one_view_per_memory). Dtype is
left to Numba's dispatch: one compiled version per argument types, all behind the same cached
dispatcher.

A serial kernel that allocates nothing (most of them) is the same loop twice: `kernel_at`
takes every array as its address (its dtypes written in its loads and stores,
codegen/render/address_loops.py) and has a C entry, which first calls reach from the driver running
as Python (codegen/run/address_calls.py); `kernel`, on array views, is what compiled drivers call.
Neither has a CPython wrapper. The wrapper unboxing a dozen arrays was about 30% of the cold
compile of an unrolled LSTM's kernels, array views and indexing another 40% of the rest
(measured A/B on the same box); `kernel` compiles with the driver, in the background.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

from backplan.codegen.render.address_loops import loads_and_stores

KERNEL_HEADER = '''"""A backplan loop kernel, shared by every plan whose loop has this body.
Keyed by the hash of this source; regenerated and compared before it runs; do not edit."""
import math

import numpy as np
from backplan.codegen.jit import njit, prange

from backplan.codegen.flags import (
    ADDRESS_KERNEL_JIT_OPTIONS, DRIVER_KERNEL_JIT_OPTIONS, INTERLEAVED_LOOP_KERNEL_JIT_OPTIONS,
    KERNEL_JIT_OPTIONS, LEAN_KERNEL_JIT_OPTIONS, PARALLEL_KERNEL_JIT_OPTIONS,
    SMALL_LOOP_KERNEL_JIT_OPTIONS,
)
from backplan.codegen.kernels.scalar_functions import *  # noqa: F403
from backplan.codegen.kernels.views import (
    contiguous_bits_view, contiguous_view, contiguous_view_at, load, load_bytes, origin, store,
    store_bytes, strided_view, strided_view_at,
)
'''
# What a kernel running backplan's GEMM on blocks of rows imports besides
# (codegen/render/epilogue.py).
GEMM_IMPORTS = "from backplan.codegen.kernels.gemm.api import ROW_BLOCK, gemm as own_gemm\n"

# (pattern, canonical prefix): bases, offsets, strides and sizes are parameters; the rest locals.
_NAMES = re.compile(
    r"\b(?:(?P<acc>acc_v\d+)|(?P<part>part_v\d+)|(?P<local>t\d+)"
    r"|(?:s\d+_)?(?:(?P<array>b\d+)|(?P<offset>o\d+)|(?P<stride>d\d+_\d+)|(?P<view>w\d+)"
    r"|(?P<size>n\d+)))\b"
)
_PREFIX = {
    "acc": "acc",
    "part": "part",
    "local": "t",
    "array": "a",
    "offset": "o",
    "stride": "d",
    "view": "w",
    "size": "n",
}
_PARAMETERS = ("array", "offset", "stride", "size")


@dataclass(frozen=True)
class KernelSource:
    """A canonical kernel and how one plan calls it."""

    digest: str  # hash of `source`: the kernel's identity, file name and registry key
    source: str  # a whole module defining `kernel`
    parallel: bool
    arguments: tuple[str, ...]  # the plan's expressions for the parameters, in order

    @property
    def name(self) -> str:
        """The name the plan's driver gives the kernel."""
        return f"k_{self.digest[:20]}"

    @property
    def takes_addresses(self) -> bool:
        """Whether a Python-run driver calls its loops taking addresses (`kernel_at`)."""
        return "def kernel_at(" in self.source


def canonical_kernel(
    lines: list[str],
    scalars: dict,
    bases: dict,
    parallel: bool,
    salt: str,
    shared: bool = False,
    imports: str = "",
    dtype_of=lambda base: None,
):
    """lines: the loop's source; scalars: value of each offset, size and stride name it uses;
    bases: the plan's array for each base name. salt: everything else the compiled code
    depends on (code generator fingerprint, flags). shared: each plan array one parameter
    (always so in a parallel kernel); otherwise one per view. imports: lines added to the
    header (GEMM_IMPORTS). dtype_of: the NumPy type name (np.float32) of a plan array, None
    where unknown; a kernel takes addresses only when every array's dtype is known."""
    if parallel:
        lines = _one_view_per_memory(lines, scalars, bases)
    key = (tuple(lines), tuple(bases.items()), parallel, salt, shared, imports)
    key += (tuple(dtype_of(a) for a in bases.values()),)
    found = _RENAMED.get(key)
    if found is None:
        found = _with_these_literals(lines, key)
    if found is None:
        found = _renamed(lines, bases, parallel, salt, shared, imports, dtype_of)
        _keep(_RENAMED, key, found)
        floats, shape_key = _float_literals(lines, key)
        if floats and found[3] == floats:  # every float literal a parameter: values apart
            _keep(_PARAMETERS_APART, shape_key, found[:3])
    digest, source, words, literals = found
    arguments = [f"np.intp({scalars[word]})" if array is None else array for word, array in words]
    return KernelSource(digest, source, parallel, (*arguments, *literals))


# (loop lines, bases, ...) -> (digest, source, each parameter's (word, plan array or None),
# literal arguments): the same loop at another batch size of one symbolic plan (or of a plan
# rendered again) differs only in its sizes and offsets, the scalars' values, so it is renamed
# and hashed once (an unrolled LSTM's 210 calls: about a third of rendering a new size).
_RENAMED: dict = {}
RENAMED_KEPT = 8192
# The same with each float literal's text a placeholder (its first place among the loop's
# distinct float literals) -> (digest, source, words), for loops whose every float literal
# became a parameter (an address kernel: `_literals_as_parameters`): a mean's 1/n or
# attention's scale differ at another batch size, and only their values, passed as arguments,
# do; a loop that keeps a literal in its code is found by its own lines alone.
_PARAMETERS_APART: dict = {}


def _keep(cache: dict, key, found) -> None:
    if len(cache) >= RENAMED_KEPT:
        cache.clear()
    cache[key] = found


def _float_literals(lines: list[str], key: tuple) -> tuple[tuple, tuple]:
    """(the loop's distinct float literals as written, in first-use order; the key with each
    one's text a placeholder)."""
    texts: list[str] = []

    def placeholder(match: re.Match) -> str:
        text = match.group(0)
        if text not in texts:
            texts.append(text)
        return f"np.float{match.group(1)}(<{texts.index(text)}>)"

    shaped = tuple(_FLOAT_LITERAL.sub(placeholder, line) for line in lines)
    return tuple(texts), (shaped, *key[1:])


def _with_these_literals(lines: list[str], key: tuple) -> tuple | None:
    """The renaming of a loop seen with other float literals only, all of them parameters:
    its digest, source and words, and these literals as its arguments; else None."""
    if not _PARAMETERS_APART:
        return None
    floats, shape_key = _float_literals(lines, key)
    found = _PARAMETERS_APART.get(shape_key) if floats else None
    return None if found is None else (*found, floats)


def _renamed(lines, bases, parallel, salt, shared, imports, dtype_of) -> tuple:
    renamed, params, words = {}, [], []
    counters = dict.fromkeys(_PREFIX, 0)
    parameter_of: dict[str, str] = {}  # the plan's array -> its parameter, when shared

    def rename(match: re.Match) -> str:
        word = match.group(0)
        if word not in renamed and match.lastgroup == "array" and (shared or parallel):
            renamed[word] = parameter_of.get(bases[word])
        if renamed.get(word) is None:
            kind = match.lastgroup
            renamed[word] = f"{_PREFIX[kind]}{counters[kind]}"
            counters[kind] += 1
            if kind in _PARAMETERS:
                params.append(renamed[word])
                words.append((word, bases[word] if kind == "array" else None))
            if kind == "array":
                parameter_of[bases[word]] = renamed[word]
        return renamed[word]

    body = tuple(_NAMES.sub(rename, line) for line in lines)
    dtypes = tuple((p, dtype_of(a)) for p, (_, a) in zip(params, words, strict=True) if p[0] == "a")
    digest, source, literals = _kernel_text(body, tuple(params), parallel, salt, imports, dtypes)
    return digest, source, tuple(words), literals


@functools.lru_cache(maxsize=4096)
def _kernel_text(
    body: tuple, params: tuple, parallel: bool, salt: str, imports: str, dtypes: tuple
) -> tuple[str, str, tuple[str, ...]]:
    """(digest, source, literal arguments) of a renamed loop body. Cached: an unrolled loop
    calls the same few kernels at every step (858 call sites of 21 kernels in a 48-step LSTM),
    and making each call site's kernel again cost its first call a quarter of a second."""
    params, literals = list(params), []
    functions = None
    if parallel:
        decorator = "@njit(parallel=True, **PARALLEL_KERNEL_JIT_OPTIONS)"
    elif allocates(body):
        decorator = "@njit(**KERNEL_JIT_OPTIONS)"
    else:
        decorator = "@njit(**LEAN_KERNEL_JIT_OPTIONS)"
        # Only in an address kernel: the twin compiled drivers call is force-inlined, so its
        # float parameters are constants again; any other kernel keeps its literals.
        names, values = [], []
        loop = _literals_as_parameters(list(body), names, values)
        functions = _address_kernel(params + names, loop, dict(dtypes))
        if functions is not None:
            params += names
            literals = values
    if functions is None:
        functions = [decorator, f"def kernel({', '.join(params)}):"]
        functions += ["    " + line for line in body]
    source = "\n".join([KERNEL_HEADER + imports, "", *functions]) + "\n"
    digest = hashlib.sha256((salt + "\n" + source).encode()).hexdigest()
    return digest, source, tuple(literals)


_FLOAT_LITERAL = re.compile(r"\bnp\.float(32|64)\((-?\d+(?:\.\d*)?(?:e[-+]?\d+)?)\)")


def _literals_as_parameters(body: list[str], params: list[str], arguments: list[str]) -> list[str]:
    """The body with its float literals as parameters (`c0_f32`), appended with their values:
    a mean's 1/n or attention's 1/sqrt(d) depend on the sizes, and as literals they made the
    same loop of a model at other sizes a kernel of its own (a transformer at 1/64 of its
    width compiled 8 new kernels, 1.0 s). Compiled drivers pass them as constants, so after
    inlining the code is what the literal gave."""
    names: dict[str, str] = {}

    def parameter(match: re.Match) -> str:
        text = match.group(0)
        if text not in names:
            names[text] = f"c{len(names)}_f{match.group(1)}"
            params.append(names[text])
            arguments.append(text)
        return names[text]

    return [_FLOAT_LITERAL.sub(parameter, line) for line in body]


def _address_kernel(params: list[str], body: list[str], dtypes: dict) -> list[str] | None:
    """`kernel_at` (arrays as addresses, loads and stores; a loop converting 16-bit values or
    summing into a scalar optimised with interleaving: codegen/build/loop_optimisation.py
    INTERLEAVED_LOOP), `kernel_at_small`
    (the same, compiled quickly, for calls over few elements: codegen/run/address_calls.py
    picks) and `kernel` (the same loop on array views), or None where an array's dtype is
    unknown or the body uses an array other than in a view. Compiled drivers call `kernel`:
    inlined there with the plan's sizes as constants, the view form kept its speed where the
    address form lost some (a CNN's 4-deep pooling loops: 41 against 52-62 us per call); it
    compiles with the driver, in the background, while first calls use `kernel_at` or
    `kernel_at_small`."""
    if any(d is None for d in dtypes.values()):
        return None
    # Views loads_and_stores leaves (a GEMM's operands, codegen/render/epilogue.py) are made from
    # addresses.
    loop = _views_at(loads_and_stores(body, dtypes) or body, dtypes)
    if loop is None:
        return None
    at = [*("    " + line for line in loop), "", ""]
    options = "INTERLEAVED_LOOP" if converts_16_bit(loop) or sums_into_scalar(loop) else "ADDRESS"
    return [
        f"@njit(**{options}_KERNEL_JIT_OPTIONS)",
        f"def kernel_at({', '.join(params)}):",
        *at,
        "@njit(**SMALL_LOOP_KERNEL_JIT_OPTIONS)",
        f"def kernel_at_small({', '.join(params)}):",
        *at,
        "@njit(**DRIVER_KERNEL_JIT_OPTIONS)",
        f"def kernel({', '.join(params)}):",
        *("    " + line for line in body),
    ]


# The conversions codegen/kernels/half.py gives generated loops for bfloat16 and float16 values.
_HALF_CONVERSION = re.compile(r"\b(?:bf16_to_f32|f16_to_f32|f32_to_bf16|f32_to_f16)\(")


def converts_16_bit(loop: list[str]) -> bool:
    """Whether a loop body loads or stores bfloat16 or float16 values (through conversions)."""
    return any(_HALF_CONVERSION.search(line) for line in loop)


_SCALAR_SUM = re.compile(r"^\s*acc\d+ \+= ")  # loops.py's sum into a scalar accumulator


def sums_into_scalar(loop: list[str]) -> bool:
    """Whether a loop body sums into a scalar (a row's sum, a loss): vectorised without
    interleaving, such a sum has one vector add in flight, a chain of adds' latency."""
    return any(_SCALAR_SUM.match(line) for line in loop)


_ADDRESS_VIEW = re.compile(r"^(\s*\w+ = )(contiguous|strided)_view\((a\d+), (.*)\)$")
_ARRAY_PARAMETER = re.compile(r"\ba\d+\b")
_ORIGIN = re.compile(r"^\s*p\d+ = origin\(a\d+, ")  # what loads_and_stores made of a view


def _views_at(body: list[str], dtypes: dict) -> list[str] | None:
    """The body with its views made from addresses (codegen/kernels/views.py), where its views are
    used in ways loads_and_stores does not write out."""
    loop = []
    for line in body:
        match = _ADDRESS_VIEW.match(line)
        if match:
            start, kind, array, rest = match.groups()
            loop.append(f"{start}{kind}_view_at({array}, {rest}, {dtypes[array]})")
        elif _ARRAY_PARAMETER.search(line) and not _ORIGIN.match(line):
            return None
        else:
            loop.append(line)
    return loop


# What a kernel body may call and still allocate nothing: loops, its own views, scalar NumPy
# types and constants, math and the scalar functions kernels import
# (codegen/kernels/scalar_functions.py).
_CALL = re.compile(r"(?<!\w)(np\.|math\.|\.)?(\w+)\(")
_NUMPY_SCALARS = {
    "float16", "float32", "float64", "intp", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool_",
}  # fmt: skip
_BUILTINS = {"range", "prange", "min", "max", "abs", "int", "float", "bool", "len"}
_VIEWS = {"contiguous_view", "contiguous_bits_view", "strided_view"}
# Calls that return nothing and keep no array: the GEMM takes its arrays by address and its
# packing buffers are its own (codegen/kernels/gemm/symbols.py).
_RETURNS_NOTHING = {"own_gemm"}


@functools.cache
def _scalar_functions() -> frozenset[str]:
    from backplan.codegen.kernels import scalar_functions

    return frozenset(name for name, value in vars(scalar_functions).items() if callable(value))


def allocates(lines: list[str]) -> bool:
    """Whether a kernel body may allocate (or receive) an array that needs Numba's
    reference-counting runtime: any call but the known scalar ones counts, conservatively.
    A missed allocation made in the kernel itself would be refused by Numba's compiler; one
    returned by a callee would leak, hence a list of what is allowed, not of what is not."""
    allowed = _BUILTINS | _VIEWS | _RETURNS_NOTHING | _scalar_functions()
    for line in lines:
        for prefix, name in _CALL.findall(line):
            if prefix == "np." and name in _NUMPY_SCALARS:
                continue
            if prefix == "math." or (not prefix and name in allowed):
                continue
            return True  # anything else, array methods included
    return False


_VIEW = re.compile(r"((?:s\d+_)?w\d+) = ((?:contiguous|strided)_view\(.*\))$")
_VIEW_NAME = re.compile(r"\b(?:s\d+_)?w\d+\b")


def _one_view_per_memory(lines: list[str], scalars: dict, bases: dict) -> list[str]:
    """Views of the same memory (a value one stage of a row kernel stores and a later stage
    reads) become one view. Numba's parfor lowering sees no aliasing among the arrays a
    parallel loop uses (their views are made before it) and marks them noalias: two views of
    the same elements would let LLVM move a load above the store it must follow."""
    first: dict[str, str] = {}  # the view's memory, as text -> its first view's name
    same: dict[str, str] = {}  # a repeated view -> the first one
    kept = []
    for line in lines:
        match = _VIEW.match(line)
        if match:
            memory = _NAMES.sub(
                lambda m: str(bases.get(m.group(0), scalars.get(m.group(0), m.group(0)))),
                match.group(2),
            )
            if memory in first:
                same[match.group(1)] = first[memory]
                continue
            first[memory] = match.group(1)
        kept.append(line)
    return [_VIEW_NAME.sub(lambda m: same.get(m.group(0), m.group(0)), line) for line in kept]
