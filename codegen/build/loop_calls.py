"""A compiled driver calls the plan's loops through their native entries, the very machine code a
Python-run driver's first calls already run, instead of inlining each loop's view form.

A driver inlining its loops re-types, re-lowers, re-optimises and re-emits every loop of the
plan in its own module: a deep MLP's 380-statement driver took about 20 CPU s to build, an
unrolled LSTM's longer, and steps ran the Python-run driver meanwhile (BENCHMARKS.md, 31).
Here each call of an address kernel (codegen/render/kernel_source.py: `kernel_at`, fully
optimised, or `kernel_at_small`, compiled quickly for loops over few elements) in the driver
lowers to a call of an external symbol naming the loop form; the symbol is published in this
process (`llvmlite.binding.add_symbol`) with the address of the form's entry, compiled or loaded
by the plan's first call (codegen/run/address_calls.py, codegen/build/loop_batch.py). Arrays
go as the address of their first element, float literals and sizes as values: the same
arguments as the Python-run driver passes through ctypes. The driver's own compile is then its
statements: argument conversions and calls.

The symbol names the kernel and the form (`bp_loop_<kernel>_<form>.`), nothing else: the
kernel's name is the hash of its source. A driver loaded from the disk cache in another process
is handed to `resolve_payload` (cache_signing.before_load, after its signature is checked): each
loop form it names gets its entry in this process (loaded from its batch or Numba's cache, or
compiled) and the symbol this process's address. A kernel the process has not loaded (it is
loaded with its plan, before the driver) makes the cached driver stale: compiled again.

The price: LLVM sees neither the loop's body at the call nor the plan's sizes as constants.
BACKPLAN_DRIVER_LOOPS picks: `linked` (the loops' view forms inlined into the driver, as before)
or `address` (this).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

from numba import types
from numba.core import cgutils
from numba.core.extending import lower_builtin, models, register_model, typeof_impl
from numba.core.typing.templates import Signature

from backplan.codegen.build import cache_signing, native_calls

MODES = ("linked", "address")
PREFIX = "bp_loop_"
_NAME = re.compile(rb"bp_loop_(k_[0-9a-f]+)_(kernel_at(?:_small)?)\.")
FORMS = ("kernel_at", "kernel_at_small")  # by whether the form is the small one


def mode() -> str:
    """BACKPLAN_DRIVER_LOOPS: how a compiled driver reaches the plan's loops."""
    chosen = os.environ.get("BACKPLAN_DRIVER_LOOPS") or "linked"
    if chosen not in MODES:
        raise ValueError(
            f"BACKPLAN_DRIVER_LOOPS={chosen!r}; use one of {', '.join(MODES)} (how a compiled "
            "driver calls the plan's loops: inlined into it, or by the address of their code)"
        )
    return chosen


def key_text() -> str:
    """What a driver's machine code depends on here, for its cache key: a driver calling loops
    by address and one inlining them are different code from the same source."""
    return "" if mode() == "linked" else "|loops:address"


class LoopCallee(native_calls.NativeCallee):
    """A loop kernel as the compiled driver sees it: its calls go to a loop form's native entry
    (`call`, the kernel's codegen/run/address_calls.AddressCall). `dispatcher` is the kernel
    itself: what a Python-run driver maps to its AddressCall (native_calls.unwrapped)."""

    __slots__ = ("call", "kernel_name")

    def __init__(self, dispatcher, call, kernel_name: str):
        super().__init__(dispatcher)
        self.call = call
        self.kernel_name = kernel_name

    def __repr__(self) -> str:
        return f"LoopCallee({self.kernel_name})"


def wrap_loops(namespace: dict) -> None:
    """In a generated driver module's namespace, each address kernel (`k_<hash>`) becomes a
    LoopCallee; any other kernel (parallel, allocating) a NativeCallee, called by address too:
    linked, it would be compiled again for each literal size the driver passes it (Numba
    specialises a dispatcher called from compiled code on literal arguments)."""
    from numba.core.dispatcher import Dispatcher

    from backplan.codegen.build import kernel_cache

    for name, value in list(namespace.items()):
        if not name.startswith("k_") or isinstance(value, native_calls.NativeCallee):
            continue
        call = kernel_cache.python_call(value)
        if call is not value:
            namespace[name] = LoopCallee(value, call, name)
        elif isinstance(value, Dispatcher):
            namespace[name] = native_calls.NativeCallee(value)


