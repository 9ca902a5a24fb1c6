"""Numba's @intrinsic, typed once per argument types.

Numba types each call of an intrinsic by first refreshing the whole target context (reloading
its registries: numba/core/typing/templates.py, _get_target_registry) and only then looking
the argument types up in the intrinsic's cache. A cold unrolled LSTM's kernels make about 570
calls of the view intrinsics (origin, load, store): the refreshes were 0.25 s of a 2.4 s first
call. Here the cache is looked up first, and a miss is typed as Numba types it. What a hit
skips only installs lowerings registered since the last refresh; every compile refreshes both
contexts when it starts, and a lowering not found refreshes again.
"""

from numba.core import extending
from numba.core.typing import templates


def intrinsic(definition):
    """numba.core.extending.intrinsic(definition), whose typing looks its cache up first."""
    handle = extending.intrinsic(definition)
    template = _template_of(handle)
    template.generic = _cache_first(template.generic)
    return handle


def _template_of(handle):
    for value, function_type in reversed(templates.builtin_registry.globals):
        if value is handle:
            return function_type.templates[0]
    raise LookupError(f"intrinsic {handle} was not registered")


def _cache_first(generic):
    def typed(self, args, kws):
        try:
            return self._impl_cache[self.context, args, tuple(kws.items())]
        except KeyError:
            return generic(self, args, kws)

    return typed
