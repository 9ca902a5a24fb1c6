"""A compiled plan driver calls the library functions it uses (convolutions, GEMM entries, rows,
attention, random...) through their native entry points instead of linking them.

Numba links every function a compiled function calls into the caller's LLVM module, then
optimises and emits the whole module again: a CNN's 82-statement training-step driver spent
half of its compile re-optimising and re-emitting library functions that were compiled (and
cached) already. Here each library function a driver module names is wrapped
(`NativeCallee`), and a call of one compiles to a call of an external symbol; the symbol is
published in this process (`llvmlite.binding.add_symbol`) with the address of the function's
own compiled code, so the driver's module holds none of it.

Loop kernels stay linked: the driver inlines them (codegen/flags.py DRIVER_KERNEL_JIT_OPTIONS)
with its sizes and float literals as constants, and that specialisation is worth its compile
time: the digits CNN's training step ran 16% slower with every kernel called by address
(its pooling loops run over 2 to 4 elements), while calling the library functions by address
measured no slower (BENCHMARKS.md, compile time). BACKPLAN_DRIVER_LOOPS=address calls the
loops by address too (codegen/build/loop_calls.py).

The symbol's name describes the callee: its module, its name and the argument types it was
compiled for (a pickle, base64 in the name). A driver loaded from the disk cache in another
process, where every address differs, is handed to `resolve_payload` before it loads
(cache_signing.before_load): each name found in its machine code is read back, the callee
compiled or loaded from its own cache, and the name published with this process's address.
The payload was verified as backplan's (signed) before the hook sees it, so the names in it
are backplan's too.
"""

from __future__ import annotations

import base64
import importlib
import pickle
import re
import sys
import threading
import zlib

from llvmlite import binding
from numba import types
from numba.core import cgutils, imputils
from numba.core.compiler_lock import global_compiler_lock
from numba.core.dispatcher import Dispatcher
from numba.core.extending import lower_builtin, models, register_model, typeof_impl
from numba.core.typing.templates import Signature

from backplan.codegen.build import cache_signing

PREFIX = "bp_native_"
LOOP_KERNEL_MODULES = "backplan_kernel_"  # codegen/build/kernel_cache.py names them so
END = "."  # names may be stored back to back (LLVM bitcode's string table): each ends here
_NAME = re.compile(rb"bp_native_([A-Za-z0-9_-]+)\.")


class NativeCallee:
    """A function a compiled driver calls by address; called from Python it is the function.
    `widen`, when given, maps the caller's argument types to the ones the callee is compiled
    for (each a type the caller's converts to, e.g. an array of any layout): callers passing
    arrays of several layouts then share one compiled callee."""

    __slots__ = ("dispatcher", "widen")

    def __init__(self, dispatcher, widen=None):
        self.dispatcher = dispatcher
        self.widen = widen

    def __call__(self, *args, **kwargs):
        return self.dispatcher(*args, **kwargs)

    def compiled_for(self, args: tuple):
        """The callee's compiled version for a call with these argument types."""
        return _target(self.dispatcher, self.widen(args) if self.widen else args)

    def __repr__(self) -> str:
        return f"NativeCallee({_label(self.dispatcher)})"


def _label(dispatcher) -> str:
    return f"{dispatcher.py_func.__module__}.{dispatcher.py_func.__qualname__}"


def wrap_callees(namespace: dict) -> None:
    """Wrap, in a generated module's namespace, every library function its driver may call:
    Numba dispatchers other than loop kernels (inlined, see above), the driver itself and its
    parts (linked into `run`: they hold only calls), and functions Numba inlines in its IR."""
    for name, value in list(namespace.items()):
        if name == "run" or name.startswith("run_part") or not isinstance(value, Dispatcher):
            continue
        if value.py_func.__module__.startswith(LOOP_KERNEL_MODULES):
            continue
        if value.targetoptions.get("inline", "never") != "never":
            continue
        namespace[name] = NativeCallee(value)


def unwrapped(value):
    """The function a NativeCallee stands for (anything else as it is)."""
    return value.dispatcher if isinstance(value, NativeCallee) else value


class NativeFunction(types.Callable, types.Dummy):
    """Numba's type of a NativeCallee: a call types as the callee's compiled signature and
    lowers to a call of its symbol (lower_native_call)."""

    def __init__(self, callee: NativeCallee):
        self.callee = callee
        super().__init__(name=f"native({_label(callee.dispatcher)})")

    def get_call_type(self, context, args, kws):
        if kws:
            return None  # drivers pass arguments by position
        args = tuple(types.unliteral(a) for a in args)
        compiled = self.callee.compiled_for(args)
        return Signature(compiled.signature.return_type, args, recvr=self)

    def get_call_signatures(self):
        return [], True

    def get_impl_key(self, sig):
        return NativeFunction


register_model(NativeFunction)(models.OpaqueModel)  # no value: the call names its callee


@typeof_impl.register(NativeCallee)
def _typeof_callee(value, context):
    return NativeFunction(value)


