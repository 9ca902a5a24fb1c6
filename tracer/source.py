"""Finding the user's own source: the first frames that are not backplan itself, walked once per
op, and the public backplan function the user called there."""

import contextlib
import functools
import sys
import sysconfig
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from backplan.runtime.location import SourceLoc, loc_text

__all__ = ["located", "user_frame_loc", "loc_text", "at_location"]

MAX_USER_FRAMES = 3
_NOT_USER_DIRS = tuple(
    {
        sysconfig.get_paths()[k]
        for k in ("stdlib", "purelib", "platlib")
        if k in sysconfig.get_paths()
    }
)
_outside_user_code: dict[str, bool] = {}
_getframe = sys._getframe
_PLUMBING = frozenset({"apply", "fn", "located_call"})  # dispatch, generated wrappers, located


def _is_library(module_name: str) -> bool:
    if module_name.startswith(("backplan.examples", "backplan.demo", "backplan.bench.peers")):
        # the demo and its models are user code; so are the bench's runners: their step is
        # the training loop a user writes, and the call path they time walks what a user's does
        return False
    return (
        module_name == "backplan"
        or module_name.startswith("backplan.")
        or module_name in ("contextlib", "functools")
    )


def _module_name(globals_: dict) -> str:
    """A module's real name, also when it runs as __main__ (`python -m backplan ...`)."""
    name = globals_.get("__name__", "")
    if name == "__main__":
        spec = globals_.get("__spec__")
        name = getattr(spec, "name", None) or name
    return name


def _is_outside_user_code(filename: str) -> bool:
    """Frames of the standard library and installed packages (a test runner, runpy) end the
    user's stack: the user is not looking at them."""
    known = _outside_user_code.get(filename)
    if known is None:
        known = filename.startswith(_NOT_USER_DIRS) or filename.startswith("<frozen")
        _outside_user_code[filename] = known
    return known


def _public_name(name: str) -> str | None:
    """Library frames seen from the inside out; the outermost one with a public name is the
    function the user called (`mse_loss`, not the `mul` it calls)."""
    public = name.isidentifier() and not name.startswith("_") and name not in _PLUMBING
    return name if public else None


USER, LIBRARY, OUTSIDE = 0, 1, 2
# id(code) -> (USER | LIBRARY | OUTSIDE, public name or None, code, token): the entry holds
# the code, so its id names no other code while the entry lives
_code_facts: dict = {}
_locs: dict = {}  # (api, token, offset, ...) -> (SourceLoc, codes): repeated lines share one
MAX_CACHED = 20_000


def _facts(frame) -> tuple:
    """What a frame's code is, worked out once per code object (each op walks only lookups)."""
    code = frame.f_code
    facts = _code_facts.get(id(code))  # by id: hashing a code object hashes its contents
    if facts is None or facts[2] is not code:
        if len(_code_facts) > MAX_CACHED:
            _code_facts.clear()
        if _is_library(_module_name(frame.f_globals)):
            kind = LIBRARY
        else:
            kind = OUTSIDE if _is_outside_user_code(code.co_filename) else USER
        facts = _code_facts[id(code)] = (kind, _public_name(code.co_name), code, object())
    return facts


class _Given(threading.local):
    """.loc: the location a translator names for the ops it calls. A class default, not
    getattr(local, "loc", None): a missing attribute raises and catches AttributeError inside
    getattr, which cost every compiled call and backward() 0.4 us twice."""

    loc: SourceLoc | None = None


_given = _Given()
# at_location blocks open now, in any thread: while there are none, user_frame_loc does not ask
# the thread's own (a threading.local read cost ~500 instructions, twice a compiled step)
_given_open = 0
_given_count_lock = threading.Lock()


@contextlib.contextmanager
def at_location(loc: SourceLoc | None):
    """Ops called inside record `loc` as their user line: code translated from another
    framework (an imported PyTorch module) names the line of the model it came from, not the
    translator's own frames."""
    global _given_open
    outer = _given.loc
    _given.loc = loc
    with _given_count_lock:
        _given_open += 1
    try:
        yield
    finally:
        _given.loc = outer
        with _given_count_lock:
            _given_open -= 1