class LoopFunction(types.Callable, types.Dummy):
    """Numba's type of a LoopCallee: a call returns nothing and lowers to a call of the loop
    form's symbol (lower_loop_call)."""

    def __init__(self, callee: LoopCallee):
        self.callee = callee
        super().__init__(name=f"loop({callee.kernel_name})")

    def get_call_type(self, context, args, kws):
        if kws or len(args) != len(self.callee.call._kinds):
            return None  # the driver passes every parameter, by position
        return Signature(types.none, tuple(types.unliteral(a) for a in args), recvr=self)

    def get_call_signatures(self):
        return [], True

    def get_impl_key(self, sig):
        return LoopFunction


register_model(LoopFunction)(models.OpaqueModel)


@typeof_impl.register(LoopCallee)
def _typeof_loop(value, context):
    return LoopFunction(value)


@lower_builtin(LoopFunction, types.VarArg(types.Any))
def lower_loop_call(context, builder, sig, args):
    """The loop form's native entry called as Numba calls a compiled function (a status, a
    result pointer, the exception slot), a failing status propagated."""
    callee = sig.args[0].callee
    kinds = [getattr(types, kind[0]) for kind in callee.call._kinds]
    name = publish(callee.call, driver_form(callee.call))
    values = []
    for value, given, wanted in zip(args[1:], sig.args[1:], kinds, strict=True):
        if wanted == types.voidptr:
            data = context.make_array(given)(context, builder, value).data
            values.append(builder.bitcast(data, cgutils.voidptr_t))
        else:
            values.append(context.cast(builder, value, given, wanted))
    function_type = context.call_conv.get_function_type(types.none, kinds)
    function = cgutils.get_or_insert_function(builder.module, function_type, name)
    status, _ = context.call_conv.call_function(builder, function, types.none, kinds, values)
    with cgutils.if_unlikely(builder, status.is_error):
        context.call_conv.return_status_propagate(builder, status)
    return context.get_dummy_value()


def driver_form(call) -> bool:
    """Which form the driver calls (True: the small one): the full loop where it is compiled or
    cached (it serves calls of any size at full speed), else the small one where that is,
    else the full one, compiled now."""
    if call._full_is_ready():
        return False
    return call._entries[True] is not None or not call.needs_compiling(True)


def symbol(kernel_name: str, small: bool) -> str:
    return f"{PREFIX}{kernel_name}_{FORMS[small]}."


def publish(call, small: bool) -> str:
    """Publish the form's entry (compiled or loaded now if it has none) under its symbol."""
    entry = call._entries[small] or call._compile(small)
    address = ctypes.cast(entry, ctypes.c_void_p).value
    name = symbol(_kernel_name(call), small)
    native_calls.publish_address(name, address)
    return name


def _kernel_name(call) -> str:
    module = call.loop(False).py_func.__module__
    return module.removeprefix(native_calls.LOOP_KERNEL_MODULES)


def published_here() -> dict[str, bool]:
    """Each loop symbol published in this process: whether it holds the address of its form's
    entry in this process."""
    with native_calls._publishing:
        published = {n: a for n, a in native_calls._published.items() if n.startswith(PREFIX)}
    checked = {}
    for name, address in published.items():
        kernel_name, form = _NAME.match(name.encode()).groups()
        entry = _call_of(kernel_name)._entries[form.decode() == FORMS[True]]
        checked[name] = entry is not None and ctypes.cast(entry, ctypes.c_void_p).value == address
    return checked


def _call_of(kernel_name: bytes):
    """The AddressCall of a loaded loop kernel, by its name; None where it is not loaded."""
    from backplan.codegen.build import kernel_cache

    module = sys.modules.get(native_calls.LOOP_KERNEL_MODULES + kernel_name.decode())
    call = kernel_cache.python_call(getattr(module, "kernel", None))
    return call if hasattr(call, "_compile") else None


def resolve_payload(payload: bytes) -> None:
    """Before a cached driver calling loops by symbol loads: each loop form it names gets its
    entry in this process, and the symbol its address."""
    for kernel_name, form in dict.fromkeys(_NAME.findall(payload)):
        call = _call_of(kernel_name)
        if call is None:
            raise native_calls.UnknownCallee(f"loop kernel {kernel_name.decode()} is not loaded")
        try:
            publish(call, form.decode() == FORMS[True])
        except Exception as error:  # it does not compile here: compiling the driver says why
            raise native_calls.UnknownCallee(f"{kernel_name.decode()}: {error}") from error


cache_signing.before_load(PREFIX.encode(), resolve_payload)
