"""A test says which backend it means: the suite runs plans on the reference interpreter
(conftest.py sets BACKPLAN_BACKEND=reference), so a test written for the compiled path that
forgets `use_backend("numba")` passes while testing the interpreter. A test whose name speaks
of the compiled path (compiled, kernel, driver, arena, workspace, GEMM, fast path...) and whose
plans all ran on the interpreter fails, saying how to choose: `@pytest.mark.numba` runs it on
Numba, `@pytest.mark.reference` keeps the interpreter where the test is about the plan or the
API, not the kernels (a body choosing its backend itself with use_backend runs a plan there)."""

from __future__ import annotations

import inspect
import re
from contextlib import contextmanager

COMPILED_WORDS = re.compile(
    r"(?:^|_)(compiled|kernels?|drivers?|arenas?|workspaces?|fast_path|lean|gemms?|fused|numba)"
    r"(?:_|$)"
)


@contextmanager
def backends_run():
    """The set of backends of the runners made inside (runtime/backend.py's two classes)."""
    from backplan.runtime.backend import CompiledRunner, ReferenceRunner

    made: set[str] = set()
    inits = {cls: cls.__init__ for cls in (CompiledRunner, ReferenceRunner)}

    def recording(cls):
        init = inits[cls]

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            made.add(cls.backend)

        return __init__

    for cls in inits:
        cls.__init__ = recording(cls)
    try:
        yield made
    finally:
        for cls, init in inits.items():
            cls.__init__ = init


def unstated_intent(item, made: set[str]) -> str | None:
    """Why a test that ran only on the interpreter must say which backend it means, or None.
    A test parametrized by backend, or whose body names one (use_backend, a child's
    BACKPLAN_BACKEND), has chosen."""
    name = item.originalname
    found = COMPILED_WORDS.search(name)
    if found is None or made != {"reference"}:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "reference" in params.values() or any("backend" in p for p in params):
        return None
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        source = ""
    if "backend" in source.lower():
        return None
    return (
        f"{name} speaks of the compiled path ({found.group(1)!r}) but every plan it ran, ran on "
        "the reference interpreter (tests/conftest.py's default): mark it @pytest.mark.numba to "
        "run it compiled, or @pytest.mark.reference where the interpreter is what it means"
    )