def user_frame_loc(skip: int = 0, api: str | None = None) -> SourceLoc | None:
    """The innermost user frame as a SourceLoc, with up to MAX_USER_FRAMES user frames around
    it (they stop at backplan's own frames, so a traced function's stack ends at its body) and
    the public function called from it. Every op and compiled call asks, so the walk is a
    dict lookup per frame (what a code object is, worked out once) and one per location; the
    frames are listed again only to make a location not seen before. skip: how many frames, the
    caller's first, are backplan's own by construction (a fast path's fixed chain of calls),
    passed over in one step: each frame walked costs a frame object and ~0.1 us. api: the
    public function those skipped frames stand for (Tensor.backward names itself)."""
    if _given_open:
        given = _given.loc
        if given is not None:
            return given
    frame = _getframe(1 + skip)
    try:  # a subscript, not .get: a method call costs a compiled step ~1,000 instructions
        facts = _code_facts[id(frame.f_code)]
    except KeyError:
        facts = _facts(frame)
    while facts[0] == LIBRARY:
        if facts[1] is not None:
            api = facts[1]
        frame = frame.f_back
        if frame is None:
            return None
        facts = _code_facts.get(id(frame.f_code)) or _facts(frame)
    # a code's token, not its id or itself: a code object hashes by its whole content, and
    # an id is a new int compared by value; a token hashes and compares by identity. The
    # instruction offset, not the line: f_lineno decodes the code's line table on every read
    # (a long module's loop paid microseconds), and an offset falls on one line. Each f_back
    # makes a frame object (Python 3.11 creates them on demand): none past the last one kept.
    first, key, depth = frame, [api, facts[3], frame.f_lasti], 1
    while depth < MAX_USER_FRAMES:
        frame = frame.f_back
        if frame is None:
            break
        try:
            facts = _code_facts[id(frame.f_code)]
        except KeyError:
            facts = _facts(frame)
        if facts[0] != USER:
            break
        key.append(facts[3])
        key.append(frame.f_lasti)
        depth += 1
    key = tuple(key)
    try:
        return _locs[key][0]
    except KeyError:
        return _new_loc(key, depth, first, api)


def _new_loc(key: tuple, depth: int, frame, api: str | None) -> SourceLoc:
    """The SourceLoc of `depth` frames from `frame` outwards, kept for the next call with the
    codes its key names (so their ids stay theirs while the entry lives)."""
    if len(_locs) > MAX_CACHED:
        _locs.clear()
    frames = []
    for _ in range(depth):
        frames.append(frame)
        frame = frame.f_back
    stack = tuple((f.f_code.co_name, f.f_code.co_filename, f.f_lineno) for f in frames)
    loc = SourceLoc(stack, api)
    _locs[key] = (loc, [f.f_code for f in frames])
    return loc


_LOCATED = ("ShapeError", "DtypeError", "BackplanError", "OperandTypeError", "IndexError")
_depth = threading.local()
F = TypeVar("F", bound=Callable[..., Any])


def located(fn: F) -> F:
    """Public ops raise ShapeError and DtypeError naming the op the user called and the user's
    line, as errors from the graph builder do. Only the outermost op call (mean, not the sum it
    calls) rewrites the message, and only when the line is not in it yet."""
    name = fn.__name__

    @functools.wraps(fn)
    def located_call(*args, **kwargs):
        depth = getattr(_depth, "value", 0)
        _depth.value = depth + 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if depth or type(exc).__name__ not in _LOCATED:
                raise
            raise _with_location(exc, name) from None
        finally:
            _depth.value = depth

    return located_call  # type: ignore[return-value]


def _with_location(exc: Exception, name: str) -> Exception:
    loc = user_frame_loc()
    message = str(exc)
    if loc is None or f"{loc[0]}:{loc[1]}" in message or loc_text(loc) in message:
        return exc
    if not message.startswith(f"{name}(") and not message.startswith(f"{name}:"):
        message = f"{name}: {message}"
    return type(exc)(f"{message} at {loc_text(loc)}")