@lower_builtin(NativeFunction, types.VarArg(types.Any))
def lower_native_call(context, builder, sig, args):
    """The call of the callee's symbol with its native calling convention (a status, the
    result through a pointer, the exception slot), the status propagated as Numba's own call of
    a compiled function does."""
    callee, argument_types, values = sig.args[0].callee, sig.args[1:], args[1:]
    compiled = callee.compiled_for(tuple(argument_types))
    target = compiled.signature
    name = publish(compiled)
    converted = [
        context.cast(builder, value, given, wanted)
        for value, given, wanted in zip(values, argument_types, target.args, strict=False)
    ]
    for omitted in target.args[len(values) :]:
        converted.append(context.get_constant_generic(builder, omitted, omitted.value))
    function_type = context.call_conv.get_function_type(target.return_type, target.args)
    function = cgutils.get_or_insert_function(builder.module, function_type, name)
    status, result = context.call_conv.call_function(
        builder, function, target.return_type, target.args, converted
    )
    with cgutils.if_unlikely(builder, status.is_error):
        context.call_conv.return_status_propagate(builder, status)
    result = imputils.fix_returning_optional(context, builder, target, status, result)
    return context.cast(builder, result, target.return_type, sig.return_type)


def _target(dispatcher, args: tuple):
    """The dispatcher's compiled version for these arguments (omitted defaults folded in),
    compiled here or loaded from its disk cache, once per process."""
    with global_compiler_lock:
        _, folded = dispatcher._compiler.fold_argument_types(args, {})
        folded = tuple(folded)
        if folded not in dispatcher.overloads:
            dispatcher.compile(folded)
        return dispatcher.overloads[folded]


_published: dict[str, int] = {}  # symbol -> address, in this process
_publishing = threading.Lock()


def symbol_name(compiled) -> str:
    """The callee's symbol: its module, name and argument types, readable back in another
    process (resolve_payload)."""
    described = (compiled.fndesc.modname, compiled.fndesc.qualname, tuple(compiled.signature.args))
    packed = zlib.compress(pickle.dumps(described, protocol=4), 9)
    return PREFIX + base64.urlsafe_b64encode(packed).decode().rstrip("=") + END


def publish(compiled, name: str | None = None) -> str:
    """Publish the compiled function's address under its symbol (or `name`, as a cached
    driver spells it) in this process; the name."""
    name = name or symbol_name(compiled)
    address = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
    if not address:
        raise RuntimeError(f"{compiled.fndesc.qualname} has no native entry to call")
    publish_address(name, address)
    return name


def publish_address(name: str, address: int) -> None:
    """Make `name` resolve to `address` for code loaded after this in this process."""
    with _publishing:
        if _published.get(name) != address:
            binding.add_symbol(name, address)
            _published[name] = address


class UnknownCallee(cache_signing.StaleEntry):
    """A cached driver names a callee this process cannot find: the driver is compiled again."""


def resolve_payload(payload: bytes) -> None:
    """Before a cached function whose machine code calls callees by symbol loads: publish each
    symbol with this process's address, compiling or loading each callee first."""
    for encoded in dict.fromkeys(_NAME.findall(payload)):
        name = PREFIX + encoded.decode() + END
        if name in _published:
            continue
        try:
            compiled = _callee(encoded)
        except UnknownCallee:
            raise
        except Exception as error:  # it does not compile here: compiling the driver says why
            raise UnknownCallee(f"{name[:60]}...: {type(error).__name__}: {error}") from error
        publish(compiled, name)


def _callee(encoded: bytes):
    """The compiled function a symbol names, in this process (compiled or loaded from its own
    cache here if it is not yet)."""
    module_name, qualname, args = _described(encoded)
    module = sys.modules.get(module_name)
    if module is None and not module_name.startswith(LOOP_KERNEL_MODULES):
        module = importlib.import_module(module_name)  # a library module; kernels are loaded
    function = unwrapped(getattr(module, qualname, None) if module is not None else None)
    if not isinstance(function, Dispatcher):
        raise UnknownCallee(f"{module_name}.{qualname} (not loaded in this process)")
    with global_compiler_lock:
        if args not in function.overloads:
            function.compile(args)
        return function.overloads[args]


def _described(encoded: bytes) -> tuple:
    padded = encoded + b"=" * (-len(encoded) % 4)
    return pickle.loads(zlib.decompress(base64.urlsafe_b64decode(padded)))


def callees_in(code: bytes) -> list[str]:
    """`module.name` of each function machine code calls by symbol."""
    return [f"{m}.{q}" for m, q, _ in map(_described, dict.fromkeys(_NAME.findall(code)))]


def callees_of(dispatcher) -> list[str]:
    """`module.name` of each function a compiled function's versions call by symbol."""
    found = []
    for compiled in dispatcher.overloads.values():
        _, _, (code, _) = compiled.library.serialize_using_object_code()
        found += callees_in(code)
    return found


def published_here() -> dict[str, bool]:
    """Each callee published in this process (`module.name(types)`): whether its symbol holds
    the address of the callee's compiled code in this process."""
    with _publishing:
        published = {n: a for n, a in _published.items() if n.startswith(PREFIX)}
    checked = {}
    for name, address in published.items():
        compiled = _callee(name[len(PREFIX) : -len(END)].encode())
        label = f"{compiled.fndesc.modname}.{compiled.fndesc.qualname}{compiled.signature}"
        own = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
        checked[label] = checked.get(label, True) and own == address
    return checked


cache_signing.before_load(PREFIX.encode(), resolve_payload)
